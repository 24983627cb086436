/* The row-invariant bf16 GEMM (cpu_gemm.py): the shared store and the tiled work split; the register tiles
   of the one ISA variant this build targets, chosen by the compiler's target macros */
#pragma once
#include "bf16.h"
#include <stdlib.h>
#include "nanospec.h"

/* the 16 outputs of one register of accumulators: + bias, rounded to bf16 once, into y (or yf: fp32 holding
   the bf16 value); columns from N on are the zero rows padding the last panel and are not written */
static inline void store16(const float* out, const uint16_t* b, uint16_t* y, float* yf, long N, long m, long n0) {
    if (n0 + 16 <= N) {  /* a whole register pair: the same adds and rounding in vectors (one value at a time,
                            the LM head's epilogue cost about a third of its time at K = 576) */
        __m256 s0 = _mm256_loadu_ps(out), s1 = _mm256_loadu_ps(out + 8);
        if (b) { s0 = _mm256_add_ps(s0, load_bf16(b + n0)); s1 = _mm256_add_ps(s1, load_bf16(b + n0 + 8)); }
        __m256i r0 = round8(s0), r1 = round8(s1);
        if (yf) {
            _mm256_storeu_si256((__m256i*)(yf + m * N + n0), _mm256_slli_epi32(r0, 16));
            _mm256_storeu_si256((__m256i*)(yf + m * N + n0 + 8), _mm256_slli_epi32(r1, 16));
        } else {  /* pack the 16-bit halves: per 128-bit lane [r0 0-3, r1 0-3 | r0 4-7, r1 4-7], then in order */
            __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
            _mm256_storeu_si256((__m256i*)(y + m * N + n0), pk);
        }
        return;
    }
    for (long c = 0; c < 16 && n0 + c < N; c++) {
        long n = n0 + c;
        float s = out[c];
        if (b) { uint32_t u = (uint32_t)b[n] << 16; float bf; __builtin_memcpy(&bf, &u, 4); s += bf; }
        uint16_t r = to_bf16(s);
        if (yf) { uint32_t u = (uint32_t)r << 16; __builtin_memcpy(yf + m * N + n, &u, 4); }
        else y[m * N + n] = r;
    }
}

/* a register tile: rows m.. m + height of x (row stride kx, in the kernel's units) times panel p of W (p counts the
   whole matrix's panels; W is the part of a chain that holds p); where pf is not 0 it prefetches the next panel's
   64-byte lines [l0, l1) (tiles[fmt(bits)][height] for height 1..mtmax) */
typedef void (*tile_fn)(const void* x, long kx, const Packed* W, const uint16_t* wide, const uint16_t* b, uint16_t* y,
                        float* yf, long N, long m, long p, const char* pf, long l0, long l1);
/* (bf16 tiles: wide, where not 0, holds panel p as pack() lays it out, to read instead of W's) */

/* panel pd of a quantized part W widened to pack()'s bf16 layout, into dst [panel x K] (each ISA's header) */
static void widen_panel(const Packed* W, long pd, long K, uint16_t* dst);

/* the tile tables' formats: bf16; int8, 4, 5, 6-bit codes; then the K-quants' factorized tiles (the sub-block's codes
   times x, then its scale and offset: gemm_kquant.h on AVX-512 BF16, 4 and 5-6 bits; gemm_kfma.h on the FMA
   kernels, 4, 5 and 6 bits), and KWIDE, the FMA kernels' over a panel widened once (the AVX-512 BF16 kernel's decode
   their codes in each tile: tiled()) */
#if defined(__AVX512BF16__)
#define KWIDE 7
#else
#define KWIDE 8
#endif
#define NFMT 9
static inline int fmt(long bits) { return bits == 16 ? 0 : bits == 8 ? 1 : bits == 4 ? 2 : bits == 5 ? 3 : 4; }
#if KWIDE != 7
/* panel pd of a K-quant part W as its tiles' codes, into dst, and its groups' scales into ksc_buf (the FMA kernels') */
static void kwiden_panel(const Packed* W, long pd, long K, uint16_t* dst);
#endif
static inline int fmt_of(const Packed* W) {
    if (!W->sup || W->bits == 8) return fmt(W->bits);
    return KWIDE == 7 ? (W->bits == 4 ? 5 : 6) : (int)W->bits + 1;
}
static inline int has_kquant(const Packed* W) {
    for (; W; W = W->next)
        if (W->sup && W->bits != 8) return 1;
    return 0;
}
static __thread float* xsum_buf;  /* the K-quant tiles' sums of x [M][K / 16], each thread its own copy */
static __thread long xsum_cap;
#if KWIDE != 7
static __thread float* ksc_buf;  /* the FMA kernels' kwiden_panel's scales and offsets per group of the panel */
static __thread long ksc_cap;
#endif
/* room for n floats in a thread's buffer *buf of *cap, grown as needed, kept (64-byte aligned) */
static inline void room(float** buf, long* cap, long n) {
    if (*cap < n) {
        free(*buf);
        *cap = n;
        *buf = aligned_alloc(64, (sizeof(float) * n + 63) / 64 * 64);
    }
}
static inline long wbits(long bits) { return bits == 5 || bits == 6 ? 4 : bits; }  /* bits a code in w */
static inline long hbits(long bits) { return bits == 5 || bits == 6 ? bits - 4 : 0; }  /* bits a code in h */

