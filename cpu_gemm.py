"""The CPU linear layer for bf16 weights: a small AVX2/FMA kernel, built with the system C compiler on first use.

Why: on CPUs without a bf16 dot-product instruction (AVX2, plain AVX-512) torch's bf16 GEMM costs about the
same per row at any row count (measured: 16 rows = 7x one row on an AVX2 EPYC), so verifying a draft tree
costs several decode steps and speculation cannot pay. This kernel streams each bf16 weight row once per
pass, widens it to fp32 in registers and multiplies it into every row of the pass (a register tile of up to
4 rows x 3 weight rows), so extra rows cost FMAs, not weight traffic.

Row-invariant by construction: every output element is one FMA chain over k in order (8 lanes), then the same
horizontal sum, whatever the tile, the row count or the row's place in the pass. A token's bits never depend
on how many tokens share its pass, which is what exact mode needs (exact.py then finds that every pass size
agrees). Products of bf16 values are exact in fp32; the sum is rounded to bf16 once, round-to-nearest-even.

`linear(x, w, b)` uses the kernel where `enabled()` says it pays on this machine (a timing check of the
model's shapes, run once per machine and cached, see `choose`), else `F.linear`. NANOSPEC_CPU_GEMM=torch
or =kernel overrides the check. Under torch.compile the kernel is the custom op `nanospec::linear_bf16`.
"""
import ctypes
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

ENV = "NANOSPEC_CPU_GEMM"  # auto (default) | kernel | torch

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

