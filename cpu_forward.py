"""The CPU target pass in one C call: every decoder layer of a bf16 model (norms, fused GEMMs, RoPE, the KV
write, attention, the MLP, the residuals) for all rows of a pass.

Why: on CPU a pass through PyTorch's eager ops costs far more than its arithmetic. A one-row decode step of
the default 30-layer model issues about 1,500 small ops (measured: 13 of 36 ms outside the GEMMs and the
attention), and SDPA's CPU flash kernel spends most of its time on a masked, static-length cache. Here the
whole layer stack runs in one OpenMP parallel region of one C function (cpu_gemm's GEMM tiles inside), with
q/k/v and gate/up fused into one packed weight each (gpt-fast's wqkv; loaded from the HF checkpoint as it is).

Exact by construction: every step works on each row alone, in an order that does not depend on the pass.
The GEMMs are cpu_gemm's (row-invariant). Attention reads, for each query row, exactly the keys its mask
allows, in increasing slot order, one dot product per key (one FMA chain over the head dimension, a fixed
horizontal sum; in the AVX-512 BF16 build one vdpbf16ps chain over its pairs, 1.1-1.2x faster verification
passes of 11-26 rows at 300-1,000 keys on Zen 4, in the key's own vector lane, from a transposed copy of the
keys kept next to the cache, scoring whole 16-slot blocks and keeping the allowed keys' scores: no horizontal
sum per key, 1.05-1.17x faster passes of 11-26 rows and 1.17x faster 1,000-token prefills on Zen 5; the
AVX-512F build reads the same transposed keys with one fp32 FMA chain over the head dimension per lane), then a
two-pass softmax in that order. Tree nodes come after their ancestors (draft.Tree),
so a node sees the prefix and then its ancestors in the same order and with the same values as the
autoregressive token at its position sees them. A token's bits therefore never depend on how many rows
share its pass or where its keys sit, and exact mode needs neither padding nor model.exact_attention.

Rounding follows the PyTorch bf16 path (model.py): every op's result is rounded to bf16 where that path
rounds (norm, RoPE, residual adds, SiLU, the product with up); attention runs in fp32 over the bf16 cache.
So the two paths agree to bf16 rounding, not bit for bit (sums run in other orders).

Used by model.Transformer.forward for batch-1 passes of bf16 CPU models where cpu_gemm's kernel is on
(`attach`); other passes (batches, explicit [B, 1, T, S] masks) take the PyTorch path.
"""
import ctypes
import hashlib
import os
import time

import torch
from torch import Tensor

import cpu_gemm

SOURCE = cpu_gemm.SOURCE + r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* NANOSPEC_PHASES (phase_kernel(): bench_ar.py --profile): thread 0 adds the wall time since the last barrier of
   the pass to its kind's total at each barrier, so the kinds add up to the pass (each one's waits included) */
enum { PH_GEMM, PH_ATTN, PH_NORM, PH_ROPE, PH_SILU, PH_RESID, PH_SETUP, PH_N };
#ifdef NANOSPEC_PHASES
static double PHT[PH_N], ph_last;
#define PH(c) do { if (omp_get_thread_num() == 0) { double t_ = omp_get_wtime(); PHT[c] += t_ - ph_last; ph_last = t_; } } while (0)
void phase_times(double* out) { for (int i = 0; i < PH_N; i++) { out[i] = PHT[i]; PHT[i] = 0; } }
#else
#define PH(c) do { } while (0)
#endif

static inline float rbf(float f) { uint16_t h = to_bf16(f); uint32_t u = (uint32_t)h << 16; float r; memcpy(&r, &u, 4); return r; }
static inline float fbf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float r; memcpy(&r, &u, 4); return r; }

/* 8 x bf16 rounding, kept as fp32 (to_bf16 then widen; NaN stays NaN) */
static inline __m256 rbf8(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd),
                                 _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), f, _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
}
#ifdef __AVX512F__
/* rbf8 over 16 lanes: the same integer rounding lane for lane */
static inline __m512 rbf16v(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd),
                                 _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_castsi512_ps(r), f);
}
#endif

/* y[t] = bf16(w * bf16(x[t] * rsqrt(mean(x[t]^2) + eps))), as model.RMSNorm; y's rows are ys apart */
static void rmsnorm(const float* x, const uint16_t* w, float* y, long ys, long T, long D, float eps) {
    /* a row's sum of squares is one chain of adds over d in order (each square rounded, then added); 8 rows'
       chains run interleaved, so their adds overlap instead of each waiting for the last one's latency
       (measured on Zen 5: two norms of 16 rows had cost 0.25 ms a pass). Past the last row the chains repeat
       it: as fast (the chains overlap), one loop for any row count */
    #pragma omp for schedule(static)
    for (long t0 = 0; t0 < T; t0 += 8) {
        const long n = T - t0 < 8 ? T - t0 : 8;
        const float* r0 = x + t0 * D;
        const float* rr[8];
        for (int i = 0; i < 8; i++) rr[i] = r0 + (i < n ? i : n - 1) * D;
        float ss[8] = {0};
        for (long d = 0; d < D; d++)
            #pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                float sq = rr[i][d] * rr[i][d];
                __asm__("" : "+x"(sq));  /* the rounded square, then the add: no fused multiply-add */
                ss[i] += sq;
            }
        for (long i = 0; i < n; i++) {
            const float* r = r0 + i * D;
            float inv = 1.f / sqrtf(ss[i] / (float)D + eps), *yr = y + (t0 + i) * ys;
            const __m256 iv = _mm256_set1_ps(inv);
            long d = 0;
            for (; d + 8 <= D; d += 8)  /* 8 lanes of the scalar line below: the same products and roundings */
                _mm256_storeu_ps(yr + d, rbf8(_mm256_mul_ps(load_bf16(w + d), rbf8(_mm256_mul_ps(_mm256_loadu_ps(r + d), iv)))));
            for (; d < D; d++) yr[d] = rbf(fbf(w[d]) * rbf(r[d] * inv));
        }
    }
}

/* x [n_heads, hd] in place: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), as model.apply_rope */
static void rope(float* x, long n_heads, long hd, const uint16_t* cs, const uint16_t* sn) {
    long h2 = hd / 2;
    float tmp[512];
    for (long h = 0; h < n_heads; h++) {
        float* r = x + h * hd;
        for (long d = 0; d < hd; d++) {
            float rot = d < h2 ? -r[d + h2] : r[d - h2];
            tmp[d] = rbf(rbf(r[d] * fbf(cs[d])) + rbf(rot * fbf(sn[d])));
        }
        memcpy(r, tmp, hd * sizeof(float));
    }
}

/* exp(x) lane by lane, fp32: Cephes-style range reduction and degree-6 polynomial (about 1 ulp; x below -87.3
   gives 0). Vector code instead of libm's scalar expf: attention and SiLU take one per score / element. One body
   for both widths (V: the vector type, P: the intrinsics' prefix, ROUND: round to nearest, CAST: int to float
   lanes), so exp16 gives exp8's bits lane for lane at half the instructions. */
