"""The hybrid drafter: a tree (an EAGLE head's or a draft model's) and a prompt-lookup chain in one verification tree,
its tree drafter started late."""
import time

import torch
from torch import Tensor

from budget import SIZES
from draft import Accepted, Behind, Drafter, Prefill, Tree, ancestor_mask, lookup_tree_of
from draft_lookup import NgramDrafter, match_key


class LazyHead:
    """The hybrid's tree drafter (EAGLE head or draft model), started (prefill, then the steps since) when it first
    drafts: chains alone never pay for it. The start is a set-up budget.Budgets weighs (pays_back): price(), paid().
    A drafter without the target's LM head (project) cannot take the prompt's top-k later: it starts at once."""

    MAX_PENDING_TOKENS = 512  # chained accepted tokens kept while the prefill waits; past this it catches up

    def __init__(self, drafter):
        self.drafter, self.rate = drafter, 0.0  # rate: seconds per waiting token of the last start (0: none yet)

    def prefill(self, p: Prefill):
        self.deferred = p if self.drafter.project is not None else None  # its prefill, until it first drafts
        if self.deferred is None:
            self.drafter.prefill(p)
        # the accepted steps the head has not seen: the first `chunks` of them earlier runs of 64, each chained once
        self.behind, self.chunks = Behind(top=self.drafter.reads_top, every=self.drafter.reads_every_top), 0
        self.waiting = p.tokens.shape[0]  # tokens a start would run the head over (prompt + accepted since)
        self.start_s = self.started_s = 0.0  # start_s: the start's seconds until the engine takes them (paid)

    @property
    def started(self) -> bool:
        return self.deferred is None

    def follow(self, a: Accepted, L: int):
        """Keeps one step for the next catch-up: one update over many steps costs about what one over one does."""
        self.behind.add(a)
        self.waiting += L
        if len(self.behind) - self.chunks >= 64:
            if self.started or sum(int(c.L) for c in self.behind.steps[:self.chunks]) >= self.MAX_PENDING_TOKENS:
                self.catch_up()
            else:  # keep only the accepted positions while the prefill waits, each run chained once
                self.behind.fold(self.chunks)
                self.chunks += 1

    def catch_up(self):
        start, t0 = self.deferred, time.perf_counter()
        if start is not None:
            self.deferred = None
            self.drafter.prefill(start)
        if self.behind:
            self.chunks = 0
            self.drafter.update(self.behind.take())
        if start is not None:
            self.start_s = self.started_s = time.perf_counter() - t0
            self.rate = self.start_s / self.waiting

    def price(self) -> float:
        """Seconds a start would take now (0 once started, and before the first start measures it)."""
        return 0.0 if self.started else self.rate * self.waiting

    def paid(self) -> float:
        s, self.start_s = self.start_s, 0.0
        return s


