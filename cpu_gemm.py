"""The CPU linear layer for bf16 weights: a small kernel (csrc/gemm*.h, built by cbuild.py with the system C
compiler on first use), in one of three variants chosen by the CPU's flags: AVX-512 BF16 dot products where the
CPU has them (Zen 4, Cooper Lake, Sapphire Rapids and later), else AVX-512F FMAs (Skylake-SP, Cascade Lake, Ice
Lake), else AVX2/FMA (NANOSPEC_CPU_ISA=avx512 or avx2 forces a smaller one). The ISA becomes compiler flags and
csrc/gemm.h picks the variant by #if on the compiler's target macros; the packed layout it reads (PANEL, KB,
pack()) is chosen here.

Why: on CPUs without a bf16 dot-product instruction (AVX2, plain AVX-512) torch's bf16 GEMM costs about the
same per row at any row count (measured: 16 rows = 7x one row on an AVX2 EPYC), and on an AVX-512 BF16 EPYC
its one-row path is twice as slow as this kernel, so verifying a draft tree costs several decode steps and
speculation cannot pay. This kernel streams the bf16 weights once per pass in panels, and multiplies each
panel into several rows of the pass at a time, so extra rows cost multiply-adds, not weight traffic:
- AVX2: panels of 16 rows, widened to fp32 in registers, into up to 6 rows at a time (12 accumulators:
  BLIS's 6 x 16 AVX2 shape); while a panel computes, the next one is prefetched into L2 (measured on the
  AVX2 EPYC, the default model's GEMMs against the earlier 4 x 3 dot-product tiles, alternating: 1.10x at 1
  row, 1.21x at 8, 1.30x at 16; BENCHMARKS.md).
- AVX-512F: the AVX2 kernel's FMAs in 16-lane registers, panels of 64 rows into up to 6 rows (24 accumulators);
  the same bits as the AVX2 kernel (test_cpu_gemm checks it), twice its work per instruction.
- AVX-512 BF16: panels of 64 rows, pairs of k side by side, into up to 6 rows at a time with vdpbf16ps (24
  accumulators); each instruction does 32 multiply-adds, 4x an AVX2 FMA (BENCHMARKS.md).

Row-invariant by construction: every output element is one fp32 chain over k in order (FMAs, or dot
products of k pairs), plus the bias, whatever the tile, the row count or the row's place in the pass. A
token's bits never depend on how many tokens share its pass, which is what exact mode needs (exact.py then
finds that every pass size agrees). The sum is rounded to bf16 once, round-to-nearest-even. The BF16 variant
rounds differently from the two FMA ones, but a machine only ever runs one.

`linear(x, w, b)` uses the kernel where `enabled()` says it pays on this machine (a timing check of the
model's shapes, run once per machine and cached, see `choose`), else `F.linear`. NANOSPEC_CPU_GEMM=torch
or =kernel overrides the check. Under torch.compile the kernel is the custom op `nanospec::linear_bf16`.
"""
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import cbuild
from cbuild import cache_dir, cached, cpu_supported, merge_json, read_json  # noqa: F401 (used as cpu_gemm.*)

ENV = "NANOSPEC_CPU_GEMM"  # auto (default) | kernel | torch

ISA_ENV = "NANOSPEC_CPU_ISA"  # auto (default): the best kernel this CPU runs | avx2: the portable one


def cpu_flags() -> set[str]:
    try:
        return set(next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration, IndexError):
        return set()


def pick_isa() -> str:
    """'avx512bf16' where the CPU has AVX-512 BF16 dot products, 'avx512' where it has AVX-512F without them, else
    'avx2'; NANOSPEC_CPU_ISA=avx512 or avx2 asks for a smaller one. Decided from the CPU's flags, not timed: a bf16
    dot product does twice an FMA's work per lane, and a 16-lane FMA twice an 8-lane one."""
    want = os.environ.get(ISA_ENV, "auto")
    if want not in ("auto", "avx512", "avx2"):
        raise ValueError(f"{ISA_ENV} must be auto, avx512 or avx2, got {want!r}")
    flags = cpu_flags()
    if want == "auto" and {"avx512f", "avx512_bf16"} <= flags:
        return "avx512bf16"
    return "avx512" if want in ("auto", "avx512") and "avx512f" in flags else "avx2"


ISA = pick_isa()
# (-Wno-maybe-uninitialized: gcc 12 doubts the attention's per-row arrays, which every row it reads fills)
FLAGS = ["-O3", "-Wall", "-Wno-maybe-uninitialized", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"] + {
    "avx512bf16": ["-mavx512f", "-mavx512bf16"], "avx512": ["-mavx512f"], "avx2": []}[ISA]
