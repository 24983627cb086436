/* The fused CPU pass (cpu_forward.py): every decoder layer of a batch-1 bf16 pass in one call */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "gemm.h"
#include "nanospec.h"
#include "ops.h"

/* NANOSPEC_PHASES (cpu_forward.timed(): bench_ar.py --profile): thread 0 adds the wall time since the last barrier of
   the pass to its kind's total at each barrier, so the kinds add up to the pass (each one's waits included) */
enum { PH_GEMM, PH_ATTN, PH_NORM, PH_ROPE, PH_SILU, PH_RESID, PH_SETUP, PH_N };
#ifdef NANOSPEC_PHASES
static double PHT[PH_N], ph_last;
#define PH(c) do { if (omp_get_thread_num() == 0) { double t_ = omp_get_wtime(); PHT[c] += t_ - ph_last; ph_last = t_; } } while (0)
void phase_times(double* out) { for (int i = 0; i < PH_N; i++) { out[i] = PHT[i]; PHT[i] = 0; } }
#else
#define PH(c) do { } while (0)
#endif

/* x [n_heads, hd] in place: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), as model.apply_rope */
static void rope(float* x, long n_heads, long hd, const uint16_t* cs, const uint16_t* sn) {
    long h2 = hd / 2;
    float tmp[512];
    for (long h = 0; h < n_heads; h++) {
        float* r = x + h * hd;
        for (long d = 0; d < hd; d++) {
            float rot = d < h2 ? -r[d + h2] : r[d - h2];
            tmp[d] = rbf(rbf(r[d] * fbf(cs[d])) + rbf(rot * fbf(sn[d])));
        }
        memcpy(r, tmp, hd * sizeof(float));
    }
}

/* The scores of MK keys for G queries (heads sharing one KV head): each (query, key) dot product is its own chain
   over hd in order, then a fixed reduction, whatever G and MK are. Several keys and heads at once only hide the
   latency and widen each bf16 key chunk once for all G heads. One body for both builds (QT, V, P: the query's
   element, vector type and intrinsics' prefix; KV, STEP, KLOAD, QLOAD: a chunk of STEP head dimensions of a key
   and of a query; MAC(acc, q, k): the chain's step; SUM: the reduction):
   - dots: one FMA chain, then hsum;
   - dots512 (the AVX-512 BF16 build, hd % 32 == 0): one vdpbf16ps chain over the pairs (q is bf16-exact: RoPE
     rounds it to bf16), 32 multiply-adds per instruction against 8 per AVX2 FMA. */
#define DOTS_FN(NAME, QT, V, P, KV, STEP, KLOAD, QLOAD, MAC, SUM) \
static inline __attribute__((always_inline)) void NAME(const QT* const* q, const uint16_t* K, const int* ks, \
        long hd, float scale, float* const* s, long j0, const int G, const int MK) { \
    V acc[4][4]; \
    const uint16_t* kr[4]; \
    for (int i = 0; i < MK; i++) kr[i] = K + (long)ks[j0 + i] * hd; \
    for (int h = 0; h < G; h++) for (int i = 0; i < MK; i++) acc[h][i] = P##_setzero_ps(); \
    for (long c = 0; c < hd; c += STEP) { \
        KV kv[4]; \
        for (int i = 0; i < MK; i++) kv[i] = KLOAD(kr[i] + c); \
        for (int h = 0; h < G; h++) { \
            KV qv = QLOAD(q[h], c); \
            for (int i = 0; i < MK; i++) acc[h][i] = MAC(acc[h][i], qv, kv[i]); \
        } \
    } \
    for (int h = 0; h < G; h++) for (int i = 0; i < MK; i++) s[h][j0 + i] = SUM(acc[h][i]) * scale; \
}
static inline __m256 q8(const float* q, long c) { return _mm256_loadu_ps(q + c); }
static inline __m256 fma8(__m256 acc, __m256 q, __m256 k) { return _mm256_fmadd_ps(q, k, acc); }
DOTS_FN(dots, float, __m256, _mm256, __m256, 8, load_bf16, q8, fma8, hsum)
#ifdef __AVX512BF16__
static inline __m512bh k32(const uint16_t* k) { return (__m512bh)_mm512_loadu_si512(k); }
static inline __m512bh q32(const uint32_t* q, long c) { return (__m512bh)_mm512_loadu_si512(q + c / 2); }
DOTS_FN(dots512, uint32_t, __m512, _mm512, __m512bh, 32, k32, q32, _mm512_dpbf16_ps, _mm512_reduce_add_ps)
#endif

/* o[h][c0 .. c0 + CB * LANES) = sum over keys j (in order) of p[h][j] * V[ks[j]][c] for G heads: one FMA per key
   into each accumulator, in key order, whatever G and CB are. One body for both widths (V: the vector type, P: the
   intrinsics' prefix, LOAD: LANES bf16 -> fp32); pv512 needs hd % 16 == 0. */
