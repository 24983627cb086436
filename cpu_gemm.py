"""The CPU linear layer for bf16 weights: a small kernel built with the system C compiler on first use, in one
of three variants chosen by the CPU's flags: AVX-512 BF16 dot products where the CPU has them (Zen 4, Cooper
Lake, Sapphire Rapids and later), else AVX-512F FMAs (Skylake-SP, Cascade Lake, Ice Lake), else AVX2/FMA
(NANOSPEC_CPU_ISA=avx512 or avx2 forces a smaller one).

Why: on CPUs without a bf16 dot-product instruction (AVX2, plain AVX-512) torch's bf16 GEMM costs about the
same per row at any row count (measured: 16 rows = 7x one row on an AVX2 EPYC), and on an AVX-512 BF16 EPYC
its one-row path is twice as slow as this kernel, so verifying a draft tree costs several decode steps and
speculation cannot pay. This kernel streams the bf16 weights once per pass in panels, and multiplies each
panel into several rows of the pass at a time, so extra rows cost multiply-adds, not weight traffic:
- AVX2: panels of 16 rows, widened to fp32 in registers, into up to 6 rows at a time (12 accumulators:
  BLIS's 6 x 16 AVX2 shape); while a panel computes, the next one is prefetched into L2 (measured on the
  AVX2 EPYC, the default model's GEMMs against the earlier 4 x 3 dot-product tiles, alternating: 1.10x at 1
  row, 1.21x at 8, 1.30x at 16; BENCHMARKS.md, session 11).
- AVX-512F: the AVX2 kernel's FMAs in 16-lane registers, panels of 64 rows into up to 6 rows (24 accumulators);
  the same bits as the AVX2 kernel (test_cpu_gemm checks it), twice its work per instruction.
- AVX-512 BF16: panels of 64 rows, pairs of k side by side, into up to 6 rows at a time with vdpbf16ps (24
  accumulators); each instruction does 32 multiply-adds, 4x an AVX2 FMA (BENCHMARKS.md, session 12).

Row-invariant by construction: every output element is one fp32 chain over k in order (FMAs, or dot
products of k pairs), plus the bias, whatever the tile, the row count or the row's place in the pass. A
token's bits never depend on how many tokens share its pass, which is what exact mode needs (exact.py then
finds that every pass size agrees). The sum is rounded to bf16 once, round-to-nearest-even. The BF16 variant
rounds differently from the two FMA ones, but a machine only ever runs one.

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

COMMON = r"""
#include <immintrin.h>
#include <omp.h>
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
/* 8 fp32 -> 8 bf16 (in the low half of each 32-bit lane): to_bf16's arithmetic, lane by lane */
static inline __m256i round8(__m256 s) {
    const __m256i u = _mm256_castps_si256(s), one = _mm256_set1_epi32(1);
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fc0), nan);
}
/* the 16 outputs of one register of accumulators: + bias, rounded to bf16 once, into y (or yf: fp32 holding
   the bf16 value); columns from N on are the zero rows padding the last panel and are not written */
static inline void store16(const float* out, const uint16_t* b, uint16_t* y, float* yf, long N, long m, long n0) {
    if (n0 + 16 <= N) {  /* a whole register pair: the same adds and rounding in vectors (one value at a time,
                            the LM head's epilogue cost about a third of its time at K = 576) */
        __m256 s0 = _mm256_loadu_ps(out), s1 = _mm256_loadu_ps(out + 8);
        if (b) { s0 = _mm256_add_ps(s0, load_bf16(b + n0)); s1 = _mm256_add_ps(s1, load_bf16(b + n0 + 8)); }
        __m256i r0 = round8(s0), r1 = round8(s1);
        if (yf) {
            _mm256_storeu_si256((__m256i*)(yf + m * N + n0), _mm256_slli_epi32(r0, 16));
            _mm256_storeu_si256((__m256i*)(yf + m * N + n0 + 8), _mm256_slli_epi32(r1, 16));
        } else {  /* pack the 16-bit halves: per 128-bit lane [r0 0-3, r1 0-3 | r0 4-7, r1 4-7], then in order */
            __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
            _mm256_storeu_si256((__m256i*)(y + m * N + n0), pk);
        }
        return;
    }
    for (long c = 0; c < 16 && n0 + c < N; c++) {
        long n = n0 + c;
        float s = out[c];
        if (b) { uint32_t u = (uint32_t)b[n] << 16; float bf; __builtin_memcpy(&bf, &u, 4); s += bf; }
        uint16_t r = to_bf16(s);
        if (yf) { uint32_t u = (uint32_t)r << 16; __builtin_memcpy(yf + m * N + n, &u, 4); }
        else y[m * N + n] = r;
    }
}
/* rows[slot[i]] = W[tok[i]] and the same row into the packed copy P (pack()'s layout: panels of `panel` rows, k
   in groups of kb, row c of a panel at place[c] among a group's panel slots), for every i with 0 <= slot[i] <
   nslots and tok[i] a row of W (the others are skipped: masked entries) */
