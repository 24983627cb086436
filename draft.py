"""The drafter protocol, what a step hands the next (`Tree`, `Prefill`, `Accepted`) and shared tree helpers.
`Drafter` holds the protocol's defaults. Batch 1; n: 0-dim, tokens in the target's KV cache; root: [1], the last
emitted token, not yet cached.
    nodes, depth (most tokens one verification carries, root included; deepest level); graphable (False:
    draft/update read host values); keeps_steps (update keeps an Accepted past the step); reads_states, reads_top
    (update reads the target's hidden/aux states; its top-k per accepted position, or per verified node where
    reads_every_top); prompt_logits (last prompt
    positions whose logits prefill reads, 0: the last)
    setup(max_seq), prefill(Prefill), update(Accepted), stats() -> dict, budget_key(hist) -> budget source
    draft(root, n, budget=None) -> Tree: static shapes, no host sync; only the first `budget` nodes are verified
    budget.py's hooks: budget_keys(hist) (the sources that may draft the step), budget_use(key) (the one chosen),
    budget_sizes(key), budget_start(key), budget_needs(key, b), budget_setup(key, b), setup_paid(), start_rate
EAGLE-2's search (`tree_search`, `rerank`) serves every drafter with an LM head (draft_eagle.py, draft_model.py)."""
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import Tensor

import cpu_draft


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
        """The first b nodes: nodes are listed best first, parents first, so this is the tree of budget b."""
        if b >= self.tokens.shape[0]:
            return self
        return Tree(self.tokens[:b], self.parents[:b], self.depth[:b], self.anc[:b, :b], self.valid[:b],
                    None if self.q is None else self.q[:b], self.max_depth)


@dataclass
class Prefill:
    tokens: Tensor  # [T] the prompt
    first: Tensor  # [1] the first generated token
    logits: Tensor  # [R, V] at the last R = min(T, prompt_logits) or 1 positions ([T, V]: a fifth of a CPU prefill)
    hidden: Tensor  # [1, T, d] target final hidden states
    aux: Tensor | None  # [1, T, 3d] EAGLE-3 aux states (the drafter's aux_layers), None when it reads none


@dataclass
class Accepted:
    """One verification's outcome, on device with static shapes (path is padded past L)."""
    tree: Tree
    path: Tensor  # [D+1] node indices of the accepted path, root first
    L: Tensor  # 0-dim accepted nodes, root included
    bonus: Tensor  # 0-dim the target's token after the path (the next root)
    logits: Tensor  # [N, V] target logits at every tree node
    hidden: Tensor  # [1, N, d] target final hidden states at every tree node
    aux: Tensor | None  # [1, N, 3d] EAGLE-3 aux states, None when the target has none
    n: Tensor  # 0-dim tokens in the target's KV cache before the step
    top: Tensor | None = None  # [D+1, k] the target's top-k per path position instead of logits (chained(top=k));
    # [N, k] per node where the drafter reads_every_top (batch.BatchEngine._kept)

    def next_tokens(self) -> Tensor:
        """[D+1] the token after each path node: the next path token, and the bonus after the last accepted."""
        nxt = torch.cat([self.tree.tokens[self.path[1:]], self.bonus.view(1)])
        return torch.where(torch.arange(nxt.shape[0], device=nxt.device) == self.L - 1, self.bonus, nxt)


