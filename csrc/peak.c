/* The machine's multiply-add peak with the kernel's own instruction (bench_ar.py --profile's arithmetic floor):
   vdpbf16ps where the build has AVX-512 BF16, else a 16- or 8-lane fp32 FMA */
#include <immintrin.h>
#include <omp.h>
#include "nanospec.h"
/* iters rounds of 24 independent chains per thread (enough to hide the instruction's latency), no memory
   traffic; returns GFLOP/s over `threads` threads (FLOPS per instruction: 2 per lane and product) */
double peak_gflops(long iters, int threads) {
    double t0 = omp_get_wtime(), sink = 0;
    #pragma omp parallel num_threads(threads) reduction(+:sink)
    {
#if defined(__AVX512BF16__)
        typedef __m512 vec;
        const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3c00);  /* bf16 2^-7 */
#define STEP(a) a = _mm512_dpbf16_ps(a, x, x)
#define FLOPS 64
#elif defined(__AVX512F__)
        typedef __m512 vec;
        const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-4f);
#define STEP(a) a = _mm512_fmadd_ps(a, x, y)
#define FLOPS 32
#else
        typedef __m256 vec;
        const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-4f);
#define STEP(a) a = _mm256_fmadd_ps(a, x, y)
#define FLOPS 16
#endif
        vec a[24];
        for (int i = 0; i < 24; i++) __builtin_memset(&a[i], 0, sizeof(vec));
        for (long it = 0; it < iters; it++) {
            #pragma GCC unroll 24
            for (int i = 0; i < 24; i++) STEP(a[i]);
        }
        for (int i = 0; i < 24; i++) { float f; __builtin_memcpy(&f, &a[i], 4); sink += f; }
    }
    double t = omp_get_wtime() - t0;
    return sink == -1.0 ? 0 : (double)iters * 24 * FLOPS * threads / t / 1e9;  /* (sink: keep the chains) */
}
