"""Prompt lookup: the longest suffix of prompt + output seen earlier proposes what followed it (a chain, or a
tree of several earlier continuations), and its budget sources (one per match length).
"""
import heapq

from torch import Tensor

from budget import SIZES
from draft import Accepted, Drafter, Prefill, Tree, lookup_tree_of

def match_key(n: int, chain: list[int]) -> str:
    """The budget source of a prompt-lookup step (budget.Budgets): chains found by a longer suffix match are
    right more often (a one-token match is a guess), so each match length keeps its own acceptance and sizes,
    and steps without a chain (a root alone) do not count as misses of the chains' nodes."""
    return f"ngram{n}" if chain else "ngram0"


class NgramDrafter(Drafter):
    """Prompt lookup: the longest suffix (nmax..nmin tokens) seen earlier in prompt + output proposes
    the tokens that followed it: a chain where its earlier occurrences agree, else a tree of their
    continuations, best first (lookup_tree; budget keys and the hybrid's merge use the most recent chain,
    match()). It searches a host-side token list (as llama.cpp's lookup does), so its
    draft and update read the root and the accepted tokens from the device (graphable = False); on CPU
    that costs nothing, on CUDA two tiny copies after the step's sync."""

    graphable = False
    reads_states = False  # update reads the accepted tokens only

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
        replayed offline on 60 Spec-Bench l10 greedy outputs (greedy acceptance, a fixed size every step),
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
