/* gemm.h's variant for builds with AVX-512F and no AVX-512 BF16 (Skylake-SP, Cascade Lake, Ice Lake): the AVX2
   kernel's arithmetic in 16-lane registers, the AVX-512 BF16 kernel's shape (panels of 64, tiles of up to 6 rows) */
#pragma once

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