static inline __m256 load_bf16(const uint16_t* p) {  /* 8 bf16 -> 8 fp32 (bf16 = the high half of fp32) */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline float hsum(__m256 a) {  /* one fixed order for every output */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u; __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* MT rows of x times the 3 weight rows of packed group g (P[g][k / 8][j][8], see pack()): a group's
   K x 3 weights are one contiguous stream, read once per MT rows from L1. */
static inline __attribute__((always_inline)) void tile(const float* x, long K, const uint16_t* P, const uint16_t* b,
        uint16_t* y, float* yf, long N, long m0, long g, const int MT) {
    __m256 acc[4][3];
    for (int i = 0; i < MT; i++) for (int j = 0; j < 3; j++) acc[i][j] = _mm256_setzero_ps();
    const uint16_t* w0 = P + g * 3 * K;
    for (long k = 0; k < K; k += 8) {
        __m256 w[3];
        for (int j = 0; j < 3; j++) w[j] = load_bf16(w0 + k * 3 + j * 8);
        for (int i = 0; i < MT; i++) {
            __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
            for (int j = 0; j < 3; j++) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MT; i++) for (int j = 0; j < 3; j++) {
        long n = g * 3 + j;
        if (n >= N) break;  /* the zero rows padding the last group */
        float s = hsum(acc[i][j]);
        if (b) { uint32_t u = (uint32_t)b[n] << 16; float bf; __builtin_memcpy(&bf, &u, 4); s += bf; }
        uint16_t r = to_bf16(s);
        if (yf) { uint32_t u = (uint32_t)r << 16; __builtin_memcpy(yf + (m0 + i) * N + n, &u, 4); }  /* fp32 holding the bf16 value */
        else y[(m0 + i) * N + n] = r;
    }
}
static void t4(const float* x, long K, const uint16_t* P, const uint16_t* b, uint16_t* y, float* yf, long N, long m, long g) {
    tile(x, K, P, b, y, yf, N, m, g, 4);
}
static void t3(const float* x, long K, const uint16_t* P, const uint16_t* b, uint16_t* y, float* yf, long N, long m, long g) {
    tile(x, K, P, b, y, yf, N, m, g, 3);
}
static void t2(const float* x, long K, const uint16_t* P, const uint16_t* b, uint16_t* y, float* yf, long N, long m, long g) {
    tile(x, K, P, b, y, yf, N, m, g, 2);
}
static void t1(const float* x, long K, const uint16_t* P, const uint16_t* b, uint16_t* y, float* yf, long N, long m, long g) {
    tile(x, K, P, b, y, yf, N, m, g, 1);
}

/* y[M, N] (bf16; or yf, fp32 holding bf16 values) = xf[M, K] @ W[N, K]^T (+ b[N]); xf fp32, b bf16; P: W packed
   by pack(). Work-shared over the threads of the enclosing parallel region (serial outside one). */
static void gemm_rows(const float* xf, long M, long K, const uint16_t* P, const uint16_t* b, long N, uint16_t* y, float* yf) {
    const long G = (N + 2) / 3, GB = 16;  /* groups per task: enough tasks for the threads, few enough to be cheap */
    const long tasks = (G + GB - 1) / GB;
    #pragma omp for schedule(static)
    for (long t = 0; t < tasks; t++) {
        long g1 = (t + 1) * GB < G ? (t + 1) * GB : G;
        for (long g = t * GB; g < g1; g++) {
            long m = 0;
            for (; m + 4 <= M; m += 4) t4(xf, K, P, b, y, yf, N, m, g);
            /* the last 1-3 rows in one tile (one pass over the group's weights), the same chains as any tile */
            if (M - m == 3) t3(xf, K, P, b, y, yf, N, m, g);
            else if (M - m == 2) t2(xf, K, P, b, y, yf, N, m, g);
            else if (M - m == 1) t1(xf, K, P, b, y, yf, N, m, g);
        }
    }
}

/* y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]); x, b, y bf16; P: W packed by pack(); xf: fp32 scratch [M, K] */
void linear_bf16(const uint16_t* x, float* xf, long M, long K, const uint16_t* P, const uint16_t* b, long N,
                 uint16_t* y, int threads) {
    for (long i = 0; i < M * K; i++) { uint32_t u = (uint32_t)x[i] << 16; __builtin_memcpy(xf + i, &u, 4); }
    #pragma omp parallel num_threads(threads)
    gemm_rows(xf, M, K, P, b, N, y, 0);
}
"""
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    """NanoSpec's per-user cache (NANOSPEC_CACHE moves it): the built kernel and the per-machine answers."""
    root = os.environ.get("NANOSPEC_CACHE")
    return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanospec"


def cpu_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


_LIB = []  # [] not tried yet, [None] unavailable, [fn] built and loaded


def kernel():
    """The loaded C function, or None (not x86 with AVX2+FMA, or no C compiler). Built once, cached on disk."""
    if not _LIB:
        lib = load(SOURCE, "cpu_gemm")
        fn = lib.linear_bf16 if lib is not None else None
        if fn is not None:
            p, i = ctypes.c_void_p, ctypes.c_long
            fn.argtypes, fn.restype = [p, p, i, i, p, p, i, p, ctypes.c_int], None
        _LIB.append(fn)
    return _LIB[0]


def load(source: str, stem: str):
    """Build C source with FLAGS into cache_dir()/<stem>-<hash>.so (once per source and compiler) and load
    it; None where it cannot (not x86 with AVX2+FMA, no C compiler)."""
    if not cpu_supported():
        return None
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha256((source + " ".join(FLAGS) + cc).encode()).hexdigest()[:16]
    so = cache_dir() / f"{stem}-{tag}.so"
    try:
        if not so.is_file():
            so.parent.mkdir(parents=True, exist_ok=True)
            src, tmp = so.with_suffix(f".{os.getpid()}.c"), so.with_suffix(f".{os.getpid()}.tmp")
            src.write_text(source)
            subprocess.run([cc, *FLAGS, str(src), "-o", str(tmp)], check=True, capture_output=True, timeout=120)
            tmp.replace(so)  # atomic: a concurrent process sees the whole library or none
            src.unlink()
        # torch is loaded first, so the library's libgomp.so.1 resolves to torch's own: one OpenMP thread
        # pool in the process (two pools would spin against each other on a 2-core machine)
        return ctypes.CDLL(str(so))
    except (OSError, subprocess.SubprocessError):
        return None


def pack(w: Tensor) -> Tensor:
    """w [N, K] bf16 -> [ceil(N / 3), K / 8, 3, 8]: each group of 3 weight rows interleaved by 8-wide chunks
    of k, so the kernel streams a group as one contiguous run (unpacked rows are 3 interleaved streams:
    measured 1.3-1.7x slower at one row). The last group is padded with zero rows."""
    N, K = w.shape
    G = -(-N // 3)
    wp = torch.cat([w, w.new_zeros(G * 3 - N, K)]) if G * 3 > N else w
    return wp.reshape(G, 3, K // 8, 8).transpose(1, 2).contiguous()


def pack_rows_(packed: Tensor, rows: Tensor, slots: Tensor):
    """Row slots[i] of the matrix that packed = pack(W) holds becomes rows[i] (rows [n, K], slots [n]), in
    place: a packed copy follows a buffer whose rows change (vocab.NanoSpecVocab). Static shapes, no sync."""
    G, K8, three, eight = packed.shape
    slots = slots.long()
    packed[slots // three, :, slots % three, :] = rows.reshape(-1, K8, eight)  # [n, K/8, 8] per (group, place)


def kernel_linear(x: Tensor, packed: Tensor, N: int, b: Tensor | None = None) -> Tensor:
    """x [..., K] bf16 @ W.T (+ b [N]) -> [..., N] bf16 with the C kernel; packed = pack(W), W [N, K]."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.bfloat16)
    xf = torch.empty(x2.shape[0], K)
    kernel()(x2.data_ptr(), xf.data_ptr(), x2.shape[0], K, packed.data_ptr(), 0 if b is None else b.data_ptr(), N,
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
    """What per-machine answers depend on: the CPU, its vector ISA, torch and the thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def merge_json(path: Path, key: str, value):
    """Set path[key] = value in a JSON file of per-machine answers: read, merge, replace atomically (a
    concurrent process sees the old file or the new one). A read-only home only costs a re-check next time."""
    data = read_json(path)
    data[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass


def cached(key: str, compute) -> bool:
    """A per-machine yes/no answer: cache_dir()/cpu_gemm.json[key], computed once (compute()) and stored."""
    f = cache_dir() / "cpu_gemm.json"
    data = read_json(f)
    if key not in data:
        data[key] = bool(compute())
        merge_json(f, key, data[key])
    return data[key]


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
