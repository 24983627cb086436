"""An EAGLE-3 head's whole EAGLE-2 tree search in one C call on a bf16 CPU (draft.EagleDrafter.draft's loop).

Why: on CPU a drafting level through PyTorch's eager ops costs ~30 small ops (masks, top-k, gathers, one-hot
ancestor rows) around a head layer that the C pass runs in ~0.1 ms; a 16-node draft took ~2.3 ms of a ~7 ms
decode step (BENCHMARKS.md, session 16). Here every level (the head layer, its norm, the LM head over the draft
vocabulary's packed rows, log-softmax, top-k, the frontier's choice and its ancestor mask) and the final
rerank run in C, reusing cpu_forward's layer pass and cpu_gemm's GEMM.

The same search as the PyTorch loop, step for step, with one fixed tie order (the lower index first, where
torch.topk leaves ties unordered); sums run in other orders, so scores agree to float rounding. Whatever the
tree, the target verifies it: output is unchanged (the drafter only decides what gets verified).
"""
import ctypes
import os

import torch
from torch import Tensor

import cpu_forward
import cpu_gemm

SOURCE = cpu_forward.SOURCE + r"""
/* best k of x[0..n) (k <= n) into top[]: highest first, ties to the lower index */
static void top_k(const float* x, long n, long k, long* top) {
    long m = 0;
    for (long i = 0; i < n; i++) {
        float v = x[i];
        if (m == k && !(v > x[top[k - 1]])) continue;
        long j = m < k ? m++ : k - 1;
        while (j > 0 && v > x[top[j - 1]]) { top[j] = top[j - 1]; j--; }
        top[j] = i;
    }
}

/* the best k (<= 64) of each of M bf16 rows x[rows[i]] (n wide) -> idx [M, k], highest first, ties to the
   lower index (NaN never chosen). Why: torch.topk over the target's 49k logits of a step's path rows cost
   ~0.13 ms; here 8 lanes at a time are compared with the k-th best so far, and only the rare lane above it
   takes the scalar insertion. */
void topk_rows_bf16(const uint16_t* x, long n, const int64_t* rows, long M, long k, int64_t* idx, int threads) {
    #pragma omp parallel for num_threads(M > 1 ? threads : 1) schedule(static)
    for (long i = 0; i < M; i++) {
        const uint16_t* r = x + rows[i] * n;
        float v[64];
        long t[64], m = 0, j = 0;
#define INSERT(val, at) { long p = m < k ? m++ : k - 1; \
        while (p > 0 && (val) > v[p - 1]) { v[p] = v[p - 1]; t[p] = t[p - 1]; p--; } v[p] = (val); t[p] = (at); }
        for (; j < n && m < k; j++) { float f = fbf(r[j]); if (f == f) INSERT(f, j) }
        for (; j + 32 <= n; j += 32) {  /* 32 at a time: one branch per 32 scores */
            __m256 th = _mm256_set1_ps(v[k - 1]);
            __m256 h = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(load_bf16(r + j), th, _CMP_GT_OQ),
                                                 _mm256_cmp_ps(load_bf16(r + j + 8), th, _CMP_GT_OQ)),
                                    _mm256_or_ps(_mm256_cmp_ps(load_bf16(r + j + 16), th, _CMP_GT_OQ),
                                                 _mm256_cmp_ps(load_bf16(r + j + 24), th, _CMP_GT_OQ)));
            if (!_mm256_movemask_ps(h)) continue;
            for (long b = j; b < j + 32; b++) { float f = fbf(r[b]); if (f > v[k - 1]) INSERT(f, b) }
        }
        for (; j < n; j++) { float f = fbf(r[j]); if (f > v[k - 1]) INSERT(f, j) }
#undef INSERT
        for (long c = 0; c < k; c++) idx[i * k + c] = c < m ? t[c] : 0;
    }
}

/* a step's vocabulary metrics (draft.VocabDrafter.observe, which documents them): of the first L of the n emitted
   ids em[] (draft rows, ok[] where the draft vocabulary has the id), those the window scores (count > 0, or a fill
   token in a free slot), and the window's active slots; metrics += [hits, L, active, 0, 1], metrics[3] = the
   largest active. Why: the same in about 15 small torch ops cost 0.4 ms a step on an Ice Lake Xeon. */
void nanospec_metrics(const int64_t* em, const uint8_t* ok, long n, long L, long V, long W, const int32_t* count,
                      const int32_t* fill_slot, const int64_t* token_of, int64_t* metrics) {
    long hits = 0, act = 0;
    for (long i = 0; i < n && i < L; i++) {
        int64_t t = em[i];
        if (!ok[i] || t < 0 || t > V) continue;
        int in = count[t] > 0;
        if (!in && fill_slot) { int32_t s = fill_slot[t]; in = s >= 0 && token_of[s] < 0; }
        hits += in;
    }
    for (long s = 0; s < W; s++) act += token_of[s] >= 0;
    metrics[0] += hits; metrics[1] += L; metrics[2] += act; metrics[4] += 1;
    if (act > metrics[3]) metrics[3] = act;
}

/* NanoSpec's window append (vocab.NanoSpecVocab._append, which documents the state) in one pass over the n
   new ids, step for step as the PyTorch version: the same ring, counts, slots, outputs and rows. Why: the
   static-shape version is ~45 small ops (0.2-0.35 ms a step on CPU), built for CUDA graphs. The scratch
   arrays are the caller's: cand, slot [2n] int64, flags [2n]. */
void nanospec_append(const int64_t* new_in, const uint8_t* valid_in, long n, long V, long W, int64_t* ring,
                     int64_t* head, int32_t* count, int32_t* slot_of, int64_t* token_of, int32_t* winner,
                     const int64_t* fill_tok, int has_fill, int64_t* ids, uint16_t* bias, uint16_t* rows,
                     uint16_t* P, const uint16_t* Wt, long K, long panel, long kb, const int64_t* place,
                     int64_t* cand, int64_t* slot, uint8_t* flags) {
    const long m = 2 * n;
    long nv = 0, h = *head;
    for (long e = 0; e < n; e++) {  /* the r-th valid id goes to ring position (head + r) % W */
        int ok = valid_in[e] && new_in[e] >= 0 && new_in[e] < V;
        long pos = ok ? (h + nv) % W : W;
        nv += ok;
        int64_t t = ok ? new_in[e] : V, o = ring[pos];  /* (valid positions are distinct: read = read first) */
        cand[e] = t;
        cand[n + e] = ok && o >= 0 ? o : V;  /* the evicted id */
        ring[pos] = t;
    }
    *head = (h + nv) % W;
    for (long c = 0; c < m; c++) flags[c] = count[cand[c]] == 0;  /* bit 0: count 0 before */
    for (long c = 0; c < m; c++) count[cand[c]] += c < n ? 1 : -1;
    count[V] = 0;
    for (long c = 0; c < m; c++) winner[cand[c]] = (int32_t)c;  /* per id the last candidate decides */
    for (long c = 0; c < m; c++) {
        int win = winner[cand[c]] == c && cand[c] < V, after = count[cand[c]] > 0, zero_before = flags[c];
        flags[c] = (win && zero_before && after) | (win && !zero_before && !after) << 1;  /* 1 born, 2 died */
    }
    for (long c = 0; c < m; c++) {
        if (!(flags[c] & 2)) continue;
        int64_t dead = slot_of[cand[c]];
        token_of[dead] = -1;
        slot_of[cand[c]] = -1;
        if (has_fill && rows && fill_tok[dead] >= 0)  /* a freed slot scores its fill token again */
            write_rows(rows, P, Wt, V, fill_tok + dead, &dead, 1, W, K, panel, kb, place);
    }
    long br = 0;
    for (long c = 0; c < m; c++) slot[c] = W;
    for (long s = 0; s < W && br < m; s++) {  /* the k-th born id takes the k-th free slot */
        if (token_of[s] >= 0) continue;
        while (br < m && !(flags[br] & 1)) br++;
        if (br == m) break;
        slot[br] = s;
        token_of[s] = cand[br];
        slot_of[cand[br]] = (int32_t)s;
        br++;
    }
    slot_of[V] = -1;
    token_of[W] = -1;
    for (long s = 0; s < W; s++) {
        int64_t t = token_of[s], ft = fill_tok[s];
        int on = t >= 0 || (has_fill && ft >= 0 && count[ft] == 0);
        ids[s] = t >= 0 ? t : (has_fill && ft >= 0 ? ft : 0);
        bias[s] = on ? 0 : 0xFF80;  /* bf16 0 or -inf */
    }
    if (rows) write_rows(rows, P, Wt, V, cand, slot, n, W, K, panel, kb, place);  /* born ids are all new */
}

/* r[0..n) = fp32 of y's bf16 scores; returns their log-sum-exp (max first, as torch.log_softmax) */
static float lse_row(const uint16_t* y, long n, float* r) {
    float m = -INFINITY;
    for (long i = 0; i < n; i++) { r[i] = fbf(y[i]); m = r[i] > m ? r[i] : m; }
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    long i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(r + i), mv)));
    float s = hsum(acc);
    for (; i < n; i++) s += expf(r[i] - m);
    return m + logf(s);
}

/* The draft vocabulary's log-probabilities of M rows of bf16 LM-head inputs x [M, D]: scores y [M, W] (the
   packed rows P, bias b or 0), each row's best k -> tok [M, k] (target ids: ids, then r2t where the head's
   vocabulary is pruned) and logp [M, k]. Adds its seconds (the GEMM, log-softmax, top-k: what depends on the
   vocabulary) to *lm_s. */
static void score(const uint16_t* x, float* xf, long M, long D, const uint16_t* P, const uint16_t* b, long W,
                  const int64_t* ids, const int64_t* r2t, long k, uint16_t* y, float* r, long* top, int64_t* tok,
                  float* logp, double* lm_s, int threads) {
    double t0 = omp_get_wtime();
    linear_bf16(x, xf, M, D, P, b, W, y, threads);
    for (long i = 0; i < M; i++) {
        float lse = lse_row(y + i * W, W, r);
        top_k(r, W, k, top);
        for (long j = 0; j < k; j++) {
            int64_t row = ids[top[j]];
            tok[i * k + j] = r2t ? r2t[row] : row;
            logp[i * k + j] = r[top[j]] - lse;
        }
    }
    *lm_s += omp_get_wtime() - t0;
}

/* An EAGLE-3 head's layer as the C entry points below see it (cpu_forward's table row, dims, its KV cache of S
   slots, the target's embeddings, the head's RoPE tables) */
typedef struct {
    const int64_t* tab; long D, H, Hkv, hd, I, S; float eps;
    uint16_t* kv; const uint16_t *embed, *cos_t, *sin_t;
} Head;

/* the head's layer over T rows of features x [T, D] (in place: its output): the embeddings of tok, RoPE at
   positions pos, K and V written at slots cpos, attention by mask [T, S] */
static void head_layer(const Head* h, uint16_t* x, long T, const int64_t* tok, const int64_t* pos,
                       const int64_t* cpos, const uint8_t* mask, int threads) {
    const long D = h->D, hd = h->hd;
    uint16_t* emb = malloc(sizeof(uint16_t) * T * D);
    uint16_t* cs = malloc(sizeof(uint16_t) * T * hd);
    uint16_t* sn = malloc(sizeof(uint16_t) * T * hd);
    const int64_t no_aux = -1;
    uint16_t aux_dummy[8];
    for (long i = 0; i < T; i++) {
        memcpy(emb + i * D, h->embed + tok[i] * D, sizeof(uint16_t) * D);
        memcpy(cs + i * hd, h->cos_t + pos[i] * hd, sizeof(uint16_t) * hd);
        memcpy(sn + i * hd, h->sin_t + pos[i] * hd, sizeof(uint16_t) * hd);
    }
    stack_bf16(h->tab, 1, D, h->H, h->Hkv, hd, h->I, h->eps, T, h->S, x, emb, cs, sn, mask, cpos, h->kv, 0, &no_aux, 0,
               aux_dummy, 0, threads);
    free(emb); free(cs); free(sn);
}

/* EagleDrafter.update's head pass in one call: the accepted path's R positions (padded to the tree's depth +
   1): fc over their aux states (rows path[i] of aux [N, F], fc packed as fcP, bias fcb or 0), the head layer
   at slots n .. n + R - 1 (causal over the cache), writing the head's KV; out1 [D] = the output at position
   L - 1 (the next draft's features), lm1 [D] = its final norm (norm_w: the next draft's LM-head input, as
   eagle_tree_bf16 norms its frontier; in torch after the call, one row's norm had cost ~0.15 ms: cold caches) */
void eagle_update_bf16(const int64_t* tab, long D, long H, long Hkv, long hd, long I, float eps, long S,
                       uint16_t* kv, const uint16_t* embed, const uint16_t* cos_t, const uint16_t* sin_t,
                       const uint16_t* fcP, const uint16_t* fcb, long F, const uint16_t* aux, const int64_t* path,
                       const int64_t* nxt, long R, long n, long L, uint16_t* out1, const uint16_t* norm_w,
                       uint16_t* lm1, int threads) {
    const Head hh = {tab, D, H, Hkv, hd, I, S, eps, kv, embed, cos_t, sin_t};
    uint16_t* feats = malloc(sizeof(uint16_t) * R * F);
    float* ff = malloc(sizeof(float) * (R * F > 2 * D ? R * F : 2 * D));
    uint16_t* x = malloc(sizeof(uint16_t) * R * D);
    uint8_t* mask = malloc(R * S);
    int64_t* cpos = malloc(sizeof(int64_t) * R);
    for (long i = 0; i < R; i++) {
        memcpy(feats + i * F, aux + path[i] * F, sizeof(uint16_t) * F);
        memset(mask + i * S, 1, n + i + 1);
        memset(mask + i * S + n + i + 1, 0, S - n - i - 1);
        cpos[i] = n + i;  /* (also the RoPE position) */
    }
    linear_bf16(feats, ff, R, F, fcP, fcb, D, x, threads);  /* the head's input features, as eagle.project */
    head_layer(&hh, x, R, nxt, cpos, cpos, mask, threads);
    memcpy(out1, x + (L - 1) * D, sizeof(uint16_t) * D);
    for (long d = 0; d < D; d++) ff[d] = fbf(out1[d]);  /* (ff is free again: 2 rows of scratch) */
    rmsnorm(ff, norm_w, ff + D, D, 1, D, eps);
    for (long d = 0; d < D; d++) lm1[d] = to_bf16(ff[D + d]);
    free(feats); free(ff); free(x); free(mask); free(cpos);
}

/* EAGLE-2 over an EAGLE-3 head's layer (tab: one cpu_forward layer row, norm_w: the head's final norm, embed:
   the target's embeddings, cos_t/sin_t [S, hd] the head's RoPE tables, kv [1, 2, Hkv, S, hd] its cache with n
   positions in use), as draft.EagleDrafter.draft: from the last accepted position's output out0 and LM-head
   input lm0 [D], expand the best-k frontier by cumulative log-probability for `depth` levels (frontier slots
   n + (lvl-1)*k + j, attending to the n cached positions and their own ancestors), then keep the best N - 1
   candidates, parents first, best first. Out: tokens, parents, depth [N] (root first), anc [N, N]. */
void eagle_tree_bf16(const int64_t* tab, long D, long H, long Hkv, long hd, long I, float eps, long S,
                     uint16_t* kv, const uint16_t* norm_w, const uint16_t* embed, const uint16_t* cos_t,
                     const uint16_t* sin_t, const uint16_t* out0, const uint16_t* lm0, long n,
                     const uint16_t* P, const uint16_t* b, const int64_t* ids, long W, const int64_t* r2t,
                     long k, long depth, long N, int64_t root, int64_t* tokens, int64_t* parents,
                     int64_t* depth_out, uint8_t* anc, double* lm_s, int threads) {
    const long C = k + (depth - 1) * k * k, A = depth * k;  /* candidates; ancestor bits (draft slots) */
    const Head hh = {tab, D, H, Hkv, hd, I, S, eps, kv, embed, cos_t, sin_t};
    int64_t* ctok = malloc(sizeof(int64_t) * C);
    float* csc = malloc(sizeof(float) * C);
    long* cpar = malloc(sizeof(long) * C);
    long* clvl = malloc(sizeof(long) * C);
    int64_t* ftok = malloc(sizeof(int64_t) * k);
    float* fsc = malloc(sizeof(float) * k);
    long* fcand = malloc(sizeof(long) * k);
    uint8_t* fanc = calloc(k * A, 1);
    uint8_t* nanc = malloc(k * A);
    uint16_t* x = malloc(sizeof(uint16_t) * k * D);   /* the frontier's features; the layer's output in place */
    uint16_t* nx = malloc(sizeof(uint16_t) * k * D);
    uint16_t* lm = malloc(sizeof(uint16_t) * k * D);
    float* xf = malloc(sizeof(float) * k * D);
    float* nf = malloc(sizeof(float) * k * D);
    uint8_t* mask = malloc(k * S);
    int64_t* cpos = malloc(sizeof(int64_t) * k), * rpos = malloc(sizeof(int64_t) * k);
    uint16_t* y = malloc(sizeof(uint16_t) * k * W);
    float* r = malloc(sizeof(float) * (W > C ? W : C));
    long* top = malloc(sizeof(long) * (k * k > N ? k * k : N));
    int64_t* tk = malloc(sizeof(int64_t) * k * k);
    float* lp = malloc(sizeof(float) * k * k);
    float* sc = malloc(sizeof(float) * k * k);
    long* pos_of = malloc(sizeof(long) * C);
    *lm_s = 0.0;
    score(lm0, xf, 1, D, P, b, W, ids, r2t, k, y, r, top, ctok, csc, lm_s, threads);
    for (long j = 0; j < k; j++) {
        cpar[j] = -1; clvl[j] = 0;
        ftok[j] = ctok[j]; fsc[j] = csc[j]; fcand[j] = j; fanc[j * A + j] = 1;
        memcpy(x + j * D, out0, sizeof(uint16_t) * D);
    }
    long base = k;  /* the first candidate of this level */
    for (long lvl = 1; lvl < depth; lvl++) {
        for (long j = 0; j < k; j++) {
            uint8_t* m = mask + j * S;
            memset(m, 1, n);
            memset(m + n, 0, S - n);
            for (long a = 0; a < A; a++) m[n + a] = fanc[j * A + a];
            cpos[j] = n + (lvl - 1) * k + j;
            rpos[j] = n + lvl - 1;  /* every frontier node sits at this depth's position */
        }
        head_layer(&hh, x, k, ftok, rpos, cpos, mask, threads);
        for (long i = 0; i < k * D; i++) nf[i] = fbf(x[i]);
        rmsnorm(nf, norm_w, xf, D, k, D, eps);  /* lm = norm(out), as eagle.EagleHead.forward */
        for (long i = 0; i < k * D; i++) lm[i] = to_bf16(xf[i]);
        score(lm, xf, k, D, P, b, W, ids, r2t, k, y, r, top, tk, lp, lm_s, threads);
        for (long i = 0; i < k; i++)
            for (long j = 0; j < k; j++) {
                long c = base + i * k + j;
                sc[i * k + j] = fsc[i] + lp[i * k + j];  /* cumulative log-prob of the k*k children */
                ctok[c] = tk[i * k + j]; csc[c] = sc[i * k + j]; cpar[c] = fcand[i]; clvl[c] = lvl;
            }
        top_k(sc, k * k, k, top);  /* the next frontier: best k of the k*k */
        for (long j = 0; j < k; j++) {
            long p = top[j] / k;
            ftok[j] = tk[top[j]]; fsc[j] = sc[top[j]]; fcand[j] = base + top[j];
            memcpy(nx + j * D, x + p * D, sizeof(uint16_t) * D);
            memcpy(nanc + j * A, fanc + p * A, A);
            nanc[j * A + lvl * k + j] = 1;
        }
        memcpy(x, nx, sizeof(uint16_t) * k * D);
        memcpy(fanc, nanc, k * A);
        base += k * k;
    }
    /* rerank: a child's score never exceeds its parent's, and the small depth penalty breaks exact ties the
       same way, so (key desc, index asc) puts every parent before its children */
    for (long c = 0; c < C; c++) {
        float s = csc[c] != csc[c] || csc[c] == -INFINITY ? -1e30f : csc[c];
        r[c] = s - 1e-4f * (float)clvl[c];
        pos_of[c] = -1;
    }
    top_k(r, C, N - 1, top);
    for (long i = 0; i < N - 1; i++) pos_of[top[i]] = i;
    tokens[0] = root; parents[0] = -1; depth_out[0] = 0;
    for (long i = 0; i < N - 1; i++) {
        long c = top[i];
        tokens[i + 1] = ctok[c];
        parents[i + 1] = cpar[c] < 0 ? 0 : pos_of[cpar[c]] + 1;
        depth_out[i + 1] = clvl[c] + 1;
    }
    memset(anc, 0, N * N);  /* ancestor-or-self closure, depth rounds (as draft.ancestor_mask) */
    for (long i = 0; i < N; i++) anc[i * N + i] = 1;
    for (long it = 0; it < depth; it++)
        for (long i = 1; i < N; i++)
            for (long j = 0; j < N; j++) anc[i * N + j] |= anc[parents[i] * N + j];
    free(ctok); free(csc); free(cpar); free(clvl); free(ftok); free(fsc); free(fcand); free(fanc); free(nanc);
    free(x); free(nx); free(lm); free(xf); free(nf); free(mask); free(cpos); free(rpos);
    free(y); free(r); free(top); free(tk); free(lp); free(sc); free(pos_of);
}
"""


