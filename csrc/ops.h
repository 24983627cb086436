/* Row ops the fused pass and the draft step share: RMSNorm and a vector exp */
#pragma once
#include <math.h>
#include "bf16.h"

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