void write_rows(uint16_t* rows, uint16_t* P, const uint16_t* W, long V, const int64_t* tok, const int64_t* slot,
                long n, long nslots, long K, long panel, long kb, const int64_t* place) {
    const long G = K / kb;
    for (long i = 0; i < n; i++) {
        long s = slot[i], t = tok[i];
        if (s < 0 || s >= nslots || t < 0 || t >= V) continue;
        const uint16_t* src = W + t * K;
        __builtin_memcpy(rows + s * K, src, K * 2);
        uint16_t* dst = P + (s / panel) * G * panel * kb + place[s % panel] * kb;
        for (long g = 0; g < G; g++)
            for (long j = 0; j < kb; j++) dst[g * panel * kb + j] = src[g * kb + j];
    }
}
/* a register tile: rows m.. m + height of x (row stride kx, in the kernel's units) times packed panel p; where
   pf is not 0 it prefetches the next panel's 64-byte lines [l0, l1) (tiles[height] for height 1..mtmax) */
typedef void (*tile_fn)(const void* x, long kx, const uint16_t* P, const uint16_t* b, uint16_t* y, float* yf, long N,
                        long m, long p, const char* pf, long l0, long l1);

/* y[M, N] (bf16; or yf, fp32 holding bf16 values) = x[M, K] @ W[N, K]^T (+ b[N]) through a kernel's tiles, over
   packed panels of `panel` weight rows (panel x K bf16 each). Work-shared over the threads of the enclosing parallel
   region (serial outside one), ending in a barrier: each thread takes one contiguous run of (row block, panel)
   pairs, or, where the kernel has half-panel tiles (halves: tiles of a panel's first or last panel / 2 columns,
   their p = 2 x panel + half), of half pairs, and a thread's two halves of one panel are one whole tile. Why
   halves: the default model's o and down products have 9 panels of 64; two threads took 5 and 4, one idle a
   tenth of the product, at every row count (memory-bound or not). The rows are cut into ceil(rows / mtmax) tiles
   of nearly equal height (8 rows with mtmax 6: 4 + 4, not 6 + 2), as each tile's chains must be many enough to
   hide the latency; row blocks of at most 48 keep a block's x in L2 while the panels stream. While a panel computes,
   the next one is prefetched into L2, so memory and arithmetic overlap: all of it by the first tile (spread = 0),
   or, where the row block has several tiles, a share by each (spread = 1: a lone tile streams its panel with
   the hardware prefetcher; spread = 2: a lone tile prefetches all of it, as with 0). The later tiles find their
   panel in cache and give the hardware prefetcher no misses to follow. Row-invariant by construction when each
   tile computes every output the same way whatever its height or width. */