# the packed layout (pack()): panels of PANEL weight rows, KB consecutive k of a row side by side
PANEL, KB = {"avx512bf16": (64, 2), "avx512": (64, 1), "avx2": (16, 1)}[ISA]
HALF = 8 if ISA == "avx2" else 16  # FMA kernels: a k's 2 * HALF values per load interleave two halves of rows


def c_function(name: str, phases: bool = False):
    """Entry point `name` of csrc/'s library for this ISA (phases: the phase-timing build), typed; None where it
    cannot be built here. A failed build raises where NANOSPEC_CPU_GEMM=kernel asked for the kernel."""
    fn = _FN.get((name, phases))
    if fn is None:
        flags = FLAGS + (["-DNANOSPEC_PHASES"] if phases else [])
        fn = _FN[name, phases] = cbuild.function(name, flags, required=os.environ.get(ENV) == "kernel")
    return fn


_FN = {}  # (name, phases) -> the function (a plain dict: torch.compile traces through it)


def peak_gflops(threads: int | None = None, reps: int = 5) -> float | None:
    """The best of reps runs of csrc/peak.c (about 0.1 s each): this machine's multiply-add peak in GFLOP/s with the
    kernel's instruction over `threads` threads (default: torch's); None where the kernels cannot be built here."""
    fn = c_function("peak_gflops")
    if fn is None:
        return None
    threads = threads or torch.get_num_threads()
    return max(fn(2_000_000, threads) for _ in range(reps))


def kernel():
    """The GEMM's C function, or None (not x86 with AVX2+FMA, or no C compiler). Built once, cached on disk."""
    return c_function("linear_bf16")