def chained(steps: list[Accepted], states: bool = True, top: int = 0, every: bool = False) -> Accepted:
    """Consecutive steps' accepted paths as one accepted chain, for one catch-up update. states=False drops logits,
    hidden and aux; top=k keeps the top-k per position instead of logits (128 steps' logits are 12.6 MB); every:
    the steps' tops are per node (reads_every_top)."""
    rows = [a.path[:int(a.L)] for a in steps]
    idx = [slice(0, len(p)) if p.tolist() == list(range(len(p))) else p for p in rows]
    toks = torch.cat([a.tree.tokens[i] for a, i in zip(steps, idx)])  # [K] each step's root and accepted nodes
    a0, K = steps[0], toks.shape[0]
    tops = None if not top else torch.cat([(a.top[r] if every else a.top[:len(r)]) if a.top is not None
                                           else cpu_draft.topk_rows(a.logits, r, top) for a, r in zip(steps, rows)])
    logits = torch.cat([a.logits[i] for a, i in zip(steps, idx)]) if states and not top else a0.logits[:0]
    hidden = torch.cat([a.hidden[:, i] for a, i in zip(steps, idx)], 1) if states else a0.hidden[:, :0]
    aux = None if a0.aux is None else (torch.cat([a.aux[:, i] for a, i in zip(steps, idx)], 1) if states
                                       else a0.aux[:, :0])
    return Accepted(chain_tree(toks), torch.arange(K, device=toks.device), torch.full_like(a0.L, K), steps[-1].bonus,
                    logits, hidden, aux, a0.n, tops)


class Behind:
    """Steps a drafter has not read yet, handed to it as one chain when it next needs them: one update over many
    steps costs about what one over one does. It serves each sequence's steps (batch.py) and the hybrid's waiting
    head (draft_hybrid.LazyHead). A step is an Accepted,
    or a row whose class has chain(run) -> Accepted (batch.py keeps autoregressive rows as views of the step's
    tensors, one chain per run). fold() chains what is held into one step at once (accepted positions only)."""

    def __init__(self, states: bool = True, top: int = 0, every: bool = False):
        self.states, self.top, self.every, self.steps = states, top, every, []  # chained()'s: what the drafter reads

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, step):
        self.steps.append(step)

    def take(self) -> Accepted | None:
        """Every step held as one Accepted (None: nothing); nothing is held after."""
        steps, self.steps = self.steps, []
        return self._chain(steps)

    def fold(self, first: int = 0):
        """The steps from index first on, chained into one in their place."""
        if len(self.steps) - first > 1:
            self.steps[first:] = [self._chain(self.steps[first:])]

    def _chain(self, steps: list) -> Accepted | None:
        out, run = [], []
        for x in steps + [None]:
            if x is not None and not isinstance(x, Accepted):
                run.append(x)
                continue
            if run:
                out.append(type(run[0]).chain(run))
                run = []
            if x is not None:
                out.append(x)
        if len(out) <= 1:
            return out[0] if out else None
        return chained(out, states=self.states, top=self.top, every=self.every)


def stop_at(emitted: list[int], out: list[int], max_new: int, eos: set) -> list[int]:
    """The emitted tokens up to the token budget and through the first eos, as autoregressive decoding."""
    emitted = emitted[:max(max_new - len(out), 0)]
    return emitted[:next((i + 1 for i, t in enumerate(emitted) if t in eos), len(emitted))]


# pytrees: they pass whole through torch.compile'd and CUDA-graphed steps
for _cls in (Tree, Prefill, Accepted):
    pytree.register_dataclass(_cls)


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """[N] parents (parents before children) -> [N, N] ancestor-or-self closure, in max_depth static steps."""
    N = parents.shape[0]
    # P[i, j] = j is the parent of i (the root's -1 matches none); ancestors = I + P + P^2 + ...; fp32 matmul keeps
    # it static and sync-free (F.one_hot checks its indices on the host, on CPU)
    P = (parents[:, None] == torch.arange(N, device=parents.device)).float()
    anc = step = torch.eye(N, dtype=torch.float32, device=parents.device)
    for _ in range(max_depth):
        step = step @ P
        anc = anc + step
    return anc > 0


_CHAINS = {}  # N -> (parents, depth, anc, all-valid) of an N-node chain on the CPU, shared by every such chain