def kernel():
    """The loaded C function, or None where cpu_forward's pass cannot be built here."""
    if cpu_forward.kernel() is None:
        return None
    P, I = cpu_gemm.P_, cpu_gemm.I_
    return cpu_gemm.c_function(SOURCE, "cpu_draft", "eagle_tree_bf16",
                               (P, I, I, I, I, I, ctypes.c_float, I, P, P, P, P, P, P, P, I, P, P, P, I, P, I, I, I,
                                ctypes.c_int64, P, P, P, P, P, ctypes.c_int))


ENV = "NANOSPEC_CPU_DRAFT"  # on (default) | off: off drafts with the PyTorch loop (tests and benches compare)


def switched_on() -> bool:
    mode = os.environ.get(ENV, "on")
    if mode not in ("on", "off"):
        raise ValueError(f"{ENV} must be on or off, got {mode!r}")
    return mode == "on"


def topk_rows(x: Tensor, rows: Tensor | None, k: int) -> Tensor:
    """[M, k] indices of the k largest entries of each row x[rows] (x [R, n]; rows None: every row):
    torch.topk(x[rows], k).indices, in C for bf16 CPU rows (ties then go to the lower index; torch leaves them
    unordered)."""
    if (torch.compiler.is_compiling() or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2
            or not 1 <= k <= min(64, x.shape[1]) or not x.is_contiguous() or not switched_on()
            or topk_kernel() is None):
        return torch.topk(x if rows is None else x.index_select(0, rows), k, dim=-1).indices
    rows = torch.arange(x.shape[0]) if rows is None else rows.to(torch.int64).contiguous()
    lo, hi = rows.aminmax()  # (the C loop reads rows unchecked)
    if int(lo) < 0 or int(hi) >= x.shape[0]:
        raise IndexError(f"row index out of range [0, {x.shape[0]})")
    out = torch.empty(rows.shape[0], k, dtype=torch.int64)
    topk_kernel()(x.data_ptr(), x.shape[1], rows.data_ptr(), rows.shape[0], k, out.data_ptr(), torch.get_num_threads())
    return out