static void tiled(const tile_fn* tiles, const tile_fn* halves, long mtmax, long panel, int spread, const void* x,
                  long kx, long M, long K, const uint16_t* P, const uint16_t* b, long N, uint16_t* y, float* yf) {
    const long NP = (N + panel - 1) / panel, L = panel * K / 32;  /* 64-byte lines per panel */
    /* the blocks are of nearly equal height (60 rows: 30 + 30, not 48 + 12), as a thread may take a whole block;
       one run over all (row block, panel) pairs, not a loop per row block: with many blocks (a prefill) the
       pairs divide evenly */
    const long NB = (M + 47) / 48, S = halves ? 2 : 1, NI = NB * NP * S;
    const long nth = omp_get_num_threads(), me = omp_get_thread_num();
    const long i1 = NI * (me + 1) / nth;
    for (long i = NI * me / nth; i < i1;) {
        const long q = i / S, e = (q + 1) * S < i1 ? (q + 1) * S : i1;  /* this thread's part of pair q: [i, e) */
        const long mb = M * (q / NP) / NB, mend = M * (q / NP + 1) / NB, p = q % NP;
        long rows = mend - mb, nt = (rows + mtmax - 1) / mtmax;
        const char* next = p + 1 < NP && (q + 1) * S < i1 ? (const char*)(P + (p + 1) * panel * K) : 0;
        long m = mb;
        for (long t = 0; t < nt; t++) {
            long h = (mend - m) / (nt - t) + ((mend - m) % (nt - t) != 0);
            long l0 = spread && nt > 1 ? L * t / nt : 0,
                 l1 = spread && nt > 1 ? L * (t + 1) / nt : (t == 0 && spread != 1 ? L : 0);
            if (e - i == S) tiles[h](x, kx, P, b, y, yf, N, m, p, l1 > l0 ? next : 0, l0, l1);
            else halves[h](x, kx, P, b, y, yf, N, m, 2 * p + i % 2, l1 > l0 ? next : 0, l0, l1);
            m += h;
        }
        i = e;
    }
    #pragma omp barrier
}
"""

# The AVX2/FMA kernel: any x86-64 of the last decade.
GEMM_AVX2 = r"""
/* MT rows of x times the 16 weight rows of packed panel p (P[p][k][16], see pack()): a panel's K x 16
   weights are one contiguous stream, read from memory once per pass and from L1/L2 once per MT rows. Each
   k's 16 bf16 values sit interleaved [n0, n8, n1, n9, ...], so one 32-byte load becomes the two fp32 vectors
   of n0-7 and n8-15 with one shift and one mask (bf16 = the high half of fp32), and every x value is one
   broadcast: 2 * MT FMAs per load of weights, so extra rows cost FMAs, not weight traffic. */
static inline __attribute__((always_inline)) void tile(const float* x, long K, const uint16_t* P, const uint16_t* b,
        uint16_t* y, float* yf, long N, long m0, long p, const char* pf, const int MT) {
    /* named accumulators, not an array: GCC keeps an array of vectors in memory and stores it every k */
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float* x0 = x + m0 * K;
    const __m256i* w = (const __m256i*)(P + p * 16 * K);
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    #pragma GCC unroll 4
    for (long k = 0; k < K; k++) {  /* unrolled: the loop's own instructions cost 15% of the FMAs' issue slots */
        if (pf && !(k & 1)) _mm_prefetch(pf + k * 32, _MM_HINT_T1);  /* the next panel, one 64-byte line per 2 k */
        __m256i v = _mm256_loadu_si256(w + k);
        __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), w1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        __m256 xv;
#define ROW(i) if (MT > i) { xv = _mm256_broadcast_ss(x0 + i * K + k); \
            a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0); a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1); }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
    __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    float out[6][16];  /* the accumulators leave the registers once, in a loop the compiler unrolls */
    for (int i = 0; i < MT; i++) { _mm256_storeu_ps(out[i], acc[i][0]); _mm256_storeu_ps(out[i] + 8, acc[i][1]); }
    for (int i = 0; i < MT; i++) store16(out[i], b, y, yf, N, m0 + i, p * 16);
}
#define TILE(MT) static void t##MT(const void* x, long K, const uint16_t* P, const uint16_t* b, uint16_t* y, float* yf, \
        long N, long m, long p, const char* pf, long l0, long l1) { (void)l0; (void)l1; tile((const float*)x, K, P, b, y, yf, N, m, p, pf, MT); }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