#define PV_FN(NAME, V, P, LANES, LOAD) \
static inline __attribute__((always_inline)) void NAME(const float* const* p, const uint16_t* Vc, const int* ks, long n, \
        long hd, long c0, float* const* out, const int G, const int CB) { \
    V o[4][4]; \
    for (int h = 0; h < G; h++) for (int c = 0; c < CB; c++) o[h][c] = P##_setzero_ps(); \
    for (long j = 0; j < n; j++) { \
        const uint16_t* vr = Vc + (long)ks[j] * hd + c0; \
        V v[4]; \
        for (int c = 0; c < CB; c++) v[c] = LOAD(vr + LANES * c); \
        for (int h = 0; h < G; h++) { \
            V pj = P##_set1_ps(p[h][j]); \
            for (int c = 0; c < CB; c++) o[h][c] = P##_fmadd_ps(pj, v[c], o[h][c]); \
        } \
    } \
    for (int h = 0; h < G; h++) for (int c = 0; c < CB; c++) P##_storeu_ps(out[h] + c0 + LANES * c, o[h][c]); \
}
PV_FN(pv, __m256, _mm256, 8, load_bf16)
#ifdef __AVX512F__
PV_FN(pv512, __m512, _mm512, 16, load_bf16x16)
#endif

#ifdef __AVX512F__
/* The scores with the keys in the lanes (kt: the cache's transposed keys of one KV head, [slot / 16][hd / 2][16]:
   16 slots' pairs side by side, written with each key): per (query, slot) one chain over the head dimension in
   order in that slot's lane, times the scale, into sl[h][slot] for slot blocks b0 .. b0 + MB. No horizontal sum
   per score (a 16-lane reduction per key, whose shuffles bound attention). A lane's chain is the same in any
   block and pass: row-invariant. The AVX-512 BF16 build chains vdpbf16ps over the pairs (q is bf16-exact: RoPE
   rounds it to bf16); the AVX-512F build widens each pair to two fp32 keys (a shift, a mask) and chains FMAs
   over d, so it holds fewer blocks in registers (LANES_MB). */
#ifdef __AVX512BF16__
#define LANES_MB 4
#else
#define LANES_MB 2
#endif
static inline __attribute__((always_inline)) void lanes512(const uint32_t* const* qb, const float* const* qf,
        const uint32_t* kt, long hd, float scale, float* const* sl, long b0, long wb, const int G, const int MB) {
    __m512 acc[6][LANES_MB];
    const long H2 = hd / 2;
    for (int h = 0; h < G; h++) for (int i = 0; i < MB; i++) acc[h][i] = _mm512_setzero_ps();
    for (long d = 0; d < H2; d++) {
#ifdef __AVX512BF16__
        __m512bh kv[LANES_MB];
        for (int i = 0; i < MB; i++) kv[i] = (__m512bh)_mm512_loadu_si512(kt + ((b0 + i) * H2 + d) * 16);
        for (int h = 0; h < G; h++) {
            __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qb[h][d]);
            for (int i = 0; i < MB; i++) acc[h][i] = _mm512_dpbf16_ps(acc[h][i], qv, kv[i]);
        }
#else
        __m512 k0[LANES_MB], k1[LANES_MB];
        for (int i = 0; i < MB; i++) {
            __m512i u = _mm512_loadu_si512(kt + ((b0 + i) * H2 + d) * 16);
            k0[i] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
            k1[i] = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
        }
        for (int h = 0; h < G; h++) {
            /* q's two values already widened in memory (qf): each broadcast is a load, where widening it here
               took four shuffle-port instructions per query and pair, as many as its FMAs (attention of a
               16-row pass ran at half the FMA rate, measured on an Ice Lake Xeon) */
            __m512 q0 = _mm512_set1_ps(qf[h][2 * d]), q1 = _mm512_set1_ps(qf[h][2 * d + 1]);
            for (int i = 0; i < MB; i++) acc[h][i] = _mm512_fmadd_ps(q1, k1[i], _mm512_fmadd_ps(q0, k0[i], acc[h][i]));
        }
#endif
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int h = 0; h < G; h++)  /* block b's scores at sl[h] + (b - wb) * 16 */
        for (int i = 0; i < MB; i++) _mm512_storeu_ps(sl[h] + (b0 - wb + i) * 16, _mm512_mul_ps(acc[h][i], sc));
}

#endif

/* one query's scores sh[0 .. n) -> exp(s - max) in place (padded to a multiple of 8 with 0); returns 1 / their sum */
static inline __attribute__((always_inline)) float softmax_row(float* sh, long n) {
    long j;
    for (j = n; j < ((n + 7) & ~7L); j++) sh[j] = -INFINITY;  /* pad the last vector: exp gives 0 there */
    /* the max 8 lanes at a time: as exact as one at a time (a max rounds nothing; a NaN score is skipped as
       the scalar compare skipped it, and a +0 or -0 maximum gives every s - m the same value); the scalar
       loop's carried dependency had cost a sixth of attention's time at 1,200 keys */
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (j = 0; j < n; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sh + j), mv);  /* (x, m): m where x is NaN */
    mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0x4e));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0xb1));
    __m256 sum8 = _mm256_setzero_ps();
    j = 0;
