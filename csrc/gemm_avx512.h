/* gemm.h's variant for builds with AVX-512F and no AVX-512 BF16 (Skylake-SP, Cascade Lake, Ice Lake): the AVX2
   kernel's arithmetic in 16-lane registers, the AVX-512 BF16 kernel's shape (panels of 64, tiles of up to 6 rows) */
#pragma once

/* MT (<= 6) rows of x times the 64 weight rows of packed panel p (P[p][k][64]: per k, two groups of 32 values
   interleaved [n0, n16, n1, n17, ...], pack()), so each 64-byte load becomes the fp32 vectors of 16 rows with one
   shift and one mask, and every x value is one broadcast: 4 * MT FMAs per k, into 24 of the 32 registers.
   Each output is one fp32 FMA chain over k in order, as in the AVX2 kernel: the two give the same bits, and
   each instruction does twice an AVX2 FMA's work (measured on an Ice Lake Xeon, the default model's GEMMs in
   one process, alternating: 16 rows 1.4-1.5x, 60 rows 1.6-2x the AVX2 kernel, 1-4 rows the same: memory-bound). */
/* the fp32 (bf16-valued) weights of rows 16 v .. 16 v + 15 at k from codes q (a k's 64 rows in order; 4 to 6 bits:
   low nibbles, rows 32 r + j and 32 r + 16 + j in byte 16 r + j, and, 6 bits, 2-bit fields, row 16 w + j at bits
   2 j of 32-bit word w of the k's high bits hp, 5 bits, 1-bit fields, row 32 w + j at bit j of word w), sx / mx
   their group's scales and offsets: one exact FMA, as the AVX-512 BF16 kernel */
static inline __attribute__((always_inline)) __m512 widen(const uint8_t* q, const uint8_t* hp, long k, int v,
                                                           const __m512* sx, const __m512* mx, const int BITS) {
    __m512i c;
    if (BITS == 8) c = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + k * 64 + 16 * v)));
    else {
        c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + k * 32 + 16 * (v / 2))));
        c = v % 2 ? _mm512_srli_epi32(c, 4) : _mm512_and_si512(c, _mm512_set1_epi32(15));
        if (BITS == 6) {
            const __m512i r = _mm512_set_epi32(26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0, 30, 28);
            const __m512i w = _mm512_set1_epi32(((const int*)(hp + k * 16))[v]);
            c = _mm512_ternarylogic_epi32(c, _mm512_rorv_epi32(w, r), _mm512_set1_epi32(0x30), 0xF8);
        } else if (BITS == 5) {
            const __m512i r = v % 2 ? _mm512_set_epi32(27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12)
                                    : _mm512_set_epi32(11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 31, 30, 29, 28);
            const __m512i w = _mm512_set1_epi32(((const int*)(hp + k * 8))[v / 2]);
            c = _mm512_ternarylogic_epi32(c, _mm512_rorv_epi32(w, r), _mm512_set1_epi32(0x10), 0xF8);
        }
    }
    return rbf16v(_mm512_fmadd_ps(_mm512_cvtepi32_ps(c), sx[v], mx[v]));
}

/* panel pd of (part) W's codes as pack()'s bf16 panel, into dst [K][64] (per 32 rows [n0, n16, n1, n17, ...]) */
static void widen_panel(const Packed* W, long pd, long K, uint16_t* dst) {
    const long NG = K / W->group;
    const uint8_t* q = (const uint8_t*)W->w + pd * 64 * K * wbits(W->bits) / 8;
    const uint8_t* hp = W->h ? W->h + pd * 64 * K * hbits(W->bits) / 8 : 0;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (long g = 0; g < NG; g++) {
        __m512 sx[4], mx[4];
        for (int v = 0; v < 4; v++) group_sm(W, K, pd, g, 16 * v, sx + v, mx + v);
        for (long k = g * W->group; k < (g + 1) * W->group; k++)
            for (int v = 0; v < 2; v++) {  /* rows 32 v + j (low half) and 32 v + 16 + j (high half) of lane j */
#define WIDEN(u) (W->bits == 8 ? widen(q, hp, k, u, sx, mx, 8) : W->bits == 6 ? widen(q, hp, k, u, sx, mx, 6) \
                  : W->bits == 5 ? widen(q, hp, k, u, sx, mx, 5) : widen(q, hp, k, u, sx, mx, 4))
                __m512 a = WIDEN(2 * v), c = WIDEN(2 * v + 1);
#undef WIDEN
                __m512i u = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(a), 16),
                                            _mm512_and_si512(_mm512_castps_si512(c), hi));
                _mm512_storeu_si512((__m512i*)(dst + k * 64 + 32 * v), u);
            }
    }
}

