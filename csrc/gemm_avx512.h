/* gemm.h's variant for builds with AVX-512F and no AVX-512 BF16 (Skylake-SP, Cascade Lake, Ice Lake): the AVX2
   kernel's arithmetic in 16-lane registers, the AVX-512 BF16 kernel's shape (panels of 64, tiles of up to 6 rows) */
#pragma once

/* MT (<= 6) rows of x times the 64 weight rows of packed panel p (P[p][k][64]: per k, two groups of 32 values
   interleaved [n0, n16, n1, n17, ...], pack()), so each 64-byte load becomes the fp32 vectors of 16 rows with one
   shift and one mask, and every x value is one broadcast: 4 * MT FMAs per k, into 24 of the 32 registers.
   Each output is one fp32 FMA chain over k in order, as in the AVX2 kernel: the two give the same bits, and
   each instruction does twice an AVX2 FMA's work (measured on an Ice Lake Xeon, the default model's GEMMs in
   one process, alternating: 16 rows 1.4-1.5x, 60 rows 1.6-2x the AVX2 kernel, 1-4 rows the same: memory-bound). */
/* the codes of rows 16 v .. 16 v + 15 at k, as 32-bit integers, from q (a k's 64 rows in order; 4 to 6 bits:
   low nibbles, rows 32 r + j and 32 r + 16 + j in byte 16 r + j, and, 6 bits, 2-bit fields, row 16 w + j at bits
   2 j of 32-bit word w of the k's high bits hp, 5 bits, 1-bit fields, row 32 w + j at bit j of word w), sx / mx
   their group's scales and offsets; widen: their fp32 (bf16-valued) weights, one exact FMA, as the AVX-512 BF16
   kernel */
static inline __attribute__((always_inline)) __m512i codes(const uint8_t* q, const uint8_t* hp, long k, int v,
                                                            const int BITS) {
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
    return c;
}
static inline __attribute__((always_inline)) __m512 widen(const uint8_t* q, const uint8_t* hp, long k, int v,
                                                           const __m512* sx, const __m512* mx, const int BITS) {
    return rbf16v(_mm512_fmadd_ps(_mm512_cvtepi32_ps(codes(q, hp, k, v, BITS)), sx[v], mx[v]));
}

/* panel pd of (part) W's codes as pack()'s bf16 panel, into dst [K][64] (per 32 rows [n0, n16, n1, n17, ...]): their
   weights, or, raw, the codes themselves (exact in bf16: below 64) */
static inline __attribute__((always_inline)) void widen_as(const Packed* W, long pd, long K, uint16_t* dst,
                                                            const int raw) {
    const long NG = K / W->group;
    const uint8_t* q = (const uint8_t*)W->w + pd * 64 * K * wbits(W->bits) / 8;
    const uint8_t* hp = W->h ? W->h + pd * 64 * K * hbits(W->bits) / 8 : 0;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (long g = 0; g < NG; g++) {
        __m512 sx[4], mx[4];
        if (!raw) for (int v = 0; v < 4; v++) group_sm(W, K, pd, g, 16 * v, sx + v, mx + v);
        for (long k = g * W->group; k < (g + 1) * W->group; k++)
            for (int v = 0; v < 2; v++) {  /* rows 32 v + j (low half) and 32 v + 16 + j (high half) of lane j */
#define ONE(u, B) (raw ? _mm512_cvtepi32_ps(codes(q, hp, k, u, B)) : widen(q, hp, k, u, sx, mx, B))
#define WIDEN(u) (W->bits == 8 ? ONE(u, 8) : W->bits == 6 ? ONE(u, 6) : W->bits == 5 ? ONE(u, 5) : ONE(u, 4))
                __m512 a = WIDEN(2 * v), c = WIDEN(2 * v + 1);
#undef WIDEN
#undef ONE
                __m512i u = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(a), 16),
                                            _mm512_and_si512(_mm512_castps_si512(c), hi));
                _mm512_storeu_si512((__m512i*)(dst + k * 64 + 32 * v), u);
            }
    }
}
static void widen_panel(const Packed* W, long pd, long K, uint16_t* dst) { widen_as(W, pd, K, dst, 0); }

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
/* F's whole-panel tile t##MT##_##BITS and half-panel tile h##MT##_##BITS */
#define TILE_FNS(F, t, h, MT, BITS) static void t##MT##_##BITS(const void* x, long K, const Packed* W, \
        const uint16_t* wide, const uint16_t* b, uint16_t* y, float* yf, long N, long m, long p, const char* pf, \
        long l0, long l1) { F((const float*)x, K, W, wide, b, y, yf, N, m, p, pf, l0, l1, MT, 4, BITS); } \
    static void h##MT##_##BITS(const void* x, long K, const Packed* W, const uint16_t* wide, const uint16_t* b, \
        uint16_t* y, float* yf, long N, long m, long p, const char* pf, long l0, long l1) { \
        F((const float*)x, K, W, wide, b, y, yf, N, m, p, pf, l0, l1, MT, 2, BITS); }