#define EXP_FN(NAME, V, VI, P, ROUND, CAST) \
static inline V NAME(V x) { \
    x = P##_max_ps(P##_min_ps(x, P##_set1_ps(88.3762626647949f)), P##_set1_ps(-87.3f)); \
    V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); \
    V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x); \
    r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r); \
    V p = P##_set1_ps(1.9875691500e-4f); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f)); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f)); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f)); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f)); \
    p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f)); \
    p = P##_fmadd_ps(p, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.f))); \
    VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23); \
    return P##_mul_ps(p, CAST(e)); \
}
EXP_FN(exp8, __m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps)
#ifdef __AVX512F__
EXP_FN(exp16, __m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)
#endif

/* The scores of MK keys for G queries (heads sharing one KV head): each (query, key) dot product is its own
   FMA chain over hd in order, then hsum, whatever G and MK are. Several keys and heads at once only hide the
   FMA latency and widen each bf16 key chunk once for all G heads. */
static inline __attribute__((always_inline)) void dots(const float* const* q, const uint16_t* K, const int* ks,
        long hd, float scale, float* const* s, long j0, const int G, const int MK) {
    __m256 acc[4][4];
    const uint16_t* kr[4];
    for (int i = 0; i < MK; i++) kr[i] = K + (long)ks[j0 + i] * hd;
    for (int h = 0; h < G; h++) for (int i = 0; i < MK; i++) acc[h][i] = _mm256_setzero_ps();
    for (long c = 0; c < hd; c += 8) {
        __m256 kv[4];
        for (int i = 0; i < MK; i++) kv[i] = load_bf16(kr[i] + c);
        for (int h = 0; h < G; h++) {
            __m256 qv = _mm256_loadu_ps(q[h] + c);
            for (int i = 0; i < MK; i++) acc[h][i] = _mm256_fmadd_ps(qv, kv[i], acc[h][i]);
        }
    }
    for (int h = 0; h < G; h++) for (int i = 0; i < MK; i++) s[h][j0 + i] = hsum(acc[h][i]) * scale;
}

/* o[h][c0 .. c0 + CB) = sum over keys j (in order) of p[h][j] * V[ks[j]][c] for G heads: one FMA per key into
   each accumulator, in key order, whatever G and CB are */
static inline __attribute__((always_inline)) void pv(const float* const* p, const uint16_t* V, const int* ks, long n,
        long hd, long c0, float* const* out, const int G, const int CB) {
    __m256 o[4][4];
    for (int h = 0; h < G; h++) for (int c = 0; c < CB; c++) o[h][c] = _mm256_setzero_ps();
    for (long j = 0; j < n; j++) {
        const uint16_t* vr = V + (long)ks[j] * hd + c0;
        __m256 v[4];
        for (int c = 0; c < CB; c++) v[c] = load_bf16(vr + 8 * c);
        for (int h = 0; h < G; h++) {
            __m256 pj = _mm256_set1_ps(p[h][j]);
            for (int c = 0; c < CB; c++) o[h][c] = _mm256_fmadd_ps(pj, v[c], o[h][c]);
        }
    }
    for (int h = 0; h < G; h++) for (int c = 0; c < CB; c++) _mm256_storeu_ps(out[h] + c0 + 8 * c, o[h][c]);
}

#ifdef __AVX512BF16__
/* The AVX-512 BF16 build (cpu_gemm.ISA): dots() with 16-lane registers. Each (query, key) score is one chain of
   vdpbf16ps over the head dimension's pairs in order (q is bf16-exact: RoPE rounds it to bf16), then a fixed
   reduction; 32 multiply-adds per instruction against 8 per AVX2 FMA. hd % 32 == 0. */
static inline __attribute__((always_inline)) void dots512(const uint32_t* const* qb, const uint16_t* K, const int* ks,
        long hd, float scale, float* const* s, long j0, const int G, const int MK) {
    __m512 acc[4][4];
    const uint16_t* kr[4];
    for (int i = 0; i < MK; i++) kr[i] = K + (long)ks[j0 + i] * hd;
    for (int h = 0; h < G; h++) for (int i = 0; i < MK; i++) acc[h][i] = _mm512_setzero_ps();
    for (long c = 0; c < hd; c += 32) {
        __m512bh kv[4];
        for (int i = 0; i < MK; i++) kv[i] = (__m512bh)_mm512_loadu_si512(kr[i] + c);
        for (int h = 0; h < G; h++) {
            __m512bh qv = (__m512bh)_mm512_loadu_si512(qb[h] + c / 2);
            for (int i = 0; i < MK; i++) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], qv, kv[i]);
        }
    }
    for (int h = 0; h < G; h++) for (int i = 0; i < MK; i++) s[h][j0 + i] = _mm512_reduce_add_ps(acc[h][i]) * scale;
}

#endif

#ifdef __AVX512F__
/* The scores with the keys in the lanes (kt: the cache's transposed keys of one KV head, [slot / 16][hd / 2][16]:
   16 slots' pairs side by side, written with each key): per (query, slot) one chain over the head dimension in
   order in that slot's lane, times the scale, into sl[h][slot] for slot blocks b0 .. b0 + MB. No horizontal sum
   per score (a 16-lane reduction per key, whose shuffles bound attention). A lane's chain is the same in any
   block and pass: row-invariant. The AVX-512 BF16 build chains vdpbf16ps over the pairs (q is bf16-exact: RoPE
   rounds it to bf16); the AVX-512F build widens each pair to two fp32 keys (a shift, a mask) and chains FMAs
   over d, so it holds fewer blocks in registers (LANES_MB). */
#ifdef __AVX512BF16__
#define LANES_MB 4
#else
#define LANES_MB 2
#endif
static inline __attribute__((always_inline)) void lanes512(const uint32_t* const* qb, const float* const* qf,
        const uint32_t* kt, long hd, float scale, float* const* sl, long b0, const int G, const int MB) {
    __m512 acc[6][LANES_MB];
    const long H2 = hd / 2;
    for (int h = 0; h < G; h++) for (int i = 0; i < MB; i++) acc[h][i] = _mm512_setzero_ps();
    for (long d = 0; d < H2; d++) {
#ifdef __AVX512BF16__
        __m512bh kv[LANES_MB];
        for (int i = 0; i < MB; i++) kv[i] = (__m512bh)_mm512_loadu_si512(kt + ((b0 + i) * H2 + d) * 16);
        for (int h = 0; h < G; h++) {
            __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qb[h][d]);
            for (int i = 0; i < MB; i++) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], qv, kv[i]);
        }
#else
        __m512 k0[LANES_MB], k1[LANES_MB];
        for (int i = 0; i < MB; i++) {
            __m512i u = _mm512_loadu_si512(kt + ((b0 + i) * H2 + d) * 16);
            k0[i] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
            k1[i] = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
        }
        for (int h = 0; h < G; h++) {
            /* q's two values already widened in memory (qf): each broadcast is a load, where widening it here
               took four shuffle-port instructions per query and pair, as many as its FMAs (attention of a
               16-row pass ran at half the FMA rate, measured on an Ice Lake Xeon) */
            __m512 q0 = _mm512_set1_ps(qf[h][2 * d]), q1 = _mm512_set1_ps(qf[h][2 * d + 1]);
            for (int i = 0; i < MB; i++) acc[h][i] = _mm512_fmadd_ps(q1, k1[i], _mm512_fmadd_ps(q0, k0[i], acc[h][i]));
        }