static inline __attribute__((always_inline)) void tile(const float* x, long K, const Packed* W, const uint16_t* wide,
        const uint16_t* b, uint16_t* y, float* yf, long N, long m0, long p, const char* pf, long l0, long l1,
        const int MT, const int NVH, const int BITS) {
    /* NVH = 4: the whole panel p; NVH = 2: the half panel p (panel p / 2's 32 columns from 32 x (p % 2): the
       second of each k's two 64-byte loads, or the first; quantized, the second or first half of each k's codes).
       The panel counts the whole matrix's (its outputs), pd this part's (its data) */
    __m512 acc[6][4];  /* in registers: the loops over it are unrolled (MT and NVH are constants) */
    for (int i = 0; i < MT; i++) for (int v = 0; v < NVH; v++) acc[i][v] = _mm512_setzero_ps();
    const float* x0 = x + m0 * K;
    const long half = NVH == 4 ? 0 : p % 2, pp = NVH == 4 ? p : p / 2, pd = pp - W->p0;
    const long n0 = pp * 64 + half * 32;
    const __m512i* w = (const __m512i*)(wide ? wide : (const uint16_t*)W->w + pd * 64 * K) + half;
    /* quantized: this tile's half from element 32 x half of each k's codes; a group's scales and offsets widened
       once per group */
    const uint8_t* q = (const uint8_t*)W->w + pd * 64 * K * wbits(BITS) / 8 + half * 32 * wbits(BITS) / 8;
    const uint8_t* hp = BITS == 5 || BITS == 6 ? W->h + pd * 64 * K * hbits(BITS) / 8 + half * 32 * hbits(BITS) / 8
                                               : 0;
    const long GK = BITS == 16 ? K : W->group, NG = K / GK;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    long due = 0, l = l0;
    for (long g = 0; g < NG; g++) {
        __m512 sx[4], mx[4];
        if (BITS != 16) for (int v = 0; v < NVH; v++) group_sm(W, K, pd, g, half * 32 + 16 * v, sx + v, mx + v);
        #pragma GCC unroll 2
        for (long k = g * GK; k < (g + 1) * GK; k++) {
            if (pf)  /* this tile's share of the next panel, spread evenly over its k loop (as the BF16 kernel) */
                for (due += l1 - l0; due >= K; due -= K, l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
            __m512 wv[4];
            if (BITS == 16)
                for (int v = 0; v < NVH / 2; v++) {
                    __m512i u = _mm512_loadu_si512(w + 2 * k + v);
                    wv[2 * v] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
                    wv[2 * v + 1] = _mm512_castsi512_ps(_mm512_and_si512(u, hi));
                }
            else
                for (int v = 0; v < NVH; v++) wv[v] = widen(q, hp, k, v, sx, mx, BITS);
            for (int i = 0; i < MT; i++) {
                __m512 xv = _mm512_set1_ps(x0[i * K + k]);
                for (int v = 0; v < NVH; v++) acc[i][v] = _mm512_fmadd_ps(xv, wv[v], acc[i][v]);
            }
        }
    }
    float out[16];
    for (int i = 0; i < MT; i++) for (int v = 0; v < NVH; v++) {
        _mm512_storeu_ps(out, acc[i][v]);
        store16(out, b, y, yf, N, m0 + i, n0 + v * 16);
    }
}
#define TILE(MT, BITS) static void t##MT##_##BITS(const void* x, long K, const Packed* W, const uint16_t* wide, \
        const uint16_t* b, uint16_t* y, float* yf, long N, long m, long p, const char* pf, long l0, long l1) { \
        tile((const float*)x, K, W, wide, b, y, yf, N, m, p, pf, l0, l1, MT, 4, BITS); } \
    static void h##MT##_##BITS(const void* x, long K, const Packed* W, const uint16_t* wide, const uint16_t* b, \
        uint16_t* y, float* yf, long N, long m, long p, const char* pf, long l0, long l1) { \
        tile((const float*)x, K, W, wide, b, y, yf, N, m, p, pf, l0, l1, MT, 2, BITS); }
#define TILES(BITS) TILE(1, BITS) TILE(2, BITS) TILE(3, BITS) TILE(4, BITS) TILE(5, BITS) TILE(6, BITS)
TILES(16) TILES(8) TILES(4) TILES(5) TILES(6)
static const tile_fn tiles[NFMT][7] = {{0, t1_16, t2_16, t3_16, t4_16, t5_16, t6_16},
    {0, t1_8, t2_8, t3_8, t4_8, t5_8, t6_8}, {0, t1_4, t2_4, t3_4, t4_4, t5_4, t6_4},
    {0, t1_5, t2_5, t3_5, t4_5, t5_5, t6_5}, {0, t1_6, t2_6, t3_6, t4_6, t5_6, t6_6}};
static const tile_fn half_tiles[NFMT][7] = {{0, h1_16, h2_16, h3_16, h4_16, h5_16, h6_16},
    {0, h1_8, h2_8, h3_8, h4_8, h5_8, h6_8}, {0, h1_4, h2_4, h3_4, h4_4, h5_4, h6_4},
    {0, h1_5, h2_5, h3_5, h4_5, h5_5, h6_5}, {0, h1_6, h2_6, h3_6, h4_6, h5_6, h6_6}};
#define FMA_HALVES half_tiles  /* 9-panel products split evenly over 2 threads (tiled()) */
#define FMA_PANEL 64
/* a lone tile (1-6 rows) prefetches the whole next panel, as the AVX2 kernel's first tile does (measured on an Ice
   Lake Xeon: 4 rows 1.1x faster than leaving it to the hardware prefetcher); several tiles share it out, as the
   BF16 kernel's do */
#define FMA_SPREAD 2