#ifdef __AVX512F__
    for (const __m512 m16 = _mm512_broadcastss_ps(_mm256_castps256_ps128(mv)); j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + j), m16));  /* two 8-lane steps of the sum below */
        _mm512_storeu_ps(sh + j, e);
        sum8 = _mm256_add_ps(_mm256_add_ps(sum8, _mm512_castps512_ps256(e)), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
#endif
    for (; j < n; j += 8) {  /* the sum: 8 lanes in key order, then the fixed hsum */
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), mv));
        _mm256_storeu_ps(sh + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    return n ? 1.f / hsum(sum8) : 0.f;
}

/* G (<= 4) heads sharing one KV head, one row: softmax(q K^T * scale) V over the keys ks[0..n) (cache slots,
   increasing), fp32; s: G scratch rows of n + 8. Passes with the transposed keys take attend_rows instead. */
static inline __attribute__((always_inline)) void attend_g(const float* const* q, const uint16_t* K, const uint16_t* V,
        const int* ks, long n, long hd, float scale, float* const* s, float* const* out, const int G) {
    long j = 0;
#ifdef __AVX512BF16__
    const int wide = hd % 32 == 0;
    if (wide) {
        uint32_t qbuf[4][128];  /* each head's q as bf16 pairs (hd <= 256) */
        const uint32_t* qb[4];
        for (int h = 0; h < G; h++) {
            for (long d = 0; d < hd; d += 2) qbuf[h][d / 2] = (uint32_t)to_bf16(q[h][d]) | (uint32_t)to_bf16(q[h][d + 1]) << 16;
            qb[h] = qbuf[h];
        }
        for (; j + 4 <= n; j += 4) dots512(qb, K, ks, hd, scale, s, j, G, 4);
        for (; j < n; j++) dots512(qb, K, ks, hd, scale, s, j, G, 1);
    }
#else
    const int wide = 0;
#endif
    if (!wide) {
        for (; j + 4 <= n; j += 4) dots(q, K, ks, hd, scale, s, j, G, 4);
        for (; j < n; j++) dots(q, K, ks, hd, scale, s, j, G, 1);
    }
    float inv[4];
    for (int h = 0; h < G; h++) inv[h] = softmax_row(s[h], n);
    const float* const* p = (const float* const*)s;
    long c0 = 0;
#ifdef __AVX512BF16__
    if (wide) {
        if (G <= 3) for (; c0 + 64 <= hd; c0 += 64) pv512(p, V, ks, n, hd, c0, out, G, 4);
        for (; c0 + 32 <= hd; c0 += 32) pv512(p, V, ks, n, hd, c0, out, G, 2);
    }
#endif
    if (G <= 3) for (; c0 + 32 <= hd; c0 += 32) pv(p, V, ks, n, hd, c0, out, G, 4);
    for (; c0 + 16 <= hd; c0 += 16) pv(p, V, ks, n, hd, c0, out, G, 2);
    for (; c0 < hd; c0 += 8) pv(p, V, ks, n, hd, c0, out, G, 1);
    for (int h = 0; h < G; h++) {
        __m256 iv = _mm256_set1_ps(inv[h]);
        for (long c = 0; c < hd; c += 8) _mm256_storeu_ps(out[h] + c, _mm256_mul_ps(_mm256_loadu_ps(out[h] + c), iv));
    }
}

static void attend(const float* const* q, const uint16_t* K, const uint16_t* V, const int* ks, long n,
                   long hd, float scale, float* const* s, float* const* out, int G) {
    switch (G) {
        case 1: attend_g(q, K, V, ks, n, hd, scale, s, out, 1); break;
        case 2: attend_g(q, K, V, ks, n, hd, scale, s, out, 2); break;
        case 3: attend_g(q, K, V, ks, n, hd, scale, s, out, 3); break;
        default: attend_g(q, K, V, ks, n, hd, scale, s, out, 4); break;
    }
}


#ifdef __AVX512F__
/* o[i][c0 .. c0 + 16 CB) = sum over query i's keys j (in key order) of p[i][j] * V[ks[i][j]][c] for NQ queries
   of one KV head: their common leading run of slots r0 .. r0 + m - 1 first, one load and widening of each value row
   for all of them, then each query's own rest. Every accumulator is one FMA chain over its query's keys in
   order, as pv512's: the same bits however the queries are grouped. A value row's 32 values at a time are
   one load, its low halves shifted up (the even columns) and its masked high halves (the odd ones) two fp32
   vectors, so o[i][2u] holds columns 32u + 0, 2, .., 30 and o[i][2u + 1] the odd ones, put back in order at
   the store (a 16-value widening load and a shift per vector had cost as many shuffle-port instructions as
   FMAs: measured on an Ice Lake Xeon). CB (2 or 4) vectors: 32 or 64 columns. */