static const tile_fn tiles[7] = {0, t1, t2, t3, t4, t5, t6};
#define FMA_HALVES 0  /* panels of 16: the products' panel counts are even */
#define FMA_PANEL 16
#define FMA_SPREAD 0  /* the first tile prefetches the whole next panel */
"""

# The AVX-512F kernel (Skylake-SP, Cascade Lake, Ice Lake: AVX-512 without bf16 dot products): the AVX2 kernel's
# arithmetic in 16-lane registers, the AVX-512 BF16 kernel's shape (panels of 64, tiles of up to 6 rows).
GEMM_AVX512 = r"""
/* MT (<= 6) rows of x times the 64 weight rows of packed panel p (P[p][k][64]: per k, two groups of 32 values
   interleaved [n0, n16, n1, n17, ...], pack()), so each 64-byte load becomes the fp32 vectors of 16 rows with one
   shift and one mask, and every x value is one broadcast: 4 * MT FMAs per k, into 24 of the 32 registers.
   Each output is one fp32 FMA chain over k in order, as in the AVX2 kernel: the two give the same bits, and
   each instruction does twice an AVX2 FMA's work (measured on an Ice Lake Xeon, the default model's GEMMs in
   one process, alternating: 16 rows 1.4-1.5x, 60 rows 1.6-2x the AVX2 kernel, 1-4 rows the same: memory-bound). */
static inline __attribute__((always_inline)) void tile(const float* x, long K, const uint16_t* P, const uint16_t* b,
        uint16_t* y, float* yf, long N, long m0, long p, const char* pf, long l0, long l1, const int MT, const int NVH) {
    /* NVH = 4: the whole panel p; NVH = 2: the half panel p (panel p / 2's 32 columns from 32 x (p % 2): the
       second of each k's two 64-byte loads, or the first) */
    __m512 acc[6][4];  /* in registers: the loops over it are unrolled (MT and NVH are constants) */
    for (int i = 0; i < MT; i++) for (int v = 0; v < NVH; v++) acc[i][v] = _mm512_setzero_ps();
    const float* x0 = x + m0 * K;
    const long half = NVH == 4 ? 0 : p % 2;
    const long n0 = NVH == 4 ? p * 64 : p / 2 * 64 + half * 32;
    const __m512i* w = (const __m512i*)(P + (NVH == 4 ? p : p / 2) * 64 * K) + half;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    long due = 0, l = l0;
    #pragma GCC unroll 2
    for (long k = 0; k < K; k++) {
        if (pf)  /* this tile's share of the next panel, spread evenly over its k loop (as the BF16 kernel) */
            for (due += l1 - l0; due >= K; due -= K, l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
        __m512 wv[4];
        for (int v = 0; v < NVH / 2; v++) {
            __m512i u = _mm512_loadu_si512(w + 2 * k + v);
            wv[2 * v] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
            wv[2 * v + 1] = _mm512_castsi512_ps(_mm512_and_si512(u, hi));
        }
        for (int i = 0; i < MT; i++) {
            __m512 xv = _mm512_set1_ps(x0[i * K + k]);
            for (int v = 0; v < NVH; v++) acc[i][v] = _mm512_fmadd_ps(xv, wv[v], acc[i][v]);
        }
    }
    float out[16];
    for (int i = 0; i < MT; i++) for (int v = 0; v < NVH; v++) {
        _mm512_storeu_ps(out, acc[i][v]);
        store16(out, b, y, yf, N, m0 + i, n0 + v * 16);
    }
}
#define TILE(MT) static void t##MT(const void* x, long K, const uint16_t* P, const uint16_t* b, uint16_t* y, float* yf, \
        long N, long m, long p, const char* pf, long l0, long l1) { tile((const float*)x, K, P, b, y, yf, N, m, p, pf, l0, l1, MT, 4); } \
    static void h##MT(const void* x, long K, const uint16_t* P, const uint16_t* b, uint16_t* y, float* yf, \
        long N, long m, long p, const char* pf, long l0, long l1) { tile((const float*)x, K, P, b, y, yf, N, m, p, pf, l0, l1, MT, 2); }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