def topk_kernel():
    if cpu_forward.kernel() is None:
        return None
    P, I = cpu_gemm.P_, cpu_gemm.I_
    return cpu_gemm.c_function(SOURCE, "cpu_draft", "topk_rows_bf16", (P, I, P, I, I, P, ctypes.c_int))


def append_kernel():
    if cpu_forward.kernel() is None:
        return None
    P, I = cpu_gemm.P_, cpu_gemm.I_
    return cpu_gemm.c_function(SOURCE, "cpu_draft", "nanospec_append",
                               (P, P, I, I, I, P, P, P, P, P, P, P, ctypes.c_int, P, P, P, P, P, I, I, I, P, P, P, P))


def append(v, new: Tensor, valid: Tensor) -> bool:
    """NanoSpec's _append in C where it applies (CPU, cpu_gemm's row writer serves the vocabulary, eager, on);
    False where the caller's PyTorch version must run."""
    if (torch.compiler.is_compiling() or new.device.type != "cpu" or not v.c_rows or v.packed is None
            or not switched_on() or append_kernel() is None):
        return False
    new, valid = new.long().contiguous(), valid.to(torch.bool).contiguous()
    n = new.shape[0]
    cand, slot, flags = torch.empty(2 * n, dtype=torch.int64), torch.empty(2 * n, dtype=torch.int64), torch.empty(2 * n, dtype=torch.uint8)
    append_kernel()(new.data_ptr(), valid.data_ptr(), n, v.V, v.W, v.ring.data_ptr(), v.head.data_ptr(), v.count_.data_ptr(),
       v.slot_of_.data_ptr(), v.token_of_.data_ptr(), v.winner.data_ptr(), v.fill_tok.data_ptr(), int(v.has_fill),
       v.ids.data_ptr(), v.bias.data_ptr(), v.rows.data_ptr(), v.packed.data_ptr(), v.weight.data_ptr(),
       v.weight.shape[1], cpu_gemm.PANEL, cpu_gemm.KB, cpu_gemm._SLOT.data_ptr(), cand.data_ptr(), slot.data_ptr(),
       flags.data_ptr())
    return True


