/* bf16 <-> fp32: widening loads, torch's round-to-nearest-even, one fixed horizontal sum */
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline __m256 load_bf16(const uint16_t* p) {  /* 8 bf16 -> 8 fp32 (bf16 = the high half of fp32) */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#ifdef __AVX512F__
static inline __m512 load_bf16x16(const uint16_t* p) {  /* 16 bf16 -> 16 fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#endif
static inline float hsum(__m256 a) {  /* one fixed order for every output */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch's float -> bfloat16 */
    uint32_t u; __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* 8 fp32 -> 8 bf16 (in the low half of each 32-bit lane): to_bf16's arithmetic, lane by lane */
static inline __m256i round8(__m256 s) {
    const __m256i u = _mm256_castps_si256(s), one = _mm256_set1_epi32(1);
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fc0), nan);
}

static inline float rbf(float f) { uint16_t h = to_bf16(f); uint32_t u = (uint32_t)h << 16; float r; memcpy(&r, &u, 4); return r; }
static inline float fbf(uint16_t h) { uint32_t u = (uint32_t)h << 16; float r; memcpy(&r, &u, 4); return r; }

/* 8 x bf16 rounding, kept as fp32 (to_bf16 then widen; NaN stays NaN) */
static inline __m256 rbf8(__m256 f) {
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd),
                                 _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), f, _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
}
#ifdef __AVX512F__
/* rbf8 over 16 lanes: the same integer rounding lane for lane */
static inline __m512 rbf16v(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd),
                                 _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_castsi512_ps(r), f);
}
#endif
