"""The C kernels' loader: csrc/'s .c files compiled into one shared library per flag set, cached in cache_dir() under
a hash of the sources, flags and compiler. SIGNATURES types each entry point and the ctypes structs mirror
csrc/nanospec.h's field for field. Also the per-machine cache of measured answers (cache_dir, cached, JSON helpers),
kept only when measured on a quiet machine.
"""
import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

SRC_ENV = "NANOSPEC_CSRC"  # another csrc/ folder (tests build a broken copy)
P, L, INT, F32, I64, F64 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_int64, ctypes.c_double


class RowsDst(ctypes.Structure):
    _fields_ = [("rows", P), ("P", P), ("W", P), ("V", L), ("nslots", L), ("K", L), ("panel", L), ("kb", L),
                ("place", P), ("fast", L), ("Ws", P), ("Wm", P), ("Ps", P), ("Pm", P)]


class Packed(ctypes.Structure):
    pass


Packed._fields_ = [("w", P), ("s", P), ("m", P), ("bits", L), ("group", L), ("h", P), ("sc", P), ("mn", P),
                   ("sup", L), ("zero", L), ("p0", L), ("next", ctypes.POINTER(Packed)), ("fast", L)]


GATHER = ctypes.CFUNCTYPE(None, L, L, P, P)  # (g, T, part, full): StackArgs.gather, tensor parallelism's (tp.py)


class StackArgs(ctypes.Structure):
    _fields_ = [("tab", P), ("L", L), ("D", L), ("H", L), ("Hkv", L), ("hd", L), ("I", L), ("eps", F32), ("T", L),
                ("S", L), ("x", P), ("emb", P), ("cs", P), ("sn", P), ("mask", P), ("mbase", P), ("W", L), ("cpos", P),
                ("kv", P), ("kt", P),
                ("aux_of", P), ("n_aux", L), ("aux", P), ("fnorm", P), ("threads", INT), ("gather", GATHER), ("tp", L)]


class KVCache(ctypes.Structure):
    _fields_ = [("kv", P), ("kt", P), ("L", L), ("Hkv", L), ("S", L), ("hd", L), ("nbs", L)]


class Head(ctypes.Structure):
    _fields_ = [("tab", P), ("D", L), ("H", L), ("Hkv", L), ("hd", L), ("I", L), ("S", L), ("eps", F32), ("kv", P),
                ("embed", P), ("cos_t", P), ("sin_t", P)]


class TreeArgs(ctypes.Structure):
    _fields_ = [("head", Head), ("norm_w", P), ("out0", P), ("lm0", P), ("n", L), ("P", P), ("b", P), ("ids", P),
                ("W", L), ("r2t", P), ("k", L), ("depth", L), ("N", L), ("root", I64), ("tokens", P), ("parents", P),
                ("depth_out", P), ("anc", P), ("lm_s", P), ("threads", INT)]


class UpdateArgs(ctypes.Structure):
    _fields_ = [("head", Head), ("fcP", P), ("fcb", P), ("F", L), ("aux", P), ("path", P), ("nxt", P), ("R", L),
                ("n", L), ("L", L), ("out1", P), ("norm_w", P), ("lm1", P), ("threads", INT)]


class Window(ctypes.Structure):
    _fields_ = [("V", L), ("W", L), ("ring", P), ("head", P), ("count", P), ("slot_of", P), ("token_of", P),
                ("winner", P), ("fill_tok", P), ("fill_slot", P), ("has_fill", INT), ("ids", P), ("bias", P),
                ("dst", RowsDst)]


ptr = ctypes.byref


# name -> (argument types, result type): csrc/nanospec.h's entry points
SIGNATURES = {
    "linear_bf16": ((P, P, L, L, P, P, L, P, INT), None), "linear_packed": ((P, P, L, L, P, P, L, P, INT), None),
    "write_rows": ((ctypes.POINTER(RowsDst), P, P, L), None),
    "stack_bf16": ((ctypes.POINTER(StackArgs),), None), "compact_bf16": ((ctypes.POINTER(KVCache), P, P, L), None),
    "phase_times": ((P,), None), "eagle_tree_bf16": ((ctypes.POINTER(TreeArgs),), None),
    "eagle_update_bf16": ((ctypes.POINTER(UpdateArgs),), None),
    "nanospec_append": ((ctypes.POINTER(Window), P, P, L, P, P, P), None),
    "nanospec_metrics": ((P, P, L, L, L, L, P, P, P, P), None), "topk_rows_bf16": ((P, L, P, L, L, P, INT), None),
    "argmax_rows": ((P, INT, L, L, P, INT), None), "peak_gflops": ((L, INT), F64),
}


def src_dir() -> Path:
    return Path(os.environ.get(SRC_ENV) or Path(__file__).resolve().parent / "csrc")


def sources(src: Path | None = None) -> list[Path]:
    """Every file the build reads: the .c files it compiles and the headers they include."""
    return sorted(p for p in (src or src_dir()).iterdir() if p.suffix in (".c", ".h"))


