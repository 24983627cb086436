"""An independent draft model (a small model sharing the target's tokenizer): EAGLE-2 dynamic trees, or chains, of
its own top-k, one pass of the model per level; its KV cache follows the accepted path."""
import torch
from torch import Tensor

from budget import SIZES
from draft import Accepted, Prefill, Tree, check_tree_budget, top_pick, tree_search
from draft_eagle import VocabDrafter, timed_lm_head
from model import Transformer
from sampling import logits_to_probs, sample_from

CHAIN_MAX = 7  # budgets up to 7 nodes draft chains (2-6 tokens): a level costs a pass of the model, wide or not


def sampled_pick(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """tree_search's pick for a sampled chain (k = 1): a draw from exp(logp), which the p/q rule accepts."""
    idx = sample_from(logp.exp())[..., None]
    return logp.gather(-1, idx), idx


class ModelDrafter(VocabDrafter):
    """EAGLE-2's search over a draft model: per level one pass over the frontier's k tokens (positions n + level,
    slots past the catch-up rows, a mask of the cached prefix and each row's ancestors), top-k children by cumulative
    log-prob, the best k as the next frontier, then rerank. Its proposals are its own top-k (deterministic), so tree
    acceptance stays exact when sampling; a sampled chain (top-k 1 with sampling) draws and carries q (p/q rule).

    The cache: slots 0 .. c-1 hold positions 0 .. c-1; hist holds every token by position. A draft first feeds
    positions c .. n (the accepted tokens it never fed, then the root) in one pass; update moves the accepted nodes
    it fed (the root, then frontier nodes whose token paths the accepted path follows) to slots n, n+1, ..."""

    reads_states = False  # tokens only (and the target's top-k for NanoSpec's window)
    k_ver_at = "verified"  # NanoSpec: the target's top-k at every verified node (a draft model's window keeps up)
    traced = False  # a traced draft has run: its catch-up pass has a static width (update keeps within it)

    def __init__(self, model: Transformer, vocab, k: int = 5, sampling=None, tree: tuple | None = None,
                 project=None):
        """tree: (top-k, depth, nodes); None: a chain of k tokens. project: the target's LM head (prompt_topk)."""
        if tree is None:
            if k < 1:
                raise ValueError(f"--spec-k must be >= 1, got {k}")
            tree = (1, k, k + 1)
        topk, depth, nodes = tree
        check_tree_budget(topk, depth, nodes)
        self.model, self.vocab, self.sampling, self.project = model, vocab, sampling, project
        self.topk, self.depth, self.nodes = topk, min(depth, nodes - 1), nodes  # (deeper levels could not be kept)
        chains = range(min(3, nodes), min(CHAIN_MAX, nodes) + 1)
        self.sizes = sorted({1, *chains, *(s for s in SIZES if CHAIN_MAX < s < nodes), nodes})
        self.start = max([s for s in self.sizes[1:] if self.shape_for(s)[0] == 1], default=nodes)

    def budget_key(self, hist: list[int]) -> str:
        return "model"

    def stats(self) -> dict:
        return dict(super().stats(), draft_passes=int(getattr(self, "passes", 0)))

    def budget_sizes(self, key: str | None = None) -> list[int]:
        return self.sizes

    def budget_start(self, key: str) -> int:
        return self.start

    def shape_for(self, budget: int | None) -> tuple[int, int, int]:
        """(top-k, depth, nodes) for a budget: chains up to CHAIN_MAX nodes, trees of the configured depth past it."""
        if budget is None or budget >= self.nodes:
            return self.topk, self.depth, self.nodes
        if self.topk == 1 or budget - 1 <= min(self.depth, CHAIN_MAX - 1):
            return 1, budget - 1, budget
        D = min(self.depth, budget - 1)
        return min(self.topk, max(2, -(-(budget - 1) // D))), D, budget

    def setup(self, max_seq: int):
        m, R = self.model, self.depth + 2
        seq = min(max_seq + R, m.args.max_position_embeddings)
        slots = seq + R + self.depth * self.topk  # the catch-up rows, then each level's frontier
        m.setup_caches(1, seq, slots)
        dev = m.norm.weight.device
        if getattr(self, "hist", None) is None or self.hist.shape[0] != slots + 1:
            # persistent state, written in place: captured graphs keep reading the same memory
            self.hist = torch.zeros(slots + 1, dtype=torch.long, device=dev)  # tokens by position; the last: a sink
            self.c = torch.zeros((), dtype=torch.long, device=dev)
            self.fed_n = torch.full((), -1, dtype=torch.long, device=dev)  # the last draft's n (-1: consumed)
            self.fed_tok = torch.full((self.depth, self.topk, self.depth), -1, dtype=torch.long, device=dev)
            self.fed_slot = torch.zeros(self.depth, self.topk, dtype=torch.long, device=dev)
            # the draft model's passes this request, prefill included (bench_gguf's bytes per token); a tensor:
            # a Python counter would be a guard, recompiling a compiled step at every value
            self.passes = torch.zeros((), dtype=torch.long, device=dev)

    @staticmethod
    def _tracing() -> bool:
        return torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def _forward(self, toks: Tensor, pos: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        self.passes.add_(1)
        _, h, _ = self.model(toks[None], pos, mask=mask, cache_pos=slots, return_hidden=True, compute_logits=False)
        return h[0]

    def _catch_up(self, R: int, n: Tensor, root: Tensor | None = None) -> Tensor:
        """One pass over positions c .. c + R - 1: the tokens not fed yet (below n), the root at n, pads past it."""
        pos = self.c + torch.arange(R, device=n.device)
        toks = self.hist[pos] if root is None else torch.where(pos < n, self.hist[pos], root)
        return self._forward(toks, torch.minimum(pos, n), pos, self.model.causal_mask(pos))

    @torch.no_grad()
    def prefill(self, p: Prefill):
        T = p.tokens.shape[0]
        self.hist[:T].copy_(p.tokens)
        self.passes.zero_()
        self.c.zero_()
        self.fed_n.fill_(-1)
        self._catch_up(T, self.c + T)
        self.c.fill_(T)
        self.reset_vocab(p)

    def _logp(self, h: Tensor, qs: list | None) -> tuple[Tensor, Tensor]:
        scores, ids = timed_lm_head(self, h)  # [r, n_rows], [n_rows]
        if qs is None:
            return torch.log_softmax(scores.float(), dim=-1), ids
        probs = logits_to_probs(scores, self.sampling)
        # index_add: inactive slots (prob 0) may repeat a token id, adding 0 keeps the real entry
        qs.append(torch.zeros(self.model.args.vocab_size, device=h.device).index_add(0, ids, probs[0]))
        return probs.log(), ids

    @torch.no_grad()
    def draft(self, root: Tensor, n: Tensor, budget: int | None = None) -> Tree:
        k, D, N = self.shape_for(budget)
        m, dev = self.model, n.device
        self.c.copy_(torch.minimum(self.c, n))  # drafting at n again (tests, the hybrid) feeds the root again
        if self._tracing():
            R, self.traced = self.depth + 2, True  # static: at most depth + 1 tokens wait (update)
        else:
            R = int(n - self.c) + 1  # (a CPU read; on CUDA after the engine's own sync of this step)
        h = self._catch_up(R, n, root).index_select(0, (n - self.c).view(1))  # the root's row
        base = self.c + R  # the frontier's slots follow the catch-up rows
        self.hist.index_copy_(0, n.view(1), root)
        self.c.copy_(n + 1)
        self.fed_n.copy_(n)
        self.fed_tok.fill_(-1)
        qs = [] if k == 1 and self.sampling is not None and not self.sampling.greedy else None
        no_slots = torch.zeros(k, m.seq_range.shape[0], dtype=torch.bool, device=dev)
        paths = []  # each level's frontier token paths, for update to find the accepted nodes fed here

        def expand(lvl, fr):
            paths.append(fr.tokens[:, None] if lvl == 1 else torch.cat([paths[-1][fr.parent], fr.tokens[:, None]], 1))
            slots = base + (lvl - 1) * k + torch.arange(k, device=dev)
            self.fed_tok[lvl, :k, :lvl].copy_(paths[-1])
            self.fed_slot[lvl, :k].copy_(slots)
            mask = (m.seq_range[None, :] <= n) | no_slots.index_copy(1, base + torch.arange(D * k, device=dev), fr.anc)
            return self._logp(self._forward(fr.tokens, (n + lvl).expand(k), slots, mask), qs)

        logp, ids = self._logp(h, qs)
        t = tree_search(logp[0], ids, expand, root, k, D, N, sampled_pick if qs is not None else top_pick)
        if qs is not None:  # node i's children came from the i-th level's distribution
            t.q = torch.stack(qs + [torch.zeros_like(qs[0])])
        return t

    def _fed(self, a: Accepted, pt: Tensor) -> tuple[Tensor, Tensor]:
        """(F, src): the accepted path's first F nodes have KV in the cache (the root and frontier nodes whose token
        paths it follows: KV depends on tokens and positions only), at slots src [depth] (past F: no move)."""
        Dm, dev = self.depth, pt.device
        lv = torch.arange(Dm, device=dev)
        want = torch.cat([pt[1:Dm + 1], pt.new_full((max(Dm + 1 - pt.shape[0], 0),), -2)])  # path tokens, depth 1..
        ok = ((self.fed_tok == want) | (lv >= lv[:, None, None])).all(-1) & (self.fed_tok[:, :, 0] >= 0)
        run = torch.cumprod((ok.any(-1) & (lv < a.L))[1:].long(), 0).sum()  # levels fed in a row from level 1
        F = torch.where(a.n == self.fed_n, 1 + run, 0)
        slot = self.fed_slot.gather(1, ok.int().argmax(-1, keepdim=True))[:, 0]
        return F, torch.where((lv < F) & (lv > 0), slot, a.n + lv)

    @torch.no_grad()
    def update(self, a: Accepted):
        pt = a.tree.tokens.index_select(0, a.path)  # [D+1] path tokens, root first (padded past L)
        F, src = self._fed(a, pt)
        self.model.compact_kv(src, a.n)  # the fed accepted nodes to slots n, n+1, ...
        self.c.copy_(torch.where(a.n == self.fed_n, a.n + F, self.c))
        j = torch.arange(pt.shape[0], device=pt.device)
        self.hist.index_copy_(0, torch.where(j < a.L, a.n + j, self.hist.shape[0] - 1), pt)
        self.fed_n.fill_(-1)
        if self.traced and not self._tracing():
            # after an untraced catch-up (a run of held steps) a traced draft's static pass must still reach the root
            if (wait := int(a.n + a.L - self.c)) > self.depth:
                self._catch_up(wait, a.n + a.L)
                self.c.add_(wait)
        self.observe(a, a.next_tokens())