#endif
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int h = 0; h < G; h++)
        for (int i = 0; i < MB; i++) _mm512_storeu_ps(sl[h] + (b0 + i) * 16, _mm512_mul_ps(acc[h][i], sc));
}

/* pv() with 16-lane blocks: one FMA per key into each accumulator, in key order. hd % 16 == 0. */
static inline __attribute__((always_inline)) void pv512(const float* const* p, const uint16_t* V, const int* ks, long n,
        long hd, long c0, float* const* out, const int G, const int CB) {
    __m512 o[4][4];
    for (int h = 0; h < G; h++) for (int c = 0; c < CB; c++) o[h][c] = _mm512_setzero_ps();
    for (long j = 0; j < n; j++) {
        const uint16_t* vr = V + (long)ks[j] * hd + c0;
        __m512 v[4];
        for (int c = 0; c < CB; c++)
            v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vr + 16 * c))), 16));
        for (int h = 0; h < G; h++) {
            __m512 pj = _mm512_set1_ps(p[h][j]);
            for (int c = 0; c < CB; c++) o[h][c] = _mm512_fmadd_ps(pj, v[c], o[h][c]);
        }
    }
    for (int h = 0; h < G; h++) for (int c = 0; c < CB; c++) _mm512_storeu_ps(out[h] + c0 + 16 * c, o[h][c]);
}
#endif

/* one query's scores sh[0 .. n) -> exp(s - max) in place (padded to a multiple of 8 with 0); returns 1 / their sum */
static inline __attribute__((always_inline)) float softmax_row(float* sh, long n) {
    long j;
    for (j = n; j < ((n + 7) & ~7L); j++) sh[j] = -INFINITY;  /* pad the last vector: exp gives 0 there */
    /* the max 8 lanes at a time: as exact as one at a time (a max rounds nothing; a NaN score is skipped as
       the scalar compare skipped it, and a +0 or -0 maximum gives every s - m the same value); the scalar
       loop's carried dependency had cost a sixth of attention's time at 1,200 keys */
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (j = 0; j < n; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sh + j), mv);  /* (x, m): m where x is NaN */
    mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0x4e));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0xb1));
    __m256 sum8 = _mm256_setzero_ps();
    j = 0;
#ifdef __AVX512F__
    for (const __m512 m16 = _mm512_broadcastss_ps(_mm256_castps256_ps128(mv)); j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + j), m16));  /* two 8-lane steps of the sum below */
        _mm512_storeu_ps(sh + j, e);
        sum8 = _mm256_add_ps(_mm256_add_ps(sum8, _mm512_castps512_ps256(e)), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
    for (; j < n; j += 8) {  /* the sum: 8 lanes in key order, then the fixed hsum */
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), mv));
        _mm256_storeu_ps(sh + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    return n ? 1.f / hsum(sum8) : 0.f;
}

/* G (<= 4) heads sharing one KV head, one row: softmax(q K^T * scale) V over the keys ks[0..n) (cache slots,
   increasing), fp32; s: G scratch rows of n + 8. Passes with the transposed keys take attend_rows instead. */
static inline __attribute__((always_inline)) void attend_g(const float* const* q, const uint16_t* K, const uint16_t* V,
        const int* ks, long n, long hd, float scale, float* const* s, float* const* out, const int G) {
    long j = 0;
#ifdef __AVX512BF16__
    const int wide = hd % 32 == 0;
    if (wide) {
        uint32_t qbuf[4][128];  /* each head's q as bf16 pairs (hd <= 256) */
        const uint32_t* qb[4];
        for (int h = 0; h < G; h++) {
            for (long d = 0; d < hd; d += 2) qbuf[h][d / 2] = (uint32_t)to_bf16(q[h][d]) | (uint32_t)to_bf16(q[h][d + 1]) << 16;
            qb[h] = qbuf[h];
        }
        for (; j + 4 <= n; j += 4) dots512(qb, K, ks, hd, scale, s, j, G, 4);
        for (; j < n; j++) dots512(qb, K, ks, hd, scale, s, j, G, 1);
    }
#else
    const int wide = 0;
#endif
    if (!wide) {
        for (; j + 4 <= n; j += 4) dots(q, K, ks, hd, scale, s, j, G, 4);
        for (; j < n; j++) dots(q, K, ks, hd, scale, s, j, G, 1);
    }
    float inv[4];
    for (int h = 0; h < G; h++) inv[h] = softmax_row(s[h], n);
    const float* const* p = (const float* const*)s;
    long c0 = 0;
#ifdef __AVX512BF16__
    if (wide) {
        if (G <= 3) for (; c0 + 64 <= hd; c0 += 64) pv512(p, V, ks, n, hd, c0, out, G, 4);
        for (; c0 + 32 <= hd; c0 += 32) pv512(p, V, ks, n, hd, c0, out, G, 2);
    }
#endif
    if (G <= 3) for (; c0 + 32 <= hd; c0 += 32) pv(p, V, ks, n, hd, c0, out, G, 4);
    for (; c0 + 16 <= hd; c0 += 16) pv(p, V, ks, n, hd, c0, out, G, 2);
    for (; c0 < hd; c0 += 8) pv(p, V, ks, n, hd, c0, out, G, 1);
    for (int h = 0; h < G; h++) {
        __m256 iv = _mm256_set1_ps(inv[h]);
        for (long c = 0; c < hd; c += 8) _mm256_storeu_ps(out[h] + c, _mm256_mul_ps(_mm256_loadu_ps(out[h] + c), iv));
    }
}

static void attend(const float* const* q, const uint16_t* K, const uint16_t* V, const int* ks, long n,
                   long hd, float scale, float* const* s, float* const* out, int G) {
    switch (G) {
        case 1: attend_g(q, K, V, ks, n, hd, scale, s, out, 1); break;
        case 2: attend_g(q, K, V, ks, n, hd, scale, s, out, 2); break;
        case 3: attend_g(q, K, V, ks, n, hd, scale, s, out, 3); break;
        default: attend_g(q, K, V, ks, n, hd, scale, s, out, 4); break;
    }
}


#ifdef __AVX512F__
/* o[i][c0 .. c0 + 16 CB) = sum over query i's keys j (in key order) of p[i][j] * V[ks[i][j]][c] for NQ queries
   of one KV head: their common leading run of slots 0 .. m - 1 first, one load and widening of each value row
   for all of them, then each query's own rest. Every accumulator is one FMA chain over its query's keys in
   order, as pv512's: the same bits however the queries are grouped. A value row's 32 values at a time are
   one load, its low halves shifted up (the even columns) and its masked high halves (the odd ones) two fp32
   vectors, so o[i][2u] holds columns 32u + 0, 2, .., 30 and o[i][2u + 1] the odd ones, put back in order at
   the store (a 16-value widening load and a shift per vector had cost as many shuffle-port instructions as
   FMAs: measured on an Ice Lake Xeon). CB (2 or 4) vectors: 32 or 64 columns. */
