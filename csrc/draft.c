/* The EAGLE-3 draft step (cpu_draft.py): tree search, head update, NanoSpec's window, top-k rows */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "nanospec.h"
#include "ops.h"

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
void nanospec_append(const Window* w, const int64_t* new_in, const uint8_t* valid_in, long n, int64_t* cand,
                     int64_t* slot, uint8_t* flags) {
    const long V = w->V, W = w->W;
    int64_t *ring = w->ring, *head = w->head, *token_of = w->token_of, *ids = w->ids;
    int32_t *count = w->count, *slot_of = w->slot_of, *winner = w->winner;
    const int64_t* fill_tok = w->fill_tok;
    const int has_fill = w->has_fill;
    uint16_t* bias = w->bias;
    const RowsDst* rows = w->dst.rows || w->dst.fast ? &w->dst : 0;
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
            write_rows(rows, fill_tok + dead, &dead, 1);
    }
    for (long c = 0; c < m; c++) slot[c] = W;
    for (long c = 0; c < m; c++) {  /* a born fill token takes its own slot where free (fill ids are distinct) */
        int32_t own = has_fill && (flags[c] & 1) ? w->fill_slot[cand[c]] : -1;
        if (own < 0 || token_of[own] >= 0) continue;
        slot[c] = own;
        token_of[own] = cand[c];
        slot_of[cand[c]] = own;
        flags[c] |= 4;
    }
    long br = 0;
    for (long s = W - 1; s >= 0 && br < m; s--) {  /* the k-th other born id takes the k-th free slot from the top */
        if (token_of[s] >= 0) continue;
        while (br < m && (!(flags[br] & 1) || (flags[br] & 4))) br++;
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
    if (rows) write_rows(rows, cand, slot, n);  /* born ids are all new */
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
    const StackArgs a = {h->tab, 1, D, h->H, h->Hkv, hd, h->I, h->eps, T, h->S, x, emb, cs, sn, mask, 0, h->S, cpos,
                         h->kv, 0, &no_aux, 0, aux_dummy, 0, threads};
    stack_bf16(&a);
    free(emb); free(cs); free(sn);
}

/* EagleDrafter.update's head pass in one call: the accepted path's R positions (padded to the tree's depth +
   1): fc over their aux states (rows path[i] of aux [N, F], fc packed as fcP, bias fcb or 0), the head layer
   at slots n .. n + R - 1 (causal over the cache), writing the head's KV; out1 [D] = the output at position
   L - 1 (the next draft's features), lm1 [D] = its final norm (norm_w: the next draft's LM-head input, as
   eagle_tree_bf16 norms its frontier; in torch after the call, one row's norm had cost ~0.15 ms: cold caches) */
void eagle_update_bf16(const UpdateArgs* a) {
    const Head hh = a->head;
    const long D = hh.D, S = hh.S, F = a->F, R = a->R, n = a->n, L = a->L;
    const float eps = hh.eps;
    const uint16_t *fcP = a->fcP, *fcb = a->fcb, *aux = a->aux, *norm_w = a->norm_w;
    const int64_t *path = a->path, *nxt = a->nxt;
    uint16_t *out1 = a->out1, *lm1 = a->lm1;
    const int threads = a->threads;
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
void eagle_tree_bf16(const TreeArgs* a) {
    const Head hh = a->head;
    const long D = hh.D, S = hh.S, n = a->n, W = a->W, k = a->k, depth = a->depth, N = a->N;
    const float eps = hh.eps;
    const uint16_t *norm_w = a->norm_w, *out0 = a->out0, *lm0 = a->lm0, *P = a->P, *b = a->b;
    const int64_t *ids = a->ids, *r2t = a->r2t, root = a->root;
    int64_t *tokens = a->tokens, *parents = a->parents, *depth_out = a->depth_out;
    uint8_t* anc = a->anc;
    double* lm_s = a->lm_s;
    const int threads = a->threads;
    const long C = k + (depth - 1) * k * k, A = depth * k;  /* candidates; ancestor bits (draft slots) */
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
