/* The draft models' GEMM (AVX-512 VNNI builds): 4-bit weights times activations quantized to int8 per block of 32
   k, integer dot products (vpdpbusd: 64 multiply-adds an instruction, no widening), one scale and offset per
   32-weight block (fp16). Not the bf16 GEMM's bits: a draft only proposes, the target's exact pass decides, so
   the output stays lossless (draft_model.py). Measured on Zen 4, one thread, Q4_K 1024 x 1536 in L2: 16 G weights/s
   with the exact kernel (9 vector ops per 32 weights to widen), 55 G with this one; 17 against 33 from memory. */
#pragma once
#include <math.h>

/* Packed.fast layout (quant.fast_layout): per panel of 64 rows, per quad of k, 128 bytes: byte i < 64 holds
   row i / 4's code of k = 4 quad + i % 4 (low nibble) and row 16 + i / 4's (high nibble), byte 64 + i rows 32 +
   i / 4 and 48 + i / 4; s and m fp16 [panels][K / 32][64]: the weight is code * s + m */

static __thread int8_t* fq_buf;  /* each thread's quantized rows and their block scales (gemm_fast) */
static __thread float* fs_buf;
static __thread long fq_cap;

/* x row-major [M, K] (fp32, or bf16 where xf is 0) -> xq int8 [M, K], per 32-block dx (scale) and sx (dx * sum) */
static void quantize_rows(const float* xf, const uint16_t* xb, long M, long K, int8_t* xq, float* dx, float* sx) {
    for (long r = 0; r < M; r++)
        for (long b = 0; b < K / 32; b++) {
            float v[32], amax = 0.f;
            for (int j = 0; j < 32; j++) {
                v[j] = xf ? xf[r * K + b * 32 + j] : fbf(xb[r * K + b * 32 + j]);
                amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
            }
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                const int q = (int)lrintf(v[j] * id);
                xq[r * K + b * 32 + j] = (int8_t)q;
                sum += q;
            }
            dx[r * (K / 32) + b] = d, sx[r * (K / 32) + b] = d * (float)sum;
        }
}

/* rows m0 .. m0 + MT of the quantized x times panel p of part W (64 outputs) */
static inline __attribute__((always_inline)) void fast_tile(const int8_t* xq, const float* dx, const float* sx, long K,
        const Packed* W, const uint16_t* b, uint16_t* y, float* yf, long N, long m0, long p, const int MT) {
    const long pd = p - W->p0, NB = K / 32;
    const uint8_t* c = (const uint8_t*)W->w + pd * 64 * K / 2;
    const uint16_t *sp = W->s + pd * NB * 64, *mp = W->m + pd * NB * 64;
    const __m512i lo = _mm512_set1_epi8(15);
    __m512 fa[2][4];
    for (int r = 0; r < MT; r++) for (int v = 0; v < 4; v++) fa[r][v] = _mm512_setzero_ps();
    for (long blk = 0; blk < NB; blk++) {
        __m512i ai[2][4];
        for (int r = 0; r < MT; r++) for (int v = 0; v < 4; v++) ai[r][v] = _mm512_setzero_si512();
        for (int qd = 0; qd < 8; qd++) {
            const __m512i v0 = _mm512_loadu_si512(c + (blk * 8 + qd) * 128), v1 = _mm512_loadu_si512(c + (blk * 8 + qd) * 128 + 64);
            const __m512i w[4] = {_mm512_and_si512(v0, lo), _mm512_and_si512(_mm512_srli_epi16(v0, 4), lo),
                                  _mm512_and_si512(v1, lo), _mm512_and_si512(_mm512_srli_epi16(v1, 4), lo)};
            for (int r = 0; r < MT; r++) {
                const __m512i xv = _mm512_set1_epi32(*(const int*)(xq + (m0 + r) * K + blk * 32 + qd * 4));
                for (int v = 0; v < 4; v++) ai[r][v] = _mm512_dpbusd_epi32(ai[r][v], w[v], xv);
            }
        }
        for (int v = 0; v < 4; v++) {
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + blk * 64 + 16 * v)));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mp + blk * 64 + 16 * v)));
            for (int r = 0; r < MT; r++) {
                const long i = (m0 + r) * NB + blk;
                fa[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r][v]), _mm512_mul_ps(s, _mm512_set1_ps(dx[i])), fa[r][v]);
                fa[r][v] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), fa[r][v]);
            }
        }
    }
    float out[16];
    for (int r = 0; r < MT; r++) for (int v = 0; v < 4; v++) {
        _mm512_storeu_ps(out, fa[r][v]);
        store16(out, b, y, yf, N, m0 + r, p * 64 + v * 16);
    }
}

/* y[M, N] = x[M, K] @ W^T (+ b) for W in the fast layout (every part of a chain), x fp32 (xf) or bf16 (xb):
   work-shared over the enclosing parallel region's threads (each quantizes x itself: no barrier before), ending in
   a barrier, as tiled() */
static void gemm_fast(const float* xf, const uint16_t* xb, long M, long K, const Packed* W, const uint16_t* b, long N,
                      uint16_t* y, float* yf) {
    if (fq_cap < M * K) {
        free(fq_buf);
        free(fs_buf);
        fq_cap = M * K;
        fq_buf = malloc(fq_cap);
        fs_buf = malloc(sizeof(float) * 2 * (fq_cap / 32 + 1));
    }
    float *dx = fs_buf, *sx = fs_buf + M * (K / 32);
    quantize_rows(xf, xb, M, K, fq_buf, dx, sx);
    const long NP = (N + 63) / 64, NR = (M + 1) / 2, NI = NP * NR;
    const long nth = omp_get_num_threads(), me = omp_get_thread_num();
    for (long i = NI * me / nth; i < NI * (me + 1) / nth; i++) {
        /* a panel's row pairs in turn, so it comes from memory once (each thread's run of panels whole: row pairs
           outermost had every thread stream the whole matrix; the 0.5B draft's layers, 4 rows, Zen 4: 21 to 15 ms) */
        const long p = i / NR, m0 = i % NR * 2;
        const Packed* Wp = part_of(W, p);
        if (M - m0 >= 2) fast_tile(fq_buf, dx, sx, K, Wp, b, y, yf, N, m0, p, 2);
        else fast_tile(fq_buf, dx, sx, K, Wp, b, y, yf, N, m0, p, 1);
    }
    #pragma omp barrier
}