static inline __m512 lo_bf16x16(__m512i u) { return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)); }
static inline __m512 hi_bf16x16(__m512i u) { return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u))); }
static inline __attribute__((always_inline)) void pv_rows(const float* const* p, const uint16_t* V,
        const int* const* ks, const long* n, long m, long hd, long c0, float* const* out, const int NQ, const int CB) {
    __m512 o[6][4];
    for (int i = 0; i < NQ; i++) for (int c = 0; c < CB; c++) o[i][c] = _mm512_setzero_ps();
    for (long j = 0; j < m; j++) {  /* key j is slot j for every query here */
        const uint16_t* vr = V + j * hd + c0;
        __m512 v[4];
        for (int u = 0; u < CB / 2; u++) {
            const __m512i w = _mm512_loadu_si512(vr + 32 * u);
            v[2 * u] = lo_bf16x16(w);
            v[2 * u + 1] = hi_bf16x16(w);
        }
        for (int i = 0; i < NQ; i++) {
            __m512 pj = _mm512_set1_ps(p[i][j]);
            for (int c = 0; c < CB; c++) o[i][c] = _mm512_fmadd_ps(pj, v[c], o[i][c]);
        }
    }
    for (int i = 0; i < NQ; i++)
        for (long j = m; j < n[i]; j++) {
            const uint16_t* vr = V + (long)ks[i][j] * hd + c0;
            __m512 pj = _mm512_set1_ps(p[i][j]);
            for (int u = 0; u < CB / 2; u++) {
                const __m512i w = _mm512_loadu_si512(vr + 32 * u);
                o[i][2 * u] = _mm512_fmadd_ps(pj, lo_bf16x16(w), o[i][2 * u]);
                o[i][2 * u + 1] = _mm512_fmadd_ps(pj, hi_bf16x16(w), o[i][2 * u + 1]);
            }
        }
    /* lane l of the 16 columns from 32u (+ 16): the even vector's lane l / 2 (+ 8) or the odd one's (index + 16) */
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int i = 0; i < NQ; i++)
        for (int u = 0; u < CB / 2; u++) {
            _mm512_storeu_ps(out[i] + c0 + 32 * u, _mm512_permutex2var_ps(o[i][2 * u], first, o[i][2 * u + 1]));
            _mm512_storeu_ps(out[i] + c0 + 32 * u + 16, _mm512_permutex2var_ps(o[i][2 * u], second, o[i][2 * u + 1]));
        }
}

/* attend_g's transposed-key path for NQ (<= 6) queries of one KV head that may come from different rows of
   the pass (a few rows' heads): query i has its own keys ks[i][0 .. n[i]) and leading run pre[i]. The rows
   share the loads of what they share: every query scores every 16-slot block up to the last one any of them
   needs (a block's scores that a query's mask does not allow are dropped, as attend_g drops them), and the
   value rows of their common leading run (pv_rows). Each score is still its own chain in its lane (lanes512)
   and each output its own FMA chain over its query's keys in order: the bits of one row alone. Why: a tree's
   rows all read the same context; one row at a time, a 16-row verification at 750 keys spent 2.7 ms in
   attention against 0.85 ms for one row (Zen 5), its value widening and key loads repeated per row. */
static void attend_rows(const float* const* q, const uint16_t* V, const int* const* ks, const long* n,
                        const long* pre, long hd, float scale, float* const* s, float* const* out,
                        const uint32_t* kt, float* const* sl, const int NQ) {
    uint32_t qbuf[6][128];  /* each query as bf16 pairs (hd <= 256) */
    float qwide[6][256];  /* the same values widened to fp32 (the AVX-512F scores' broadcasts) */
    const uint32_t* qb[6];
    const float* qf[6];
    long nbmax = 0, m = pre[0];
    for (int i = 0; i < NQ; i++) {
        for (long d = 0; d < hd; d += 2) qbuf[i][d / 2] = (uint32_t)to_bf16(q[i][d]) | (uint32_t)to_bf16(q[i][d + 1]) << 16;
#ifndef __AVX512BF16__  /* (the BF16 build's scores read the pairs) */
        for (long d = 0; d < hd; d++) qwide[i][d] = rbf(q[i][d]);
#endif
        qb[i] = qbuf[i];
        qf[i] = qwide[i];
        const long nb = n[i] ? ((long)ks[i][n[i] - 1] >> 4) + 1 : 0;
        nbmax = nb > nbmax ? nb : nbmax;
        m = pre[i] < m ? pre[i] : m;
    }
    const long pb = m >> 4;
    long b = 0;
    switch (NQ) {  /* (constant query counts: the accumulators stay in registers) */
#define LANES(NQC) \
        case NQC: \
            for (; b + LANES_MB <= pb; b += LANES_MB) lanes512(qb, qf, kt, hd, scale, s, b, NQC, LANES_MB); \
            for (; b < pb; b++) lanes512(qb, qf, kt, hd, scale, s, b, NQC, 1); \
            for (; b + LANES_MB <= nbmax; b += LANES_MB) lanes512(qb, qf, kt, hd, scale, sl, b, NQC, LANES_MB); \
            for (; b < nbmax; b++) lanes512(qb, qf, kt, hd, scale, sl, b, NQC, 1); \
            break;
        LANES(1) LANES(2) LANES(3) LANES(4) LANES(5) LANES(6)
#undef LANES
    }
    float inv[6];
    for (int i = 0; i < NQ; i++) {
        for (long j = pb * 16; j < n[i]; j++) s[i][j] = sl[i][ks[i][j]];
        inv[i] = softmax_row(s[i], n[i]);
    }
    const float* const* p = (const float* const*)s;
    long c0 = 0;
    switch (NQ) {
#define PV(NQC) \
        case NQC: \
            for (; c0 + 64 <= hd; c0 += 64) pv_rows(p, V, ks, n, m, hd, c0, out, NQC, 4); \
            for (; c0 < hd; c0 += 32) pv_rows(p, V, ks, n, m, hd, c0, out, NQC, 2); \
            break;
        PV(1) PV(2) PV(3) PV(4) PV(5) PV(6)
#undef PV
    }
    for (int i = 0; i < NQ; i++) {
        __m256 iv = _mm256_set1_ps(inv[i]);
        for (long c = 0; c < hd; c += 8) _mm256_storeu_ps(out[i] + c, _mm256_mul_ps(_mm256_loadu_ps(out[i] + c), iv));
    }
}
#endif


/* h[t, i] = bf16(bf16(silu(g)) * u) for gu [T, gate | up], as F.silu(gate) * up in bf16; I % 8 == 0. Shared
   over the threads by blocks of 64 elements, not by rows (one row had left a thread idle), 16 lanes at a time in
   the AVX-512 build (exp16 is exp8 lane for lane; the division and products are the same IEEE operations) */
static inline __m256 silu8(__m256 gt, __m256 up) {
    __m256 sl = _mm256_div_ps(gt, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gt))));
    return rbf8(_mm256_mul_ps(rbf8(sl), up));
}
static void silu_mul(const float* gu, float* h, long T, long I) {
    const long nb = (I + 63) / 64;
    #pragma omp for schedule(static)
    for (long q = 0; q < T * nb; q++) {
        const long t = q / nb, i1 = (q % nb + 1) * 64 < I ? (q % nb + 1) * 64 : I;
        const float *g = gu + t * 2 * I, *u = g + I;
        float* o = h + t * I;
        long i = q % nb * 64;
#ifdef __AVX512F__
        for (; i + 16 <= i1; i += 16) {
            __m512 gt = _mm512_loadu_ps(g + i);
            __m512 sl = _mm512_div_ps(gt, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gt))));
            __m512 a = _mm512_mul_ps(rbf16v(sl), _mm512_loadu_ps(u + i));
            _mm512_storeu_ps(o + i, rbf16v(a));
        }
