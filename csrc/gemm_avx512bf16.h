/* gemm.h's variant for builds with AVX-512 BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids and later):
   vdpbf16ps multiplies pairs of bf16 values and adds both products into an fp32 lane, 32 multiply-adds per
   instruction against the AVX2 kernel's 8 per FMA, and the weights need no widening */
#pragma once

#ifndef NV
#define NV 4
#endif
/* MT (<= 6) rows of x times the 64 weight rows of packed panel p (P[p][k/2][64][2]: for each pair of k, each
   weight row's two bf16 values side by side, so one 64-byte load is 16 rows' pairs; quantized (BITS 8 or 4), the
   codes in the same places, widened to those bf16 values in registers). x: bf16 pairs, K2 = K / 2
   per row; one 32-bit broadcast per row and pair. Each output is one chain of vdpbf16ps over the pairs in
   order; 4 x MT independent chains hide its latency (24 accumulators of the 32 registers), one row's 4
   included. A pass of one tile (up to 6 rows) leaves its panel stream to the hardware prefetcher; in larger
   passes each tile prefetches a share of the next panel (tiled(), spread): measured on Zen 4, the default
   model's GEMMs, alternating in one process, 12-15% faster at 12-16 rows than no prefetch, the same at 1, 8,
   26 and 48 rows, where prefetching the whole next panel from the one-row tile was 7-12% slower. 16-row tiles
   of 16-row panels, which read each panel once per 16 rows, were 5-15% slower at 1-4 rows and between 20%
   faster and 15% slower at 16, as this shared machine's memory speed moved. */
/* a quantized group's scales and offsets in each lane's row order, for k pairs: row c twice (sx[2 v], sx[2 v + 1]:
   rows 16 v .. 16 v + 7 and 16 v + 8 .. 16 v + 15, each twice) */
static inline __attribute__((always_inline)) void expand(const Packed* W, long K, long pd, long g, __m512* sx,
                                                         __m512* mx) {
    const __m512i dlo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i dhi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    for (int v = 0; v < NV; v++) {
        __m512 s, m;
        group_sm(W, K, pd, g, 16 * v, &s, &m);
        sx[2 * v] = _mm512_permutexvar_ps(dlo, s), sx[2 * v + 1] = _mm512_permutexvar_ps(dhi, s);
        mx[2 * v] = _mm512_permutexvar_ps(dlo, m), mx[2 * v + 1] = _mm512_permutexvar_ps(dhi, m);
    }
}

/* the bf16 weights of vector v of k pair k from a panel's codes q (and high bits hp): 32 values, rows 16 v .. 16 v +
   15's pairs; 8 bits: 32 bytes; else 16 bytes of low nibbles (values j and j + 16 in byte j) and, 6 bits, two
   32-bit words of 2-bit fields (value j at bits 2 j of word j / 16), 5 bits, one of 1-bit fields (value j at bit j),
   each moved to bit 4 by a rotate and merged with one ternary-logic op. One exact FMA each: (code - zero) * s + m is
   q * s + (m - zero * s), its product exact in fp32 */
