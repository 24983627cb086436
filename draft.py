"""Drafters: EAGLE-1/2 and EAGLE-3 heads, an independent draft model, prompt-lookup n-grams, the EAGLE-2
dynamic tree, and `make_drafter`, the one place that builds a drafter with its vocabulary. Every drafter
proposes a `Tree` (chains are the one-child case). Every LM-head projection goes through
`self.vocab.logits(h)` (vocab.py), which scores the active rows only.

The drafter protocol: every drafter has these, with these signatures, and the engine asks nothing else
(batch 1; n = 0-dim tensor, tokens already in the target's KV cache; root = [1] the last emitted token,
not yet in the cache):
    nodes, depth                 most tokens one verification carries (root included); deepest tree level
    graphable                    False when draft/update read host values (prompt lookup): run them eagerly
    reads_states, reads_top      what update reads besides the accepted tokens: the target's hidden / aux
                                 states (bool), and its top-k tokens at each accepted position (k, 0: none;
                                 NanoSpec's K_ver); a run of autoregressive steps reaches it as one chain that
                                 keeps only those (chained), not the run's whole logits rows
    setup(max_seq)               before a request whose target cache has max_seq slots
    prompt_logits                how many of the last prompt positions' target logits prefill() reads (NanoSpec's
                                 top-K_pre: as many as its window holds); 0: only the last one, which every
                                 prefill projects
    prefill(p: Prefill)          the target's prefill: prompt, first token, logits, hidden and aux states
    budget_key(hist) -> str      which budget.Budgets source the next step's drafts belong to
    draft(root, n, budget=None) -> Tree
                                 static shapes, no host sync (graphable drafters); budget: the engine will
                                 verify at most this prefix of the tree (budget.py), so a drafter may skip
                                 work that cannot reach it (the hybrid skips the EAGLE tree for a chain)
    update(a: Accepted)          one verification's outcome: accepted path, bonus, target logits and features
    stats() -> dict              the request's metrics: LM-head time, vocabulary coverage and active size
Optional, for a drafter whose sources need their own budgets (the engine reads them with getattr; only the
hybrid has them): budget_sizes(key) and budget_start(key), a source's sizes and first size;
budget_setup(key, b) -> seconds a draft of b nodes pays once first (the late head's start), and
setup_paid() -> the seconds such set-ups took since the last call (kept out of the step times).
"""
import heapq
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

import cpu_draft
from budget import SIZES
from download import resolve_checkpoint
from eagle import EagleHead, load_eagle, read_keys
from model import ModelError, Transformer, load_model
from sampling import Sampling, logits_to_probs, sample_from
from tokenizer import Tokenizer
from vocab import make_vocab

# ---------------------------------------------------------------- trees and what steps hand each other

@dataclass
class Tree:
    tokens: Tensor  # [N] long, node 0 is the root (the last emitted token)
    parents: Tensor  # [N] long, -1 for the root; parents come before children
    depth: Tensor  # [N] long, root 0
    anc: Tensor  # [N, N] bool, anc[i, j] = j is i or an ancestor of i
    valid: Tensor  # [N] bool, padding nodes are never accepted
    q: Tensor | None = None  # [N, V] draft distribution that proposed each node's children (sampled chains)
    max_depth: int = 0  # static bound on depth: the accepted path has at most max_depth + 1 nodes

    def prefix(self, b: int) -> "Tree":
        """The first b nodes. Drafters list nodes best first, parents before children, so this is the tree
        they would have drafted with a budget of b nodes (budget.py verifies such prefixes)."""
        if b >= self.tokens.shape[0]:
            return self
        q = None if self.q is None else self.q[:b]
        return Tree(self.tokens[:b], self.parents[:b], self.depth[:b], self.anc[:b, :b], self.valid[:b], q,
                    self.max_depth)


@dataclass
class Prefill:
    """What the target's prefill hands a drafter."""
    tokens: Tensor  # [T] the prompt
    first: Tensor  # [1] the first generated token
    logits: Tensor  # [R, V] target logits at the last R prompt positions, R = min(T, the drafter's prompt_logits)
    # or 1 (a [T, V] LM head costs a fifth of a 200-token CPU prefill)
    hidden: Tensor  # [1, T, d] target final hidden states
    aux: Tensor | None  # [1, T, 3d] EAGLE-3 aux states (model.aux_layers), None when the target has none