static const tile_fn tiles[7] = {0, t1, t2, t3, t4, t5, t6};
static const tile_fn half_tiles[7] = {0, h1, h2, h3, h4, h5, h6};
#define FMA_HALVES half_tiles  /* 9-panel products split evenly over 2 threads (tiled()) */
#define FMA_PANEL 64
/* a lone tile (1-6 rows) prefetches the whole next panel, as the AVX2 kernel's first tile does (measured on an Ice
   Lake Xeon: 4 rows 1.1x faster than leaving it to the hardware prefetcher); several tiles share it out, as the
   BF16 kernel's do */
#define FMA_SPREAD 2
"""

# The two FMA kernels' entry points (after their tiles, FMA_PANEL and FMA_SPREAD)
FMA_ENTRY = r"""
/* y[M, N] (bf16; or yf, fp32 holding bf16 values) = xf[M, K] @ W[N, K]^T (+ b[N]); xf fp32 holding bf16
   values, b bf16; P: W packed by pack(); xs: scratch the AVX-512 BF16 kernel needs (unused here). Every
   output is one fp32 FMA chain over k in order, plus the bias, rounded once: the same whatever the tile, the
   row count or the row's place in the pass (row-invariant, as exact mode needs). Tiles of up to 6 rows. */
static void gemm_rows(const float* xf, long M, long K, const uint16_t* P, const uint16_t* b, long N, uint16_t* y,
                      float* yf, uint16_t* xs) {
    (void)xs;
    tiled(tiles, FMA_HALVES, 6, FMA_PANEL, FMA_SPREAD, xf, K, M, K, P, b, N, y, yf);
}

/* y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]); x, b, y bf16; P: W packed by pack(); xf: fp32 scratch [M, K] */
void linear_bf16(const uint16_t* x, float* xf, long M, long K, const uint16_t* P, const uint16_t* b, long N,
                 uint16_t* y, int threads) {
    for (long i = 0; i < M * K; i++) { uint32_t u = (uint32_t)x[i] << 16; __builtin_memcpy(xf + i, &u, 4); }
    #pragma omp parallel num_threads(threads)
    gemm_rows(xf, M, K, P, b, N, y, 0, 0);
}
"""

# The AVX-512 BF16 kernel (Zen 4 and later, Cooper Lake, Sapphire Rapids and later): vdpbf16ps multiplies
# pairs of bf16 values and adds both products into an fp32 lane, 32 multiply-adds per instruction against
# the AVX2 kernel's 8 per FMA, and the weights need no widening.
GEMM_AVX512BF16 = r"""
#ifndef NV
#define NV 4
#endif
/* MT (<= 6) rows of x times the 64 weight rows of packed panel p (P[p][k/2][64][2]: for each pair of k, each
   weight row's two bf16 values side by side, so one 64-byte load is 16 rows' pairs). x: bf16 pairs, K2 = K / 2
   per row; one 32-bit broadcast per row and pair. Each output is one chain of vdpbf16ps over the pairs in
   order; 4 x MT independent chains hide its latency (24 accumulators of the 32 registers), one row's 4
   included. A pass of one tile (up to 6 rows) leaves its panel stream to the hardware prefetcher; in larger
   passes each tile prefetches a share of the next panel (tiled(), spread): measured on Zen 4, the default
   model's GEMMs, alternating in one process, 12-15% faster at 12-16 rows than no prefetch, the same at 1, 8,
   26 and 48 rows, where prefetching the whole next panel from the one-row tile was 7-12% slower. 16-row tiles
   of 16-row panels, which read each panel once per 16 rows, were 5-15% slower at 1-4 rows and between 20%
   faster and 15% slower at 16, as this shared machine's memory speed moved. */