def chain_tree(tokens: Tensor, valid: Tensor | None = None, q: Tensor | None = None) -> Tree:
    N, dev = tokens.shape[0], tokens.device
    # eager CPU: built once per length (trees are never written in place): five small ops, 0.08 ms a step
    cached = dev.type == "cpu" and not torch.compiler.is_compiling()
    parts = _CHAINS.get(N) if cached else None
    if parts is None:
        ar = torch.arange(N, device=dev)
        parts = (ar - 1, ar, ar[None, :] <= ar[:, None], torch.ones(N, dtype=torch.bool, device=dev))
        if cached:
            _CHAINS[N] = parts
    parents, depth, anc, ones = parts
    return Tree(tokens, parents, depth, anc, ones if valid is None else valid, q, N - 1)


def lookup_tree_of(root: Tensor, tok: list[int], par: list[int], pad_to: int = 0) -> Tree:
    """The Tree of root and nodes tok below it (par: node i + 1's parent), padded to 1 + pad_to (one shape)."""
    pad = max(pad_to - len(tok), 0)
    dev = root.device
    if par == list(range(len(par))):
        valid = None if not pad else torch.tensor([True] * (1 + len(tok)) + [False] * pad, device=dev)
        return chain_tree(torch.tensor([int(root)] + tok + [0] * pad, device=dev), valid)
    parents = [-1] + par + [0] * pad
    N = len(parents)
    depth, anc = [0] * N, []  # anc: ancestor-or-self rows on the host (N <= k + 1): the parent's row and itself
    for i in range(N):
        row = list(anc[parents[i]]) if i else [False] * N
        row[i] = True
        anc.append(row)
        depth[i] = depth[parents[i]] + 1 if i else 0
    return Tree(torch.tensor([int(root)] + tok + [0] * pad, device=dev), torch.tensor(parents, device=dev),
                torch.tensor(depth, device=dev), torch.tensor(anc, device=dev),
                torch.tensor([True] * (1 + len(tok)) + [False] * pad, device=dev), None, pad_to or max(depth))


@dataclass
class Frontier:
    """One level of EAGLE-2's search: its best k nodes by cumulative log-prob, expanded together."""
    tokens: Tensor  # [k]
    parent: Tensor  # [k] each node's row in the previous level's frontier (level 1: 0, the root)
    anc: Tensor  # [k, D*k] bool: the node and its ancestors among the frontier slots (level l: (l-1)*k + row)