def metrics_kernel():
    if cpu_forward.kernel() is None:
        return None
    P, I = cpu_gemm.P_, cpu_gemm.I_
    return cpu_gemm.c_function(SOURCE, "cpu_draft", "nanospec_metrics", (P, P, I, I, I, I, P, P, P, P))


def metrics(drafter, em: Tensor, ok: Tensor, L: Tensor) -> bool:
    """VocabDrafter.observe's metrics in C where they apply (a NanoSpec window on the CPU, eager, on): the
    emitted rows em [n] (ok [n]: in the draft vocabulary), the accepted length L (a CPU tensor: a memory
    read, not a sync); False where the caller's PyTorch version must run."""
    v, m = drafter.vocab, drafter.metrics
    if (torch.compiler.is_compiling() or not hasattr(v, "count_") or v.count_.device.type != "cpu"
            or not switched_on() or metrics_kernel() is None):
        return False
    em, ok = em.to(torch.int64).contiguous(), ok.to(torch.bool).contiguous()
    fs = getattr(v, "fill_slot_", None) if v.has_fill else None
    metrics_kernel()(em.data_ptr(), ok.data_ptr(), em.shape[0], int(L), v.V, v.W, v.count_.data_ptr(),
                     0 if fs is None else fs.data_ptr(), v.token_of_.data_ptr(), m.data_ptr())
    return True