@dataclass
class Accepted:
    """One verification's outcome, on device with static shapes (path is padded past L)."""
    tree: Tree  # the verified tree
    path: Tensor  # [D+1] node indices of the accepted path, root first
    L: Tensor  # 0-dim accepted nodes, root included
    bonus: Tensor  # 0-dim the target's token after the path (the next root)
    logits: Tensor  # [N, V] target logits at every tree node
    hidden: Tensor  # [1, N, d] target final hidden states at every tree node
    aux: Tensor | None  # [1, N, 3d] EAGLE-3 aux states, None when the target has none
    n: Tensor  # 0-dim tokens in the target's KV cache before the step
    # [D+1, k] the target's top-k tokens at each path position, where a catch-up chain kept them instead of the
    # logits (chained(top=k); logits then has 0 rows)
    top: Tensor | None = None

    def next_tokens(self) -> Tensor:
        """[D+1] the token after each path node: the next path token, and the bonus after the last accepted."""
        nxt = torch.cat([self.tree.tokens[self.path[1:]], self.bonus.view(1)])
        return torch.where(torch.arange(nxt.shape[0], device=nxt.device) == self.L - 1, self.bonus, nxt)


def chained(steps: list[Accepted], states: bool = True, top: int = 0) -> Accepted:
    """Consecutive steps' accepted paths (an autoregressive step's: its one node) as one fully accepted chain,
    so that a drafter catches up on a run of them in one update (budget.py's fallback; the hybrid's chain-only
    steps). Reads each step's accepted path on the host. states=False leaves out the target's logits, hidden
    and aux states (0 rows); top=k keeps the target's top-k tokens at each position (Accepted.top) instead of its
    logits rows (then 0 rows); a drafter says what it reads (reads_states, reads_top). Why: a run of 128
    autoregressive steps' logits is 12.6 MB to copy for the default model, into freshly mapped memory
    (measured: 27 ms, 0.2 ms a step, 3% of a CPU decode step, for prompt lookup that never reads them and
    NanoSpec that reads 3 tokens a row). A path that runs 0, 1, .. (a chain's, an autoregressive step's) is
    cut as a slice, not gathered."""
    idx, rows = [], []
    for a in steps:
        p = a.path[:int(a.L)]
        pl = p.tolist()
        idx.append(slice(0, len(pl)) if pl == list(range(len(pl))) else p)
        rows.append(p)
    toks = torch.cat([a.tree.tokens[i] for a, i in zip(steps, idx)])  # [K] each step's root and accepted nodes
    a0, K = steps[0], toks.shape[0]
    tops = None
    if top:  # (an earlier chain's top rows as they are: its path is 0, 1, ..)
        tops = torch.cat([a.top[i] if a.top is not None else cpu_draft.topk_rows(a.logits, r, top)
                          for a, i, r in zip(steps, idx, rows)])
    logits = (torch.cat([a.logits[i] for a, i in zip(steps, idx)]) if states and not top else a0.logits[:0])
    if states:
        hidden = torch.cat([a.hidden[:, i] for a, i in zip(steps, idx)], 1)
        aux = None if a0.aux is None else torch.cat([a.aux[:, i] for a, i in zip(steps, idx)], 1)
    else:
        hidden, aux = a0.hidden[:, :0], (None if a0.aux is None else a0.aux[:, :0])
    return Accepted(chain_tree(toks), torch.arange(K, device=toks.device), torch.full_like(a0.L, K), steps[-1].bonus,
                    logits, hidden, aux, a0.n, tops)


# registered pytrees: they pass whole through torch.compile'd and CUDA-graphed steps (Graphed flattens them)
for _cls in (Tree, Prefill, Accepted):
    pytree.register_dataclass(_cls)


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """[N] parents (parents before children) -> [N, N] ancestor-or-self closure, in max_depth static steps."""
    N = parents.shape[0]
    eye = torch.eye(N, dtype=torch.bool, device=parents.device)
    # P[i, j] = j is the parent of i; ancestors = I + P + P^2 + ...; fp32 matmul keeps it static and sync-free.
    P = F.one_hot(parents.clamp(min=0), N).float() * (parents >= 0).float()[:, None]
    anc, step = eye.float(), eye.float()
    for _ in range(max_depth):
        step = step @ P
        anc = anc + step
    return anc > 0


_CHAINS = {}  # N -> (parents, depth, ancestors, all-valid) of an N-node chain on the CPU, shared by every such chain


def chain_tree(tokens: Tensor, valid: Tensor | None = None, q: Tensor | None = None) -> Tree:
    """A chain root -> t1 -> ... -> tk as a Tree."""
    N = tokens.shape[0]
    if tokens.device.type == "cpu" and not torch.compiler.is_compiling():
        # eager CPU: a chain's structure is built once per length (read-only everywhere: trees are never written
        # in place). Why: its five small ops cost about 0.08 ms, and every autoregressive step makes a chain
        if N not in _CHAINS:
            ar = torch.arange(N)
            _CHAINS[N] = (ar - 1, ar, ar[None, :] <= ar[:, None], torch.ones(N, dtype=torch.bool))
        parents, depth, anc, ones = _CHAINS[N]
        return Tree(tokens, parents, depth, anc, ones if valid is None else valid, q, N - 1)
    ar = torch.arange(N, device=tokens.device)
    anc = ar[None, :] <= ar[:, None]
    if valid is None:
        valid = torch.ones(N, dtype=torch.bool, device=tokens.device)
    return Tree(tokens, ar - 1, ar, anc, valid, q, N - 1)


