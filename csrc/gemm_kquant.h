/* The K-quants (Q4_K, Q5_K, Q6_K: a scale s and offset m per sub-block of 16 or 32 k, under each super-block's
   fp16 d) on the AVX-512 BF16 kernel, factorized. Per weight row and sub-block b: y += s_b S_b + c_b X_b, where S_b
   is one vdpbf16ps chain over the sub-block's k pairs of x times the codes as the bf16 values 128 + q (the bit
   pattern 0x4300 | q: one or two bitwise ops a vector, no conversion), X_b the sum of x over the sub-block (ksums,
   once per product) and c_b = m_b - 128 s_b (the weight is s_b q + m_b). No weight is rounded to bf16: the products
   are the dequantized matrix's values (the gguf package's) times x, in fp32, sub-block by sub-block. Row-invariant
   by construction: every output is the same chains and FMAs in the same order, whatever the tile or the row count.
   Why: widening each code to its bf16 weight took 8 vector ops per 32 weights (Q4_K; 11 for Q6_K), and a one-row
   pass of the 1.5B Q4_K_M model ran compute-bound at 0.62x llama.cpp's tokens/s on Zen 4. */
#pragma once

/* the codes' layout (quant.pack_planes, k): per panel and k pair, 32 bytes per vector pair (vector 2 h's value j in
   byte j's low nibble, vector 2 h + 1's in its high one; a vector: rows 16 v .. 16 v + 15's pairs) and, 5 and 6
   bits, 32 bytes of 2-bit high fields (vector v's value j at bits 2 v of byte j) */
/* the sums of x (bf16 pairs, K2 a row) over each 16 k of each row, in fp32, in one fixed order */
static void ksums(const uint32_t* x, long M, long K2) {
    const long NB = K2 / 8;
    room(&xsum_buf, &xsum_cap, M * NB);
    for (long m = 0; m < M; m++)
        for (long j = 0; j < NB; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(x + m * K2 + 8 * j));
            const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
            xsum_buf[m * NB + j] = _mm512_reduce_add_ps(f);
        }
}

/* vector v of k pair k from a panel's codes q (and high fields hp): the bf16 values 128 + code */
static inline __attribute__((always_inline)) __m512bh kcodes(const uint8_t* q, const uint8_t* hp, long k, int v,
                                                              const int BITS) {
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + k * 64 + (v >> 1) * 32)));
    const __m512i magic = _mm512_set1_epi16(0x4300);
    __m512i w = v & 1 ? _mm512_or_si512(_mm512_srli_epi16(c, 4), magic)
                      : _mm512_ternarylogic_epi32(c, _mm512_set1_epi16(15), magic, 0xEA);  /* (c & 15) | magic */
    if (BITS != 4) {  /* vector v's 2-bit field to bits 4-5, merged: w | (h & 0x30) */
        __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(hp + k * 32)));
        h = v == 0 ? _mm512_slli_epi16(h, 4) : v == 1 ? _mm512_slli_epi16(h, 2) : v == 3 ? _mm512_srli_epi16(h, 2) : h;
        w = _mm512_ternarylogic_epi32(w, h, _mm512_set1_epi16(0x30), 0xF8);
    }
    return (__m512bh)w;
}

/* MT rows of x times panel p of K-quant part W (BITS 4, or 6 for 5 and 6 bits), each tile decoding the codes
   itself (tiled() widens no K-quant panel on this kernel). Few rows, the panel's 4 vectors at once (4 chains for
   the latency); more, one half of it at a time (2 x MT chains and as many accumulators in registers). Each
   output's chains and FMAs are the same either way. */
static inline __attribute__((always_inline)) void ktile(const uint32_t* x, long K2, const Packed* W,
        const uint16_t* wide, const uint16_t* b, uint16_t* y, float* yf, long N, long m0, long p, const char* pf,
        long l0, long l1, const int MT, const int BITS) {
    /* 3-4 rows: the whole panel too (1.2-1.4x a half at a time, Zen 4) */
    (void)wide;
    const int HV = MT <= 4 ? 4 : 2;
    const long pd = p - W->p0, K = 2 * K2, GK = W->group / 2, NG = K2 / GK, XB = K / 16, xs = W->group / 16;
    const uint8_t* q = (const uint8_t*)W->w + pd * 64 * K2;
    const uint8_t* hp = BITS == 6 ? W->h + pd * 32 * K2 : 0;
    const uint32_t* x0 = x + m0 * K2;
    const float* X = xsum_buf + m0 * XB;
    long due = 0, l = l0;
    float out[16];
    for (int hf = 0; hf < 4 / HV; hf++) {
        __m512 acc[6][4];
        for (int i = 0; i < MT; i++) for (int v = 0; v < HV; v++) acc[i][v] = _mm512_setzero_ps();
        for (long g = 0; g < NG; g++) {
            __m512 S[6][4];
            for (int i = 0; i < MT; i++) for (int v = 0; v < HV; v++) S[i][v] = _mm512_setzero_ps();
            for (long k = g * GK; k < (g + 1) * GK; k++) {
                if (pf && hf == 0)  /* this tile's share of the next panel (as tile()) */
                    for (due += l1 - l0; due >= K2; due -= K2, l++) _mm_prefetch(pf + l * 64, _MM_HINT_T0);
                __m512bh wv[4];
                for (int v = 0; v < HV; v++) wv[v] = kcodes(q, hp, k, hf * HV + v, BITS);
                for (int i = 0; i < MT; i++) {
                    const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x0[i * K2 + k]);
                    for (int v = 0; v < HV; v++) S[i][v] = _mm512_dpbf16_ps(S[i][v], xb, wv[v]);
                }
            }
            for (int v = 0; v < HV; v++) {
                __m512 s, m;
                group_sm(W, K, pd, g, 16 * (hf * HV + v), &s, &m);
                const __m512 c = _mm512_fmadd_ps(s, _mm512_set1_ps(-128.f), m);
                for (int i = 0; i < MT; i++) {
                    const float xg = xs == 2 ? X[i * XB + 2 * g] + X[i * XB + 2 * g + 1] : X[i * XB + g];
                    acc[i][v] = _mm512_fmadd_ps(c, _mm512_set1_ps(xg), _mm512_fmadd_ps(s, S[i][v], acc[i][v]));
                }
            }
        }
        for (int i = 0; i < MT; i++) for (int v = 0; v < HV; v++) {
            _mm512_storeu_ps(out, acc[i][v]);
            store16(out, b, y, yf, N, m0 + i, (p * 4 + hf * HV + v) * 16);
        }
    }
}
#define KTILE(MT, BITS) static void k##MT##_##BITS(const void* x, long K2, const Packed* W, const uint16_t* wide, \
        const uint16_t* b, uint16_t* y, float* yf, long N, long m, long p, const char* pf, long l0, long l1) { \
        ktile((const uint32_t*)x, K2, W, wide, b, y, yf, N, m, p, pf, l0, l1, MT, BITS); }
#define KTILES(BITS) KTILE(1, BITS) KTILE(2, BITS) KTILE(3, BITS) KTILE(4, BITS) KTILE(5, BITS) KTILE(6, BITS)
KTILES(4) KTILES(6)