#endif
        for (; i < i1; i += 8) _mm256_storeu_ps(o + i, silu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    }
}

enum { W_IN, W_QKV, B_QKV, W_O, W_POST, W_GU, W_DOWN, W_HID, NW };

/* x [T, D] bf16, in place: the rows after all L layers. tab [L, NW] pointers (packed weights, norms, bias
   or 0). cs, sn [T, hd] bf16 RoPE rows; mask [T, S] (bool bytes) over the cache's S slots; cpos [T] the
   slots this pass writes; kv [L, 2, Hkv, S, hd] bf16; kt (AVX-512 builds with hd % 32 == 0, or 0) the same
   keys transposed, [L, Hkv, ceil(S / 16), hd / 2, 16] bf16 pairs (lanes512's layout), written with them and
   read instead of K for the scores. aux [T, n_aux, D]: slot j gets the input of layer
   aux_of[j] (repeats allowed). An EAGLE-3 layer (tab's W_HID set: its hidden_norm) takes q/k/v from
   [input_layernorm(emb[t]); hidden_norm(x[t])] (2D wide, emb [T, D] bf16: the token embeddings) and keeps
   x as the residual, as eagle.EagleHead.forward; W_HID = 0 is a plain decoder layer. */
void stack_bf16(const int64_t* tab, long L, long D, long H, long Hkv, long hd, long I, float eps, long T,
                long S, uint16_t* x, const uint16_t* emb, const uint16_t* cs, const uint16_t* sn, const uint8_t* mask,
                const int64_t* cpos, uint16_t* kv, uint32_t* kt, const int64_t* aux_of, long n_aux, uint16_t* aux,
                const uint16_t* fnorm, int threads) {
    const long Q = H * hd, KV = Hkv * hd, NQKV = Q + 2 * KV, g = H / Hkv;
    const long nbs = (S + 15) / 16, H2 = hd / 2;  /* kt's slot blocks and pairs */
#ifndef __AVX512F__
    kt = 0;
#endif
    if (hd % 32) kt = 0;
#ifdef NANOSPEC_PHASES
    ph_last = omp_get_wtime();
#endif
    float* sl = kt ? malloc(sizeof(float) * threads * 6 * nbs * 16) : 0;  /* slot-indexed scores, per thread */
    const float scale = 1.f / sqrtf((float)hd);
    long wide = NQKV > 2 * I ? NQKV : 2 * I;
    float* xr = malloc(sizeof(float) * T * D);
    long hw = 2 * D > Q ? 2 * D : Q;
    hw = hw > I ? hw : I;
    float* h = malloc(sizeof(float) * T * hw);
    float* ef = emb ? malloc(sizeof(float) * T * D) : 0;
    float* y = malloc(sizeof(float) * T * wide);
    float* o = malloc(sizeof(float) * T * D);
    int* keys = malloc(sizeof(int) * T * S);
    long* nk = malloc(sizeof(long) * 2 * T);  /* each row's key count, then its leading run of slots 0, 1, .. */
    long* npre = nk + T;
    float* sc = malloc(sizeof(float) * threads * 6 * (S + 8));
    uint16_t* xs = malloc(sizeof(uint16_t) * threads * T * hw);  /* gemm_rows' bf16 copies of its input (AVX-512 BF16) */
    const long hb = T * Hkv >= 2 * threads ? (g < 4 ? g : 4) : 1;  /* heads per attention task */
    const long nb = (g + hb - 1) / hb;
    /* rows per attention task (the transposed-key path, attend_rows): as many as keep each task's queries at
       most 6 while there are still two tasks per thread */
    long rb = kt ? 6 / hb : 1;
    while (rb > 1 && (T + rb - 1) / rb * Hkv * nb < 2 * threads) rb--;
    const long nrb = (T + rb - 1) / rb;
    for (long t = 0; t < T; t++) {  /* each row's keys, in slot order, once for all layers and heads */
        nk[t] = 0;
        for (long j = 0; j < S; j++) if (mask[t * S + j]) keys[t * S + nk[t]++] = (int)j;
        for (npre[t] = 0; npre[t] < nk[t] && keys[t * S + npre[t]] == npre[t];) npre[t]++;
    }
    for (long i = 0; i < T * D; i++) xr[i] = fbf(x[i]);
    if (ef) for (long i = 0; i < T * D; i++) ef[i] = fbf(emb[i]);
    PH(PH_SETUP);
    #pragma omp parallel num_threads(threads)
    {
    for (long l = 0; l < L; l++) {
        const int64_t* w = tab + l * NW;
        uint16_t* Kc = kv + (l * 2) * Hkv * S * hd;
        uint16_t* Vc = Kc + Hkv * S * hd;
        for (long j = 0; j < n_aux; j++)
            if (aux_of[j] == l) {
                #pragma omp for schedule(static)
                for (long t = 0; t < T; t++)
                    for (long d = 0; d < D; d++) aux[(t * n_aux + j) * D + d] = to_bf16(xr[t * D + d]);
                PH(PH_RESID);
            }
        long kin = D;
        if (w[W_HID] && ef) {  /* EAGLE-3: [norm(embedding); norm(hidden)], embedding first */
            rmsnorm(ef, (const uint16_t*)w[W_IN], h, 2 * D, T, D, eps);
            rmsnorm(xr, (const uint16_t*)w[W_HID], h + D, 2 * D, T, D, eps);
            kin = 2 * D;
        } else rmsnorm(xr, (const uint16_t*)w[W_IN], h, D, T, D, eps);
        PH(PH_NORM);
        gemm_rows(h, T, kin, (const uint16_t*)w[W_QKV], (const uint16_t*)w[B_QKV], NQKV, 0, y, xs);  /* [T, q | k | v] */
        PH(PH_GEMM);
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            float* r = y + t * NQKV;
            rope(r, H + Hkv, hd, cs + t * hd, sn + t * hd);  /* q heads, then k heads: contiguous */
            for (long j = 0; j < Hkv; j++)
                for (long d = 0; d < hd; d++) {
                    Kc[(j * S + cpos[t]) * hd + d] = to_bf16(r[Q + j * hd + d]);
                    Vc[(j * S + cpos[t]) * hd + d] = to_bf16(r[Q + KV + j * hd + d]);
                }
            if (kt) {  /* the same keys' pairs into their slot's lane */
                uint32_t* kl = kt + l * Hkv * nbs * H2 * 16;
                for (long j = 0; j < Hkv; j++) {
                    const uint32_t* kr = (const uint32_t*)(Kc + (j * S + cpos[t]) * hd);
                    uint32_t* dst = kl + (j * nbs + cpos[t] / 16) * H2 * 16 + cpos[t] % 16;
                    for (long d = 0; d < H2; d++) dst[d * 16] = kr[d];
                }
            }
        }
        PH(PH_ROPE);
        /* tasks: (block of up to rb rows, KV head, block of up to hb of the heads sharing it); a head's
           arithmetic is the same in any block, so the blocks only balance the threads (one head per task when
           rows are few) and share loads (attend_rows) */
        /* KV head major, each thread one contiguous run: a KV head's tasks share its keys and values, which come
           from memory once per thread that takes any of them (dealt round-robin, every thread read every head:
           measured on an Ice Lake Xeon, contiguous runs 2% faster at 1 row, 3-4% at 60, 8% for a 750-token
           prefill). Within a head the row blocks alternate from both ends (0, last, 1, last - 1, ..), so any
           run of them holds early and late rows alike: a prefill's rows see 1 .. T keys, and halves by row had
           left one thread a quarter of the work */
        #pragma omp for schedule(static)
        for (long tk = 0; tk < nrb * Hkv * nb; tk++) {
            const long r = tk % (nrb * nb), rp = r / nb;
            long t0 = (rp % 2 ? nrb - 1 - rp / 2 : rp / 2) * rb, j = tk / (nrb * nb), h0 = j * g + r % nb * hb;
            int G = (int)(g - tk % nb * hb < hb ? g - tk % nb * hb : hb);
            int R = (int)(T - t0 < rb ? T - t0 : rb), NQ = R * G;
            const float* qs[6];
            const int* kq[6];
            long nq[6], pq[6];
            float *ss[6], *os[6], *ls[6];
            for (int i = 0; i < NQ; i++) {
                const long t = t0 + i / G, hh = h0 + i % G;
                qs[i] = y + t * NQKV + hh * hd;
                kq[i] = keys + t * S;
                nq[i] = nk[t];
                pq[i] = npre[t];
                ss[i] = sc + ((long)omp_get_thread_num() * 6 + i) * (S + 8);
                os[i] = h + t * Q + hh * hd;
                ls[i] = sl ? sl + ((long)omp_get_thread_num() * 6 + i) * nbs * 16 : 0;
            }
            const uint32_t* ktj = kt ? kt + (l * Hkv + j) * nbs * H2 * 16 : 0;
            (void)ktj; (void)pq; (void)ls;  /* (the AVX2 build has no transposed keys) */
#ifdef __AVX512F__
            if (ktj) attend_rows(qs, Vc + j * S * hd, kq, nq, pq, hd, scale, ss, os, ktj, ls, NQ);
            else
#endif
            attend(qs, Kc + j * S * hd, Vc + j * S * hd, kq[0], nq[0], hd, scale, ss, os, G);
            for (int i = 0; i < NQ; i++) for (long d = 0; d < hd; d++) os[i][d] = rbf(os[i][d]);
        }
        PH(PH_ATTN);
        gemm_rows(h, T, Q, (const uint16_t*)w[W_O], 0, D, 0, o, xs);
        PH(PH_GEMM);
        #pragma omp for schedule(static)
        for (long i = 0; i < T * D; i++) xr[i] = rbf(xr[i] + o[i]);
        PH(PH_RESID);
        rmsnorm(xr, (const uint16_t*)w[W_POST], h, D, T, D, eps);
        PH(PH_NORM);
        gemm_rows(h, T, D, (const uint16_t*)w[W_GU], 0, 2 * I, 0, y, xs);  /* [T, gate | up] */
        PH(PH_GEMM);
        silu_mul(y, h, T, I);
        PH(PH_SILU);
        gemm_rows(h, T, I, (const uint16_t*)w[W_DOWN], 0, D, 0, o, xs);
        PH(PH_GEMM);
        #pragma omp for schedule(static)
        for (long i = 0; i < T * D; i++) xr[i] = rbf(xr[i] + o[i]);
        PH(PH_RESID);
    }
    /* the model's final norm (fnorm, or 0: none), here rather than in torch after the call: its eight small ops
       met cold caches after the pass and cost about 0.2 ms a pass (measured on Zen 5) */
    if (fnorm) rmsnorm(xr, fnorm, h, D, T, D, eps);
    PH(PH_NORM);
    }
    const float* fin = fnorm ? h : xr;
    for (long i = 0; i < T * D; i++) x[i] = to_bf16(fin[i]);
    free(xr); free(h); free(y); free(o); free(keys); free(nk); free(sc); free(ef); free(xs); free(sl);
    PH(PH_SETUP);
}

