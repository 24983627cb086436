"""The drafters with an LM head: EAGLE-2's dynamic tree over an EAGLE-1/2 or EAGLE-3 head, and an independent
draft model's chain. Every LM-head projection goes through `self.vocab.logits(h)` (vocab.py), which scores
the draft vocabulary's active rows only.
"""
import time

import torch
import torch.nn.functional as F
from torch import Tensor

import cpu_draft
from draft import Accepted, Drafter, Prefill, Tree, ancestor_mask, chain_tree, check_tree_budget
from eagle import EagleHead
from model import Transformer
from sampling import logits_to_probs, sample_from

def timed_lm_head(drafter, h: Tensor):
    """drafter.vocab.logits(h), adding its wall time to drafter.lm_head_s in eager mode (exact on CPU; on CUDA
    it measures launch time unless the caller syncs). Skipped under torch.compile, where it would break the graph."""
    if torch.compiler.is_compiling():
        return drafter.vocab.logits(h)
    t0 = time.perf_counter()
    out = drafter.vocab.logits(h)
    drafter.lm_head_s += time.perf_counter() - t0
    return out


class VocabDrafter(Drafter):
    """What the drafters with an LM head share: the draft vocabulary's reset at prefill, its update with each
    verification, and the request's vocabulary metrics, kept in device buffers (in-place adds replay
    correctly from a CUDA graph and cost no host sync). Its update reads the target's features."""

    project = None  # the target's LM head (hidden [.., d] -> logits), given by make_drafter: see prompt_topk
    # prompt_topk's chunks: [768, 49152] logits in one piece (75 MB) outgrow the caches, and one LM head then
    # top-k over them cost 135 ms on Zen 5 where 128-row chunks, each reduced to its top-k at once, cost 100
    PROJECT_ROWS = 128

    @property
    def reads_top(self) -> int:
        return self.vocab.k_ver  # observe appends the target's top-k_ver at the accepted positions

    @property
    def window_rows(self) -> int:
        # NanoSpec's window starts with the target's top-k_pre at each prompt position, 1 + k_pre entries a
        # position: only the last ceil(W / (1 + k_pre)) positions can be in it (a 900-token prompt's LM head
        # over every position cost 0.35 s on the AVX2 EPYC, the longest prompts more than their decoding)
        k = self.vocab.k_pre
        return 0 if k == 0 else -(-self.vocab.W // (1 + k))

    @property
    def prompt_logits(self) -> int:
        return 0 if self.project is not None else self.window_rows  # (with the LM head: prompt_topk projects)

    def prompt_topk(self, p: Prefill) -> Tensor:
        """[R, k_pre] the target's top-k_pre at the last R = min(T, window_rows) prompt positions (at least the
        last): from p.logits, or with the target's LM head projected here from p.hidden, in chunks."""
        k, T = self.vocab.k_pre, p.tokens.shape[0]
        R = min(T, self.window_rows)
        if self.project is None or R <= 1:
            return cpu_draft.topk_rows(p.logits, None, k)
        hid, c = p.hidden[0, T - R:-1], self.PROJECT_ROWS
        top = [cpu_draft.topk_rows(self.project(hid[i:i + c]), None, k) for i in range(0, R - 1, c)]
        return torch.cat(top + [cpu_draft.topk_rows(p.logits[-1:], None, k)])  # the last row as the engine's

    def rows_of(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """target token ids -> (vocab rows, valid); identity unless the head has a pruned vocabulary."""
        return ids, torch.ones_like(ids, dtype=torch.bool)

    def reset_vocab(self, p: Prefill):
        dev = p.tokens.device
        if getattr(self, "metrics", None) is None or self.metrics.device != dev:
            self.metrics = torch.zeros(5, dtype=torch.long, device=dev)  # hits, emitted, active sum, max, steps
        self.metrics.zero_()
        self.lm_head_s = 0.0
        top, _ = self.rows_of(self.prompt_topk(p))  # [R, k_pre] (k_pre 0: none)
        # the last R prompt positions, each with its top-k_pre (the window keeps the newest entries: with R
        # = prompt_logits the same window as from every position)
        rows, _ = self.rows_of(p.tokens[p.tokens.shape[0] - top.shape[0]:])
        self.vocab.reset(rows, top)

    def observe(self, a: Accepted, nxt: Tensor):
        """Coverage (paper Fig. 1b: were the emitted tokens in the active vocabulary during this step?) and
        active size, measured before this step's append; then append the tree and the target's top-k_ver."""
        vocab, dev = self.vocab, nxt.device
        on_path = torch.arange(nxt.shape[0], device=dev) < a.L
        em_rows, em_ok = self.rows_of(nxt)
        if not cpu_draft.metrics(self, em_rows, em_ok, a.L):  # (CPU: the same in one C call)
            hits = (vocab.contains(em_rows) & em_ok & on_path).sum()
            act = vocab.active_size().long()
            m = self.metrics
            m.add_(torch.stack([hits, a.L.long(), act, torch.zeros_like(act), torch.ones_like(act)]))
            m[3:4].copy_(torch.maximum(m[3:4], act.view(1)))
        ver = (a.top if a.top is not None and a.top.shape[1] == vocab.k_ver   # [D+1, k_ver]
               else cpu_draft.topk_rows(a.logits, a.path, vocab.k_ver))
        drows, dvalid = self.rows_of(a.tree.tokens)
        vrows, vvalid = self.rows_of(ver)
        dvalid, vvalid = dvalid & a.tree.valid, vvalid & on_path[:, None]
        W = getattr(vocab, "W", None)
        if W is not None and drows.shape[0] + vrows.numel() > W:
            # a catch-up chain (draft.chained: a run of autoregressive or chain-only steps) longer than the
            # window takes in one append: its older entries would leave the window anyway, so the newest
            # positions that fit go in (a chain: node i is path position i). Shapes only, no sync.
            P = W // (1 + vrows.shape[1])
            drows, dvalid, vrows, vvalid = drows[-P:], dvalid[-P:], vrows[-P:], vvalid[-P:]
        vocab.update(drows, dvalid, vrows, vvalid)

    def stats(self) -> dict:
        hits, emitted, act_sum, act_max, steps = self.metrics.tolist()
        d = dict(lm_head_s=self.lm_head_s)
        if steps:
            d.update(vocab_active_mean=round(act_sum / steps, 1), vocab_active_max=act_max,
                     vocab_coverage=round(hits / max(emitted, 1), 4), vocab_state_bytes=self.vocab.state_bytes())
        return d


class EagleDrafter(VocabDrafter):
    """EAGLE-2 dynamic tree over an EAGLE-1/2 or EAGLE-3 head.

    Draft position i holds the pair (target feature f_i, token x_{i+1}); its output predicts x_{i+2}."""

    def __init__(self, head: EagleHead, vocab, topk=10, depth=5, nodes=60, project=None):
        check_tree_budget(topk, depth, nodes)
        self.head, self.vocab, self.project = head, vocab, project
        self.topk, self.depth, self.nodes = topk, depth, nodes
        self.lm_head_s = 0.0  # wall time inside vocab.logits (accurate on CPU; on CUDA only when synced)
        # row <-> token maps for heads with a pruned vocabulary (EAGLE-3 d2t); identity otherwise
        self.tok_to_row = self.token_to_row_map(head)
        self.row_to_tok = None if self.tok_to_row is None else torch.arange(head.c.draft_vocab_size, device=head.d2t.device) + head.d2t

    @staticmethod
    def token_to_row_map(head: EagleHead) -> Tensor | None:
        """[V] target token -> draft row (-1 when the pruned draft vocabulary lacks it), None if unpruned."""
        if not hasattr(head, "d2t"):
            return None
        Vd, dev = head.c.draft_vocab_size, head.d2t.device
        t2r = torch.full((head.c.args.vocab_size,), -1, dtype=torch.long, device=dev)
        return t2r.index_copy(0, torch.arange(Vd, device=dev) + head.d2t, torch.arange(Vd, device=dev))

    def setup(self, max_seq: int):
        self.head.setup_caches(max_seq + self.depth * self.topk)
        d, w = self.head.c.args.dim, self.head.fc.weight
        if getattr(self, "last_out", None) is None:
            # persistent state buffers, written with copy_: captured graphs keep reading the same memory
            self.last_out = torch.zeros(d, dtype=w.dtype, device=w.device)
            self.last_lm_in = torch.zeros(d, dtype=w.dtype, device=w.device)

    def rows_of(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """target token ids -> (vocab rows, valid) (a pruned draft vocabulary lacks some tokens)."""
        if self.tok_to_row is None:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        r = self.tok_to_row[ids]
        return r.clamp(min=0), r >= 0

    def tokens_of(self, rows: Tensor) -> Tensor:
        return rows if self.row_to_tok is None else self.row_to_tok[rows]

    def _logp(self, lm_in: Tensor) -> tuple[Tensor, Tensor]:
        scores, ids = timed_lm_head(self, lm_in)  # [..., n], [n] rows
        return torch.log_softmax(scores.float(), dim=-1), ids

    def _features(self, hidden: Tensor, aux: Tensor | None) -> Tensor:
        return aux if self.head.c.version == 3 else hidden  # EAGLE-3 reads three aux layers, EAGLE-1/2 the last

    @torch.no_grad()
    def prefill(self, p: Prefill):
        """Runs the head over the prompt: position t holds (target feature f_t, token x_{t+1})."""
        next_tokens = torch.cat([p.tokens[1:], p.first.view(1)])  # [T]
        pos = torch.arange(next_tokens.shape[0], device=next_tokens.device)
        h = self.head
        out, lm_in = h(next_tokens[None], h.project(self._features(p.hidden, p.aux)), pos, pos,
                       h.seq_range[None, :] <= pos[:, None])
        self.last_out.copy_(out[0, -1])
        self.last_lm_in.copy_(lm_in[0, -1])
        self.reset_vocab(p)

    @torch.no_grad()
    def update(self, a: Accepted):
        """Runs the head over the accepted path (padded to D+1) and keeps the last accepted position's state."""
        nxt = a.next_tokens()
        h = self.head
        if cpu_draft.usable(self) and h.c.version == 3 and cpu_draft.update(self, a, nxt):
            # the head's pass in one C call (its ~20 eager ops cost more than its layer), the norm of its last row too
            self.observe(a, nxt)
            return
        feats = self._features(a.hidden, a.aux).index_select(1, a.path)  # [1, D+1, F]
        pos = a.n + torch.arange(nxt.shape[0], device=nxt.device)
        out, lm_in = h(nxt[None], h.project(feats), pos, pos, h.seq_range[None, :] <= pos[:, None])
        idx = (a.L - 1).view(1)
        self.last_out.copy_(out[0].index_select(0, idx)[0])
        self.last_lm_in.copy_(lm_in[0].index_select(0, idx)[0])
        self.observe(a, nxt)

    def budget_key(self, hist: list[int]) -> str:
        """The statistics budget.Budgets keeps for the next step (hist: every token so far, the next root last)."""
        return "eagle"

    def shape_for(self, budget: int | None) -> tuple[int, int, int]:
        """(top-k, depth, nodes) of the tree drafted for a budget of verified nodes: the configured tree, or
        for a smaller budget a search scaled to it (top-k up to half the budget, depth up to budget - 1), so
        drafting costs what the budget verifies (on the AVX2 CPU the full 16-node draft costs about half a
        decode step, a 4-node one a fifth; a 2-node tree is the root's best child alone: no head forward).
        One static shape per budget size."""
        if budget is None or budget >= self.nodes:
            return self.topk, self.depth, self.nodes
        return min(self.topk, max(1, budget // 2)), min(self.depth, budget - 1), budget

    @torch.no_grad()
    def draft(self, root: Tensor, n: Tensor, budget: int | None = None) -> Tree:
        """EAGLE-2: expand the top-k frontier by cumulative log-probability for `depth` levels,
        then keep the best `nodes - 1` candidates (shape_for: scaled to a smaller budget). Static shapes
        throughout, no host syncs."""
        k, D, N = self.shape_for(budget)
        if cpu_draft.usable(self):  # the whole search in one C call: a level's ~30 eager ops cost more than its layer
            tokens, parents, depth, anc = cpu_draft.tree(self, root, n, k, D, N)
            return Tree(tokens, parents, depth, anc, torch.ones(N, dtype=torch.bool), None, D)
        h, dev = self.head, root.device
        logp, ids = self._logp(self.last_lm_in[None])  # [1, n_rows]
        s, idx = torch.topk(logp[0], k)  # [k]
        cand_tok, cand_score, cand_parent = [self.tokens_of(ids[idx])], [s], [torch.full((k,), -1, device=dev)]
        fr_tok, fr_score, fr_cand = cand_tok[0], s, torch.arange(k, device=dev)
        fr_feat = self.last_out[None].expand(k, -1)  # [k, d]
        fr_anc = F.one_hot(torch.arange(k, device=dev), D * k).bool()  # frontier ancestors among draft slots
        base = 0  # index of the first candidate of the current level
        for lvl in range(1, D):
            slots = n + (lvl - 1) * k + torch.arange(k, device=dev)  # draft cache slots of this frontier
            mask = (h.seq_range[None, :] < n) | self._slot_mask(fr_anc, n)
            out, lm_in = h(fr_tok[None], fr_feat[None], (n + lvl - 1).expand(k), slots, mask)
            logp, ids = self._logp(lm_in[0])  # [k, n_rows]
            s, idx = torch.topk(logp, k, dim=-1)  # [k, k]
            sc = (fr_score[:, None] + s).flatten()  # cumulative log-prob of the k*k children
            tok = self.tokens_of(ids[idx]).flatten()
            parent = fr_cand.repeat_interleave(k)
            cand_tok.append(tok), cand_score.append(sc), cand_parent.append(parent)
            base += k if lvl == 1 else k * k
            top = torch.topk(sc, k).indices  # next frontier: best k of the k*k
            prow = top // k
            fr_tok, fr_score, fr_cand = tok[top], sc[top], base + top
            fr_feat = out[0, prow]
            fr_anc = fr_anc[prow] | F.one_hot(lvl * k + torch.arange(k, device=dev), D * k).bool()
        return self._rerank(torch.cat(cand_tok), torch.cat(cand_score), torch.cat(cand_parent), root, k, D, N)

    def _slot_mask(self, fr_anc: Tensor, n: Tensor) -> Tensor:
        # place the [k, D*k] ancestor rows at draft cache columns n .. n + D*k
        k = fr_anc.shape[0]
        m = torch.zeros(k, self.head.seq_range.shape[0], dtype=torch.bool, device=fr_anc.device)
        return m.index_copy(1, n + torch.arange(fr_anc.shape[1], device=fr_anc.device), fr_anc)

    def _rerank(self, tok, score, parent, root, k, D, N) -> Tree:
        dev, C = tok.device, tok.shape[0]
        level = torch.cat([torch.zeros(k, device=dev), torch.arange(1, D, device=dev).repeat_interleave(k * k)])
        # a child's score never exceeds its parent's; the small depth penalty breaks exact ties the same
        # way, so a selected child's parent is always selected too
        key = torch.nan_to_num(score, nan=-1e30, neginf=-1e30) - 1e-4 * level
        sel = torch.sort(torch.topk(key, N - 1).indices).values  # [N-1], candidate order = parents first
        # then best first (stable: ties keep parents first), so every prefix is the tree of a smaller budget
        sel = sel[torch.sort(key[sel], descending=True, stable=True).indices]
        pos_of = torch.full((C,), -1, dtype=torch.long, device=dev).index_copy(0, sel, torch.arange(N - 1, device=dev))
        cp = parent[sel]
        parents = torch.cat([torch.tensor([-1], device=dev), torch.where(cp < 0, 0, pos_of[cp.clamp(min=0)] + 1)])
        depth = torch.cat([torch.zeros(1, device=dev), level[sel] + 1]).long()
        tokens = torch.cat([root.view(1), tok[sel]])
        anc = ancestor_mask(parents, D)
        return Tree(tokens, parents, depth, anc, torch.ones(N, dtype=torch.bool, device=dev), None, D)


class ModelDrafter(VocabDrafter):
    """An independent small model sharing the target's tokenizer; drafts a chain of k tokens."""

    def __init__(self, model: Transformer, vocab, k=5, sampling=None):
        if k < 1:
            raise ValueError(f"--spec-k must be >= 1, got {k}")
        self.model, self.vocab, self.k, self.sampling = model, vocab, k, sampling
        self.depth, self.nodes = k, k + 1
        self.lm_head_s = 0.0

    def budget_key(self, hist: list[int]) -> str:
        return "model"

    def setup(self, max_seq: int):
        # the chain needs k + 1 slots past the verified prefix; the engine's cache budget already counts
        # them, so clamping to the draft's context only drops slack
        self.model.setup_caches(1, min(max_seq + self.k + 1, self.model.args.max_position_embeddings))
        if getattr(self, "prev", None) is None:
            self.prev = torch.zeros(1, dtype=torch.long, device=self.model.lm_head.weight.device)

    @torch.no_grad()
    def prefill(self, p: Prefill):
        T = p.tokens.shape[0]
        self.model(p.tokens[None], torch.arange(T, device=p.tokens.device), compute_logits=False)
        self.prev.copy_(p.tokens[-1:])
        self.reset_vocab(p)

    @torch.no_grad()
    def draft(self, root: Tensor, n: Tensor, budget: int | None = None) -> Tree:
        m, k = self.model, self.k
        # re-feed the previous token with the root: its KV is missing when the whole last chain was accepted
        toks, pos = torch.cat([self.prev, root.view(1)]), n - 1 + torch.arange(2, device=n.device)
        chain, qs = [root.view(1)], []
        for i in range(k):
            _, h, _ = m(toks[None], pos, return_hidden=True, compute_logits=False)
            scores, ids = timed_lm_head(self, h[0, -1])  # [n_rows]
            if self.sampling is None or self.sampling.greedy:
                nxt = ids.index_select(0, torch.argmax(scores).view(1))
            else:
                # index_add: inactive slots (prob 0) may repeat a token id, adding 0 keeps the real entry
                q = torch.zeros(m.args.vocab_size, device=n.device).index_add(0, ids, logits_to_probs(scores, self.sampling))
                qs.append(q)
                nxt = sample_from(q).view(1)
            chain.append(nxt)
            toks, pos = nxt, pos[-1:] + 1
        q = torch.stack(qs + [torch.zeros_like(qs[0])]) if qs else None
        return chain_tree(torch.cat(chain), q=q)

    def update(self, a: Accepted):
        # the cache already holds root + accepted chain tokens at the right positions
        self.prev.copy_(a.tree.tokens.index_select(0, a.path.index_select(0, (a.L - 1).view(1))))
        self.observe(a, a.next_tokens())
