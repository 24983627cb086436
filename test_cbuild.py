"""The C loader: a broken source fails loudly where the kernel is required (the compiler's message in the error)
and with one stderr line and the PyTorch fallback otherwise; the cache key follows every included header."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cbuild
import cpu_gemm

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not cbuild.cpu_supported() or shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="needs x86-64 with AVX2+FMA and a C compiler")


@pytest.fixture
def broken(tmp_path, monkeypatch):
    """A copy of csrc/ whose shared bf16 header has a syntax error (every .c file stops at it: a fast failure)."""
    src = tmp_path / "csrc"
    shutil.copytree(HERE / "csrc", src)
    h = src / "bf16.h"
    h.write_text(h.read_text() + "\nstatic int broken(void) { return 1 }\n")
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    return src


def test_required_build_error_shows_the_compiler(broken, capsys):
    with pytest.raises(cbuild.BuildError) as e:
        cbuild.load(cpu_gemm.FLAGS, required=True, src=broken)
    msg = str(e.value)
    assert "bf16.h" in msg and "error" in msg and "expected" in msg  # gcc's own words: expected ';' before '}'
    assert not list((broken.parent / "cache").glob("*.so"))


def test_auto_build_error_is_one_line_and_none(broken, capsys):
    assert cbuild.load(cpu_gemm.FLAGS, required=False, src=broken) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nanospec: CPU kernels failed to build (") and "using PyTorch" in err[0]
    assert "bf16.h" in err[0] and "error" in err[0]  # the compiler's first error
    assert cbuild.load(cpu_gemm.FLAGS, required=False, src=broken) is None  # remembered: no second build, no line
    assert capsys.readouterr().err == ""


CHECK = """
import torch, cpu_gemm, sampling
print(cpu_gemm.kernel() is None, int(sampling.argmax(torch.tensor([[1.0, 3.0, 2.0]]))[0]))
"""


@pytest.mark.parametrize("mode", ["auto", "kernel"])
def test_the_engine_falls_back_or_raises(broken, mode):
    """Through the modules' own entry points (NANOSPEC_CSRC points the loader at the broken copy): auto falls back
    to PyTorch after one stderr line; NANOSPEC_CPU_GEMM=kernel stops with the compiler's message."""
    env = {**os.environ, cbuild.SRC_ENV: str(broken), cpu_gemm.ENV: mode}
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=HERE, env=env, capture_output=True, text=True)
    if mode == "auto":
        assert r.returncode == 0 and r.stdout.split() == ["True", "1"], r.stderr
        ours = [l for l in r.stderr.splitlines() if l.startswith("nanospec:")]
        assert len(ours) == 1 and "failed to build" in ours[0] and "using PyTorch" in ours[0], r.stderr
    else:
        assert r.returncode != 0 and "BuildError" in r.stderr and "bf16.h" in r.stderr and "error" in r.stderr


def test_hash_follows_headers_and_flags(tmp_path):
    src = tmp_path / "csrc"
    shutil.copytree(HERE / "csrc", src)
    before = cbuild.source_hash(cpu_gemm.FLAGS, src)
    assert before == cbuild.source_hash(cpu_gemm.FLAGS, HERE / "csrc")
    assert before != cbuild.source_hash(cpu_gemm.FLAGS + ["-DNANOSPEC_PHASES"], src)
    h = src / "gemm.h"  # a header no Python file names: only included
    h.write_text(h.read_text() + "\n/* changed */\n")
    assert cbuild.source_hash(cpu_gemm.FLAGS, src) != before


def test_builds_once_and_says_so(tmp_path, monkeypatch, capsys):
    """A cache miss builds, with one line saying so; a later process finds the library in the cache."""
    src = tmp_path / "tiny"
    src.mkdir()
    (src / "one.c").write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    flags = ["-O1", "-shared", "-fPIC"]
    lib = cbuild.load(flags, src=src)
    assert lib.one() == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nanospec: building CPU kernels for this machine, once: ")
    so = list((tmp_path / "cache").glob("*.so"))
    assert len(so) == 1 and cbuild.source_hash(flags, src) in so[0].name
    del cbuild._LIBS[cbuild.source_hash(flags, src)]  # as a new process: found in the cache, not built
    assert cbuild.load(flags, src=src).one() == 1 and capsys.readouterr().err == ""


def test_answers_measured_on_a_busy_machine_are_not_kept(tmp_path, monkeypatch):
    """cached() keeps an answer only where its measurement waited for a CPU at most MAX_WAIT s a second (Linux
    schedstat run delay): a busy machine's answer serves the process and the next one measures again; an
    unknown delay (no schedstat) counts as quiet. The process's own delay is read for real."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    waited = iter([0.0, 5.0, 1.0, 1.001])  # 5 s waited during the first measurement, 1 ms in the second
    monkeypatch.setattr(cbuild, "run_delay", lambda: next(waited))
    calls = []
    measure = lambda: calls.append(time.sleep(0.05)) or True  # 50 ms: 1 ms waited is 0.02 s a second
    assert cbuild.cached("k", measure) and not (tmp_path / "cpu_gemm.json").exists()
    assert cbuild.cached("k", measure) and len(calls) == 2
    assert json.loads((tmp_path / "cpu_gemm.json").read_text()) == {"k": True}
    assert cbuild.cached("k", lambda: calls.append(1) or False) and len(calls) == 2  # read back, not measured
    monkeypatch.setattr(cbuild, "run_delay", lambda: None)
    assert cbuild.measured_quietly(lambda: 3) == (3, True)
    monkeypatch.undo()
    d = cbuild.run_delay()
    assert d is None or d >= 0.0
    if Path("/proc/self/task").is_dir():
        assert d is not None