# where (weight row c of a panel, k offset j) sits among a k group's PANEL * KB values: AVX2 [n0, n8, n1, n9, ...]
# (one k; see its tile()), AVX-512F the same per 32 rows [n0, n16, n1, n17, ..., n32, n48, ...], AVX-512 BF16
# [n0k0, n0k1, n1k0, n1k1, ...] (a pair of k)
_PLACE = (torch.tensor([c // (2 * HALF) * 2 * HALF + 2 * (c % HALF) + c % (2 * HALF) // HALF for c in range(PANEL)])
          if KB == 1 else torch.arange(PANEL * KB))


def pack(w: Tensor) -> Tensor:
    """w [N, K] bf16 -> [ceil(N / PANEL), K / KB, PANEL * KB]: panels of PANEL weight rows, k-major in groups of
    KB, each group's values placed for the kernel's loads, so a panel is one contiguous stream (the last panel
    is padded with zero rows)."""
    N, K = w.shape
    P = -(-N // PANEL)
    wp = torch.cat([w, w.new_zeros(P * PANEL - N, K)]) if P * PANEL > N else w
    # one strided copy (an index by _PLACE was 10x slower): the FMA kernels interleave the two halves of each
    # 2 * HALF rows of a panel; AVX-512 BF16 puts each row's pair of k side by side, a transpose of 32-bit pairs
    if KB == 1:
        return wp.reshape(P, PANEL // (2 * HALF), 2, HALF, K).permute(0, 4, 1, 3, 2).reshape(P, K, PANEL)
    return wp.view(torch.int32).reshape(P, PANEL, K // 2).transpose(1, 2).contiguous().view(w.dtype).reshape(P, K // 2, PANEL * 2)


def unpack(packed: Tensor, N: int) -> Tensor:
    """pack()'s inverse: the [N, K] matrix a packed copy holds."""
    P, G, _ = packed.shape
    return packed[:, :, _PLACE].view(P, G, PANEL, KB).permute(0, 2, 1, 3).reshape(P * PANEL, G * KB)[:N]


# where weight row c of a panel sits among a k group's PANEL slots (contiguous int64: write_rows reads it too)
_SLOT = (_PLACE.view(PANEL, KB)[:, 0] // KB).contiguous()


def pack_rows_(packed: Tensor, rows: Tensor, slots: Tensor):
    """Row slots[i] of the matrix that packed = pack(W) holds becomes rows[i] (rows [n, K], slots [n]), in
    place: a packed copy follows a buffer whose rows change (vocab.NanoSpecVocab). Static shapes, no sync."""
    slots = slots.long()
    n, K = rows.shape
    P, G, _ = packed.shape
    # one index pair per row, each k group's KB values one contiguous copy (3x faster than indexing every value)
    packed.view(P, G, PANEL, KB)[slots // PANEL, :, _SLOT.to(slots.device)[slots % PANEL]] = rows.view(n, G, KB)


def _rows_writer():
    return c_function("write_rows")


def _write_rows_c(rows: Tensor, packed: Tensor, weight: Tensor, tok: Tensor, slots: Tensor):
    tok, slots = tok.long().contiguous(), slots.long().contiguous()
    V, K = weight.shape
    dst = cbuild.RowsDst(rows.data_ptr(), packed.data_ptr(), weight.data_ptr(), V, rows.shape[0], K, PANEL, KB,
                         _SLOT.data_ptr())
    _rows_writer()(cbuild.ptr(dst), tok.data_ptr(), slots.data_ptr(), tok.numel())


@torch.library.custom_op("nanospec::write_rows_", mutates_args=("rows", "packed"))
def write_rows_op(rows: Tensor, packed: Tensor, weight: Tensor, tok: Tensor, slots: Tensor) -> None:
    _write_rows_c(rows, packed, weight, tok, slots)


@write_rows_op.register_fake
def _(rows, packed, weight, tok, slots):
    return None


def writes_rows(rows: Tensor, packed: Tensor | None, weight: Tensor) -> bool:
    """Whether write_rows_ serves these tensors here (decided once, before any tracing: it builds the C code)."""
    return (packed is not None and rows.is_contiguous() and weight.is_contiguous() and packed.is_contiguous()
            and rows.dtype == weight.dtype == packed.dtype == torch.bfloat16 and rows.device.type == "cpu"
            and _rows_writer() is not None)


def write_rows_(rows: Tensor, packed: Tensor, weight: Tensor, tok: Tensor, slots: Tensor):
    """rows[slots[i]] = weight[tok[i]] for 0 <= slots[i] < len(rows), and the same rows into packed = pack(rows)'s
    copy, in one C call (NanoSpec's window update: two torch scatters and a gather cost 0.5 ms a step on the
    AVX2 EPYC); for tensors writes_rows() accepts."""
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
    kernel()(x2.data_ptr(), 0 if xf is None else xf.data_ptr(), x2.shape[0], K, packed.data_ptr(), 0 if b is None else b.data_ptr(), N,
             y.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


@torch.library.custom_op("nanospec::linear_bf16", mutates_args=())
def linear_bf16_op(x: Tensor, packed: Tensor, N: int, b: Tensor | None) -> Tensor:
    return kernel_linear(x, packed, N, b)


@linear_bf16_op.register_fake
def _(x, packed, N, b):
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


def mode() -> str:
    m = os.environ.get(ENV, "auto")
    if m not in ("auto", "kernel", "torch"):
        raise ValueError(f"{ENV} must be auto, kernel or torch, got {m!r}")
    return m


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
    """Give every kernel-usable linear layer of module (those with a `packed` buffer slot, model.Linear)
    its packed weights, where the kernel is on. A second, packed copy of the weights: memory for speed.
    Returns how many were packed."""
    n = 0
    for m in module.modules():
        if enabled() and "packed" in m._buffers and usable(m.weight):
            m.packed = pack(m.weight.detach())
            n += 1
    return n


def choose(shapes: list[tuple[int, int]], rows=(1, 16), reps: int = 5) -> bool:
    """Turn the kernel on for this process iff it beats torch's bf16 GEMM on a pass through these (N, K)
    weight shapes (one entry per layer: repeats weigh) at every row count in rows (decode and a CPU
    verification tree), timed here on distinct, cold weights, alternating, medians of reps. The answer is
    cached per machine in cache_dir()/cpu_gemm.json. NANOSPEC_CPU_GEMM=kernel|torch skips the check."""
    m = mode()
    if m != "auto" or kernel() is None:
        on = m == "kernel" and kernel() is not None
    else:
        counts = {s: shapes.count(s) for s in sorted(set(shapes))}
        on = cached(f"{machine_id()} {counts} rows {list(rows)}", lambda: _faster(counts, rows, reps))
    switch(on)
    return on


def machine_id() -> str:
    """What per-machine answers depend on: the CPU, its vector ISA, torch, the thread count and the kernels'
    sources (a changed kernel times, and rounds, anew)."""
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
            fns = {"torch": lambda: [F.linear(x, w) for w in ws], "kernel": lambda: [kernel_linear(x, p, N) for p in ps]}
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