/* the accepted path's KV into place: for i < n, cache slot src[i] -> slot dst[i] of every layer's K and V rows
   [L, 2, Hkv, S, hd] and (kt, or 0) of their transposed copy [L, Hkv, nbs, hd / 2, 16]; every source is read
   before any slot is written (as index_select then index_copy_), so overlapping moves are safe */
void compact_bf16(uint16_t* kv, uint32_t* kt, long L, long Hkv, long S, long hd, long nbs, const int64_t* src,
                  const int64_t* dst, long n) {
    const long R = L * 2 * Hkv, RT = kt ? L * Hkv : 0, H2 = hd / 2;
    uint16_t* rows = malloc(sizeof(uint16_t) * n * R * hd);
    uint32_t* lanes = malloc(sizeof(uint32_t) * (n * RT * H2 + 1));
    for (long i = 0; i < n; i++) {
        for (long r = 0; r < R; r++) memcpy(rows + (i * R + r) * hd, kv + (r * S + src[i]) * hd, hd * 2);
        for (long r = 0; r < RT; r++)
            for (long d = 0; d < H2; d++)
                lanes[(i * RT + r) * H2 + d] = kt[((r * nbs + src[i] / 16) * H2 + d) * 16 + src[i] % 16];
    }
    for (long i = 0; i < n; i++) {
        for (long r = 0; r < R; r++) memcpy(kv + (r * S + dst[i]) * hd, rows + (i * R + r) * hd, hd * 2);
        for (long r = 0; r < RT; r++)
            for (long d = 0; d < H2; d++)
                kt[((r * nbs + dst[i] / 16) * H2 + d) * 16 + dst[i] % 16] = lanes[(i * RT + r) * H2 + d];
    }
    free(rows); free(lanes);
}
"""
TAG = hashlib.sha256(SOURCE.encode()).hexdigest()[:8]  # keys the per-machine answers about this pass

def kernel():
    """The loaded C function, or None where cpu_gemm's kernel cannot be built here."""
    if cpu_gemm.kernel() is None:
        return None
    if _TIMED[0]:
        return phase_kernel()
    P, I = cpu_gemm.P_, cpu_gemm.I_
    return cpu_gemm.c_function(SOURCE, "cpu_forward", "stack_bf16", (P, I, I, I, I, I, I, ctypes.c_float, I, I, P,
                                                                     P, P, P, P, P, P, P, P, I, P, P, ctypes.c_int))


# The pass's kinds of work, in phase_times()'s order (the C enum PH_*)
PHASES = ("GEMMs", "attention", "norms", "RoPE + KV writes", "SiLU", "residuals", "set-up")
PHASE_SOURCE = "#define NANOSPEC_PHASES\n" + SOURCE  # the same pass, timing its phases (bench_ar.py --profile)
_TIMED = [False]