static inline __m512 lo_bf16x16(__m512i u) { return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)); }
static inline __m512 hi_bf16x16(__m512i u) { return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u))); }
static inline __attribute__((always_inline)) void pv_rows(const float* const* p, const uint16_t* V,
        const int* const* ks, const long* n, long r0, long m, long hd, long c0, float* const* out, const int NQ,
        const int CB) {
    __m512 o[6][4];
    for (int i = 0; i < NQ; i++) for (int c = 0; c < CB; c++) o[i][c] = _mm512_setzero_ps();
    for (long j = 0; j < m; j++) {  /* key j is slot r0 + j for every query here */
        const uint16_t* vr = V + (r0 + j) * hd + c0;
        __m512 v[4];
        for (int u = 0; u < CB / 2; u++) {
            const __m512i w = _mm512_loadu_si512(vr + 32 * u);
            v[2 * u] = lo_bf16x16(w);
            v[2 * u + 1] = hi_bf16x16(w);
        }
        for (int i = 0; i < NQ; i++) {
            __m512 pj = _mm512_set1_ps(p[i][j]);
            for (int c = 0; c < CB; c++) o[i][c] = _mm512_fmadd_ps(pj, v[c], o[i][c]);
        }
    }
    for (int i = 0; i < NQ; i++)
        for (long j = m; j < n[i]; j++) {
            const uint16_t* vr = V + (long)ks[i][j] * hd + c0;
            __m512 pj = _mm512_set1_ps(p[i][j]);
            for (int u = 0; u < CB / 2; u++) {
                const __m512i w = _mm512_loadu_si512(vr + 32 * u);
                o[i][2 * u] = _mm512_fmadd_ps(pj, lo_bf16x16(w), o[i][2 * u]);
                o[i][2 * u + 1] = _mm512_fmadd_ps(pj, hi_bf16x16(w), o[i][2 * u + 1]);
            }
        }
    /* lane l of the 16 columns from 32u (+ 16): the even vector's lane l / 2 (+ 8) or the odd one's (index + 16) */
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int i = 0; i < NQ; i++)
        for (int u = 0; u < CB / 2; u++) {
            _mm512_storeu_ps(out[i] + c0 + 32 * u, _mm512_permutex2var_ps(o[i][2 * u], first, o[i][2 * u + 1]));
            _mm512_storeu_ps(out[i] + c0 + 32 * u + 16, _mm512_permutex2var_ps(o[i][2 * u], second, o[i][2 * u + 1]));
        }
}

/* attend_g's transposed-key path for NQ (<= 6) queries of one KV head that may come from different rows of
   the pass (a few rows' heads): query i has its own keys ks[i][0 .. n[i]) and leading run pre[i]. The rows
   share the loads of what they share: every query scores every 16-slot block from the first to the last one
   any of them needs (a block's scores that a query's mask does not allow are dropped, as attend_g drops
   them), and the value rows of their common leading run of consecutive slots (pv_rows; a batch's sequence
   reads its own range, its run starting at the range's first slot). Each score is still its own chain in its lane (lanes512)
   and each output its own FMA chain over its query's keys in order: the bits of one row alone. Why: a tree's
   rows all read the same context; one row at a time, a 16-row verification at 750 keys spent 2.7 ms in
   attention against 0.85 ms for one row (Zen 5), its value widening and key loads repeated per row. */