#define TILE(MT, BITS) TILE_FNS(tile, t, h, MT, BITS)
#define TILES(BITS) TILE(1, BITS) TILE(2, BITS) TILE(3, BITS) TILE(4, BITS) TILE(5, BITS) TILE(6, BITS)
TILES(16) TILES(8) TILES(4) TILES(5) TILES(6)

/* panel pd of K-quant part W's codes as bf16 values (exact) in pack()'s layout, into dst [K][64], and its groups'
   s and m into ksc_buf [groups][4 vectors][s 16, m 16], for several tiles over one panel (gemm_kfma.h) */
static void kwiden_panel(const Packed* W, long pd, long K, uint16_t* dst) {
    const long NG = K / W->group;
    widen_as(W, pd, K, dst, 1);
    room(&ksc_buf, &ksc_cap, NG * 128);
    for (long g = 0; g < NG; g++)
        for (int v = 0; v < 4; v++) {
            __m512 sv, mv;
            group_sm(W, K, pd, g, 16 * v, &sv, &mv);
            _mm512_store_ps(ksc_buf + (g * 4 + v) * 32, sv), _mm512_store_ps(ksc_buf + (g * 4 + v) * 32 + 16, mv);
        }
}

/* MT rows of x times (half) panel p of K-quant part W, factorized (gemm_kfma.h): BITS 4, 5, 6 decoding the codes,
   16 reading kwiden_panel's. NVH as tile(); few rows take the tile's vectors at once, more HV = 2 at a time (the
   sub-block chains and the accumulators in registers); each output's chains and FMAs are the same either way */