static inline __attribute__((always_inline)) void tile(const uint32_t* x, long K2, const uint16_t* P, const uint16_t* b,
        uint16_t* y, float* yf, long N, long m0, long p, const char* pf, long l0, long l1, const int MT) {
    __m512 acc[6][NV];  /* in registers: the loops over it are unrolled (MT and NV are constants) */
    for (int i = 0; i < MT; i++) for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();
    const uint32_t* x0 = x + m0 * K2;
    const __m512i* w = (const __m512i*)(P + p * 32 * NV * K2);
    long due = 0, l = l0;
    #pragma GCC unroll 2
    for (long k = 0; k < K2; k++) {
        /* this tile's share of the next panel, spread evenly over its k loop by a running remainder (two integer
           divisions per k had cost 12-16% of 26- and 60-row passes, measured on Zen 5), into L1 (T0: 3-13% faster
           than L2 at 16-26 rows there) */
        if (pf)
            for (due += l1 - l0; due >= K2; due -= K2, l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
        __m512bh wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512(w + NV * k + v);
        for (int i = 0; i < MT; i++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x0[i * K2 + k]);
            for (int v = 0; v < NV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xb, wv[v]);
        }
    }
    float out[16];
    for (int i = 0; i < MT; i++) for (int v = 0; v < NV; v++) {
        _mm512_storeu_ps(out, acc[i][v]);
        store16(out, b, y, yf, N, m0 + i, (p * NV + v) * 16);
    }
}
#define TILE(MT) static void t##MT(const void* x, long K2, const uint16_t* P, const uint16_t* b, uint16_t* y, \
        float* yf, long N, long m, long p, const char* pf, long l0, long l1) { tile((const uint32_t*)x, K2, P, b, y, yf, N, m, p, pf, l0, l1, MT); }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
static const tile_fn tiles[7] = {0, t1, t2, t3, t4, t5, t6};

/* y[M, N] = x[M, K] @ W[N, K]^T (+ b), x as bf16 pairs, in tiles of up to 6 rows over panels of 64. Row-invariant
   by construction: every output is one chain of vdpbf16ps over the k pairs in order, plus the bias, rounded
   once, whatever the tile, the row count or the row's place in the pass. */
static void gemm_pairs(const uint32_t* x, long M, long K, const uint16_t* P, const uint16_t* b, long N, uint16_t* y,
                       float* yf) {
    tiled(tiles, 0, 6, 16 * NV, 1, x, K / 2, M, K, P, b, N, y, yf);
}

/* the fused pass's interface (cpu_forward.py): xf [M, K] fp32 holding bf16 values, made bf16 (exact) in xs
   [threads, M, K] first */
static void gemm_rows(const float* xf, long M, long K, const uint16_t* P, const uint16_t* b, long N, uint16_t* y,
                      float* yf, uint16_t* xs) {
    uint16_t* mine = xs + omp_get_thread_num() * M * K;  /* each thread its own copy: no barrier before the GEMM */
    for (long i = 0; i < M * K; i++) mine[i] = to_bf16(xf[i]);
    gemm_pairs((const uint32_t*)mine, M, K, P, b, N, y, yf);
}

/* y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]); x, b, y bf16 (x 4-byte aligned: K is even); xf unused */
void linear_bf16(const uint16_t* x, float* xf, long M, long K, const uint16_t* P, const uint16_t* b, long N,
                 uint16_t* y, int threads) {
    (void)xf;
    #pragma omp parallel num_threads(threads)
    gemm_pairs((const uint32_t*)x, M, K, P, b, N, y, 0);
}
"""
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
SOURCE = COMMON + {"avx512bf16": GEMM_AVX512BF16, "avx512": GEMM_AVX512 + FMA_ENTRY, "avx2": GEMM_AVX2 + FMA_ENTRY}[ISA]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"] + {
    "avx512bf16": ["-mavx512f", "-mavx512bf16"], "avx512": ["-mavx512f"], "avx2": []}[ISA]
# the packed layout (pack()): panels of PANEL weight rows, KB consecutive k of a row side by side
PANEL, KB = {"avx512bf16": (64, 2), "avx512": (64, 1), "avx2": (16, 1)}[ISA]
HALF = 8 if ISA == "avx2" else 16  # FMA kernels: a k's 2 * HALF values per load interleave two halves of rows


def cache_dir() -> Path:
    """NanoSpec's per-user cache (NANOSPEC_CACHE moves it): the built kernel and the per-machine answers."""
    root = os.environ.get("NANOSPEC_CACHE")
    return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nanospec"


def cpu_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


P_, I_ = ctypes.c_void_p, ctypes.c_long  # the C functions' pointer and long arguments


_FNS = {}  # (stem, name) -> the loaded function or None (a plain dict: torch.compile traces through it)