static inline __attribute__((always_inline)) __m512bh widen(const uint8_t* q, const uint8_t* hp, long k, int v,
                                                             const __m512* sx, const __m512* mx, const int BITS) {
    __m512i lo, hi;  /* the codes of 8 rows' pairs and of the next 8 rows' */
    if (BITS == 8) {
        lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + (NV * k + v) * 32)));
        hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + (NV * k + v) * 32 + 16)));
    } else {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + (NV * k + v) * 16)));
        lo = _mm512_and_si512(c, _mm512_set1_epi32(15));
        hi = _mm512_srli_epi32(c, 4);
        if (BITS == 6) {
            const uint32_t* w = (const uint32_t*)(hp + (NV * k + v) * 8);
            const __m512i r = _mm512_set_epi32(26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0, 30, 28);
            const __m512i f = _mm512_set1_epi32(0x30);
            lo = _mm512_ternarylogic_epi32(lo, _mm512_rorv_epi32(_mm512_set1_epi32((int)w[0]), r), f, 0xF8);
            hi = _mm512_ternarylogic_epi32(hi, _mm512_rorv_epi32(_mm512_set1_epi32((int)w[1]), r), f, 0xF8);
        } else if (BITS == 5) {
            const __m512i w = _mm512_set1_epi32(*(const int*)(hp + (NV * k + v) * 4)), f = _mm512_set1_epi32(0x10);
            const __m512i rl = _mm512_set_epi32(11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 31, 30, 29, 28);
            const __m512i rh = _mm512_set_epi32(27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12);
            lo = _mm512_ternarylogic_epi32(lo, _mm512_rorv_epi32(w, rl), f, 0xF8);
            hi = _mm512_ternarylogic_epi32(hi, _mm512_rorv_epi32(w, rh), f, 0xF8);
        }
    }
    __m512 fl = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), sx[2 * v], mx[2 * v]);
    __m512 fh = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), sx[2 * v + 1], mx[2 * v + 1]);
    return _mm512_cvtne2ps_pbh(fh, fl);  /* round to nearest even, as torch (weights are not subnormal) */
}

/* panel pd of (part) W's codes as pack()'s bf16 panel, into dst [K / 2][64][2] */
static void widen_panel(const Packed* W, long pd, long K, uint16_t* dst) {
    const long K2 = K / 2, GK = W->group / 2, NG = K2 / GK, hb = 16 * NV * K * hbits(W->bits) / 8;
    const uint8_t* q = (const uint8_t*)W->w + pd * 16 * NV * K * wbits(W->bits) / 8;
    const uint8_t* hp = W->h ? W->h + pd * hb : 0;
    for (long g = 0; g < NG; g++) {
        __m512 sx[2 * NV], mx[2 * NV];
        expand(W, K, pd, g, sx, mx);
        for (long k = g * GK; k < (g + 1) * GK; k++)
            for (int v = 0; v < NV; v++) {
                __m512bh w = W->bits == 8 ? widen(q, hp, k, v, sx, mx, 8) : W->bits == 6 ? widen(q, hp, k, v, sx, mx, 6)
                             : W->bits == 5 ? widen(q, hp, k, v, sx, mx, 5) : widen(q, hp, k, v, sx, mx, 4);
                _mm512_storeu_si512((__m512i*)(dst + (NV * k + v) * 32), (__m512i)w);
            }
    }
}

static inline __attribute__((always_inline)) void tile(const uint32_t* x, long K2, const Packed* W, const uint16_t* wide,
        const uint16_t* b, uint16_t* y, float* yf, long N, long m0, long p, const char* pf, long l0, long l1,
        const int MT, const int BITS) {
    __m512 acc[6][NV];  /* in registers: the loops over it are unrolled (MT and NV are constants) */
    for (int i = 0; i < MT; i++) for (int v = 0; v < NV; v++) acc[i][v] = _mm512_setzero_ps();
    const uint32_t* x0 = x + m0 * K2;
    /* this panel's bf16 values (W's, or wide: widened once for several tiles) or codes; p counts the whole matrix's
       panels (its outputs), pd this part's (its data) */
    const long pd = p - W->p0;
    const uint8_t* q = wide ? (const uint8_t*)wide : (const uint8_t*)W->w + pd * 16 * NV * K2 * wbits(BITS) / 4;
    const uint8_t* hp = BITS == 5 || BITS == 6 ? W->h + pd * 16 * NV * K2 * hbits(BITS) / 4 : 0;
    /* quantized: a group's scales and offsets, widened once per group, so a code's weight is one FMA */
    const long GK = BITS == 16 ? K2 : W->group / 2, NG = K2 / GK;
    long due = 0, l = l0;
    for (long g = 0; g < NG; g++) {
        __m512 sx[2 * NV], mx[2 * NV];
        if (BITS != 16) expand(W, 2 * K2, pd, g, sx, mx);
        #pragma GCC unroll 2
        for (long k = g * GK; k < (g + 1) * GK; k++) {
            /* this tile's share of the next panel, spread evenly over its k loop by a running remainder (two integer
               divisions per k had cost 12-16% of 26- and 60-row passes, measured on Zen 5), into L1 (T0: 3-13%
               faster than L2 at 16-26 rows there) */
            if (pf)
                for (due += l1 - l0; due >= K2; due -= K2, l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
            __m512bh wv[NV];
            for (int v = 0; v < NV; v++)
                wv[v] = BITS == 16 ? (__m512bh)_mm512_loadu_si512((const __m512i*)q + NV * k + v)
                                   : widen(q, hp, k, v, sx, mx, BITS);
            for (int i = 0; i < MT; i++) {
                __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x0[i * K2 + k]);
                for (int v = 0; v < NV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xb, wv[v]);
            }
        }
    }
    float out[16];
    for (int i = 0; i < MT; i++) for (int v = 0; v < NV; v++) {
        _mm512_storeu_ps(out, acc[i][v]);
        store16(out, b, y, yf, N, m0 + i, (p * NV + v) * 16);
    }
}
#define TILE(MT, BITS) static void t##MT##_##BITS(const void* x, long K2, const Packed* W, const uint16_t* wide, \
        const uint16_t* b, uint16_t* y, float* yf, long N, long m, long p, const char* pf, long l0, long l1) { \
        tile((const uint32_t*)x, K2, W, wide, b, y, yf, N, m, p, pf, l0, l1, MT, BITS); }