def top_pick(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    return torch.topk(logp, k, dim=-1)


def tree_search(logp: Tensor, ids: Tensor, expand, root: Tensor, k: int, D: int, N: int, pick=top_pick,
                tokens_of=None) -> Tree:
    """EAGLE-2's dynamic tree: the root's k best children (logp [R] over the vocabulary rows ids [R]); per level,
    expand(lvl, Frontier) -> (logp [k, R], ids) scores the frontier's children, the best k of the k*k by cumulative
    log-prob become the next frontier; then the best N - 1 nodes (rerank). pick(logp, k) -> (values, indices):
    top-k, the deterministic proposals lossless tree acceptance takes; a sampled chain (k = 1) draws instead."""
    dev, rows = logp.device, tokens_of or (lambda r: r)
    s, idx = pick(logp[None], k)
    s, idx = s[0], idx[0]
    cols = torch.arange(D * k, device=dev)
    fr = Frontier(rows(ids[idx]), torch.zeros(k, dtype=torch.long, device=dev),
                  torch.arange(k, device=dev)[:, None] == cols)  # (a comparison: F.one_hot reads indices on the host)
    cand_tok, cand_score, cand_parent = [fr.tokens], [s], [torch.full((k,), -1, device=dev)]
    fr_score, fr_cand = s, torch.arange(k, device=dev)
    base = 0  # index of the first candidate of the current level
    for lvl in range(1, D):
        logp, ids = expand(lvl, fr)
        s, idx = pick(logp, k)  # [k, k]
        sc = (fr_score[:, None] + s).flatten()  # cumulative log-prob of the k*k children
        tok = rows(ids[idx]).flatten()
        cand_tok.append(tok), cand_score.append(sc), cand_parent.append(fr_cand.repeat_interleave(k))
        base += k if lvl == 1 else k * k
        top = torch.topk(sc, k).indices  # next frontier: best k of the k*k
        prow = top // k
        fr = Frontier(tok[top], prow, fr.anc[prow] | ((lvl * k + torch.arange(k, device=dev))[:, None] == cols))
        fr_score, fr_cand = sc[top], base + top
    if k == 1:  # a chain: rerank keeps its order (scores fall with depth)
        return chain_tree(torch.cat([root.view(1)] + cand_tok)[:N])
    return rerank(torch.cat(cand_tok), torch.cat(cand_score), torch.cat(cand_parent), root, k, D, N)


def rerank(tok: Tensor, score: Tensor, parent: Tensor, root: Tensor, k: int, D: int, N: int) -> Tree:
    """The best N - 1 of tree_search's candidates (k, then k*k per deeper level) under the root, parents first."""
    dev, C = tok.device, tok.shape[0]
    level = torch.cat([torch.zeros(k, device=dev), torch.arange(1, D, device=dev).repeat_interleave(k * k)])
    # a child's score never exceeds its parent's; the depth penalty breaks exact ties so a selected
    # child's parent is always selected too
    key = torch.nan_to_num(score, nan=-1e30, neginf=-1e30) - 1e-4 * level
    sel = torch.sort(torch.topk(key, N - 1).indices).values  # [N-1], candidate order = parents first
    # then best first (stable: ties keep parents first), so every prefix is the tree of a smaller budget
    sel = sel[torch.sort(key[sel], descending=True, stable=True).indices]
    pos_of = torch.full((C,), -1, dtype=torch.long, device=dev).index_copy(0, sel, torch.arange(N - 1, device=dev))
    cp = parent[sel]
    parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=dev),
                         torch.where(cp < 0, 0, pos_of[cp.clamp(min=0)] + 1)])
    depth = torch.cat([torch.zeros(1, device=dev), level[sel] + 1]).long()
    return Tree(torch.cat([root.view(1), tok[sel]]), parents, depth, ancestor_mask(parents, D),
                torch.ones(N, dtype=torch.bool, device=dev), None, D)


def check_tree_budget(topk: int, depth: int, nodes: int):
    if depth < 1:
        raise ValueError(f"--tree-depth must be >= 1, got {depth}")
    if topk < 1:
        raise ValueError(f"--tree-topk must be >= 1, got {topk}")
    most = 1 + topk + (depth - 1) * topk * topk  # the root, k first-level nodes, k*k per deeper level
    if not 2 <= nodes <= most:
        raise ValueError(f"--tree-nodes {nodes} cannot fit a top-{topk} depth-{depth} tree (2..{most} nodes)")


class Drafter:
    """The protocol's defaults (module docstring): a drafter overrides what it has."""

    nodes: int
    depth: int
    graphable = True
    keeps_steps = False
    reads_states = True
    reads_top = 0
    reads_every_top = False
    prompt_logits = 0
    start_rate = 0.0
    aux_layers: tuple[int, ...] = ()  # target layers whose inputs it reads (an EAGLE-3 head's)

    def setup(self, max_seq: int):
        pass

    def budget_keys(self, hist: list[int]) -> list[str]:
        return [self.budget_key(hist)]

    def budget_use(self, key: str):
        pass

    def budget_sizes(self, key: str | None = None) -> list[int] | None:
        return None

    def budget_start(self, key: str) -> int | None:
        return None

    def budget_needs(self, key: str, b: int) -> bool:
        """Whether a draft of b nodes from source key needs a one-time set-up not yet paid (priced or not)."""
        return False

    def budget_setup(self, key: str, b: int) -> float:
        return 0.0

    def setup_paid(self) -> float:
        return 0.0

    def stats(self) -> dict:
        return {}
