/* The AVX2/FMA kernel: any x86-64 of the last decade (gemm.h includes it where the build targets no AVX-512) */
#pragma once

/* MT rows of x times the 16 weight rows of packed panel p (P[p][k][16], see pack(); quantized: their codes, widened
   in registers to the bf16 weights they stand for): a panel's K x 16
   weights are one contiguous stream, read from memory once per pass and from L1/L2 once per MT rows. Each
   k's 16 bf16 values sit interleaved [n0, n8, n1, n9, ...], so one 32-byte load becomes the two fp32 vectors
   of n0-7 and n8-15 with one shift and one mask (bf16 = the high half of fp32), and every x value is one
   broadcast: 2 * MT FMAs per load of weights, so extra rows cost FMAs, not weight traffic. */
/* the codes of rows 0-7 (c0) and 8-15 (c1) at k, as 32-bit integers, from q (a k's 16 rows in order; 4 to 6
   bits: low nibbles, rows j and 8 + j in byte j, and the k's high bits at hp, row j's at bits (bits - 4) j), s / o
   their group's scales and offsets; widen: their fp32 (bf16-valued) weights (w0, w1), one exact FMA, as the
   AVX-512 kernels */
static inline __attribute__((always_inline)) void codes(const uint8_t* q, const uint8_t* hp, long k, __m256i* c0,
                                                         __m256i* c1, const int BITS) {
    if (BITS == 8) {
        *c0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + k * 16)));
        *c1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + k * 16 + 8)));
    } else {
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + k * 8)));
        *c0 = _mm256_and_si256(c, _mm256_set1_epi32(15));
        *c1 = _mm256_srli_epi32(c, 4);
        if (BITS == 6 || BITS == 5) {
            const int hb = BITS - 4;
            const __m256i x = _mm256_set1_epi32(hb == 2 ? ((const int*)hp)[k] : ((const uint16_t*)hp)[k]);
            const __m256i r = _mm256_set_epi32(7 * hb, 6 * hb, 5 * hb, 4 * hb, 3 * hb, 2 * hb, hb, 0);
            const __m256i f = _mm256_set1_epi32((1 << hb) - 1), r8 = _mm256_set1_epi32(8 * hb);
            *c0 = _mm256_or_si256(*c0, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(x, r), f), 4));
            *c1 = _mm256_or_si256(*c1, _mm256_slli_epi32(_mm256_and_si256(
                _mm256_srlv_epi32(x, _mm256_add_epi32(r, r8)), f), 4));
        }
    }
}
static inline __attribute__((always_inline)) void widen(const uint8_t* q, const uint8_t* hp, long k, __m256 s0,
        __m256 s1, __m256 o0, __m256 o1, __m256* w0, __m256* w1, const int BITS) {
    __m256i c0, c1;
    codes(q, hp, k, &c0, &c1, BITS);
    *w0 = rbf8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), s0, o0));
    *w1 = rbf8(_mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), s1, o1));
}

/* a group's 16 scales and offsets (rows 0-7, 8-15) of part W's panel pd: exact, as gemm.h's group_sm */
static inline void expand(const Packed* W, long K, long pd, long g, __m256* s0, __m256* s1, __m256* o0, __m256* o1) {
    const long NG = K / W->group;
    const __m256 neg = _mm256_set1_ps(-0.f);
#define H8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#define I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p))))
    if (W->sup) {
        const long o = (pd * (K / W->sup) + g * W->group / W->sup) * 16, oc = (pd * NG + g) * 16;
        *s0 = _mm256_mul_ps(H8(W->s + o), I8(W->sc + oc)), *s1 = _mm256_mul_ps(H8(W->s + o + 8), I8(W->sc + oc + 8));
        if (W->m) {
            *o0 = _mm256_xor_ps(_mm256_mul_ps(H8(W->m + o), I8(W->mn + oc)), neg);
            *o1 = _mm256_xor_ps(_mm256_mul_ps(H8(W->m + o + 8), I8(W->mn + oc + 8)), neg);
        }
    } else {
        *s0 = H8(W->s + (pd * NG + g) * 16), *s1 = H8(W->s + (pd * NG + g) * 16 + 8);
        if (W->m) *o0 = H8(W->m + (pd * NG + g) * 16), *o1 = H8(W->m + (pd * NG + g) * 16 + 8);
    }
#undef H8
#undef I8
    if (!W->m) {
        const __m256 z = _mm256_set1_ps((float)-W->zero);
        *o0 = _mm256_mul_ps(*s0, z), *o1 = _mm256_mul_ps(*s1, z);
    }
}

/* panel pd of (part) W's codes as pack()'s bf16 panel, into dst [K][16] ([n0, n8, n1, n9, ...]): their weights, or,
   raw, the codes themselves (exact in bf16: below 64) */