def source_hash(flags: list[str] = (), src: Path | None = None) -> str:
    """A hash of csrc/'s files, the flags and the compiler: a change to any of them builds (and times) anew."""
    h = hashlib.sha256()
    for p in sources(src):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update((" ".join(flags) + " " + os.environ.get("CC", "cc")).encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """NanoSpec's per-user cache (NANOSPEC_CACHE moves it): the built kernels and the per-machine answers."""
    root = os.environ.get("NANOSPEC_CACHE")
    return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanospec"


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name`, one of choices (default: the first)."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")
    return value


def cpu_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


class BuildError(RuntimeError):
    """The compiler's failure: the message holds its whole stderr; summary() its first error line."""
    def summary(self) -> str:
        lines = str(self).splitlines()
        return next((l.strip() for l in lines[1:] if "error:" in l), lines[0])


_LIBS = {}  # hash -> the loaded library, or None where it failed (a plain dict: torch.compile traces through it)


def load(flags: list[str], required: bool = False, src: Path | None = None):
    """The library of csrc/ built with flags, loaded; None where it cannot be (not x86 with AVX2, no compiler, or a
    failed build: one line on stderr, the callers use PyTorch). A failed build raises BuildError where required."""
    if not cpu_supported():
        return None
    tag = source_hash(flags, src)
    if tag in _LIBS and (_LIBS[tag] is not None or not required):
        return _LIBS[tag]
    so = cache_dir() / f"nanospec-{tag}.so"
    try:
        if not so.is_file():
            build(flags, so, src or src_dir())
        # torch is loaded first, so libgomp.so.1 resolves to torch's own: one OpenMP pool (two would spin)
        _LIBS[tag] = ctypes.CDLL(str(so))
    except BuildError as e:
        if required:
            raise
        print(f"nanospec: CPU kernels failed to build ({e.summary()}); using PyTorch", file=sys.stderr)
        _LIBS[tag] = None
    except OSError as e:  # no compiler, or a library this machine cannot load
        print(f"nanospec: CPU kernels unavailable ({e}); using PyTorch", file=sys.stderr)
        _LIBS[tag] = None
    return _LIBS[tag]


def build(flags: list[str], so: Path, src: Path):
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler {cc!r}")
    so.parent.mkdir(parents=True, exist_ok=True)
    tmp = so.with_suffix(f".{os.getpid()}.tmp")
    t0 = time.perf_counter()
    cmd = [cc, *flags, *(str(p) for p in sources(src) if p.suffix == ".c"), "-o", str(tmp)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{cc} timed out after 300 s") from None
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"{cc} could not build the CPU kernels in {src}:\n{r.stderr.strip()}")
    tmp.replace(so)  # atomic: a concurrent process sees the whole library or none
    if r.stderr.strip():  # warnings
        print(r.stderr.strip(), file=sys.stderr)
    print(f"nanospec: building CPU kernels for this machine, once: {time.perf_counter() - t0:.1f} s", file=sys.stderr)


_FNS = {}  # (flags, name, required) -> the typed function or None


def function(name: str, flags: list[str], required: bool = False):
    """Entry point `name` (SIGNATURES) of the library built with flags, typed; None where it cannot be built."""
    key = (tuple(flags), name, required)
    if key not in _FNS:
        lib = load(flags, required)
        fn = _FNS[key] = None if lib is None else getattr(lib, name)
        if fn is not None:
            fn.argtypes, fn.restype = SIGNATURES[name]
    return _FNS[key]


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def merge_json(path: Path, key: str, value):
    """Set path[key] = value in a JSON file, replaced atomically; a read-only home only costs a re-check next time."""
    data = read_json(path)
    data[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


MAX_WAIT = 0.1  # seconds this process's threads waited for a CPU per second of a measurement, past which it is
# not stored: quiet runs waited 0.001-0.015 s a second, and with one busy process beside them 0.69-0.81 s while
# they ran 3-5x slower (Zen 4, 2 cores, pass timings): a figure taken then would steer every later run


def run_delay() -> float | None:
    """Seconds this process's threads have waited on a run queue (Linux schedstat), None where it is not known."""
    total, seen = 0, False
    for p in Path("/proc/self/task").glob("*/schedstat"):
        try:
            total += int(p.read_text().split()[1])
            seen = True
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9 if seen else None


def measured_quietly(compute):
    """(compute(), whether the process kept its CPUs meanwhile: waited at most MAX_WAIT s a second, or unknown)."""
    d0, t0 = run_delay(), time.perf_counter()
    value = compute()
    d1, wall = run_delay(), time.perf_counter() - t0
    return value, d0 is None or d1 is None or d1 - d0 <= MAX_WAIT * max(wall, 1e-3)


def cached(key: str, compute):
    """A per-machine measured answer (JSON): cache_dir()/cpu_gemm.json[key], computed (compute()) and stored once
    measured on a quiet machine (measured_quietly; else it serves this process and the next one measures again)."""
    f = cache_dir() / "cpu_gemm.json"
    data = read_json(f)
    if key not in data:
        value, quiet = measured_quietly(compute)
        if not quiet:
            return value
        data[key] = value
        merge_json(f, key, value)
    return data[key]