def c_function(source: str, stem: str, name: str, argtypes: tuple):
    """Function `name` of C source built by load() (once per process), its argument types set; None where it
    cannot be built (not x86 with AVX2+FMA, no C compiler)."""
    if (stem, name) not in _FNS:
        lib = load(source, stem)
        fn = None if lib is None else getattr(lib, name)
        if fn is not None:
            fn.argtypes, fn.restype = list(argtypes), None
        _FNS[stem, name] = fn
    return _FNS[stem, name]


# The machine's multiply-add peak with the kernel's own instruction (bench_ar.py --profile's arithmetic floor):
# vdpbf16ps where the build has AVX-512 BF16, else a 16- or 8-lane fp32 FMA
PEAK = r"""
#include <immintrin.h>
#include <omp.h>
/* iters rounds of 24 independent chains per thread (enough to hide the instruction's latency), no memory
   traffic; returns GFLOP/s over `threads` threads (FLOPS per instruction: 2 per lane and product) */
double peak_gflops(long iters, int threads) {
    double t0 = omp_get_wtime(), sink = 0;
    #pragma omp parallel num_threads(threads) reduction(+:sink)
    {
#if defined(__AVX512BF16__)
        typedef __m512 vec;
        const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3c00);  /* bf16 2^-7 */
#define STEP(a) a = _mm512_dpbf16_ps(a, x, x)
#define FLOPS 64
#elif defined(__AVX512F__)
        typedef __m512 vec;
        const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
#define STEP(a) a = _mm512_fmadd_ps(a, x, y)
#define FLOPS 32
#else
        typedef __m256 vec;
        const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-4f);
#define STEP(a) a = _mm256_fmadd_ps(a, x, y)
#define FLOPS 16
#endif
        vec a[24];
        for (int i = 0; i < 24; i++) __builtin_memset(&a[i], 0, sizeof(vec));
        for (long it = 0; it < iters; it++) {
            #pragma GCC unroll 24
            for (int i = 0; i < 24; i++) STEP(a[i]);
        }
        for (int i = 0; i < 24; i++) { float f; __builtin_memcpy(&f, &a[i], 4); sink += f; }
    }
    double t = omp_get_wtime() - t0;
    return sink == -1.0 ? 0 : (double)iters * 24 * FLOPS * threads / t / 1e9;  /* (sink: keep the chains) */
}
"""


def peak_gflops(threads: int | None = None, reps: int = 5) -> float | None:
    """The best of reps runs of PEAK (about 0.1 s each): this machine's multiply-add peak in GFLOP/s with the kernel's
    instruction over `threads` threads (default: torch's); None where the kernels cannot be built here."""
    fn = c_function(PEAK, "cpu_peak", "peak_gflops", (I_, ctypes.c_int))
    if fn is None:
        return None
    fn.restype = ctypes.c_double
    threads = threads or torch.get_num_threads()
    return max(fn(2_000_000, threads) for _ in range(reps))


def kernel():
    """The GEMM's C function, or None (not x86 with AVX2+FMA, or no C compiler). Built once, cached on disk."""
    return c_function(SOURCE, "cpu_gemm", "linear_bf16", (P_, P_, I_, I_, P_, P_, I_, P_, ctypes.c_int))


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
    return c_function(SOURCE, "cpu_gemm", "write_rows", (P_, P_, P_, I_, P_, P_, I_, I_, I_, I_, I_, P_))


def _write_rows_c(rows: Tensor, packed: Tensor, weight: Tensor, tok: Tensor, slots: Tensor):
    tok, slots = tok.long().contiguous(), slots.long().contiguous()
    V, K = weight.shape
    _rows_writer()(rows.data_ptr(), packed.data_ptr(), weight.data_ptr(), V, tok.data_ptr(), slots.data_ptr(),
                   tok.numel(), rows.shape[0], K, PANEL, KB, _SLOT.data_ptr())


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
    """What per-machine answers depend on: the CPU, its vector ISA, torch, the thread count and this kernel's
    source (a changed kernel times, and rounds, anew)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads | kernel {ISA} {hashlib.sha256(SOURCE.encode()).hexdigest()[:8]}")


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