def phase_kernel():
    P, I = cpu_gemm.P_, cpu_gemm.I_
    return cpu_gemm.c_function(PHASE_SOURCE, "cpu_forward_phases", "stack_bf16", (P, I, I, I, I, I, I, ctypes.c_float, I,
                                                                                 I, P, P, P, P, P, P, P, P, P, I, P, P, ctypes.c_int))


def timed(on: bool):
    """Run the fused pass as its phase-timing build from now on (on) or the plain one (off): the same arithmetic."""
    _TIMED[0] = bool(on)


def phase_times() -> dict[str, float]:
    """Milliseconds per kind of work (PHASES) in the timed build's passes since the last call: thread 0's wall time
    between the pass's barriers, each kind's waits for the other threads included; the kinds add up to the passes."""
    fn = cpu_gemm.c_function(PHASE_SOURCE, "cpu_forward_phases", "phase_times", (cpu_gemm.P_,))
    out = torch.zeros(len(PHASES), dtype=torch.float64)
    fn(out.data_ptr())
    return dict(zip(PHASES, (out * 1e3).tolist()))


def compact(kv: Tensor, kt: Tensor, src: list[int], dst: list[int]) -> bool:
    """model.compact_kv's moves in one C call (eager CPU): KV slot src[i] -> dst[i] in every layer, and in the
    transposed keys; False where the C code is not built here (the caller moves them with torch). Why: the
    index_select / index_copy pair and the transposed keys' advanced indexing cost about 0.15 ms a tree step."""
    fn = cpu_gemm.c_function(SOURCE, "cpu_forward", "compact_bf16", (cpu_gemm.P_, cpu_gemm.P_) + (cpu_gemm.I_,) * 5
                             + (cpu_gemm.P_, cpu_gemm.P_, cpu_gemm.I_)) if cpu_gemm.kernel() is not None else None
    if fn is None:
        return False
    L, _, Hkv, S, hd = kv.shape
    assert kv.is_contiguous() and kv.dtype == torch.bfloat16 and (kt.numel() == 0 or kt.is_contiguous())
    sd = torch.tensor([src, dst], dtype=torch.int64)  # [2, n]: the sources, then the destinations
    fn(kv.data_ptr(), kt.data_ptr() if kt.numel() else 0, L, Hkv, S, hd, kt.shape[2] if kt.numel() else 0,
       sd[0].data_ptr(), sd[1].data_ptr(), len(src))
    return True