def lookup_tree_of(root: Tensor, tok: list[int], par: list[int], pad_to: int = 0) -> Tree:
    """The Tree of a root and the nodes below it (tok, par: node i + 1's token and parent, parents first), padded
    with invalid nodes to 1 + pad_to (a static shape for --compile: then max_depth is pad_to whatever the tree,
    as for a padded chain, so the accepted path's padded length does not change and nothing retraces). A chain
    takes chain_tree's cached shape."""
    pad = max(pad_to - len(tok), 0)
    dev = root.device
    if par == list(range(len(par))):  # a chain (or the root alone)
        valid = None if not pad else torch.tensor([True] * (1 + len(tok)) + [False] * pad, device=dev)
        return chain_tree(torch.tensor([int(root)] + tok + [0] * pad, device=dev), valid)
    parents = [-1] + par + [0] * pad
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    N = len(parents)
    anc = []  # ancestor-or-self rows, built on the host (N <= k + 1 is small): the parent's row and itself
    for i in range(N):
        row = list(anc[parents[i]]) if i else [False] * N
        row[i] = True
        anc.append(row)
    return Tree(torch.tensor([int(root)] + tok + [0] * pad, device=dev), torch.tensor(parents, device=dev),
                torch.tensor(depth, device=dev), torch.tensor(anc, device=dev),
                torch.tensor([True] * (1 + len(tok)) + [False] * pad, device=dev), None, pad_to or max(depth))


def check_tree_budget(topk: int, depth: int, nodes: int):
    if depth < 1:
        raise ValueError(f"--tree-depth must be >= 1, got {depth}")
    if topk < 1:
        raise ValueError(f"--tree-topk must be >= 1, got {topk}")
    most = 1 + topk + (depth - 1) * topk * topk  # root + k first-level + k*k per deeper level
    if not 2 <= nodes <= most:
        raise ValueError(f"--tree-nodes {nodes} cannot fit a top-{topk} depth-{depth} tree (2..{most} nodes)")


# ---------------------------------------------------------------- drafters

def timed_lm_head(drafter, h: Tensor):
    """drafter.vocab.logits(h), adding its wall time to drafter.lm_head_s in eager mode (exact on CPU; on CUDA
    it measures launch time unless the caller syncs). Skipped under torch.compile, where it would break the graph."""
    if torch.compiler.is_compiling():
        return drafter.vocab.logits(h)
    t0 = time.perf_counter()
    out = drafter.vocab.logits(h)
    drafter.lm_head_s += time.perf_counter() - t0
    return out


class VocabDrafter:
    """What the drafters with an LM head share: the draft vocabulary's reset at prefill, its update with each
    verification, and the request's vocabulary metrics, kept in device buffers (in-place adds replay
    correctly from a CUDA graph and cost no host sync)."""

    graphable = True
    reads_states = True  # update reads the target's features
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


def match_key(n: int, chain: list[int]) -> str:
    """The budget source of a prompt-lookup step (budget.Budgets): chains found by a longer suffix match are
    right more often (a one-token match is a guess), so each match length keeps its own acceptance and sizes,
    and steps without a chain (a root alone) do not count as misses of the chains' nodes."""
    return f"ngram{n}" if chain else "ngram0"