static inline __attribute__((always_inline)) void widen_as(const Packed* W, long pd, long K, uint16_t* dst,
                                                            const int raw) {
    const long NG = K / W->group;
    const uint8_t* q = (const uint8_t*)W->w + pd * 16 * K * wbits(W->bits) / 8;
    const uint8_t* hp = W->h ? W->h + pd * 16 * K * hbits(W->bits) / 8 : 0;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (long g = 0; g < NG; g++) {
        __m256 s0, s1, o0, o1, w0, w1;
        if (!raw) expand(W, K, pd, g, &s0, &s1, &o0, &o1);
        for (long k = g * W->group; k < (g + 1) * W->group; k++) {
#define ONE(B) if (raw) { __m256i c0, c1; codes(q, hp, k, &c0, &c1, B); \
                          w0 = _mm256_cvtepi32_ps(c0), w1 = _mm256_cvtepi32_ps(c1); } \
               else widen(q, hp, k, s0, s1, o0, o1, &w0, &w1, B);
            if (W->bits == 8) { ONE(8) } else if (W->bits == 6) { ONE(6) }
            else if (W->bits == 5) { ONE(5) } else { ONE(4) }
#undef ONE
            __m256i u = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(w0), 16),
                                        _mm256_and_si256(_mm256_castps_si256(w1), hi));
            _mm256_storeu_si256((__m256i*)(dst + k * 16), u);
        }
    }
}
static void widen_panel(const Packed* W, long pd, long K, uint16_t* dst) { widen_as(W, pd, K, dst, 0); }

static inline __attribute__((always_inline)) void tile(const float* x, long K, const Packed* W, const uint16_t* wide,
        const uint16_t* b, uint16_t* y, float* yf, long N, long m0, long p, const char* pf, const int MT, const int BITS) {
    /* named accumulators, not an array: GCC keeps an array of vectors in memory and stores it every k */
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const float* x0 = x + m0 * K;
    /* p counts the whole matrix's panels (its outputs), pd this part's (its data) */
    const long pd = p - W->p0;
    const __m256i* w = (const __m256i*)(wide ? wide : (const uint16_t*)W->w + pd * 16 * K);
    /* quantized: a group's scales and offsets widened once per group */
    const uint8_t* q = (const uint8_t*)W->w + pd * 16 * K * wbits(BITS) / 8;
    const uint8_t* hp = BITS == 5 || BITS == 6 ? W->h + pd * 16 * K * hbits(BITS) / 8 : 0;
    const long GK = BITS == 16 ? K : W->group, NG = K / GK;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (long g = 0; g < NG; g++) {
        __m256 s0 = a00, s1 = a00, o0 = a00, o1 = a00;
        if (BITS != 16) expand(W, K, pd, g, &s0, &s1, &o0, &o1);
        #pragma GCC unroll 4
        for (long k = g * GK; k < (g + 1) * GK; k++) {  /* unrolled: the loop's own instructions cost 15% of the FMAs' issue slots */
            if (pf && !(k & 1)) _mm_prefetch(pf + k * 32 * wbits(BITS) / 16, _MM_HINT_T1);  /* the next panel, a 64-byte line per 2 k (bf16) */
            __m256 w0, w1;
            if (BITS == 16) {
                __m256i v = _mm256_loadu_si256(w + k);
                w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), w1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
            } else widen(q, hp, k, s0, s1, o0, o1, &w0, &w1, BITS);
            __m256 xv;
#define ROW(i) if (MT > i) { xv = _mm256_broadcast_ss(x0 + i * K + k); \
            a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0); a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1); }
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
        }
    }
    __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    float out[6][16];  /* the accumulators leave the registers once, in a loop the compiler unrolls */
    for (int i = 0; i < MT; i++) { _mm256_storeu_ps(out[i], acc[i][0]); _mm256_storeu_ps(out[i] + 8, acc[i][1]); }
    for (int i = 0; i < MT; i++) store16(out[i], b, y, yf, N, m0 + i, p * 16);
}
#define TILE(MT, BITS) static void t##MT##_##BITS(const void* x, long K, const Packed* W, const uint16_t* wide, \
        const uint16_t* b, uint16_t* y, float* yf, long N, long m, long p, const char* pf, long l0, long l1) { \
        (void)l0; (void)l1; tile((const float*)x, K, W, wide, b, y, yf, N, m, p, pf, MT, BITS); }
#define TILES(BITS) TILE(1, BITS) TILE(2, BITS) TILE(3, BITS) TILE(4, BITS) TILE(5, BITS) TILE(6, BITS)
TILES(16) TILES(8) TILES(4) TILES(5) TILES(6)

/* panel pd of K-quant part W's codes as bf16 values (exact) in pack()'s layout, into dst [K][16], and its groups'
   scales and offsets into ksc_buf [groups][s 16, m 16], for several tiles over one panel (gemm_kfma.h) */
