"""The CPU GEMM per weight format: billions of weights per second for a 1.5B model's FFN-sized matrix, with the
matrix in cache (one copy, again and again) and streamed from memory (copies past the L3, in turn), at 1-16 rows.
Prints a Markdown table.

    python bench_kernels.py [--formats bf16,Q8_0,Q4_0,Q4_K,Q6_K] [--rows 1,4,16] [--n 8960] [--k 1536]
"""
import argparse
import statistics
import sys
import time

import numpy as np
import torch

import cpu_gemm
import qlinear
import quant
from errors import UsageError, one_line_errors


def matrix(fmt: str, N: int, K: int, rng):
    """One N x K matrix of format fmt as the C GEMM reads it: (call(x) -> y, its bytes)."""
    if fmt == "bf16":
        w = torch.randn(N, K).bfloat16()
        p = cpu_gemm.pack(w)
        return (lambda x: cpu_gemm.kernel_linear(x, p, N)), p.numel() * 2
    if fmt not in quant.GGUF_TYPES:
        raise UsageError(f"--formats: unknown format {fmt!r} (bf16 or one of {', '.join(quant.GGUF_TYPES)})")
    kq = quant.to_kernel(quant.from_gguf(quant.random_blocks(fmt, N, K, rng), fmt, K))
    kw = qlinear.KernelWeight.of(kq, K)
    nbytes = sum(t.numel() * t.element_size() for t in kw.tensors if t is not None)
    return (lambda x: qlinear.kernel_linear(x, kw, N)), nbytes


def rate(calls: list, x, reps: int) -> float:
    """Median seconds of one product, cycling through calls (several copies: each streamed from memory)."""
    for c in calls:
        c(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for c in calls:
            c(x)
        times.append((time.perf_counter() - t) / len(calls))
    return statistics.median(times)


def run(formats, rows, N, K, reps=5, stream_mb=256) -> list[dict]:
    rng, out = np.random.default_rng(0), []
    for fmt in formats:
        one, nbytes = matrix(fmt, N, K, rng)
        copies = [one] + [matrix(fmt, N, K, rng)[0] for _ in range(max(1, stream_mb * 2 ** 20 // nbytes) - 1)]
        for m in rows:
            x = torch.randn(m, K).bfloat16()
            cached, streamed = rate([one], x, reps), rate(copies, x, reps)
            out.append(dict(format=fmt, rows=m, bytes=nbytes, cached_gws=N * K / cached / 1e9,
                            streamed_gws=N * K / streamed / 1e9, streamed_gbs=nbytes / streamed / 1e9))
    return out


def main(argv=None):
    """-> the rows (a list of dicts); bad flags raise UsageError (one line from the command line)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,Q8_0,Q4_0,Q4_K,Q6_K")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--n", type=int, default=8960)
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--stream-mb", type=int, default=256, help="copies of the matrix streamed in turn (past the L3)")
    a = ap.parse_args(argv)
    if cpu_gemm.kernel() is None:
        raise UsageError("the C kernels are not built on this machine (x86 with AVX2 and a C compiler)")
    if a.k % 256 or a.n < 1:
        raise UsageError(f"--k must be a multiple of 256 (the K-quants' super-block) and --n positive: {a.k}, {a.n}")
    rows = [int(r) for r in a.rows.split(",")]
    res = run(a.formats.split(","), rows, a.n, a.k, a.reps, a.stream_mb)
    print(f"{cpu_gemm.machine_id()}, kernel {cpu_gemm.ISA}, {torch.get_num_threads()} threads, {a.n} x {a.k}\n")
    print("| format | rows | G weights/s in cache | G weights/s streamed | GB/s streamed |")
    print("|---|---|---|---|---|")
    for r in res:
        print(f"| {r['format']} | {r['rows']} | {r['cached_gws']:.1f} | {r['streamed_gws']:.1f} "
              f"| {r['streamed_gbs']:.1f} |")
    return res


if __name__ == "__main__":
    sys.exit(one_line_errors(lambda a: main(a) and 0, sys.argv[1:]))