static void attend_rows(const float* const* q, const uint16_t* V, const int* const* ks, const long* n,
                        const long* pre, long hd, float scale, float* const* s, float* const* out,
                        const uint32_t* kt, float* const* sl, const int NQ) {
    uint32_t qbuf[6][128];  /* each query as bf16 pairs (hd <= 256) */
    float qwide[6][256];  /* the same values widened to fp32 (the AVX-512F scores' broadcasts) */
    const uint32_t* qb[6];
    const float* qf[6];
    long nbmax = 0, m = pre[0], bfirst = -1;
    for (int i = 0; i < NQ; i++) {
        for (long d = 0; d < hd; d += 2) qbuf[i][d / 2] = (uint32_t)to_bf16(q[i][d]) | (uint32_t)to_bf16(q[i][d + 1]) << 16;
#ifndef __AVX512BF16__  /* (the BF16 build's scores read the pairs) */
        for (long d = 0; d < hd; d++) qwide[i][d] = rbf(q[i][d]);
#endif
        qb[i] = qbuf[i];
        qf[i] = qwide[i];
        const long nb = n[i] ? ((long)ks[i][n[i] - 1] >> 4) + 1 : 0;
        nbmax = nb > nbmax ? nb : nbmax;
        m = pre[i] < m ? pre[i] : m;
        if (n[i] && (bfirst < 0 || (ks[i][0] >> 4) < bfirst)) bfirst = ks[i][0] >> 4;
    }
    /* the common run starts at the same slot r0 for every query (a 16-slot block edge: its scores go straight
       to s), else there is none */
    long r0 = n[0] ? ks[0][0] : 0;
    for (int i = 0; i < NQ; i++) if (!n[i] || ks[i][0] != r0) m = 0;
    if (r0 % 16) m = 0;
    if (!m) r0 = 0;
    const long pb = (r0 + m) >> 4;
    long b = r0 >> 4;
    switch (NQ) {  /* (constant query counts: the accumulators stay in registers) */
#define LANES(NQC) \
        case NQC: \
            for (; b + LANES_MB <= pb; b += LANES_MB) lanes512(qb, qf, kt, hd, scale, s, b, r0 >> 4, NQC, LANES_MB); \
            for (; b < pb; b++) lanes512(qb, qf, kt, hd, scale, s, b, r0 >> 4, NQC, 1); \
            b = b > bfirst ? b : bfirst; \
            for (; b + LANES_MB <= nbmax; b += LANES_MB) lanes512(qb, qf, kt, hd, scale, sl, b, 0, NQC, LANES_MB); \
            for (; b < nbmax; b++) lanes512(qb, qf, kt, hd, scale, sl, b, 0, NQC, 1); \
            break;
        LANES(1) LANES(2) LANES(3) LANES(4) LANES(5) LANES(6)
#undef LANES
    }
    float inv[6];
    for (int i = 0; i < NQ; i++) {
        for (long j = m >> 4 << 4; j < n[i]; j++) s[i][j] = sl[i][ks[i][j]];
        inv[i] = softmax_row(s[i], n[i]);
    }
    const float* const* p = (const float* const*)s;
    long c0 = 0;
    switch (NQ) {
#define PV(NQC) \
        case NQC: \
            for (; c0 + 64 <= hd; c0 += 64) pv_rows(p, V, ks, n, r0, m, hd, c0, out, NQC, 4); \
            for (; c0 < hd; c0 += 32) pv_rows(p, V, ks, n, r0, m, hd, c0, out, NQC, 2); \
            break;
        PV(1) PV(2) PV(3) PV(4) PV(5) PV(6)
#undef PV
    }
    for (int i = 0; i < NQ; i++) {
        __m256 iv = _mm256_set1_ps(inv[i]);
        for (long c = 0; c < hd; c += 8) _mm256_storeu_ps(out[i] + c, _mm256_mul_ps(_mm256_loadu_ps(out[i] + c), iv));
    }
}
#endif


/* h[t, i] = bf16(bf16(silu(g)) * u) for gu [T, gate | up], as F.silu(gate) * up in bf16; I % 8 == 0. Shared
   over the threads by blocks of 64 elements, not by rows (one row had left a thread idle), 16 lanes at a time in
   the AVX-512 build (exp16 is exp8 lane for lane; the division and products are the same IEEE operations) */
static inline __m256 silu8(__m256 gt, __m256 up) {
    __m256 sl = _mm256_div_ps(gt, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gt))));
    return rbf8(_mm256_mul_ps(rbf8(sl), up));
}
static void silu_mul(const float* gu, float* h, long T, long I) {
    const long nb = (I + 63) / 64;
    #pragma omp for schedule(static)
    for (long q = 0; q < T * nb; q++) {
        const long t = q / nb, i1 = (q % nb + 1) * 64 < I ? (q % nb + 1) * 64 : I;
        const float *g = gu + t * 2 * I, *u = g + I;
        float* o = h + t * I;
        long i = q % nb * 64;
#ifdef __AVX512F__
        for (; i + 16 <= i1; i += 16) {
            __m512 gt = _mm512_loadu_ps(g + i);
            __m512 sl = _mm512_div_ps(gt, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gt))));
            __m512 a = _mm512_mul_ps(rbf16v(sl), _mm512_loadu_ps(u + i));
            _mm512_storeu_ps(o + i, rbf16v(a));
        }
#endif
        for (; i < i1; i += 8) _mm256_storeu_ps(o + i, silu8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    }
}

/* xr += o, rounded to bf16 as model.py's residual adds; work-shared inside the pass's parallel region */
static void residual(float* xr, const float* o, long n) {
    #pragma omp for schedule(static)
    for (long i = 0; i < n; i++) xr[i] = rbf(xr[i] + o[i]);
}

enum { W_IN, W_QKV, B_QKV, W_O, W_POST, W_GU, W_DOWN, W_HID, NW };

