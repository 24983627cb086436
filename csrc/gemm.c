/* The GEMM's entry points: the linear layer and the packed-row writer */
#include "gemm.h"
#include "nanospec.h"

/* Packed.fast row t of W to row s of P, scale and offset with it: panel row c's codes of a k quad are 4 bytes at
   (c / 32) * 64 + (c % 16) * 4 of the quad's 128, nibble (c / 16) % 2, the other nibble another row's */
static void write_fast_row(const RowsDst* d, long t, long s) {
    const long Q = d->K / 4, NB = d->K / 32, ct = t % 64, cs = s % 64;
    const uint8_t* src = (const uint8_t*)d->W + (t / 64) * Q * 128 + (ct / 32) * 64 + (ct % 16) * 4;
    uint8_t* dst = (uint8_t*)d->P + (s / 64) * Q * 128 + (cs / 32) * 64 + (cs % 16) * 4;
    const int ht = (int)(ct / 16 % 2) * 4, hs = (int)(cs / 16 % 2) * 4;
    const uint8_t keep = hs ? 0x0F : 0xF0;
    for (long q = 0; q < Q; q++)
        for (int j = 0; j < 4; j++) {
            const uint8_t v = (uint8_t)((src[q * 128 + j] >> ht) & 15);
            dst[q * 128 + j] = (uint8_t)((dst[q * 128 + j] & keep) | (v << hs));
        }
    for (long g = 0; g < NB; g++) {
        d->Ps[(s / 64) * NB * 64 + g * 64 + cs] = d->Ws[(t / 64) * NB * 64 + g * 64 + ct];
        d->Pm[(s / 64) * NB * 64 + g * 64 + cs] = d->Wm[(t / 64) * NB * 64 + g * 64 + ct];
    }
}

/* d->rows[slot[i]] = W[tok[i]] and the same row into the packed copy P (RowsDst), for every i with
   0 <= slot[i] < nslots and tok[i] a row of W (the others are skipped: masked entries) */
void write_rows(const RowsDst* d, const int64_t* tok, const int64_t* slot, long n) {
    uint16_t *rows = d->rows, *P = d->P;
    const uint16_t* W = d->W;
    const long V = d->V, nslots = d->nslots, K = d->K, panel = d->panel, kb = d->kb;
    const int64_t* place = d->place;
    const long G = d->fast ? 0 : K / kb;
    for (long i = 0; i < n; i++) {
        long s = slot[i], t = tok[i];
        if (s < 0 || s >= nslots || t < 0 || t >= V) continue;
        if (d->fast) { write_fast_row(d, t, s); continue; }
        const uint16_t* src = W + t * K;
        __builtin_memcpy(rows + s * K, src, K * 2);
        uint16_t* dst = P + (s / panel) * G * panel * kb + place[s % panel] * kb;
        for (long g = 0; g < G; g++)
            for (long j = 0; j < kb; j++) dst[g * panel * kb + j] = src[g * kb + j];
    }
}

#if defined(__AVX512BF16__)
/* y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]); x, b, y bf16 (x 4-byte aligned: K is even); xf unused */
void linear_packed(const uint16_t* x, float* xf, long M, long K, const Packed* W, const uint16_t* b, long N,
                   uint16_t* y, int threads) {
    (void)xf;
    #pragma omp parallel num_threads(threads)
    gemm_pairs((const uint32_t*)x, M, K, W, b, N, y, 0);
}
#else
/* y[M, N] = x[M, K] @ W[N, K]^T (+ b[N]); x, b, y bf16; xf: fp32 scratch [M, K] */
void linear_packed(const uint16_t* x, float* xf, long M, long K, const Packed* W, const uint16_t* b, long N,
                   uint16_t* y, int threads) {
    for (long i = 0; i < M * K; i++) { uint32_t u = (uint32_t)x[i] << 16; __builtin_memcpy(xf + i, &u, 4); }
    #pragma omp parallel num_threads(threads)
    gemm_rows(xf, M, K, W, b, N, y, 0, 0);
}
#endif

/* linear_packed with bf16 panels P = pack(W) */
void linear_bf16(const uint16_t* x, float* xf, long M, long K, const uint16_t* P, const uint16_t* b, long N,
                 uint16_t* y, int threads) {
    const Packed W = {P, 0, 0, 16, 0};
    linear_packed(x, xf, M, K, &W, b, N, y, threads);
}
