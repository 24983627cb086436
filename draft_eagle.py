"""The drafters with an LM head (`self.vocab.logits`, vocab.py): the vocabulary's updates and metrics every such drafter
shares (`VocabDrafter`), and EAGLE-2 trees over an EAGLE head; a draft model's are in draft_model.py."""
import time

import torch
from torch import Tensor

import cpu_draft
from draft import Accepted, Drafter, Prefill, Tree, check_tree_budget, tree_search
from eagle import EagleHead


def timed_lm_head(drafter, h: Tensor):
    """drafter.vocab.logits(h), its eager wall time added to drafter.lm_head_s (on CUDA: launch time only)."""
    if torch.compiler.is_compiling():
        return drafter.vocab.logits(h)
    t0 = time.perf_counter()
    out = drafter.vocab.logits(h)
    drafter.lm_head_s += time.perf_counter() - t0
    return out


class VocabDrafter(Drafter):
    """The draft vocabulary's reset and updates, and its metrics in device buffers (no host sync)."""

    project = None  # the target's LM head (hidden -> logits), given by make_drafter: see prompt_topk
    lm_head_s = 0.0
    tok_to_row = None  # [V] target token -> draft row (-1: absent) of a pruned vocabulary, None if unpruned
    PROJECT_ROWS = 128  # prompt_topk's chunks: 128-row chunks stay in cache (100 ms vs 135 on Zen 5 at 768 rows)
    k_ver_at = "accepted"  # NanoSpec's appends of the target's top-k_ver: at the accepted positions, or "verified"

    @property
    def reads_top(self) -> int:
        return self.vocab.k_ver

    @property
    def reads_every_top(self) -> bool:
        return self.k_ver_at == "verified"

    @property
    def window_rows(self) -> int:
        # the window holds 1 + k_pre entries per prompt position: only the last ceil(W / (1 + k_pre)) fit in it
        k = self.vocab.k_pre
        return 0 if k == 0 else -(-self.vocab.W // (1 + k))

    @property
    def prompt_logits(self) -> int:
        return 0 if self.project is not None else self.window_rows

    def prompt_topk(self, p: Prefill) -> Tensor:
        """[R, k_pre] the target's top-k at the last R = min(T, window_rows) prompt positions (projected here)."""
        k, T = self.vocab.k_pre, p.tokens.shape[0]
        R = min(T, self.window_rows)
        if self.project is None or R <= 1:
            return cpu_draft.topk_rows(p.logits, None, k)
        hid, c = p.hidden[0, T - R:-1], self.PROJECT_ROWS
        top = [cpu_draft.topk_rows(self.project(hid[i:i + c]), None, k) for i in range(0, R - 1, c)]
        return torch.cat(top + [cpu_draft.topk_rows(p.logits[-1:], None, k)])  # the last row as the engine's

    def rows_of(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """target token ids -> (vocab rows, valid); identity unless the head has a pruned vocabulary."""
        if self.tok_to_row is None:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        r = self.tok_to_row[ids]
        return r.clamp(min=0), r >= 0

    def reset_vocab(self, p: Prefill):
        dev = p.tokens.device
        if getattr(self, "metrics", None) is None or self.metrics.device != dev:
            self.metrics = torch.zeros(5, dtype=torch.long, device=dev)  # hits, emitted, active sum, max, steps
        self.metrics.zero_()
        self.lm_head_s = 0.0
        top, _ = self.rows_of(self.prompt_topk(p))  # [R, k_pre]: the last R prompt positions fill the window
        rows, _ = self.rows_of(p.tokens[p.tokens.shape[0] - top.shape[0]:])
        self.vocab.reset(rows, top)

    def observe(self, a: Accepted, nxt: Tensor):
        """Coverage (paper Fig. 1b) and active size; then append the tree and the target's top-k_ver."""
        vocab, dev = self.vocab, nxt.device
        on_path = torch.arange(nxt.shape[0], device=dev) < a.L
        em_rows, em_ok = self.rows_of(nxt)
        if not cpu_draft.metrics(self, em_rows, em_ok, a.L):  # (CPU: the same in one C call)
            hits = (vocab.contains(em_rows) & em_ok & on_path).sum()
            act = vocab.active_size().long()
            m = self.metrics
            m.add_(torch.stack([hits, a.L.long(), act, torch.zeros_like(act), torch.ones_like(act)]))
            m[3:4].copy_(torch.maximum(m[3:4], act.view(1)))
        at = on_path  # the positions whose top-k_ver goes in: the accepted ones, or every verified node
        every = self.k_ver_at == "verified"
        if a.top is not None and a.top.shape[1] == vocab.k_ver:
            ver = a.top  # [D+1, k_ver], or every verified node's [N, k_ver] (a kept step of the batch engine's)
            at = a.tree.valid[:ver.shape[0]] if every else on_path
        elif vocab.k_ver:
            ver = cpu_draft.topk_rows(a.logits, None if every else a.path, vocab.k_ver)
            at = a.tree.valid[:ver.shape[0]] if every else on_path
        else:
            ver = a.path.new_zeros(a.path.shape[0], 0)  # (a static vocabulary appends nothing)
        drows, dvalid = self.rows_of(a.tree.tokens)
        vrows, vvalid = self.rows_of(ver)
        dvalid, vvalid = dvalid & a.tree.valid, vvalid & at[:, None]
        W = getattr(vocab, "W", None)
        if W is not None and drows.shape[0] + vrows.numel() > W:
            # a catch-up chain (draft.chained) longer than the window: only its newest positions would stay
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
    """EAGLE-2 dynamic tree. Draft position i holds (target feature f_i, token x_{i+1}) and predicts x_{i+2}."""

    def __init__(self, head: EagleHead, vocab, topk=10, depth=5, nodes=60, project=None):
        check_tree_budget(topk, depth, nodes)
        self.head, self.vocab, self.project = head, vocab, project
        self.aux_layers = tuple(head.c.aux_layers) if head.c.version == 3 else ()
        self.topk, self.depth, self.nodes = topk, depth, nodes
        self.tok_to_row = self.token_to_row_map(head)  # row <-> token maps of a pruned vocabulary (EAGLE-3 d2t)
        self.row_to_tok = None if self.tok_to_row is None else (
            torch.arange(head.c.draft_vocab_size, device=head.d2t.device) + head.d2t)

    @staticmethod
    def token_to_row_map(head: EagleHead) -> Tensor | None:
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

    def tokens_of(self, rows: Tensor) -> Tensor:
        return rows if self.row_to_tok is None else self.row_to_tok[rows]

    def _logp(self, lm_in: Tensor) -> tuple[Tensor, Tensor]:
        scores, ids = timed_lm_head(self, lm_in)  # [..., n], [n] rows
        return torch.log_softmax(scores.float(), dim=-1), ids

    @torch.no_grad()
    def prefill(self, p: Prefill):
        nxt, h = torch.cat([p.tokens[1:], p.first.view(1)]), self.head  # [T]
        pos = torch.arange(nxt.shape[0], device=nxt.device)
        out, lm_in = h(nxt[None], h.project(p.aux if h.c.version == 3 else p.hidden), pos, pos,
                       h.seq_range[None, :] <= pos[:, None])
        self.last_out.copy_(out[0, -1])
        self.last_lm_in.copy_(lm_in[0, -1])
        self.reset_vocab(p)

    @torch.no_grad()
    def update(self, a: Accepted):
        nxt, h = a.next_tokens(), self.head
        # CPU: one C call, the head's ~20 eager ops cost more than its layer
        if not (cpu_draft.usable(self) and h.c.version == 3 and cpu_draft.update(self, a, nxt)):
            feats = (a.aux if h.c.version == 3 else a.hidden).index_select(1, a.path)  # [1, D+1, F]: EAGLE-3 reads aux
            pos = a.n + torch.arange(nxt.shape[0], device=nxt.device)
            out, lm_in = h(nxt[None], h.project(feats), pos, pos, h.seq_range[None, :] <= pos[:, None])
            idx = (a.L - 1).view(1)
            self.last_out.copy_(out[0].index_select(0, idx)[0])
            self.last_lm_in.copy_(lm_in[0].index_select(0, idx)[0])
        self.observe(a, nxt)

    def budget_key(self, hist: list[int]) -> str:
        return "eagle"

    def shape_for(self, budget: int | None) -> tuple[int, int, int]:
        """(top-k, depth, nodes) for a budget: drafting costs what it verifies (CPU: 16 nodes half a step)."""
        if budget is None or budget >= self.nodes:
            return self.topk, self.depth, self.nodes
        return min(self.topk, max(1, budget // 2)), min(self.depth, budget - 1), budget

    @torch.no_grad()
    def draft(self, root: Tensor, n: Tensor, budget: int | None = None) -> Tree:
        """EAGLE-2: expand the top-k frontier by cumulative log-prob for `depth` levels, keep the best `nodes - 1`."""
        k, D, N = self.shape_for(budget)
        if cpu_draft.usable(self):  # one C call: a level's ~30 eager ops cost more than its layer
            tokens, parents, depth, anc = cpu_draft.tree(self, root, n, k, D, N)
            return Tree(tokens, parents, depth, anc, torch.ones(N, dtype=torch.bool), None, D)
        h, dev = self.head, root.device
        no_slots = torch.zeros(k, h.seq_range.shape[0], dtype=torch.bool, device=dev)
        feats = [self.last_out[None]]  # the previous level's head outputs: a frontier node's parent feature

        def expand(lvl, fr):
            slots = n + (lvl - 1) * k + torch.arange(k, device=dev)  # draft cache slots of this frontier
            # the prefix, and the frontier's ancestor rows placed at draft cache columns n .. n + D*k
            mask = (h.seq_range[None, :] < n) | no_slots.index_copy(1, n + torch.arange(D * k, device=dev), fr.anc)
            out, lm_in = h(fr.tokens[None], feats[-1][fr.parent][None], (n + lvl - 1).expand(k), slots, mask)
            feats.append(out[0])
            return self._logp(lm_in[0])  # [k, n_rows]

        logp, ids = self._logp(self.last_lm_in[None])  # [1, n_rows]
        return tree_search(logp[0], ids, expand, root, k, D, N, tokens_of=self.tokens_of)


def __getattr__(name: str):
    if name == "ModelDrafter":  # moved to draft_model.py (which imports this module): older imports keep working
        from draft_model import ModelDrafter
        return ModelDrafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