/* (StackArgs) x [T, D] bf16, in place: the rows after all L layers. tab [L, NW] pointers (the GEMMs' Packed
   matrices, norms, bias or 0). cs, sn [T, hd] bf16 RoPE rows; mask [T, W] (bool bytes): row t may read slot mbase[t] + j where
   mask[t, j] (mbase 0: slot j; W <= S: a batch's rows each read their own range of the slots); cpos [T] the
   slots this pass writes; kv [L, 2, Hkv, S, hd] bf16; kt (AVX-512 builds with hd % 32 == 0, or 0) the same
   keys transposed, [L, Hkv, ceil(S / 16), hd / 2, 16] bf16 pairs (lanes512's layout), written with them and
   read instead of K for the scores. aux [T, n_aux, D]: slot j gets the input of layer
   aux_of[j] (repeats allowed). An EAGLE-3 layer (tab's W_HID set: its hidden_norm) takes q/k/v from
   [input_layernorm(emb[t]); hidden_norm(x[t])] (2D wide, emb [T, D] bf16: the token embeddings) and keeps
   x as the residual, as eagle.EagleHead.forward; W_HID = 0 is a plain decoder layer. */
/* one of a layer's GEMMs (g, as StackArgs' gather numbers them): y [T, N] = x W^T (+ b); under tensor parallelism
   this rank's N / tp outputs into part, then thread 0 gathers every rank's into y while the others wait */
static void gemm_layer(const StackArgs* a, long g, const float* x, long T, long K, const Packed* W, const uint16_t* b,
                       long N, float* y, float* part, uint16_t* xs) {
    if (!a->gather) {
        gemm_rows(x, T, K, W, b, N, 0, y, xs);
        return;
    }
    gemm_rows(x, T, K, W, b, N / a->tp, 0, part, xs);
    #pragma omp barrier
    #pragma omp master
    a->gather(g, T, part, y);
    #pragma omp barrier
}