def usable(drafter) -> bool:
    """The C search applies: an EAGLE-3 head on cpu_forward's pass, a vocabulary with cpu_gemm's packed rows
    (bf16 bias or none), eager mode, the kernel on, not switched off."""
    v, h = drafter.vocab, drafter.head
    if not switched_on():
        return False
    p, b = getattr(v, "packed", None), getattr(v, "bias", None)
    return (h.cpu_pass is not None and h.kv is not None and p is not None and cpu_gemm.enabled()
            and (b is None or b.dtype == torch.bfloat16) and v.ids.shape[0] >= drafter.topk
            and not torch.compiler.is_compiling() and kernel() is not None)


def update_kernel():
    if cpu_forward.kernel() is None:
        return None
    P, I = cpu_gemm.P_, cpu_gemm.I_
    return cpu_gemm.c_function(SOURCE, "cpu_draft", "eagle_update_bf16",
                               (P, I, I, I, I, I, ctypes.c_float, I, P, P, P, P, P, P, I, P, P, P, I, I, I, P, P, P,
                                ctypes.c_int))


def update(drafter, a, nxt: Tensor) -> bool:
    """EagleDrafter.update's head pass over the accepted path in one C call (fc, the layer, the KV write), its
    output at the last accepted position into drafter.last_out and that output's final norm into
    drafter.last_lm_in; False where the caller's PyTorch pass must run
    (EAGLE-3 aux states not contiguous bf16, fc not packed). Reads n and L on the host (CPU tensors)."""
    h, aux = drafter.head, a.aux
    fc = h.fc
    if (aux is None or aux.dtype != torch.bfloat16 or not aux.is_contiguous() or fc.packed is None
            or (fc.bias is not None and fc.bias.dtype != torch.bfloat16) or update_kernel() is None):
        return False
    A, st = h.c.args, h.cpu_pass
    S, R, n, L = h.kv.shape[3], nxt.shape[0], int(a.n), int(a.L)
    path, nxt = a.path.to(torch.int64).contiguous(), nxt.to(torch.int64).contiguous()
    if n + R > S or not 1 <= L <= R or int(path.max()) >= aux.shape[1]:
        raise ValueError(f"accepted path of {R} past the head's cache ({S}) or the step's rows")
    update_kernel()(st.table.data_ptr(), A.dim, A.n_heads, A.n_kv_heads, A.head_dim, A.intermediate_size,
                    A.norm_eps, S, h.kv.data_ptr(), h.embed_tokens.weight.data_ptr(), h.rope_cos.data_ptr(),
                    h.rope_sin.data_ptr(), fc.packed.data_ptr(), 0 if fc.bias is None else fc.bias.data_ptr(),
                    aux.shape[2], aux.data_ptr(), path.data_ptr(), nxt.data_ptr(), R, n, L,
                    drafter.last_out.data_ptr(), h.norm.weight.data_ptr(), drafter.last_lm_in.data_ptr(),
                    torch.get_num_threads())
    return True


