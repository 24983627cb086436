/* The AVX2/FMA kernel: any x86-64 of the last decade (gemm.h includes it where the build targets no AVX-512) */
#pragma once

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