def transposed_keys(kv: Tensor) -> Tensor:
    """kv [L, 2, Hkv, S, hd] bf16 -> its keys as stack_bf16's kt [L, Hkv, ceil(S / 16), hd / 2, 16] (int32 pairs of
    bf16), or an empty tensor where the pass does not read them (the AVX2 build; hd % 32 != 0). Why: attention's
    scores with the keys in the vector lanes need no horizontal sum per key (lanes512); kept next to the cache
    and written with each key (transposing per pass cost 2 ms at 1,200 keys, BENCHMARKS.md session 15)."""
    L, _, Hkv, S, hd = kv.shape
    if cpu_gemm.ISA not in ("avx512bf16", "avx512") or hd % 32 or kv.dtype != torch.bfloat16:
        return kv.new_empty(0, dtype=torch.int32)
    nb = -(-S // 16)
    k = torch.zeros(L, Hkv, nb * 16, hd, dtype=kv.dtype, device=kv.device)
    k[:, :, :S] = kv[:, 0]
    return k.view(torch.int32).view(L, Hkv, nb, 16, hd // 2).transpose(3, 4).contiguous()


ENV = "NANOSPEC_CPU_FORWARD"  # on (default) | off: off keeps the PyTorch layers (with cpu_gemm's GEMMs)


def switched_on() -> bool:
    mode = os.environ.get(ENV, "on")
    if mode not in ("on", "off"):
        raise ValueError(f"{ENV} must be on or off, got {mode!r}")
    return mode == "on"


def fits_args(a) -> bool:
    """Model dims the C pass handles: no Qwen3 q/k norms, head_dim a multiple of 8 up to 256."""
    return (not a.qk_norm and a.head_dim % 8 == 0 and a.head_dim <= 256 and a.dim % 8 == 0
            and a.intermediate_size % 8 == 0 and a.n_heads % a.n_kv_heads == 0)


def fits(a, layers) -> bool:
    """Decoder layers the C pass can run now: fits_args, bf16 on the CPU, with cpu_gemm's packed linears (the
    process took the kernel), the C pass built here."""
    w = layers[0].mlp.down_proj
    return (fits_args(a) and w.weight.device.type == "cpu" and w.weight.dtype == torch.bfloat16
            and w.packed is not None and kernel() is not None)


# What a pass of so many rows is worth, in tokens, when the check below weighs a decode step against a tree
# verification: about the default drafter's mean accepted length at that budget on CPU (BENCHMARKS.md, Spec-Bench)
ROWS_WORTH = {1: 1.0, 4: 1.8, 16: 2.5}


def shape_key(a) -> str:
    """What a model's per-machine timings depend on besides the machine (cached answers are keyed by it), the
    C pass's source included."""
    return f"pass {TAG} L{a.n_layers} d{a.dim} h{a.n_heads}/{a.n_kv_heads}x{a.head_dim} i{a.intermediate_size} v{a.vocab_size}"


def attach(model):
    """Give a bf16 CPU model, whose GEMM cpu_gemm.choose has picked, its fastest pass on this machine, and pack
    its linears where the process takes cpu_gemm's kernel. The fused pass (its GEMMs are the kernel's) runs
    where it fits and either NANOSPEC_CPU_GEMM=kernel forces the kernel or, in auto mode, it beats the PyTorch
    layers with the GEMM their check chose: both timed on the model's own weights (fused_wins), once per
    machine and model shape. So a CPU whose torch GEMM wins at 16 rows (AMX) still gets the fused pass when
    its per-op savings weigh more."""
    gemm, layers_kernel = cpu_gemm.mode(), cpu_gemm.enabled()
    if not (switched_on() and gemm != "torch" and fits_args(model.args) and kernel() is not None):
        if layers_kernel:
            cpu_gemm.pack_linears(model)
        return
    cpu_gemm.switch(True)  # the fused pass's products are the kernel's: the process takes it (draft head too)
    cpu_gemm.pack_linears(model)
    packs = {m: m.packed for m in model.modules() if "packed" in m._buffers}
    stack = Stack(model.args, model.layers)
    key = (f"{cpu_gemm.machine_id()} fused pass {shape_key(model.args)} vs layers with "
           f"{'kernel' if layers_kernel else 'torch'} GEMM, worth {ROWS_WORTH}")
    if gemm == "auto" and not cpu_gemm.cached(key, lambda: fused_wins(model, stack, packs, layers_kernel)):
        cpu_gemm.switch(layers_kernel)  # the PyTorch layers, with the GEMM cpu_gemm's check chose
        for m, p in packs.items():
            m.packed = p if layers_kernel else None
        return
    model.cpu_pass = stack


@torch.no_grad()
def fused_wins(model, stack: "Stack", packs: dict, layers_kernel: bool, reps: int = 3) -> bool:
    """Time the model's whole pass here at every ROWS_WORTH size (pass_seconds), fused and as PyTorch layers,
    alternating, medians of reps; True iff the fused pass's best worth per second beats the layers'. Leaves the
    model without caches or a fused pass."""
    ts = {f: {r: [] for r in ROWS_WORTH} for f in (True, False)}
    for _ in range(reps + 1):  # the first round warms up
        for fused in (True, False):
            cpu_gemm.switch(fused or layers_kernel)
            for m, p in packs.items():  # (the fused copies replaced some; the layers need them all)
                m.packed = p
            model.cpu_pass = stack if fused else None
            for r, t in pass_seconds(model, list(ROWS_WORTH), reps=1).items():
                ts[fused][r].append(t)
    model.cpu_pass = None
    worth = {f: max(w / sorted(ts[f][r][1:])[reps // 2] for r, w in ROWS_WORTH.items()) for f in ts}
    return worth[True] > worth[False]


@torch.no_grad()
def pass_seconds(model, rows: list[int], reps: int = 3, ctx: int = 256) -> dict[int, float]:
    """{rows: median seconds} of the model's pass as it runs now (fused or PyTorch layers, its GEMM), at each
    row count, over a context of ctx keys, rows interleaved, medians of reps (one warm-up round first when
    reps > 1). Leaves the model without caches (its next setup_caches allocates them afresh)."""
    ctx = max(1, min(ctx, model.args.max_position_embeddings - max(rows)))
    tok = torch.randint(0, model.args.vocab_size, (1, max(rows)), generator=torch.Generator().manual_seed(0))
    model.max_batch = -1
    model.setup_caches(1, ctx + max(rows))
    ts = {r: [] for r in rows}
    for _ in range(reps + (reps > 1)):
        for r in rows:
            t0 = time.perf_counter()
            model(tok[:, :r], ctx + torch.arange(r))
            ts[r].append(time.perf_counter() - t0)
    model.kv, model.kt, model.max_batch, model.max_seq = None, None, -1, -1
    return {r: sorted(t[-reps:])[reps // 2] for r, t in ts.items()}


class Stack:
    """The packed, fused weights of decoder layers (a target's, or an EAGLE-3 head's one layer) and the
    pointer table the C pass reads. Holds the tensors it points at, so they live as long as the table."""

    def __init__(self, a, layers):
        self.args, self.L = a, len(layers)
        self.keep, rows = [], []
        for layer in layers:
            at, mlp = layer.self_attn, layer.mlp
            hid = getattr(layer, "hidden_norm", None)  # EAGLE-3: q/k/v read [norm(embedding); norm(hidden)]
            qkv = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]).detach()
            bias = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]).detach() if a.qkv_bias else None
            gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            ts = [layer.input_layernorm.weight.detach(), cpu_gemm.pack(qkv), bias, pack_of(at.o_proj),
                  layer.post_attention_layernorm.weight.detach(), cpu_gemm.pack(gu), pack_of(mlp.down_proj),
                  None if hid is None else hid.weight.detach()]
            self.keep += [t for t in ts if t is not None]
            rows.append([0 if t is None else t.data_ptr() for t in ts])
            for lin in (at.q_proj, at.k_proj, at.v_proj, mlp.gate_proj, mlp.up_proj):
                lin.packed = None  # their products now come from the fused copies (the torch path uses F.linear)
        self.table = torch.tensor(rows, dtype=torch.int64)
        self.aux_of = {}  # aux layers -> [n_aux] the layer whose input each aux slot gets (built once per tuple)
        self.no_kt = torch.empty(0, dtype=torch.int32)  # no transposed keys: the scores read K

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache_pos: Tensor, kv: Tensor,
                 aux_layers: tuple[int, ...] = (), emb: Tensor | None = None, kt: Tensor | None = None,
                 norm: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [T, D] bf16 (the embeddings; an EAGLE-3 head: its input features); cos, sin [T, hd] bf16; mask
        [T, S] bool; cache_pos [T] int64; kv [L, 2, Hkv, S, hd] bf16, written at cache_pos; aux_layers:
        layers whose inputs to return (repeats allowed); emb [T, D]: an EAGLE-3 head's token embeddings; kt:
        the cache's transposed keys (transposed_keys), written and read with kv, or None; norm [D]: the final
        RMSNorm's weight, applied to the output (as model.RMSNorm, in the pass's own arithmetic), or None
        -> (x after the layers (and the norm) [T, D], aux [T, len(aux_layers)*D])."""
        a, key = self.args, tuple(aux_layers)
        if key not in self.aux_of:
            self.aux_of[key] = torch.tensor(list(key) or [-1], dtype=torch.int64)
        if kt is None:
            kt = self.no_kt
        args = (x, emb, cos, sin, mask, cache_pos, kv, kt, self.table, self.aux_of[key], len(key), a.n_heads,
                a.intermediate_size, a.norm_eps, norm)
        return torch.ops.nanospec.cpu_stack(*args) if torch.compiler.is_compiling() else run(*args)


def pack_of(lin) -> Tensor:
    return lin.packed if lin.packed is not None else cpu_gemm.pack(lin.weight.detach())


def run(x: Tensor, emb: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor, cache_pos: Tensor, kv: Tensor,
        kt: Tensor, table: Tensor, aux_of: Tensor, n_aux: int, n_heads: int, inter: int, eps: float,
        norm: Tensor | None = None) -> tuple[Tensor, Tensor]:
    T, D = x.shape
    L, _, Hkv, S, hd = kv.shape
    assert kv.is_contiguous() and mask.shape == (T, S) and hd % 8 == 0 and hd <= 256 and table.shape[0] == L
    assert kt.numel() == 0 or (kt.is_contiguous() and kt.shape == (L, Hkv, -(-S // 16), hd // 2, 16))
    x = x.contiguous().clone()  # the kernel works in place
    aux = x.new_empty(T, max(n_aux, 1) * D)
    # contiguous copies bound to names: they must outlive the call
    m = mask.contiguous().view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
    cos, sin, pos = cos.contiguous(), sin.contiguous(), cache_pos.to(torch.int64).contiguous()
    e = None if emb is None else emb.contiguous()
    kernel()(table.data_ptr(), L, D, n_heads, Hkv, hd, inter, eps, T, S, x.data_ptr(), 0 if e is None else e.data_ptr(),
             cos.data_ptr(), sin.data_ptr(), m.data_ptr(), pos.data_ptr(), kv.data_ptr(),
             kt.data_ptr() if kt.numel() else 0, aux_of.data_ptr(), n_aux, aux.data_ptr(),
             0 if norm is None else norm.data_ptr(), torch.get_num_threads())
    return x, aux


@torch.library.custom_op("nanospec::cpu_stack", mutates_args=("kv", "kt"))
def cpu_stack_op(x: Tensor, emb: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor, cache_pos: Tensor, kv: Tensor,
                 kt: Tensor, table: Tensor, aux_of: Tensor, n_aux: int, n_heads: int, inter: int, eps: float,
                 norm: Tensor | None) -> tuple[Tensor, Tensor]:
    return run(x, emb, cos, sin, mask, cache_pos, kv, kt, table, aux_of, n_aux, n_heads, inter, eps, norm)


@cpu_stack_op.register_fake
def _(x, emb, cos, sin, mask, cache_pos, kv, kt, table, aux_of, n_aux, n_heads, inter, eps, norm):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], max(n_aux, 1) * x.shape[1])