static inline __attribute__((always_inline)) void ktile(const float* x, long K, const Packed* W, const uint16_t* wide,
        const uint16_t* b, uint16_t* y, float* yf, long N, long m0, long p, const char* pf, long l0, long l1,
        const int MT, const int NVH, const int BITS) {
    const int HV = MT <= 2 ? NVH : 2;
    const long half = NVH == 4 ? 0 : p % 2, pp = NVH == 4 ? p : p / 2, pd = pp - W->p0;
    const long n0 = pp * 64 + half * 32, NG = K / W->group, GK = W->group, XB = K / 16, xs = GK / 16;
    const __m512i* w = (const __m512i*)wide + half;
    const uint8_t* q = (const uint8_t*)W->w + pd * 64 * K * wbits(BITS) / 8 + half * 32 * wbits(BITS) / 8;
    const uint8_t* hp = BITS == 5 || BITS == 6 ? W->h + pd * 64 * K * hbits(BITS) / 8 + half * 32 * hbits(BITS) / 8
                                               : 0;
    const float* x0 = x + m0 * K;
    const float* X = xsum_buf + m0 * XB;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    long due = 0, l = l0;
    #pragma GCC unroll 2
    for (int hf = 0; hf < NVH / HV; hf++) {
        /* the accumulators in memory (they change once per sub-block), the chains in registers: GCC otherwise kept
           both there and reloaded the weights from the stack for every FMA */
        float acc[6][4][16] __attribute__((aligned(64)));
        for (int i = 0; i < MT; i++) for (int v = 0; v < HV; v++) _mm512_store_ps(acc[i][v], _mm512_setzero_ps());
        for (long g = 0; g < NG; g++) {
            __m512 S[6][4];
            for (int i = 0; i < MT; i++) for (int v = 0; v < HV; v++) S[i][v] = _mm512_setzero_ps();
            #pragma GCC unroll 2
            for (long k = g * GK; k < (g + 1) * GK; k++) {
                if (pf && hf == 0)  /* this tile's share of the next panel (as tile()) */
                    for (due += l1 - l0; due >= K; due -= K, l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
                __m512 wv[4];
                for (int v = 0; v < HV; v++) {
                    const int u = hf * HV + v;
                    if (BITS == 16) {
                        const __m512i c = _mm512_loadu_si512(w + 2 * k + u / 2);
                        wv[v] = _mm512_castsi512_ps(u % 2 ? _mm512_and_si512(c, hi) : _mm512_slli_epi32(c, 16));
                    } else wv[v] = _mm512_cvtepi32_ps(codes(q, hp, k, u, BITS));
                }
                for (int i = 0; i < MT; i++) {
                    const __m512 xv = _mm512_set1_ps(x0[i * K + k]);
                    for (int v = 0; v < HV; v++) S[i][v] = _mm512_fmadd_ps(xv, wv[v], S[i][v]);
                }
            }
            for (int v = 0; v < HV; v++) {
                const int u = half * 2 + hf * HV + v;  /* the vector's place in the whole panel */
                __m512 s, m;
                if (BITS == 16)
                    s = _mm512_load_ps(ksc_buf + (g * 4 + u) * 32), m = _mm512_load_ps(ksc_buf + (g * 4 + u) * 32 + 16);
                else group_sm(W, K, pd, g, 16 * u, &s, &m);
                for (int i = 0; i < MT; i++)
                    _mm512_store_ps(acc[i][v], _mm512_fmadd_ps(m, _mm512_set1_ps(xgroup(X, XB, i, g, xs)),
                                                               _mm512_fmadd_ps(s, S[i][v], _mm512_load_ps(acc[i][v]))));
            }
        }
        for (int i = 0; i < MT; i++)
            for (int v = 0; v < HV; v++) store16(acc[i][v], b, y, yf, N, m0 + i, n0 + (hf * HV + v) * 16);
    }
}
#define KTILE(MT, BITS) TILE_FNS(ktile, k, j, MT, BITS)
#define KTILES(BITS) KTILE(1, BITS) KTILE(2, BITS) KTILE(3, BITS) KTILE(4, BITS) KTILE(5, BITS) KTILE(6, BITS)
KTILES(4) KTILES(5) KTILES(6) KTILES(16)
#define ROWS(t, B) {0, t##1_##B, t##2_##B, t##3_##B, t##4_##B, t##5_##B, t##6_##B}
static const tile_fn tiles[NFMT][7] = {ROWS(t, 16), ROWS(t, 8), ROWS(t, 4), ROWS(t, 5), ROWS(t, 6),
                                       ROWS(k, 4), ROWS(k, 5), ROWS(k, 6), ROWS(k, 16)};
static const tile_fn half_tiles[NFMT][7] = {ROWS(h, 16), ROWS(h, 8), ROWS(h, 4), ROWS(h, 5), ROWS(h, 6),
                                            ROWS(j, 4), ROWS(j, 5), ROWS(j, 6), ROWS(j, 16)};
#undef ROWS
#define FMA_HALVES half_tiles  /* 9-panel products split evenly over 2 threads (tiled()) */
#define FMA_PANEL 64
/* a lone tile (1-6 rows) prefetches the whole next panel, as the AVX2 kernel's first tile does (measured on an Ice
   Lake Xeon: 4 rows 1.1x faster than leaving it to the hardware prefetcher); several tiles share it out, as the
   BF16 kernel's do */
#define FMA_SPREAD 2