/* the part of a chain of formats that holds panel p */
static inline const Packed* part_of(const Packed* W, long p) {
    while (W->next && p >= W->next->p0) W = W->next;
    return W;
}

#ifdef __AVX512F__
/* rows r .. r + 15 of part W's panel pd (of 64 rows), group g: fp32 scales s and offsets m, each exact (fp16 d
   times a small integer; a zero point as the offset -zero * s) */
static inline __attribute__((always_inline)) void group_sm(const Packed* W, long K, long pd, long g, long r, __m512* s,
                                                           __m512* m) {
    const long NG = K / W->group;
    const __m512i neg = _mm512_set1_epi32((int)0x80000000u);  /* (AVX-512F has no float xor) */
#define H16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#define I16(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p))))
    if (W->sup) {
        const long o = (pd * (K / W->sup) + g * W->group / W->sup) * 64 + r, oc = (pd * NG + g) * 64 + r;
        *s = _mm512_mul_ps(H16(W->s + o), I16(W->sc + oc));
        if (W->m)  /* -(dmin * mn) */
            *m = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(H16(W->m + o), I16(W->mn + oc))), neg));
    } else {
        *s = H16(W->s + (pd * NG + g) * 64 + r);
        if (W->m) *m = H16(W->m + (pd * NG + g) * 64 + r);
    }
#undef H16
#undef I16
    if (!W->m) *m = W->zero ? _mm512_mul_ps(*s, _mm512_set1_ps((float)-W->zero)) : _mm512_setzero_ps();
}
#endif

/* y[M, N] (bf16; or yf, fp32 holding bf16 values) = x[M, K] @ W[N, K]^T (+ b[N]) through a kernel's tiles, over
   packed panels of `panel` weight rows (panel x K bf16 each). Work-shared over the threads of the enclosing parallel
   region (serial outside one), ending in a barrier: each thread takes one contiguous run of (row block, panel)
   pairs, or, where the kernel has half-panel tiles (halves: tiles of a panel's first or last panel / 2 columns,
   their p = 2 x panel + half), of half pairs, and a thread's two halves of one panel are one whole tile. Why
   halves: the default model's o and down products have 9 panels of 64; two threads took 5 and 4, one idle a
   tenth of the product, at every row count (memory-bound or not). The rows are cut into ceil(rows / mtmax) tiles
   of nearly equal height (8 rows with mtmax 6: 4 + 4, not 6 + 2), as each tile's chains must be many enough to
   hide the latency; row blocks of at most 48 keep a block's x in L2 while the panels stream. While a panel computes,
   the next one is prefetched into L2, so memory and arithmetic overlap: all of it by the first tile (spread = 0),
   or, where the row block has several tiles, a share by each (spread = 1: a lone tile streams its panel with
   the hardware prefetcher, but a K-quant's; spread = 2: a lone tile prefetches all of it, as with 0). The later
   tiles find their panel in cache and give the hardware prefetcher no misses to follow. Row-invariant by
   construction when each tile computes every output the same way whatever its height or width; a chain's parts
   (W->next) each keep their own format, panel by panel. */
static __thread uint16_t* widen_buf;  /* each thread's widened panel (tiled()), grown as needed, kept */
static __thread long widen_cap;