void stack_bf16(const StackArgs* a) {
    const int64_t* tab = a->tab;
    long L = a->L, D = a->D, H = a->H, Hkv = a->Hkv, hd = a->hd, I = a->I, T = a->T, S = a->S, n_aux = a->n_aux;
    const long W = a->W;
    const int64_t* mbase = a->mbase;
    float eps = a->eps;
    uint16_t *x = a->x, *kv = a->kv, *aux = a->aux;
    const uint16_t *emb = a->emb, *cs = a->cs, *sn = a->sn, *fnorm = a->fnorm;
    const uint8_t* mask = a->mask;
    const int64_t *cpos = a->cpos, *aux_of = a->aux_of;
    uint32_t* kt = a->kt;
    int threads = a->threads;
    const long Q = H * hd, KV = Hkv * hd, NQKV = Q + 2 * KV, g = H / Hkv;
    const long nbs = (S + 15) / 16, H2 = hd / 2;  /* kt's slot blocks and pairs */
#ifndef __AVX512F__
    kt = 0;
#endif
    if (hd % 32) kt = 0;
#ifdef NANOSPEC_PHASES
    ph_last = omp_get_wtime();
#endif
    float* sl = kt ? malloc(sizeof(float) * threads * 6 * nbs * 16) : 0;  /* slot-indexed scores, per thread */
    const float scale = 1.f / sqrtf((float)hd);
    long wide = NQKV > 2 * I ? NQKV : 2 * I;
    float* xr = malloc(sizeof(float) * T * D);
    long hw = 2 * D > Q ? 2 * D : Q;
    hw = hw > I ? hw : I;
    float* h = malloc(sizeof(float) * T * hw);
    float* ef = emb ? malloc(sizeof(float) * T * D) : 0;
    float* y = malloc(sizeof(float) * T * wide);
    float* o = malloc(sizeof(float) * T * D);
    float* part = a->gather ? malloc(sizeof(float) * T * wide) : 0;  /* a rank's slice of a GEMM's outputs */
    int* keys = malloc(sizeof(int) * T * W);
    long* nk = malloc(sizeof(long) * 2 * T);  /* each row's key count, then its leading run of consecutive slots */
    long* npre = nk + T;
    float* sc = malloc(sizeof(float) * threads * 6 * (W + 8));
    uint16_t* xs = malloc(sizeof(uint16_t) * threads * T * hw);  /* gemm_rows' bf16 copies of its input (AVX-512 BF16) */
    const long hb = T * Hkv >= 2 * threads ? (g < 4 ? g : 4) : 1;  /* heads per attention task */
    const long nb = (g + hb - 1) / hb;
    for (long t = 0; t < T; t++) {  /* each row's keys, in slot order, once for all layers and heads */
        nk[t] = 0;
        const long b = mbase ? mbase[t] : 0;
        for (long j = 0; j < W; j++) if (mask[t * W + j]) keys[t * W + nk[t]++] = (int)(b + j);
        for (npre[t] = 0; npre[t] < nk[t] && keys[t * W + npre[t]] == keys[t * W] + npre[t];) npre[t]++;
    }
    /* rows per attention task (the transposed-key path, attend_rows): consecutive rows whose keys overlap, at
       most 6 queries a task, as many as keep two tasks per thread. A task's scores are computed for all its
       queries over every slot block any of them reads, so rows of different sequences (a batch: disjoint
       ranges, in any order) get tasks of their own: grouped by six, 64 one-row sequences at 220 keys spent 28 ms
       in attention, on their own 10 (Zen 5) */
    long* rs = malloc(sizeof(long) * (T + 1));  /* task row blocks: rows rs[i] .. rs[i + 1] */
    long nrb = 0;
    for (long rb = kt ? 6 / hb : 1;; rb--) {
        nrb = 0;
        for (long t = 0; t < T;) {
            long lo = nk[t] ? keys[t * W] >> 4 : 0, hi = nk[t] ? keys[t * W + nk[t] - 1] >> 4 : -1;
            rs[nrb++] = t++;
            for (; t < T && t - rs[nrb - 1] < rb && nk[t] && keys[t * W] >> 4 <= hi
                   && keys[t * W + nk[t] - 1] >> 4 >= lo; t++) {  /* (its slot blocks overlap the block's) */
                const long f = keys[t * W] >> 4, e = keys[t * W + nk[t] - 1] >> 4;
                lo = f < lo ? f : lo;
                hi = e > hi ? e : hi;
            }
        }
        rs[nrb] = T;
        if (rb <= 1 || nrb * Hkv * nb >= 2 * threads) break;
    }
    for (long i = 0; i < T * D; i++) xr[i] = fbf(x[i]);
    if (ef) for (long i = 0; i < T * D; i++) ef[i] = fbf(emb[i]);
    PH(PH_SETUP);
    #pragma omp parallel num_threads(threads)
    {
    for (long l = 0; l < L; l++) {
        const int64_t* w = tab + l * NW;
        uint16_t* Kc = kv + (l * 2) * Hkv * S * hd;
        uint16_t* Vc = Kc + Hkv * S * hd;
        for (long j = 0; j < n_aux; j++)
            if (aux_of[j] == l) {
                #pragma omp for schedule(static)
                for (long t = 0; t < T; t++)
                    for (long d = 0; d < D; d++) aux[(t * n_aux + j) * D + d] = to_bf16(xr[t * D + d]);
                PH(PH_RESID);
            }
        long kin = D;
        if (w[W_HID] && ef) {  /* EAGLE-3: [norm(embedding); norm(hidden)], embedding first */
            rmsnorm(ef, (const uint16_t*)w[W_IN], h, 2 * D, T, D, eps);
            rmsnorm(xr, (const uint16_t*)w[W_HID], h + D, 2 * D, T, D, eps);
            kin = 2 * D;
        } else rmsnorm(xr, (const uint16_t*)w[W_IN], h, D, T, D, eps);
        PH(PH_NORM);
        /* [T, q | k | v] */
        gemm_layer(a, 0, h, T, kin, (const Packed*)w[W_QKV], (const uint16_t*)w[B_QKV], NQKV, y, part, xs);
        PH(PH_GEMM);
        #pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            float* r = y + t * NQKV;
            rope(r, H + Hkv, hd, cs + t * hd, sn + t * hd);  /* q heads, then k heads: contiguous */
            for (long j = 0; j < Hkv; j++)
                for (long d = 0; d < hd; d++) {
                    Kc[(j * S + cpos[t]) * hd + d] = to_bf16(r[Q + j * hd + d]);
                    Vc[(j * S + cpos[t]) * hd + d] = to_bf16(r[Q + KV + j * hd + d]);
                }
            if (kt) {  /* the same keys' pairs into their slot's lane */
                uint32_t* kl = kt + l * Hkv * nbs * H2 * 16;
                for (long j = 0; j < Hkv; j++) {
                    const uint32_t* kr = (const uint32_t*)(Kc + (j * S + cpos[t]) * hd);
                    uint32_t* dst = kl + (j * nbs + cpos[t] / 16) * H2 * 16 + cpos[t] % 16;
                    for (long d = 0; d < H2; d++) dst[d * 16] = kr[d];
                }
            }
        }
        PH(PH_ROPE);
        /* tasks: (block of rows rs[i] .. rs[i + 1], KV head, block of up to hb of the heads sharing it); a head's
           arithmetic is the same in any block, so the blocks only balance the threads (one head per task when
           rows are few) and share loads (attend_rows) */
        /* KV head major, each thread one contiguous run: a KV head's tasks share its keys and values, which come
           from memory once per thread that takes any of them (dealt round-robin, every thread read every head:
           measured on an Ice Lake Xeon, contiguous runs 2% faster at 1 row, 3-4% at 60, 8% for a 750-token
           prefill). Within a head the row blocks alternate from both ends (0, last, 1, last - 1, ..), so any
           run of them holds early and late rows alike: a prefill's rows see 1 .. T keys, and halves by row had
           left one thread a quarter of the work */
        #pragma omp for schedule(static)
        for (long tk = 0; tk < nrb * Hkv * nb; tk++) {
            const long r = tk % (nrb * nb), rp = r / nb;
            const long ib = rp % 2 ? nrb - 1 - rp / 2 : rp / 2, t0 = rs[ib], j = tk / (nrb * nb);
            const long h0 = j * g + r % nb * hb;
            int G = (int)(g - tk % nb * hb < hb ? g - tk % nb * hb : hb);
            const int R = (int)(rs[ib + 1] - t0), NQ = R * G;
            const float* qs[6];
            const int* kq[6];
            long nq[6], pq[6];
            float *ss[6], *os[6], *ls[6];
            for (int i = 0; i < NQ; i++) {
                const long t = t0 + i / G, hh = h0 + i % G;
                qs[i] = y + t * NQKV + hh * hd;
                kq[i] = keys + t * W;
                nq[i] = nk[t];
                pq[i] = npre[t];
                ss[i] = sc + ((long)omp_get_thread_num() * 6 + i) * (W + 8);
                os[i] = h + t * Q + hh * hd;
                ls[i] = sl ? sl + ((long)omp_get_thread_num() * 6 + i) * nbs * 16 : 0;
            }
            const uint32_t* ktj = kt ? kt + (l * Hkv + j) * nbs * H2 * 16 : 0;
            (void)ktj; (void)pq; (void)ls;  /* (the AVX2 build has no transposed keys) */
#ifdef __AVX512F__
            if (ktj) attend_rows(qs, Vc + j * S * hd, kq, nq, pq, hd, scale, ss, os, ktj, ls, NQ);
            else
#endif
            attend(qs, Kc + j * S * hd, Vc + j * S * hd, kq[0], nq[0], hd, scale, ss, os, G);
            for (int i = 0; i < NQ; i++) for (long d = 0; d < hd; d++) os[i][d] = rbf(os[i][d]);
        }
        PH(PH_ATTN);
        gemm_layer(a, 1, h, T, Q, (const Packed*)w[W_O], 0, D, o, part, xs);
        PH(PH_GEMM);
        residual(xr, o, T * D);
        PH(PH_RESID);
        rmsnorm(xr, (const uint16_t*)w[W_POST], h, D, T, D, eps);
        PH(PH_NORM);
        gemm_layer(a, 2, h, T, D, (const Packed*)w[W_GU], 0, 2 * I, y, part, xs);  /* [T, gate | up] */
        PH(PH_GEMM);
        silu_mul(y, h, T, I);
        PH(PH_SILU);
        gemm_layer(a, 3, h, T, I, (const Packed*)w[W_DOWN], 0, D, o, part, xs);
        PH(PH_GEMM);
        residual(xr, o, T * D);
        PH(PH_RESID);
    }
    /* the model's final norm (fnorm, or 0: none), here rather than in torch after the call: its eight small ops
       met cold caches after the pass and cost about 0.2 ms a pass (measured on Zen 5) */
    if (fnorm) rmsnorm(xr, fnorm, h, D, T, D, eps);
    PH(PH_NORM);
    }
    const float* fin = fnorm ? h : xr;
    for (long i = 0; i < T * D; i++) x[i] = to_bf16(fin[i]);
    free(xr); free(h); free(y); free(o); free(part); free(keys); free(rs); free(nk); free(sc); free(ef); free(xs);
    free(sl);
    PH(PH_SETUP);
}