class HybridDrafter(Drafter):
    """A tree and a prompt-lookup chain in one tree (`--draft HEAD|MODEL --ngram`), ordered root, the tree nodes the
    chain agrees with, the chain's rest, the other tree nodes. Smaller budgets draft one or the other. The tree
    drafter is an EagleDrafter or a ModelDrafter, through the protocol alone (its budget key names its source)."""

    graphable = False
    keeps_steps = True  # LazyHead's pending steps

    def __init__(self, tree: Drafter, ngram: NgramDrafter):
        self.tree, self.ngram, self.head, self.vocab = tree, ngram, LazyHead(tree), tree.vocab
        self.aux_layers = tree.aux_layers
        self.nodes, self.depth = tree.nodes + ngram.k, max(tree.depth, ngram.k)
        self.name = tree.budget_key([])  # "eagle" or "model": the tree's source, in the budget and the stats

    @property
    def reads_top(self) -> int:
        return self.tree.reads_top

    @property
    def reads_every_top(self) -> bool:
        return self.tree.reads_every_top

    @property
    def prompt_logits(self) -> int:
        return self.tree.prompt_logits

    @property
    def start_rate(self) -> float:
        return self.head.rate

    @start_rate.setter
    def start_rate(self, rate: float):
        self.head.rate = rate

    def budget_key(self, hist: list[int]) -> str:
        """ngram<n> where prompt lookup has a chain (match_key), else the tree's; the proposal is kept for draft()."""
        n, chain = self.ngram.match(hist)
        self.proposal = (len(hist), hist[-1], chain)
        return match_key(n, chain) if chain else self.name

    def budget_keys(self, hist: list[int]) -> list[str]:
        """Where prompt lookup has a chain, its source (with the merged tree among its sizes) or the tree's alone."""
        key = self.budget_key(hist)
        return [key, self.name] if key != self.name else [key]

    def budget_use(self, key: str):
        if key == self.name:  # the tree alone: its draft() holds no chain
            self.proposal = (*self.proposal[:2], [])

    def budget_sizes(self, key: str | None = None) -> list[int]:
        """With a chain: prompt lookup's sizes, then the merged tree; without: the tree drafter's; None: both."""
        tree = self.tree.budget_sizes(self.name) or [s for s in SIZES if s < self.tree.nodes] + [self.tree.nodes]
        chain = [s for s in SIZES if s < 1 + self.ngram.k] + [1 + self.ngram.k, self.nodes]
        return sorted(set(tree + chain)) if key is None else chain if key.startswith("ngram") else tree

    def budget_start(self, key: str) -> int:
        return 1 + self.ngram.k if key.startswith("ngram") else self.tree.budget_start(key) or self.tree.nodes

    def budget_needs(self, key: str, b: int) -> bool:
        return b > 1 and not (key.startswith("ngram") and b < self.nodes) and not self.head.started

    def budget_setup(self, key: str, b: int) -> float:
        """The lazy head's start where a draft of b nodes needs the head (0 before a start has measured it)."""
        return self.head.price() if self.budget_needs(key, b) else 0.0

    def setup_paid(self) -> float:
        return self.head.paid()

    def setup(self, max_seq: int):
        self.tree.setup(max_seq + self.ngram.k)  # the chain's nodes may pass the tree's slots
        self.ngram.setup(max_seq)

    def prefill(self, p: Prefill):
        self.head.prefill(p)
        self.ngram.prefill(p)
        self.accepted = {"ngram": 0, self.name: 0, "both": 0}  # accepted draft tokens by who proposed them
        self.source, self.skipped = [], 0  # skipped: chain-only steps, no tree drafted
        self.proposal = (-1, -1, [])  # (history length, root, chain) of budget_key's proposal

    @torch.no_grad()
    def draft(self, root: Tensor, n: Tensor, budget: int | None = None) -> Tree:
        r, m = int(root), len(self.ngram.hist) + 1
        chain = self.proposal[2] if self.proposal[:2] == (m, r) else self.ngram.propose(self.ngram.hist + [r])
        small = budget is not None and 1 < budget < self.nodes and not self.ngram.static
        if small and chain:
            # prompt lookup's tree alone: within the chain that is the merged tree's prefix, and past it the tree
            # drafter costs more than its extra nodes win on a CPU
            tok, par = self.ngram.lookup_tree(self.ngram.hist + [r])
            self.source = [self.name] + ["ngram"] * len(tok)
            self.skipped += 1
            return lookup_tree_of(root, tok, par)
        self.head.catch_up()
        t = self.tree.draft(root, n, budget if small else None)  # no chain, small budget: a tree of that size
        if small or (not chain and not self.ngram.static):
            self.source = [self.name] * t.tokens.shape[0]
            return t
        toks, par = t.tokens.tolist(), t.parents.tolist()
        path, cur = [], 0  # the tree nodes the chain agrees with
        for x in chain:
            cur = next((c for c in range(1, len(toks)) if par[c] == cur and toks[c] == x), None)
            if cur is None:
                break
            path.append(cur)
        rest = chain[len(path):]
        order = [0] + path + [c for c in range(1, len(toks)) if c not in path]  # old index of each kept tree node
        new_of = {old: i for i, old in enumerate(order)}
        k0 = 1 + len(path)  # the chain's continuation goes right after the agreeing path
        pos = lambda old: new_of[old] + (len(rest) if new_of[old] >= k0 else 0)
        tokens = [toks[0]] + [toks[c] for c in path] + rest + [toks[c] for c in order[k0:]]
        parents = ([-1] + [pos(par[c]) for c in path] + [k0 - 1 + i for i in range(len(rest))]
                   + [pos(par[c]) for c in order[k0:]])
        self.source = [self.name] + ["both"] * len(path) + ["ngram"] * len(rest) + [self.name] * (len(order) - k0)
        pad = self.nodes - len(tokens) if self.ngram.static else 0  # --compile: one tree size, invalid padding
        tokens, parents = tokens + [0] * pad, parents + [0] * pad
        dev, D = t.tokens.device, max(t.max_depth, len(chain))
        P = torch.tensor(parents, device=dev)
        anc = ancestor_mask(P, D)
        valid = torch.arange(len(tokens), device=dev) < len(tokens) - pad
        return Tree(torch.tensor(tokens, device=dev), P, anc.sum(-1) - 1, anc, valid, None, D)

    @torch.no_grad()
    def update(self, a: Accepted):
        L = int(a.L)
        for i in a.path[1:L].tolist():
            if i < len(self.source):
                self.accepted[self.source[i]] += 1
        self.source = []
        self.ngram.update(a)
        self.head.follow(a, L)

    def stats(self) -> dict:
        d = self.tree.stats() if self.head.started else dict(lm_head_s=0.0)
        d.update(head_started=self.head.started, head_start_s=round(self.head.started_s, 4),
                 chain_only_steps=self.skipped)
        total = sum(self.accepted.values())
        if total:
            d["accepted_from"] = {k: round(v / total, 4) for k, v in self.accepted.items()}
        return d