#define TILES(BITS) TILE(1, BITS) TILE(2, BITS) TILE(3, BITS) TILE(4, BITS) TILE(5, BITS) TILE(6, BITS)
TILES(16) TILES(8) TILES(4) TILES(5) TILES(6)
#include "gemm_kquant.h"
static const tile_fn tiles[NFMT][7] = {{0, t1_16, t2_16, t3_16, t4_16, t5_16, t6_16},
    {0, t1_8, t2_8, t3_8, t4_8, t5_8, t6_8}, {0, t1_4, t2_4, t3_4, t4_4, t5_4, t6_4},
    {0, t1_5, t2_5, t3_5, t4_5, t5_5, t6_5}, {0, t1_6, t2_6, t3_6, t4_6, t5_6, t6_6},
    {0, k1_4, k2_4, k3_4, k4_4, k5_4, k6_4}, {0, k1_6, k2_6, k3_6, k4_6, k5_6, k6_6}};

/* y[M, N] = x[M, K] @ W[N, K]^T (+ b), x as bf16 pairs, in tiles of up to 6 rows over panels of 64. Row-invariant
   by construction: every output is one chain of vdpbf16ps over the k pairs in order, plus the bias, rounded
   once, whatever the tile, the row count or the row's place in the pass. */
static void gemm_pairs(const uint32_t* x, long M, long K, const Packed* W, const uint16_t* b, long N, uint16_t* y,
                       float* yf) {
    FAST(0, (const uint16_t*)x, M, K, W, b, N, y, yf)
    if (has_kquant(W)) ksums(x, M, K / 2);  /* each thread its own (no barrier before) */
    tiled(tiles, 0, 6, 16 * NV, 1, x, K / 2, M, K, W, b, N, y, yf);
}

/* the fused pass's interface (forward.c; gemm.c's linear_bf16 takes bf16 pairs directly): xf [M, K] fp32 holding
   bf16 values, made bf16 (exact) in xs [threads, M, K] first */
__attribute__((unused)) static void gemm_rows(const float* xf, long M, long K, const Packed* W, const uint16_t* b,
                                              long N, uint16_t* y, float* yf, uint16_t* xs) {
    FAST(xf, 0, M, K, W, b, N, y, yf)
    uint16_t* mine = xs + omp_get_thread_num() * M * K;  /* each thread its own copy: no barrier before the GEMM */
    for (long i = 0; i < M * K; i++) mine[i] = to_bf16(xf[i]);
    gemm_pairs((const uint32_t*)mine, M, K, W, b, N, y, yf);
}
