/* The greedy choice over a target pass's logits (sampling.argmax) */
#include <math.h>
#include "bf16.h"
#include "nanospec.h"

static inline float sc_bf16(const uint16_t* p) { return fbf(*p); }
static inline __m256 ld_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline float sc_f32(const float* p) { return *p; }
/* torch.argmax's rule: the first index of the largest value, or of the first NaN where the row has one
   (-0 and +0 are equal) */
#define ROW(NAME, T, VL, SL) \
static long NAME(const T* r, long V) { \
    __m256 mx = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps(); long i = 0; \
    for (; i + 8 <= V; i += 8) { __m256 v = VL(r + i); mx = _mm256_max_ps(mx, v); un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); } \
    float b[8], m = -INFINITY; _mm256_storeu_ps(b, mx); \
    for (int j = 0; j < 8; j++) m = b[j] > m ? b[j] : m; \
    int nan = _mm256_movemask_ps(un) != 0; \
    for (long j = i; j < V; j++) { float v = SL(r + j); if (v != v) nan = 1; else if (v > m) m = v; } \
    __m256 mv = _mm256_set1_ps(m); \
    for (i = 0; i + 8 <= V; i += 8) { __m256 v = VL(r + i); \
        int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, mv, _CMP_EQ_OQ)); \
        if (hit) return i + __builtin_ctz(hit); } \
    for (; i < V; i++) { float v = SL(r + i); if (nan ? v != v : v == m) return i; } \
    return 0; \
}
ROW(row_bf16, uint16_t, load_bf16, sc_bf16)
ROW(row_f32, float, ld_f32, sc_f32)
/* out[m] = argmax of row m of x [M, V] (bf16 or fp32), rows over the threads */
void argmax_rows(const void* x, int bf16, long M, long V, int64_t* out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (M > 1)
    for (long m = 0; m < M; m++)
        out[m] = bf16 ? row_bf16((const uint16_t*)x + m * V, V) : row_f32((const float*)x + m * V, V);
}