class NgramDrafter:
    """Prompt lookup: the longest suffix (nmax..nmin tokens) seen earlier in prompt + output proposes
    the tokens that followed it: a chain where its earlier occurrences agree, else a tree of their
    continuations, best first (lookup_tree; budget keys and the hybrid's merge use the most recent chain,
    match()). It searches a host-side token list (as llama.cpp's lookup does), so its
    draft and update read the root and the accepted tokens from the device (graphable = False); on CPU
    that costs nothing, on CUDA two tiny copies after the step's sync."""

    graphable = False
    reads_states, reads_top = False, 0  # update reads the accepted tokens only
    prompt_logits = 0

    def __init__(self, k=10, nmin=1, nmax=3, static=False, occurrences=8):
        if not 1 <= nmin <= nmax:
            raise ValueError(f"need 1 <= --ngram-min <= --ngram-max, got {nmin}, {nmax}")
        if k < 1:
            raise ValueError(f"--spec-k must be >= 1, got {k}")
        if occurrences < 1:
            raise ValueError(f"--ngram-occurrences must be >= 1, got {occurrences}")
        self.k, self.nmin, self.nmax = k, nmin, nmax
        self.depth, self.nodes = k, k + 1
        self.occurrences = occurrences  # earlier occurrences whose continuations make the tree (lookup_tree)
        # static: always propose k + 1 nodes (invalid padding), so a compiled verify step is traced once
        # instead of once per proposal length (each CPU inductor compile costs tens of seconds); for --compile
        self.static = static

    def budget_key(self, hist: list[int]) -> str:
        return match_key(*self.match(hist))

    def budget_sizes(self, key: str | None = None) -> list[int]:
        """budget.Budgets' sizes for a source: without a chain (ngram0) there is nothing to verify but the root,
        so autoregressive decoding; else every size up to the whole chain."""
        return [1] if key == "ngram0" else [s for s in SIZES if s < self.nodes] + [self.nodes]

    def setup(self, max_seq):
        pass

    def prefill(self, p: Prefill):
        self.hist = p.tokens.tolist()

    def match(self, hist: list[int]) -> tuple[int, list[int]]:
        """(n, chain): the longest suffix of hist, nmax..nmin tokens, seen earlier in it, and the tokens that
        followed its most recent occurrence (up to k); (0, []) where none is. Why an index: a scan of the whole
        history per step cost 0.24 ms at 600 tokens and 0.6 ms at 1,500 in Python (5% of a CPU decode step, and
        it grows with the text); an n-gram -> starts map (starts()), extended by the tokens added since the last
        call, costs microseconds (as llama.cpp's lookup keeps one)."""
        n, starts = self.starts(hist)
        return (n, hist[starts[-1] + n:starts[-1] + n + self.k]) if n else (0, [])

    def starts(self, hist: list[int]) -> tuple[int, list[int]]:
        """(n, starts): the longest suffix of hist (nmax..nmin tokens) seen earlier in it, and where it started
        earlier, oldest first (a list the index owns: read it, do not keep it); (0, []) where none is."""
        seen = getattr(self, "_seen", None)
        if seen is None or len(hist) < len(seen) or hist[:len(seen)] != seen:  # another text: index it afresh
            seen = self._seen = []
            self._at = {n: {} for n in range(self.nmin, self.nmax + 1)}
        L, m = len(hist), len(seen)
        for n, at in self._at.items():  # every n-gram that starts before the suffix's own start, L - n
            for s in range(max(m - n, 0), L - n):
                at.setdefault(tuple(hist[s:s + n]), []).append(s)  # in order: the most recent start last
        seen.extend(hist[m:])
        for n in range(min(self.nmax, L - 1), self.nmin - 1, -1):
            starts = self._at[n].get(tuple(hist[L - n:]))
            if starts:
                return n, starts
        return 0, []

    def lookup_tree(self, hist: list[int]) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the draft below the root hist[-1]: the continuations of the suffix's last
        `occurrences` earlier occurrences (up to k tokens each) merged into a trie, its nodes best first by how
        many continuations pass through them (ties: the shallower, then the more recent one's), parents before
        children, at most k of them: so every prefix is the best tree of its size (budget.py verifies prefixes).
        One occurrence, or several that agree, make match()'s chain. Why: where the text repeats with variations
        (a short match followed by different words), the siblings catch what the most recent continuation misses:
        replayed offline on session 20's 60 Spec-Bench l10 outputs (greedy acceptance, a fixed size every step),
        tau 2.31 -> 2.45 at 11 nodes, 2.23 -> 2.34 at 8, 1.94 -> 1.98 at 4 against the most recent chain."""
        n, starts = self.starts(hist)
        if not n:
            return [], []
        kids, tok, par, count, dep = {}, [], [], [], []  # the trie: node i (the root is -1) = tok[i] below par[i]
        for s in reversed(starts[-self.occurrences:]):  # the most recent first: it wins ties
            cur = -1
            for t in hist[s + n:s + n + self.k]:
                i = kids.get((cur, t))
                if i is None:
                    i = kids[cur, t] = len(tok)
                    tok.append(t), par.append(cur), count.append(0), dep.append(dep[cur] + 1 if cur >= 0 else 1)
                count[i] += 1
                cur = i
        if par == list(range(-1, len(tok) - 1)):  # one chain (the continuations agree): nothing to order
            return tok, list(range(len(tok)))
        children = {}
        for i in range(len(tok)):
            children.setdefault(par[i], []).append(i)
        # best first: the most continuations through a node, then the shallower (a sibling at depth 1 is right
        # more often than a node three guesses deep), then the more recent
        order, frontier = [], [(-count[i], dep[i], i) for i in children[-1]]
        heapq.heapify(frontier)
        while frontier and len(order) < self.k:
            i = heapq.heappop(frontier)[2]
            order.append(i)
            for j in children.get(i, ()):
                heapq.heappush(frontier, (-count[j], dep[j], j))
        pos = {old: new + 1 for new, old in enumerate(order)}  # node index in the tree (the root is 0)
        return [tok[i] for i in order], [pos.get(par[i], 0) for i in order]

    def match_scan(self, hist: list[int]) -> tuple[int, list[int]]:
        """match() by scanning the history (its reference, for the tests)."""
        for n in range(min(self.nmax, len(hist) - 1), self.nmin - 1, -1):
            suffix = hist[-n:]
            for s in range(len(hist) - n - 1, -1, -1):  # most recent earlier occurrence first
                if hist[s:s + n] == suffix:
                    return n, hist[s + n:s + n + self.k]
        return 0, []

    def propose(self, hist: list[int]) -> list[int]:
        return self.match(hist)[1]


    def draft(self, root: Tensor, n: Tensor, budget: int | None = None) -> Tree:
        r = int(root)
        tok, par = self.lookup_tree(self.hist + [r])
        return lookup_tree_of(root, tok, par, self.k if self.static else 0)

    def update(self, a: Accepted):
        # history = every token before the next root: this step's root (path[0]), then the accepted tokens
        self.hist.extend(a.tree.tokens[a.path[:int(a.L)]].tolist())

    def stats(self) -> dict:
        return {}


class HybridDrafter:
    """An EAGLE tree and a prompt-lookup chain in one verification tree (`--draft HEAD --ngram`).

    The chain is merged into the tree where they agree: its tokens follow the tree's nodes from the root as
    long as the tree holds them, and the rest hangs below the last one. Node order (what budget.py's
    prefixes cut): the root, the tree nodes the chain agrees with, the chain's own continuation, then the
    other tree nodes best first; parents still come before children. A budget below the whole tree gets
    prompt lookup's own tree alone (the chain, with siblings where earlier occurrences continued otherwise), or where there is no chain an EAGLE tree drafted for that budget (EagleDrafter.shape_for).
    It is one tree verified once, so the output is the target's as for any tree. Both drafters learn from every step (NanoSpec's window sees the
    chain's tokens too). Reads host values (the chain search): graphable = False.

    The head starts late where it projects its prompt rows itself (its `project`, the target's LM head, as
    make_drafter gives it: VocabDrafter.prompt_topk): the hybrid keeps the prefill and runs the head's pass
    over the prompt, the prompt's top-k NanoSpec's window starts from and the window's reset only when the
    head first drafts, then catches up on the steps since. A request whose steps all verify chains
    or decode autoregressively never pays for them (on Spec-Bench they made the hybrid's prefill 1.5x prompt
    lookup's). The head then holds the same state as after an eager prefill and the same updates."""

    graphable = False
    reads_states = True  # (the head's update)

    @property
    def reads_top(self) -> int:
        return self.eagle.reads_top
    # accepted steps the head has not seen, kept as chains of their accepted positions (draft.chained: tokens,
    # features and the target's top-K_ver) while its prefill waits; past this many tokens it catches up
    MAX_PENDING_TOKENS = 512

    def __init__(self, eagle: EagleDrafter, ngram: NgramDrafter):
        self.eagle, self.ngram = eagle, ngram
        self.vocab = eagle.vocab
        self.nodes = eagle.nodes + ngram.k
        self.depth = max(eagle.depth, ngram.k)
        self.start_rate = 0.0  # seconds per waiting token of this drafter's last head start (0: none yet)

    @property
    def prompt_logits(self) -> int:
        return self.eagle.prompt_logits  # (prompt lookup reads no logits)

    def budget_key(self, hist: list[int]) -> str:
        """ngram<n> where prompt lookup has a chain after hist (the next root last), found by an n-token suffix
        match (match_key), else eagle: below the whole tree the two draft differently, so budget.Budgets keeps
        their statistics apart. The proposal is kept for the draft that follows."""
        n, chain = self.ngram.match(hist)
        self.proposal = (len(hist), hist[-1], chain)
        return match_key(n, chain) if chain else "eagle"

    def budget_sizes(self, key: str | None = None) -> list[int]:
        """budget.Budgets' sizes for a source of drafts (None: every size either may verify). Where prompt lookup
        has a chain, the sizes below the merged tree are prompt lookup's tree alone, so they stop at its whole
        size (1 + k nodes, prompt lookup's own largest step: on a CPU it often pays where the merged tree does
        not); then the merged tree. Without a chain they stop at the EAGLE tree."""
        e = self.eagle.nodes  # without a chain every size from the EAGLE tree's up drafts the EAGLE tree
        tree = [s for s in SIZES if s < e] + [e]
        chain = [s for s in SIZES if s < 1 + self.ngram.k] + [1 + self.ngram.k, self.nodes]
        return sorted(set(tree + chain)) if key is None else chain if key.startswith("ngram") else tree

    def budget_start(self, key: str) -> int:
        """The size a source's budget tries first: the chain alone where there is a chain (as prompt lookup
        alone does; the merged tree is a probe away), else the EAGLE tree."""
        return 1 + self.ngram.k if key.startswith("ngram") else self.eagle.nodes

    def budget_setup(self, key: str, b: int) -> float:
        """Seconds a draft of b nodes for this source pays once first (budget.Budgets waits for it): the late
        head's start where the draft needs the head (an EAGLE tree: b > 1 without a chain, or the merged tree),
        estimated as the last start's seconds per token times the tokens now waiting (its head pass, the
        prompt's top-k and the catch-up grow with them). 0 once the head has started, and before this
        drafter's first start (nothing measured yet: that start measures it)."""
        if self.deferred is None or b <= 1 or (key.startswith("ngram") and b < self.nodes):
            return 0.0
        return self.start_rate * self.waiting

    def setup_paid(self) -> float:
        """Seconds of head starts since the last call: the engine keeps them out of the steps' times (a start
        is paid once; billed to one budget size it would make that size look slow in later requests too)."""
        s, self.start_s = self.start_s, 0.0
        return s

    def setup(self, max_seq: int):
        self.eagle.setup(max_seq + self.ngram.k)  # the chain's nodes may pass the tree's slots
        self.ngram.setup(max_seq)

    def prefill(self, p: Prefill):
        self.deferred = p if self.eagle.project is not None else None  # the head's prefill, until it first drafts
        if self.deferred is None:
            self.eagle.prefill(p)
        self.ngram.prefill(p)
        self.accepted = dict(ngram=0, eagle=0, both=0)  # accepted draft tokens by who proposed them
        self.source = []
        self.skipped = 0  # steps that verified only the chain, so the EAGLE tree was not drafted
        self.pending = []  # the accepted steps the head has not seen: it catches up when it drafts next
        self.chunks = []  # earlier runs of them, each chained once (update)
        self.waiting = p.tokens.shape[0]  # tokens a start would run the head over (prompt + accepted since)
        self.start_s = 0.0  # seconds of the head's start, until the engine takes them (setup_paid)
        self.head_start_s = 0.0
        self.proposal = (-1, -1, [])  # (history length, root, chain) of budget_key's proposal

    @torch.no_grad()
    def draft(self, root: Tensor, n: Tensor, budget: int | None = None) -> Tree:
        r, m = int(root), len(self.ngram.hist) + 1
        chain = self.proposal[2] if self.proposal[:2] == (m, r) else self.ngram.propose(self.ngram.hist + [r])
        small = budget is not None and 1 < budget < self.nodes and not self.ngram.static
        if small and chain:
            # Below the whole tree's budget, where prompt lookup has a chain, the hybrid verifies prompt
            # lookup's own tree alone (NgramDrafter.lookup_tree: the chain, with siblings where earlier
            # occurrences continue differently) and does not draft the EAGLE tree: where the continuations
            # agree and the budget reaches no further than the chain, that is the merged tree's prefix anyway
            # (node order above), and past it the EAGLE tree's draft costs more than its extra nodes win on a
            # CPU. The whole tree (budget.py's largest size, and budget None) is the merged tree (the most
            # recent chain), so the budget still weighs EAGLE against the rest.
            tok, par = self.ngram.lookup_tree(self.ngram.hist + [r])  # the chain, or the trie of several
            self.source = ["eagle"] + ["ngram"] * len(tok)
            self.skipped += 1
            return lookup_tree_of(root, tok, par)
        self._catch_up()
        t = self.eagle.draft(root, n, budget if small else None)  # no chain, small budget: a tree of that size
        if small or (not chain and not self.ngram.static):
            self.source = ["eagle"] * t.tokens.shape[0]
            return t
        toks, par = t.tokens.tolist(), t.parents.tolist()
        path, cur = [], 0  # the tree nodes the chain agrees with
        for x in chain:
            nxt = next((c for c in range(1, len(toks)) if par[c] == cur and toks[c] == x), None)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        rest = chain[len(path):]
        on = set(path)
        order = [0] + path + [c for c in range(1, len(toks)) if c not in on]  # old index of each kept tree node
        new_of = {old: i for i, old in enumerate(order)}
        k0 = 1 + len(path)  # the chain's continuation goes right after the agreeing path
        pos = lambda old: new_of[old] + (len(rest) if new_of[old] >= k0 else 0)
        tokens = [toks[0]] + [toks[c] for c in path] + rest + [toks[c] for c in order[k0:]]
        parents = ([-1] + [pos(par[c]) for c in path] + [k0 - 1 + i for i in range(len(rest))]
                   + [pos(par[c]) for c in order[k0:]])
        self.source = ["eagle"] + ["both"] * len(path) + ["ngram"] * len(rest) + ["eagle"] * (len(order) - k0)
        pad = self.nodes - len(tokens) if self.ngram.static else 0  # --compile: one tree size, invalid padding
        tokens, parents = tokens + [0] * pad, parents + [0] * pad
        dev = t.tokens.device
        P = torch.tensor(parents, device=dev)
        depth = [0] * len(parents)
        for i in range(1, len(parents)):
            depth[i] = depth[parents[i]] + 1
        D = max(t.max_depth, len(chain))
        valid = torch.arange(len(tokens), device=dev) < len(tokens) - pad
        return Tree(torch.tensor(tokens, device=dev), P, torch.tensor(depth, device=dev), ancestor_mask(P, D), valid,
                    None, D)

    @torch.no_grad()
    def update(self, a: Accepted):
        L = int(a.L)  # (the one host read of the step's outcome here)
        for i in a.path[1:L].tolist():
            if i < len(self.source):
                self.accepted[self.source[i]] += 1
        self.source = []  # (autoregressive steps verify no drafted node)
        self.ngram.update(a)
        self.pending.append(a)
        self.waiting += L
        # the head catches up in one update when it drafts next, or at 64 steps: the next step may be a chain
        # alone, which needs no head, and one update over many steps costs about what one over a single step
        # does (measured: 7% faster decoding on 10 Spec-Bench requests than updating after each EAGLE draft)
        if len(self.pending) >= 64:
            if self.deferred is None or sum(int(c.L) for c in self.chunks) >= self.MAX_PENDING_TOKENS:
                self._catch_up()
            else:  # keep only the accepted positions (chained) while the head's prefill waits; each run
                # once, not the whole wait again with every run (that copied its logits over and over)
                self.chunks.append(chained(self.pending, top=self.reads_top))
                self.pending = []

    def _catch_up(self):
        start, t0 = self.deferred, time.perf_counter()
        if start is not None:
            self.deferred = None
            self.eagle.prefill(start)
        if self.pending or self.chunks:
            steps, self.pending, self.chunks = self.chunks + self.pending, [], []
            self.eagle.update(steps[0] if len(steps) == 1 else chained(steps, top=self.reads_top))
        if start is not None:  # the start's price: what budget_setup estimates the next one by
            self.start_s = self.head_start_s = time.perf_counter() - t0
            self.start_rate = self.start_s / self.waiting

    def stats(self) -> dict:
        # a head that never drafted in this request has no vocabulary metrics of it (nor time in its LM head)
        d = self.eagle.stats() if self.deferred is None else dict(lm_head_s=0.0)
        d["head_started"] = self.deferred is None
        d["head_start_s"] = round(self.head_start_s, 4)
        d["chain_only_steps"] = self.skipped
        total = sum(self.accepted.values())
        if total:
            d["accepted_from"] = {k: round(v / total, 4) for k, v in self.accepted.items()}
        return d


def detect_draft_kind(path: Path) -> str:
    """'eagle' (fc.weight present) or 'model' (a checkpoint model.py loads)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"draft folder not found: {path}")
    if (path / "model.safetensors.index.json").is_file():
        return "model"
    try:
        keys, _ = read_keys(path)
    except ModelError:
        raise ModelError(f"draft folder {path} holds no weights (model.safetensors or pytorch_model.bin)") from None
    if "fc.weight" in keys:
        return "eagle"
    if any(k.startswith("layers.") for k in keys) and "embed_tokens.weight" in keys:
        return "model"
    raise ModelError(f"draft folder {path} is neither an EAGLE head nor a causal LM checkpoint")


# ---------------------------------------------------------------- construction

# EAGLE-2 tree (top-k, depth, nodes): the papers' 10/5/60 on GPUs; on CPU a 60-node verify costs about three
# decode steps (compute-bound), so a 16-node tree is faster at nearly the same acceptance (measured).
TREE_GPU, TREE_CPU = (10, 5, 60), (8, 5, 16)
DRAFT_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "*.safetensors", "model.safetensors.index.json", "pytorch_model.bin"]


@dataclass
class DraftConfig:
    """How to draft; each field is a flag of generate.py and bench.py."""
    draft: str = "none"  # none | ngram | an EAGLE-1/2 or EAGLE-3 head, or a draft model (folder or hub id)
    vocab: str = "full"  # full | freq:PATH[:K] | nanospec (drafters with an LM head)
    tree_topk: int | None = None  # EAGLE-2 tree; None: TREE_CPU or TREE_GPU by device
    tree_depth: int | None = None
    tree_nodes: int | None = None
    spec_k: int | None = None  # chain length: draft models 5, n-grams 10
    ngram_min: int = 1
    ngram_max: int = 3
    w_max: int = 3072  # NanoSpec window
    k_pre: int = 3  # NanoSpec: target top-K per prompt position
    k_ver: int = 3  # NanoSpec: target top-K per accepted position
    ablation: str | None = None  # NanoSpec ablation: ctx | ext | noasync | nofill
    static: bool = False  # n-gram chains padded to spec_k + 1 nodes: one compiled verify shape
    ngram: bool | None = False  # EAGLE heads: merge a prompt-lookup chain into the tree; None: on for EAGLE heads
    ngram_occurrences: int = 8  # prompt lookup's tree: continuations of this many earlier occurrences

    def tree(self, device) -> tuple[int, int, int]:
        """(top-k, depth, nodes) with this device's defaults filled in."""
        dflt = TREE_CPU if torch.device(device).type == "cpu" else TREE_GPU
        return tuple(d if v is None else v for v, d in zip((self.tree_topk, self.tree_depth, self.tree_nodes), dflt))


def append_width(nodes: int, depth: int, k_ver: int) -> int:
    """Most ids one step appends to a NanoSpec window: the tree's nodes + the target's top-k_ver per path node."""
    return nodes + (depth + 1) * k_ver


def eagle_vocab(c: DraftConfig, head: EagleHead, target: Transformer, chain: int = 0):
    """The draft vocabulary of an EAGLE head; sized for one step's append (tree nodes, a merged prompt-lookup
    chain of `chain` tokens, the target's top-K per path node)."""
    topk, depth, nodes = c.tree(head.fc.weight.device)
    check_tree_budget(topk, depth, nodes)
    rows = EagleDrafter.token_to_row_map(head)
    return make_vocab(c.vocab, head.lm_weight(), w_max=c.w_max, k_pre=c.k_pre, k_ver=c.k_ver, ablation=c.ablation,
                      eos_ids=target.args.eos_ids, max_append=append_width(nodes + chain, max(depth, chain), c.k_ver),
                      token_to_row=rows, fill=getattr(head, "fill_path", None) if rows is None else None)


def make_drafter(c: DraftConfig, target: Transformer, sampling: Sampling | None = None,
                 tokenizer: Tokenizer | None = None, head: EagleHead | None = None):
    """The one place that builds a drafter with its vocabulary (None for c.draft == "none"). For an EAGLE-3
    head it points the target's aux_layers at the head's. head: an EAGLE head already loaded from c.draft
    (bench shares one head between vocabularies). tokenizer: the target's, checked against a draft model's."""
    if c.draft == "none":
        if c.vocab != "full":
            raise ValueError("--vocab needs a drafter with an LM head (--draft PATH)")
        if c.ngram:
            raise ValueError("--ngram merges prompt lookup into an EAGLE head's tree: give --draft HEAD (or --draft ngram)")
        return None
    if c.draft == "ngram":
        if c.vocab != "full":
            raise ValueError("--vocab does not apply to --draft ngram (it has no LM head)")
        return NgramDrafter(c.spec_k or 10, c.ngram_min, c.ngram_max, static=c.static, occurrences=c.ngram_occurrences)
    dev, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    if head is None:
        path = resolve_checkpoint(c.draft, patterns=DRAFT_PATTERNS)
        if detect_draft_kind(path) == "eagle":
            head = load_eagle(path, target, dtype, dev)
    if head is not None:
        if head.c.version == 3:
            target.aux_layers = head.c.aux_layers
        topk, depth, nodes = c.tree(dev)
        if c.ngram is False:
            return EagleDrafter(head, eagle_vocab(c, head, target), topk, depth, nodes, target.lm_head)
        ngram = NgramDrafter(c.spec_k or 10, c.ngram_min, c.ngram_max, static=c.static, occurrences=c.ngram_occurrences)
        return HybridDrafter(EagleDrafter(head, eagle_vocab(c, head, target, ngram.k), topk, depth, nodes,
                                          target.lm_head), ngram)
    if c.ngram:
        raise ValueError("--ngram merges prompt lookup into an EAGLE head's tree; this --draft is a draft model")
    dm = load_model(path, dtype=dtype, device=dev)
    if dm.args.vocab_size != target.args.vocab_size:
        raise ModelError(f"draft model vocabulary ({dm.args.vocab_size}) differs from the target's ({target.args.vocab_size})")
    if tokenizer is not None and (path / "tokenizer.json").is_file() and Tokenizer(path).tok.get_vocab() != tokenizer.tok.get_vocab():
        raise ModelError("draft model tokenizer differs from the target's")
    k = c.spec_k or 5
    vocab = make_vocab(c.vocab, dm.lm_head.weight, w_max=c.w_max, k_pre=c.k_pre, k_ver=c.k_ver, ablation=c.ablation,
                       eos_ids=target.args.eos_ids, max_append=append_width(k + 1, k, c.k_ver))  # a chain: k + 1 nodes
    return ModelDrafter(dm, vocab, k, sampling)