static void kwiden_panel(const Packed* W, long pd, long K, uint16_t* dst) {
    const long NG = K / W->group;
    widen_as(W, pd, K, dst, 1);
    room(&ksc_buf, &ksc_cap, NG * 32);
    for (long g = 0; g < NG; g++) {
        __m256 s0, s1, o0, o1;
        expand(W, K, pd, g, &s0, &s1, &o0, &o1);
        float* d = ksc_buf + g * 32;
        _mm256_store_ps(d, s0), _mm256_store_ps(d + 8, s1), _mm256_store_ps(d + 16, o0), _mm256_store_ps(d + 24, o1);
    }
}

/* MT rows of x times panel p of K-quant part W, factorized (gemm_kfma.h): BITS 4, 5, 6 decoding the codes, 16
   reading kwiden_panel's. The sub-block chains in named registers (as tile()), the accumulators in memory: they
   change once per sub-block */
static inline __attribute__((always_inline)) void ktile(const float* x, long K, const Packed* W, const uint16_t* wide,
        const uint16_t* b, uint16_t* y, float* yf, long N, long m0, long p, const char* pf, const int MT,
        const int BITS) {
    const long pd = p - W->p0, GK = W->group, NG = K / GK, XB = K / 16, xs = GK / 16;
    const __m256i* w = (const __m256i*)wide;
    const uint8_t* q = (const uint8_t*)W->w + pd * 16 * K * wbits(W->bits) / 8;
    const uint8_t* hp = W->h ? W->h + pd * 16 * K * hbits(W->bits) / 8 : 0;
    const long pfk = 32 * wbits(W->bits) / 16;  /* the next panel's bytes per k, for the prefetch (as tile()) */
    const float* x0 = x + m0 * K;
    const float* X = xsum_buf + m0 * XB;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[6][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (long g = 0; g < NG; g++) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
               a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
        #pragma GCC unroll 4
        for (long k = g * GK; k < (g + 1) * GK; k++) {
            if (pf && !(k & 1)) _mm_prefetch(pf + k * pfk, _MM_HINT_T1);
            __m256 w0, w1;
            if (BITS == 16) {
                __m256i v = _mm256_loadu_si256(w + k);
                w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), w1 = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
            } else {
                __m256i c0, c1;
                codes(q, hp, k, &c0, &c1, BITS);
                w0 = _mm256_cvtepi32_ps(c0), w1 = _mm256_cvtepi32_ps(c1);
            }
            __m256 xv;
#define ROW(i) if (MT > i) { xv = _mm256_broadcast_ss(x0 + i * K + k); \
            a##i##0 = _mm256_fmadd_ps(xv, w0, a##i##0); a##i##1 = _mm256_fmadd_ps(xv, w1, a##i##1); }
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
        }
        const __m256 S[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
        __m256 s0, s1, o0, o1;
        if (BITS == 16) {
            const float* d = ksc_buf + g * 32;
            s0 = _mm256_load_ps(d), s1 = _mm256_load_ps(d + 8);
            o0 = _mm256_load_ps(d + 16), o1 = _mm256_load_ps(d + 24);
        } else expand(W, K, pd, g, &s0, &s1, &o0, &o1);
        for (int i = 0; i < MT; i++) {
            const __m256 xg = _mm256_set1_ps(xgroup(X, XB, i, g, xs));
            acc[i][0] = _mm256_fmadd_ps(o0, xg, _mm256_fmadd_ps(s0, S[i][0], acc[i][0]));
            acc[i][1] = _mm256_fmadd_ps(o1, xg, _mm256_fmadd_ps(s1, S[i][1], acc[i][1]));
        }
    }
    float out[16];
    for (int i = 0; i < MT; i++) {
        _mm256_storeu_ps(out, acc[i][0]), _mm256_storeu_ps(out + 8, acc[i][1]);
        store16(out, b, y, yf, N, m0 + i, p * 16);
    }
}
#define KTILE(MT, BITS) static void k##MT##_##BITS(const void* x, long K, const Packed* W, const uint16_t* wide, \
        const uint16_t* b, uint16_t* y, float* yf, long N, long m, long p, const char* pf, long l0, long l1) { \
        (void)l0; (void)l1; ktile((const float*)x, K, W, wide, b, y, yf, N, m, p, pf, MT, BITS); }
#define KTILES(BITS) KTILE(1, BITS) KTILE(2, BITS) KTILE(3, BITS) KTILE(4, BITS) KTILE(5, BITS) KTILE(6, BITS)
KTILES(4) KTILES(5) KTILES(6) KTILES(16)
#define ROWS(t, B) {0, t##1_##B, t##2_##B, t##3_##B, t##4_##B, t##5_##B, t##6_##B}
static const tile_fn tiles[NFMT][7] = {ROWS(t, 16), ROWS(t, 8), ROWS(t, 4), ROWS(t, 5), ROWS(t, 6),
                                       ROWS(k, 4), ROWS(k, 5), ROWS(k, 6), ROWS(k, 16)};
#undef ROWS
#define FMA_HALVES 0  /* panels of 16: the products' panel counts are even */
#define FMA_PANEL 16
#define FMA_SPREAD 0  /* the first tile prefetches the whole next panel */
