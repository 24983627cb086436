/* The library's entry points and their argument structs. cbuild.py mirrors each struct field for field (ctypes)
   and holds the one table of these signatures: change both together. */
#pragma once
#include <stdint.h>

/* A packed copy's row writer (cpu_gemm.write_rows_): the buffer rows [nslots, K], its packed copy P (pack()'s
   layout: panels of `panel` rows, k in groups of kb, row c of a panel at place[c] among a group's panel slots),
   and the source matrix W [V, K]. fast: W and P hold Packed.fast codes (gemm_fast.h's layout, no rows buffer),
   Ws, Wm and Ps, Pm their fp16 scales and offsets */
typedef struct {
    uint16_t* rows; void* P; const void* W; long V, nslots, K, panel, kb; const int64_t* place;
    long fast; const uint16_t *Ws, *Wm; uint16_t *Ps, *Pm;
} RowsDst;

/* A weight matrix W [N, K] packed for the GEMM (quant.py's module docstring has the layouts). bits 16: w holds
   pack()'s bf16 panels. bits 8: w holds quant.pack_planes()'s int8 codes: per panel, per group of KB consecutive k,
   the panel's rows in order, a row's KB codes side by side. bits 4, 5, 6: w holds the codes' low nibbles in that
   order, two a byte (in each run of 2 QC codes, code j and j + QC in byte j's low and high nibble; QC the lanes one
   widening fills: 16 with AVX-512, 8 with AVX2), h (bits 5, 6) their high bits, per k group one little-endian bit
   string, (bits - 4) bits a code in the same order. One level (sup 0): s and m fp16 [panels][K / group][PANEL], a
   panel's rows in order: the weight is bf16((code - zero) * s + m) (m 0: no offsets). Two levels (the K-quants, sup
   k per super-block): s and m fp16 [panels][K / sup][PANEL] (d, dmin), sc and mn int8 [panels][K / group][PANEL]:
   the weight is bf16((code - zero) * (d * sc) - dmin * mn). A matrix of several formats' rows (the fused q | k | v
   of a Q4_K_M file) is a chain of these (next), each from its first panel p0 on. fast (draft models, AVX-512 VNNI
   builds): 4-bit codes in gemm_fast.h's layout, not the bf16 GEMM's bits. */
typedef struct Packed {
    const void* w; const uint16_t *s, *m; long bits, group; const uint8_t* h; const int8_t *sc, *mn;
    long sup, zero, p0; const struct Packed* next; long fast;
} Packed;

void write_rows(const RowsDst* d, const int64_t* tok, const int64_t* slot, long n);
void linear_bf16(const uint16_t* x, float* xf, long M, long K, const uint16_t* P, const uint16_t* b, long N,
                 uint16_t* y, int threads);
void linear_packed(const uint16_t* x, float* xf, long M, long K, const Packed* W, const uint16_t* b, long N,
                   uint16_t* y, int threads);

/* The fused pass's arguments (cpu_forward.run; stack_bf16 in forward.c documents them; tab's GEMM entries point at
   Packed matrices). Under tensor parallelism (tp.py) tab's matrices are this rank's 1 / tp of each GEMM's output
   rows, and gather(g, T, part, full) puts every rank's slices of GEMM g of a layer (0 q | k | v, 1 o, 2 gate | up,
   3 down) into full, [T, N] fp32 in one process's column order; gather 0: one process */
typedef void (*Gather)(long g, long T, const float* part, float* full);
typedef struct {
    const int64_t* tab; long L, D, H, Hkv, hd, I; float eps; long T, S;
    uint16_t* x; const uint16_t *emb, *cs, *sn; const uint8_t* mask; const int64_t *mbase; long W; const int64_t* cpos;
    uint16_t* kv; uint32_t* kt; const int64_t* aux_of; long n_aux; uint16_t* aux; const uint16_t* fnorm; int threads;
    Gather gather; long tp;
} StackArgs;

void stack_bf16(const StackArgs* a);
/* a target's KV cache kv [L, 2, Hkv, S, hd] and (kt, or 0) its transposed keys [L, Hkv, nbs, hd / 2, 16] */
typedef struct { uint16_t* kv; uint32_t* kt; long L, Hkv, S, hd, nbs; } KVCache;

void compact_bf16(const KVCache* c, const int64_t* src, const int64_t* dst, long n);
void phase_times(double* out);  /* the -DNANOSPEC_PHASES build only */

/* An EAGLE-3 head's layer: cpu_forward's table row, dims, its KV cache of S slots, the target's embeddings, the
   head's RoPE tables */
typedef struct {
    const int64_t* tab; long D, H, Hkv, hd, I, S; float eps;
    uint16_t* kv; const uint16_t *embed, *cos_t, *sin_t;
} Head;

/* eagle_tree_bf16's search (draft.c documents it) */
typedef struct {
    Head head; const uint16_t *norm_w, *out0, *lm0; long n;
    const uint16_t *P, *b; const int64_t* ids; long W; const int64_t* r2t; long k, depth, N; int64_t root;
    int64_t *tokens, *parents, *depth_out; uint8_t* anc; double* lm_s; int threads;
} TreeArgs;

/* eagle_update_bf16's pass over the accepted path (draft.c documents it) */
typedef struct {
    Head head; const uint16_t *fcP, *fcb; long F; const uint16_t* aux; const int64_t *path, *nxt; long R, n, L;
    uint16_t* out1; const uint16_t* norm_w; uint16_t* lm1; int threads;
} UpdateArgs;

/* NanoSpec's window state (vocab.NanoSpecVocab's tensors; nanospec_append in draft.c); dst.rows = 0: no rows */
typedef struct {
    long V, W; int64_t *ring, *head; int32_t *count, *slot_of; int64_t* token_of; int32_t* winner;
    const int64_t* fill_tok; const int32_t* fill_slot; int has_fill; int64_t* ids; uint16_t* bias; RowsDst dst;
} Window;

void eagle_tree_bf16(const TreeArgs* a);
void eagle_update_bf16(const UpdateArgs* a);
void nanospec_append(const Window* w, const int64_t* new_in, const uint8_t* valid_in, long n, int64_t* cand,
                     int64_t* slot, uint8_t* flags);
void nanospec_metrics(const int64_t* em, const uint8_t* ok, long n, long L, long V, long W, const int32_t* count,
                      const int32_t* fill_slot, const int64_t* token_of, int64_t* metrics);
void topk_rows_bf16(const uint16_t* x, long n, const int64_t* rows, long M, long k, int64_t* idx, int threads);
void argmax_rows(const void* x, int bf16, long M, long V, int64_t* out, int threads);
double peak_gflops(long iters, int threads);