static void tiled(const tile_fn (*tiles)[7], const tile_fn (*halves)[7], long mtmax, long panel, int spread,
                  const void* x, long kx, long M, long K, const Packed* W, const uint16_t* b, long N, uint16_t* y,
                  float* yf) {
    const long NP = (N + panel - 1) / panel;
    /* the blocks are of nearly equal height (60 rows: 30 + 30, not 48 + 12), as a thread may take a whole block;
       one run over all (row block, panel) pairs, not a loop per row block: with many blocks (a prefill) the
       pairs divide evenly */
    const long NB = (M + 47) / 48, S = halves ? 2 : 1, NI = NB * NP * S;
    const long nth = omp_get_num_threads(), me = omp_get_thread_num();
    const long i1 = NI * (me + 1) / nth;
    for (long i = NI * me / nth; i < i1;) {
        const long q = i / S, e = (q + 1) * S < i1 ? (q + 1) * S : i1;  /* this thread's part of pair q: [i, e) */
        const long mb = M * (q / NP) / NB, mend = M * (q / NP + 1) / NB, p = q % NP;
        const Packed* Wp = part_of(W, p);
        const int f = fmt_of(Wp);
        long rows = mend - mb, nt = (rows + mtmax - 1) / mtmax;
        const char* next = 0;
        long L = 0;  /* 64-byte lines of the next panel */
        if (p + 1 < NP && (q + 1) * S < i1) {
            const Packed* Wn = part_of(W, p + 1);
            const long pb = panel * K * wbits(Wn->bits) / 8;
            next = (const char*)Wn->w + (p + 1 - Wn->p0) * pb, L = pb / 64;
        }
        /* quantized, with several tiles to a panel: widen it once into this thread's buffer (L2) and run bf16
           tiles over it, not every tile widening every code (the same bits: a quantized tile widens in registers
           to these bf16 values). Measured on Zen 5, a pass of the default model's int4 GEMMs: 16 rows 7.3 ms
           widening per tile, 5.9 widening once (bf16 5.9); 64 rows 25.6 and 17.1 (bf16 17.1). Not the K-quants
           on the AVX-512 BF16 kernel, nor Q4_K on any: their tiles take the codes in a bitwise op or two a vector
           (bf16 128 + q, or the 4-bit integer), less than storing and reloading a widened panel (the 1.5B's FFN
           matrix, Q4_K, Zen 4: 8 rows 14.6 to 17.7 G weights/s on AVX-512 BF16, 7.4 to 8.4 on AVX2, 12 rows 11.6
           to 13.8 and 5.5 to 6.0); the FMA kernels' 5 and 6-bit tiles place 2-bit fields first (Q6_K per tile on
           AVX2: 8 rows 5.6 to 5.0) */
        const int once = f && nt > 1 && (f < 5 || (KWIDE != 7 && Wp->bits != 4));
        const int fw = once ? (f >= 5 ? KWIDE : 0) : f;
        const uint16_t* wide = 0;
        if (once) {
            if (widen_cap < panel * K) {
                free(widen_buf);
                widen_cap = panel * K;
                widen_buf = aligned_alloc(64, (widen_cap * 2 + 63) / 64 * 64);
            }
#if KWIDE != 7
            if (f >= 5) kwiden_panel(Wp, p - Wp->p0, K, widen_buf); else
#endif
            widen_panel(Wp, p - Wp->p0, K, widen_buf);
            wide = widen_buf;
        }
        long m = mb;
        /* a lone K-quant tile prefetches all of the next panel (spread 1 or not): decoding its codes, it leaves
           the hardware prefetcher behind (the 1.5B Q4_K_M model's one-row pass on Zen 4: 40 to 33 ms a token) */
        const int lone = spread != 1 || f >= 5;
        for (long t = 0; t < nt; t++) {
            long h = (mend - m) / (nt - t) + ((mend - m) % (nt - t) != 0);
            long l0 = spread && nt > 1 ? L * t / nt : 0,
                 l1 = spread && nt > 1 ? L * (t + 1) / nt : (t == 0 && lone ? L : 0);
            if (e - i == S) tiles[fw][h](x, kx, Wp, wide, b, y, yf, N, m, p, l1 > l0 ? next : 0, l0, l1);
            else halves[fw][h](x, kx, Wp, wide, b, y, yf, N, m, 2 * p + i % 2, l1 > l0 ? next : 0, l0, l1);
            m += h;
        }
        i = e;
    }
    #pragma omp barrier
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "gemm_fast.h"
#define FAST(xf, xb, M, K, W, b, N, y, yf) if (W->fast) { gemm_fast(xf, xb, M, K, W, b, N, y, yf); return; }
#else
#define FAST(xf, xb, M, K, W, b, N, y, yf)
#endif

#if defined(__AVX512BF16__)
#include "gemm_avx512bf16.h"
#else
#include "gemm_kfma.h"
#if defined(__AVX512F__)
#include "gemm_avx512.h"
#else
#include "gemm_avx2.h"
#endif

/* y[M, N] (bf16; or yf, fp32 holding bf16 values) = xf[M, K] @ W[N, K]^T (+ b[N]); xf fp32 holding bf16
   values, b bf16; xs: scratch the AVX-512 BF16 kernel needs (unused here). Every output is one fp32 FMA chain
   over k in order (a K-quant's: one per sub-block, then its scale and offset, gemm_kfma.h), plus the bias, rounded
   once: the same whatever the tile, the row count or the row's place in the pass (row-invariant, as exact mode
   needs). Tiles of up to 6 rows. */
static void gemm_rows(const float* xf, long M, long K, const Packed* W, const uint16_t* b, long N, uint16_t* y,
                      float* yf, uint16_t* xs) {
    (void)xs;
    FAST(xf, 0, M, K, W, b, N, y, yf)
    if (has_kquant(W)) fsums(xf, M, K);  /* each thread its own (no barrier before) */
    tiled(tiles, FMA_HALVES, 6, FMA_PANEL, FMA_SPREAD, xf, K, M, K, W, b, N, y, yf);
}
#endif
