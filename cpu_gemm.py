"""The CPU linear layer for bf16 weights: csrc/gemm*.h (built by cbuild.py) in the variant the CPU's flags allow,
AVX-512 BF16 dot products, else AVX-512F FMAs, else AVX2/FMA; the packed layout it reads (PANEL, KB, pack()) is here.

Why: without a bf16 dot-product instruction torch's bf16 GEMM costs about the same per row at any row count
(measured: 16 rows = 7x one row on an AVX2 EPYC), so verifying a tree costs several decode steps. This kernel
streams the weights once per pass in panels and multiplies each into up to 6 rows at a time (BLIS's 6 x 16 AVX2
shape), so extra rows cost multiply-adds, not weight traffic.

Row-invariant: every output is one fp32 chain over k in order, plus the bias, rounded to bf16 once, whatever the
row count (what exact mode needs; the BF16 variant rounds unlike the FMA ones, but a machine runs only one).
`linear` uses it where `choose` (timed, cached per machine) turned it on.
"""
import contextlib
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import cbuild
from cbuild import cache_dir, cached, cpu_supported, measured_quietly, merge_json, read_json  # noqa: F401 (cpu_gemm.*)

ENV = "NANOSPEC_CPU_GEMM"  # auto (default) | kernel | torch
ISA_ENV = "NANOSPEC_CPU_ISA"  # auto (default): the best kernel this CPU runs | avx2: the portable one


def cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return set(next(l for l in lines if l.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration, IndexError):
        return set()


def pick_isa() -> str:
    """The best ISA the CPU's flags allow (each does twice the next one's work per instruction) or ISA_ENV's."""
    want, flags = cbuild.env_choice(ISA_ENV, ("auto", "avx512", "avx2")), cpu_flags()
    if want == "auto" and {"avx512f", "avx512_bf16"} <= flags:
        return "avx512bf16"
    return "avx512" if want in ("auto", "avx512") and "avx512f" in flags else "avx2"


ISA = pick_isa()
# AVX-512 VNNI (Ice Lake, Zen 4 and later): the draft models' integer GEMM (csrc/gemm_fast.h)
VNNI = ISA != "avx2" and {"avx512_vnni", "avx512bw"} <= cpu_flags()
# (-Wno-maybe-uninitialized: gcc 12 doubts the attention's per-row arrays, which every row it reads fills)
FLAGS = ["-O3", "-Wall", "-Wno-maybe-uninitialized", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"] + {
    "avx512bf16": ["-mavx512f", "-mavx512bf16"], "avx512": ["-mavx512f"], "avx2": []}[ISA] + (
    ["-mavx512bw", "-mavx512vnni"] if VNNI else [])
# the packed layout (pack()): panels of PANEL weight rows, KB consecutive k of a row side by side
PANEL, KB = {"avx512bf16": (64, 2), "avx512": (64, 1), "avx2": (16, 1)}[ISA]
HALF = 8 if ISA == "avx2" else 16  # FMA kernels: a k's 2 * HALF values per load interleave two halves of rows


def c_function(name: str, phases: bool = False):
    """Entry point `name` of csrc/'s library for this ISA (phases: the timing build), or None where not built."""
    fn = _FN.get((name, phases))
    if fn is None:
        flags = FLAGS + (["-DNANOSPEC_PHASES"] if phases else [])
        fn = _FN[name, phases] = cbuild.function(name, flags, required=os.environ.get(ENV) == "kernel")
    return fn


_FN = {}  # (name, phases) -> the function (a plain dict: torch.compile traces through it)


def peak_gflops(threads: int | None = None, reps: int = 5) -> float | None:
    """This machine's multiply-add peak in GFLOP/s with the kernel's instruction (csrc/peak.c), or None."""
    fn = c_function("peak_gflops")
    if fn is None:
        return None
    return max(fn(2_000_000, threads or torch.get_num_threads()) for _ in range(reps))


def kernel():
    """The GEMM's C function, or None (not x86 with AVX2+FMA, or no C compiler)."""
    return c_function("linear_bf16")


# where (panel row c, k offset j) sits among a k group's PANEL * KB values: AVX2 [n0, n8, n1, n9, ...], AVX-512F
# the same per 32 rows [n0, n16, n1, n17, ..., n32, n48, ...], AVX-512 BF16 [n0k0, n0k1, n1k0, n1k1, ...]
_PLACE = (torch.tensor([c // (2 * HALF) * 2 * HALF + 2 * (c % HALF) + c % (2 * HALF) // HALF for c in range(PANEL)])
          if KB == 1 else torch.arange(PANEL * KB))


def pack(w: Tensor) -> Tensor:
    """w [N, K] bf16 -> [ceil(N / PANEL), K / KB, PANEL * KB]: zero-padded panels of PANEL rows, k-major in groups
    of KB placed for the kernel's loads (_PLACE), so a panel is one contiguous stream."""
    N, K = w.shape
    P = -(-N // PANEL)
    wp = torch.cat([w, w.new_zeros(P * PANEL - N, K)]) if P * PANEL > N else w
    # one strided copy (10x faster than indexing by _PLACE); AVX-512 BF16: a transpose of 32-bit pairs of k
    if KB == 1:
        return wp.reshape(P, PANEL // (2 * HALF), 2, HALF, K).permute(0, 4, 1, 3, 2).reshape(P, K, PANEL)
    pairs = wp.view(torch.int32).reshape(P, PANEL, K // 2).transpose(1, 2).contiguous()
    return pairs.view(w.dtype).reshape(P, K // 2, PANEL * 2)


def unpack(packed: Tensor, N: int) -> Tensor:
    """pack()'s inverse: the [N, K] matrix a packed copy holds."""
    P, G, _ = packed.shape
    return packed[:, :, _PLACE].view(P, G, PANEL, KB).permute(0, 2, 1, 3).reshape(P * PANEL, G * KB)[:N]


# where weight row c of a panel sits among a k group's PANEL slots (contiguous int64: write_rows reads it too)
_SLOT = (_PLACE.view(PANEL, KB)[:, 0] // KB).contiguous()


def pack_rows_(packed: Tensor, rows: Tensor, slots: Tensor):
    """Row slots[i] of the matrix packed = pack(W) holds becomes rows[i], in place (static shapes, no sync)."""
    slots = slots.long()
    n, K = rows.shape
    P, G, _ = packed.shape
    # one index pair per row, each k group's KB values one copy (3x faster than indexing every value)
    packed.view(P, G, PANEL, KB)[slots // PANEL, :, _SLOT.to(slots.device)[slots % PANEL]] = rows.view(n, G, KB)


def _write_rows_c(rows: Tensor, packed: Tensor, weight: Tensor, tok: Tensor, slots: Tensor) -> None:
    tok, slots = tok.long().contiguous(), slots.long().contiguous()
    V, K = weight.shape
    dst = cbuild.RowsDst(rows.data_ptr(), packed.data_ptr(), weight.data_ptr(), V, rows.shape[0], K, PANEL, KB,
                         _SLOT.data_ptr())
    c_function("write_rows")(cbuild.ptr(dst), tok.data_ptr(), slots.data_ptr(), tok.numel())


write_rows_op = torch.library.custom_op("nanospec::write_rows_", _write_rows_c, mutates_args=("rows", "packed"))


@write_rows_op.register_fake
def _(rows, packed, weight, tok, slots):
    return None


def writes_rows(rows: Tensor, packed: Tensor | None, weight: Tensor) -> bool:
    """Whether write_rows_ serves these tensors here (decide before tracing: it builds the C code)."""
    return (packed is not None and rows.is_contiguous() and weight.is_contiguous() and packed.is_contiguous()
            and rows.dtype == weight.dtype == packed.dtype == torch.bfloat16 and rows.device.type == "cpu"
            and c_function("write_rows") is not None)


def write_rows_(rows: Tensor, packed: Tensor, weight: Tensor, tok: Tensor, slots: Tensor):
    """rows[slots[i]] = weight[tok[i]] for 0 <= slots[i] < len(rows), into packed = pack(rows) too, in one C call
    (torch's two scatters and a gather cost 0.5 ms a window update on the AVX2 EPYC); for writes_rows() tensors."""
    if torch.compiler.is_compiling():
        torch.ops.nanospec.write_rows_(rows, packed, weight, tok, slots)
    else:
        _write_rows_c(rows, packed, weight, tok, slots)  # eager: skip the custom-op dispatch (0.1 ms a call)


def kernel_linear(x: Tensor, packed: Tensor, N: int, b: Tensor | None = None) -> Tensor:
    """x [..., K] bf16 @ W.T (+ b [N]) -> [..., N] bf16 with the C kernel; packed = pack(W), W [N, K]."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.bfloat16)
    xf = torch.empty(x2.shape[0], K) if KB == 1 else None  # the FMA kernels widen x into it
    kernel()(x2.data_ptr(), 0 if xf is None else xf.data_ptr(), x2.shape[0], K, packed.data_ptr(),
             0 if b is None else b.data_ptr(), N, y.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


linear_bf16_op = torch.library.custom_op("nanospec::linear_bf16", kernel_linear, mutates_args=())


@linear_bf16_op.register_fake
def _(x, packed, N, b=None):  # (the dispatcher drops arguments left at their default)
    return x.new_empty(*x.shape[:-1], N)


def usable(w: Tensor) -> bool:
    """The kernel's domain: bf16 weights on the CPU with K a multiple of 8 (and the kernel built here)."""
    return w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.shape[1] % 8 == 0 and kernel() is not None


_ON = [False]  # the machine's choice (a plain bool, so torch.compile guards on it), set by choose()


def enabled() -> bool:
    return _ON[0]


def switch(on: bool):
    """Turn the kernel on or off for this process (choose() and cpu_forward.attach decide; benches compare)."""
    _ON[0] = bool(on)


@contextlib.contextmanager
def turned_off():
    """The kernel off within a block (model.forward's large --no-exact passes: torch's GEMMs), then as it was."""
    on = _ON[0]
    _ON[0] = False
    try:
        yield
    finally:
        _ON[0] = on


def mode() -> str:
    return cbuild.env_choice(ENV, ("auto", "kernel", "torch"))


def linear(x: Tensor, w: Tensor, b: Tensor | None = None, packed: Tensor | None = None) -> Tensor:
    """F.linear(x, w, b), through the kernel where this machine chose it and w was packed (pack_linears)."""
    if not (_ON[0] and packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and (b is None or b.dtype == torch.bfloat16)) or (
            w.requires_grad and torch.is_grad_enabled()):  # the kernel has no backward: training uses torch's
        return F.linear(x, w, b)
    if torch.compiler.is_compiling():
        return torch.ops.nanospec.linear_bf16(x, packed, w.shape[0], b)
    return kernel_linear(x, packed, w.shape[0], b)  # eager: skip the custom-op dispatch (microseconds per call)


def pack_linears(module) -> int:
    """Pack module's kernel-usable linears (model.Linear) where the kernel is on (memory for speed); how many."""
    ms = [m for m in module.modules() if enabled() and "packed" in m._buffers and usable(m.weight)]
    for m in ms:
        m.packed = pack(m.weight.detach())
    return len(ms)


def choose(shapes: list[tuple[int, int]], rows=(1, 16), reps: int = 5) -> bool:
    """Turn the kernel on iff it beats torch's GEMM on a pass through these (N, K) shapes (repeats weigh) at every
    row count in rows, timed on distinct, cold weights, alternating, medians of reps; cached per machine."""
    m = mode()
    if m != "auto" or kernel() is None:
        on = m == "kernel" and kernel() is not None
    else:
        counts = {s: shapes.count(s) for s in sorted(set(shapes))}
        on = cached(f"{machine_id()} {counts} rows {list(rows)}", lambda: bool(_faster(counts, rows, reps)))
    switch(on)
    return on


def machine_id() -> str:
    """What per-machine answers depend on: the CPU, its ISA, torch, the thread count and the kernels' sources."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads | kernel {ISA} {cbuild.source_hash()[:8]}")


def _faster(counts: dict, rows, reps) -> bool:
    g = torch.Generator().manual_seed(0)
    for r in rows:
        total = {"torch": 0.0, "kernel": 0.0}
        for (N, K), c in counts.items():
            copies = max(1, min(c, (64 << 20) // (N * K * 2)))  # distinct weights, as in a pass (not cache-hot)
            ws = [torch.randn(N, K, generator=g).bfloat16() for _ in range(copies)]
            ps = [pack(w) for w in ws]
            x = torch.randn(r, K, generator=g).bfloat16()
            fns = {"torch": lambda: [F.linear(x, w) for w in ws],
                   "kernel": lambda: [kernel_linear(x, p, N) for p in ps]}
            ts = {name: [] for name in fns}
            for _ in range(reps + 1):  # alternate the two, so drift in the machine's speed hits both alike
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    ts[name].append((time.perf_counter() - t0) / copies)
            for name in total:
                total[name] += c * sorted(ts[name][1:])[reps // 2]  # the first round warms up
        if total["kernel"] >= total["torch"]:
            return False
    return True