def tree(drafter, root: Tensor, n: Tensor, k: int, depth: int, nodes: int):
    """(tokens [N], parents [N], depth [N], anc [N, N] bool) of EagleDrafter.draft's search, in one C call.
    Reads n and root on the host: CPU tensors, so a memory read, not a device sync."""
    h, v, a = drafter.head, drafter.vocab, drafter.head.c.args
    v.wait()
    st = h.cpu_pass
    S = h.kv.shape[3]
    W = v.ids.shape[0]
    if int(n) + depth * k > S or k > W:
        raise ValueError(f"draft tree of {depth} x {k} slots past the head's cache ({S}) or window ({W})")
    tokens = torch.empty(nodes, dtype=torch.int64)
    parents, dep = torch.empty_like(tokens), torch.empty_like(tokens)
    anc = torch.empty(nodes, nodes, dtype=torch.bool)
    lm_s = torch.zeros(1, dtype=torch.float64)
    r2t = drafter.row_to_tok
    ids = v.ids if v.ids.dtype == torch.int64 else v.ids.long()
    b = getattr(v, "bias", None)
    kernel()(st.table.data_ptr(), a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size, a.norm_eps, S,
             h.kv.data_ptr(), h.norm.weight.data_ptr(), h.embed_tokens.weight.data_ptr(), h.rope_cos.data_ptr(),
             h.rope_sin.data_ptr(), drafter.last_out.data_ptr(), drafter.last_lm_in.data_ptr(), int(n),
             v.packed.data_ptr(), 0 if b is None else b.data_ptr(), ids.data_ptr(), W,
             0 if r2t is None else r2t.data_ptr(), k, depth, nodes, int(root), tokens.data_ptr(), parents.data_ptr(),
             dep.data_ptr(), anc.data_ptr(), lm_s.data_ptr(), torch.get_num_threads())
    drafter.lm_head_s += float(lm_s)
    return tokens, parents, dep, anc
