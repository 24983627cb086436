"""The drafter protocol and what a step hands the next: `Tree`, `Prefill`, `Accepted`, the `Drafter` base
with the protocol's defaults, and the tree helpers every drafter shares. Drafters: draft_eagle.py (EAGLE
heads, a draft model), draft_lookup.py (prompt lookup), draft_hybrid.py (both in one tree); draft_config.py
builds them.

The protocol (batch 1; n = 0-dim tensor, tokens already in the target's KV cache; root = [1] the last
emitted token, not yet in the cache):
    nodes, depth                 most tokens one verification carries (root included); deepest tree level
    graphable                    False when draft/update read host values (prompt lookup): run them eagerly
    reads_states, reads_top      what update reads besides the accepted tokens: the target's hidden / aux
                                 states, and its top-k tokens per accepted position (NanoSpec's K_ver; 0: none)
    setup(max_seq)               before a request whose target cache has max_seq slots
    prompt_logits                how many last prompt positions' target logits prefill() reads (0: the last)
    prefill(p: Prefill)          the target's prefill: prompt, first token, logits, hidden and aux states
    budget_key(hist) -> str      which budget.Budgets source the next step's drafts belong to
    draft(root, n, budget=None) -> Tree
                                 static shapes, no host sync (graphable drafters); budget: the engine verifies
                                 at most this prefix, so a drafter may skip work that cannot reach it
    update(a: Accepted)          one verification's outcome: accepted path, bonus, target logits and features
    stats() -> dict              the request's metrics: LM-head time, vocabulary coverage and active size
    budget_sizes(key), budget_start(key)    a source's own budget sizes and first size (None: budget.py's)
    budget_setup(key, b), setup_paid(), start_rate    a one-time set-up a draft of b nodes pays first, the
                                 seconds set-ups took since the last call, its price per waiting token
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

import cpu_draft

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
    logits: Tensor  # [R, V] at the last R = min(T, prompt_logits) or 1 positions ([T, V]: a fifth of a CPU prefill)
    hidden: Tensor  # [1, T, d] target final hidden states
    aux: Tensor | None  # [1, T, 3d] EAGLE-3 aux states (model.aux_layers), None when the target has none


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
    top: Tensor | None = None  # [D+1, k] the target's top-k per path position instead of logits (chained(top=k))

    def next_tokens(self) -> Tensor:
        """[D+1] the token after each path node: the next path token, and the bonus after the last accepted."""
        nxt = torch.cat([self.tree.tokens[self.path[1:]], self.bonus.view(1)])
        return torch.where(torch.arange(nxt.shape[0], device=nxt.device) == self.L - 1, self.bonus, nxt)


def chained(steps: list[Accepted], states: bool = True, top: int = 0) -> Accepted:
    """Consecutive steps' accepted paths as one fully accepted chain, so that a drafter catches up on a run of
    them in one update (budget.py's fallback; the hybrid's chain-only steps). states=False leaves out the
    target's logits, hidden and aux states (0 rows); top=k keeps its top-k tokens per position (Accepted.top)
    instead of the logits rows: a drafter says what it reads (reads_states, reads_top). Why: 128 autoregressive
    steps' logits are 12.6 MB to copy for the default model (27 ms, 3% of a CPU decode step, for prompt lookup
    that never reads them). A path 0, 1, .. is cut as a slice, not gathered."""
    idx, rows = [], []
    for a in steps:
        p = a.path[:int(a.L)]
        pl = p.tolist()
        idx.append(slice(0, len(pl)) if pl == list(range(len(pl))) else p)
        rows.append(p)
    toks = torch.cat([a.tree.tokens[i] for a, i in zip(steps, idx)])  # [K] each step's root and accepted nodes
    a0, K = steps[0], toks.shape[0]
    tops = None
    if top:
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
        # eager CPU: built once per length (trees are never written in place): five small ops, 0.08 ms a step
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
    with invalid nodes to 1 + pad_to (--compile: one shape, max_depth pad_to, so nothing retraces). A chain
    takes chain_tree's cached shape."""
    pad = max(pad_to - len(tok), 0)
    dev = root.device
    if par == list(range(len(par))):
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
    most = 1 + topk + (depth - 1) * topk * topk  # the root, k first-level nodes, k*k per deeper level
    if not 2 <= nodes <= most:
        raise ValueError(f"--tree-nodes {nodes} cannot fit a top-{topk} depth-{depth} tree (2..{most} nodes)")


class Drafter:
    """The protocol's defaults (module docstring): a drafter overrides what it has."""

    nodes: int
    depth: int
    graphable = True
    reads_states = True
    reads_top = 0
    prompt_logits = 0
    start_rate = 0.0

    def setup(self, max_seq: int):
        pass

    def budget_sizes(self, key: str | None = None) -> list[int] | None:
        return None

    def budget_start(self, key: str) -> int | None:
        return None

    def budget_setup(self, key: str, b: int) -> float:
        return 0.0

    def setup_paid(self) -> float:
        return 0.0

    def stats(self) -> dict:
        return {}
