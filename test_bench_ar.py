"""bench_ar.py --profile on a tiny checkpoint: one row per pass size, each part measured, and the weight floor."""
import sys

import pytest

import bench_ar
from conftest import write_tiny_hf


def test_profile_prints_one_row_per_pass_size(tmp_path, capsys, monkeypatch):
    path, _ = write_tiny_hf(tmp_path / "t")
    monkeypatch.setattr(bench_ar, "read_bandwidth_gbs", lambda: 10.0)  # a 1 GiB read is not a unit test
    monkeypatch.setattr(sys, "argv", ["bench_ar.py", "--checkpoint", str(path), "--profile", "--context", "20",
                                      "--rows", "1,4", "--dtype", "float32"])
    bench_ar.main()
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "4"]
    assert "reading the weights once takes" in out
    for r in rows:
        whole, gemms, attn = (float(c) for c in r.split("|")[2:5])
        assert whole > 0 and gemms > 0 and attn > 0


def test_llama_cpp_peer_reads_its_timings(tmp_path):
    """A llama-completion run's tokens/s: generated tokens (eval runs + the prompt eval's first token) over its
    prompt-eval + eval time; a failed run is one line, not a traceback."""
    fake = tmp_path / "llama-completion"
    fake.write_text("#!/bin/sh\necho 'Paris.'\n"
                    "echo 'common_perf_print: prompt eval time =      50.00 ms /    16 tokens ( 3 ms per token)' >&2\n"
                    "echo 'common_perf_print:        eval time =     150.00 ms /     9 runs   (16 ms per token)' >&2\n")
    fake.chmod(0o755)
    assert bench_ar.run_llama_cpp(str(fake), "m.gguf", "hi", 16) == pytest.approx(10 / 0.2)
    fake.write_text("#!/bin/sh\necho 'error: unable to load model' >&2\nexit 1\n")
    with pytest.raises(SystemExit, match="llama.cpp failed.*unable to load model"):
        bench_ar.run_llama_cpp(str(fake), "m.gguf", "hi", 16)
