/* The K-quants (Q4_K, Q5_K, Q6_K) on the FMA kernels (AVX2; AVX-512F without BF16), factorized as the AVX-512 BF16
   kernel's (gemm_kquant.h): per weight row and sub-block b of 16 or 32 k, y = fma(m_b, X_b, fma(s_b, S_b, y)),
   where S_b is one fp32 FMA chain over the sub-block's k of x times the code q itself (exact: a bf16 x times an
   integer below 64), X_b the sum of x over the sub-block (fsums) and s_b, m_b the exact scale and offset (the
   weight is s_b q + m_b: the gguf package's dequantized value, unrounded). The AVX2 and AVX-512F tiles do the
   same operations lane for lane, so the two give the same bits; each is row-invariant by construction. Why: the
   widening kernel turned every code into its bf16 weight (convert, FMA with the scale and offset, round: 5-6
   vector ops per 8 or 16 weights) before its FMA, and a one-row product of Q4_K codes ran compute-bound at 6.2
   (AVX2) and 8.1 GB/s (AVX-512F) on Zen 4, where a plain read streams 29. */
#pragma once

/* the sums of x (fp32 rows of K) over each 16 k of each row, one after another in k order */
static void fsums(const float* x, long M, long K) {
    const long NB = K / 16;
    room(&xsum_buf, &xsum_cap, M * NB);
    for (long m = 0; m < M; m++)
        for (long j = 0; j < NB; j++) {
            float s = 0.f;
            for (int i = 0; i < 16; i++) s += x[m * K + 16 * j + i];
            xsum_buf[m * NB + j] = s;
        }
}

/* row i's sum of x over group g (xs: the group's 16-k blocks, 1 or 2) */
static inline float xgroup(const float* X, long XB, int i, long g, long xs) {
    return xs == 2 ? X[i * XB + 2 * g] + X[i * XB + 2 * g + 1] : X[i * XB + g];
}
