"""The hybrid drafter: an EAGLE tree and a prompt-lookup chain in one verification tree, its EAGLE head
started late (LazyHead).
"""
import time

import torch
from torch import Tensor

from budget import SIZES
from draft import Accepted, Drafter, Prefill, Tree, ancestor_mask, chained, lookup_tree_of
from draft_eagle import EagleDrafter
from draft_lookup import NgramDrafter, match_key

class LazyHead:
    """The hybrid's EAGLE head, started when it first drafts, where it projects its prompt rows itself (its
    `project`, the target's LM head, as make_drafter gives it: VocabDrafter.prompt_topk). Until then it keeps
    the prefill and the accepted steps; its start runs the head's pass over the prompt, the prompt's top-k
    NanoSpec's window starts from and the window's reset, then one update over the steps since. A request
    whose steps all verify chains or decode autoregressively never pays for them (on Spec-Bench they made the
    hybrid's prefill 1.5x prompt lookup's). The head then holds the same state as after an eager prefill and
    the same updates.

    The start is a set-up the budget weighs (budget.Budgets: ski rental): price() estimates it from the last
    start's seconds per waiting token (rate; its head pass, the prompt's top-k and the catch-up grow with the
    tokens), and paid() hands the engine the seconds a start took, to keep out of the step times (paid once;
    billed to one budget size it would make that size look slow in later requests too)."""

    # accepted steps the head has not seen, kept as chains of their accepted positions (draft.chained: tokens,
    # features and the target's top-K_ver) while its prefill waits; past this many tokens it catches up
    MAX_PENDING_TOKENS = 512

    def __init__(self, eagle: EagleDrafter):
        self.eagle = eagle
        self.rate = 0.0  # seconds per waiting token of the last start (0: none yet)

    def prefill(self, p: Prefill):
        self.deferred = p if self.eagle.project is not None else None  # the head's prefill, until it first drafts
        if self.deferred is None:
            self.eagle.prefill(p)
        self.pending = []  # the accepted steps the head has not seen: it catches up when it drafts next
        self.chunks = []  # earlier runs of them, each chained once (follow)
        self.waiting = p.tokens.shape[0]  # tokens a start would run the head over (prompt + accepted since)
        self.start_s = 0.0  # seconds of the start, until the engine takes them (paid)
        self.started_s = 0.0

    @property
    def started(self) -> bool:
        return self.deferred is None

    def follow(self, a: Accepted, L: int):
        """One verification's outcome (L accepted nodes), kept for the next catch-up. The head catches up when
        it drafts next, or at 64 steps: the next step may be a chain alone, which needs no head, and one update
        over many steps costs about what one over a single step does (measured: 7% faster decoding on 10
        Spec-Bench requests than updating after each EAGLE draft)."""
        self.pending.append(a)
        self.waiting += L
        if len(self.pending) >= 64:
            if self.started or sum(int(c.L) for c in self.chunks) >= self.MAX_PENDING_TOKENS:
                self.catch_up()
            else:  # keep only the accepted positions (chained) while the prefill waits; each run once, not
                # the whole wait again with every run (that copied its logits over and over)
                self.chunks.append(chained(self.pending, top=self.eagle.reads_top))
                self.pending = []

    def catch_up(self):
        """Starts the head where it waits, then updates it over the steps it has not seen."""
        start, t0 = self.deferred, time.perf_counter()
        if start is not None:
            self.deferred = None
            self.eagle.prefill(start)
        if self.pending or self.chunks:
            steps, self.pending, self.chunks = self.chunks + self.pending, [], []
            self.eagle.update(steps[0] if len(steps) == 1 else chained(steps, top=self.eagle.reads_top))
        if start is not None:
            self.start_s = self.started_s = time.perf_counter() - t0
            self.rate = self.start_s / self.waiting

    def price(self) -> float:
        """Seconds a start would take now: 0 once started, and before the first start (nothing measured yet:
        that start measures it)."""
        return 0.0 if self.started else self.rate * self.waiting

    def paid(self) -> float:
        """Seconds of starts since the last call."""
        s, self.start_s = self.start_s, 0.0
        return s


class HybridDrafter(Drafter):
    """An EAGLE tree and a prompt-lookup chain in one verification tree (`--draft HEAD --ngram`).

    The chain is merged into the tree where they agree: its tokens follow the tree's nodes from the root as
    long as the tree holds them, and the rest hangs below the last one. Node order (what budget.py's
    prefixes cut): the root, the tree nodes the chain agrees with, the chain's own continuation, then the
    other tree nodes best first; parents still come before children. A budget below the whole tree gets
    prompt lookup's own tree alone (the chain, with siblings where earlier occurrences continued otherwise),
    or where there is no chain an EAGLE tree drafted for that budget (EagleDrafter.shape_for). It is one tree
    verified once, so the output is the target's as for any tree. Both drafters learn from every step
    (NanoSpec's window sees the chain's tokens too). Reads host values (the chain search): graphable = False.
    The EAGLE head is a LazyHead: it starts when it first drafts."""

    graphable = False

    def __init__(self, eagle: EagleDrafter, ngram: NgramDrafter):
        self.eagle, self.ngram = eagle, ngram
        self.head = LazyHead(eagle)
        self.vocab = eagle.vocab
        self.nodes = eagle.nodes + ngram.k
        self.depth = max(eagle.depth, ngram.k)

    @property
    def reads_top(self) -> int:
        return self.eagle.reads_top

    @property
    def prompt_logits(self) -> int:
        return self.eagle.prompt_logits  # (prompt lookup reads no logits)

    @property
    def start_rate(self) -> float:
        return self.head.rate

    @start_rate.setter
    def start_rate(self, rate: float):
        self.head.rate = rate

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
        """Seconds a draft of b nodes for this source pays once first (budget.Budgets waits for it): the lazy
        head's start where the draft needs the head (an EAGLE tree: b > 1 without a chain, or the merged tree)."""
        if b <= 1 or (key.startswith("ngram") and b < self.nodes):
            return 0.0
        return self.head.price()

    def setup_paid(self) -> float:
        return self.head.paid()

    def setup(self, max_seq: int):
        self.eagle.setup(max_seq + self.ngram.k)  # the chain's nodes may pass the tree's slots
        self.ngram.setup(max_seq)

    def prefill(self, p: Prefill):
        self.head.prefill(p)
        self.ngram.prefill(p)
        self.accepted = dict(ngram=0, eagle=0, both=0)  # accepted draft tokens by who proposed them
        self.source = []
        self.skipped = 0  # steps that verified only the chain, so the EAGLE tree was not drafted
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
        self.head.catch_up()
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
        self.head.follow(a, L)

    def stats(self) -> dict:
        # a head that never drafted in this request has no vocabulary metrics of it (nor time in its LM head)
        d = self.eagle.stats() if self.head.started else dict(lm_head_s=0.0)
        d["head_started"] = self.head.started
        d["head_start_s"] = round(self.head.started_s, 4)
        d["chain_only_steps"] = self.skipped
        total = sum(self.accepted.values())
        if total:
            d["accepted_from"] = {k: round(v / total, 4) for k, v in self.accepted.items()}
        return d