/* the accepted path's KV into place: for i < n, cache slot src[i] -> slot dst[i] of every layer's K and V rows
   [L, 2, Hkv, S, hd] and (kt, or 0) of their transposed copy [L, Hkv, nbs, hd / 2, 16]; every source is read
   before any slot is written (as index_select then index_copy_), so overlapping moves are safe */
void compact_bf16(const KVCache* c, const int64_t* src, const int64_t* dst, long n) {
    uint16_t* kv = c->kv;
    uint32_t* kt = c->kt;
    const long L = c->L, Hkv = c->Hkv, S = c->S, hd = c->hd, nbs = c->nbs;
    const long R = L * 2 * Hkv, RT = kt ? L * Hkv : 0, H2 = hd / 2;
    uint16_t* rows = malloc(sizeof(uint16_t) * n * R * hd);
    uint32_t* lanes = malloc(sizeof(uint32_t) * (n * RT * H2 + 1));
    for (long i = 0; i < n; i++) {
        for (long r = 0; r < R; r++) memcpy(rows + (i * R + r) * hd, kv + (r * S + src[i]) * hd, hd * 2);
        for (long r = 0; r < RT; r++)
            for (long d = 0; d < H2; d++)
                lanes[(i * RT + r) * H2 + d] = kt[((r * nbs + src[i] / 16) * H2 + d) * 16 + src[i] % 16];
    }
    for (long i = 0; i < n; i++) {
        for (long r = 0; r < R; r++) memcpy(kv + (r * S + dst[i]) * hd, rows + (i * R + r) * hd, hd * 2);
        for (long r = 0; r < RT; r++)
            for (long d = 0; d < H2; d++)
                kt[((r * nbs + dst[i] / 16) * H2 + d) * 16 + dst[i] % 16] = lanes[(i * RT + r) * H2 + d];
    }
    free(rows); free(lanes);
}
