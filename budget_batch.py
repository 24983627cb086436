"""The step's speculative budget (BatchBudget): each sequence's tree size for the next step (1: no draft). A
sequence alone steps by its own budget.Budgets (probes, the per-source policy, the engine's memory of earlier
requests); a batch's sizes are chosen for the whole batch's tokens per second. A step costs the target pass over
every sequence's rows, P(R), plus each sequence's drafting. With λ the batch's tokens per second, a sequence
takes the size b that maximises

    E_i(b) - λ * (P(R_others + b) - P(R_others + 1) + draft(b) - draft(1))

(Dinkelbach's rule for a ratio: at λ the current rate, a size pays iff it raises the batch's rate). At batch 1 this
is budget.py's choice. When the pass turns compute-bound, extra rows cost what they verify and trees lose, so
speculation turns itself off; as the batch thins it comes back. E_i is the sequence's own acceptance per node rank
and per source (budget.Budget), started from every sequence's (a new sequence's untried ranks would count as
likely as not: with a few sources each, exploring had cost more than it found); P,
draft and λ are running means of what every step measured.

λ is the larger of the measured rate and drafting off's, n / P(n): a rate held down by drafting that does not pay
must not make drafting look cheap. A sequence's drafting cost holds everything its tree adds to a step: its
drafter's catch-up and draft, and the host work of its acceptance.
"""
import weakref

import budget
from budget import SIZES, Budget
from budget_policy import Policy, pays_back


def bucket(rows: int) -> int:
    """Row counts measured together: exact to 16, then 8 buckets an octave."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return (rows + step // 2) // step * step


def lower_hull(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of points sorted by x (Andrew's monotone chain): slopes that never fall."""
    h = []
    for p in pts:
        while len(h) >= 2 and (h[-1][0] - h[-2][0]) * (p[1] - h[-2][1]) <= (h[-1][1] - h[-2][1]) * (p[0] - h[-2][0]):
            h.pop()
        h.append(p)
    return h


class PassCosts:
    """Seconds of the target pass by rows: running means per bucket, read through their lower convex hull, so
    the cost of an extra row never falls as rows grow (a pass is bound by bandwidth, then by arithmetic; noisy
    means had made extra rows look free, and a whole batch drafted at once)."""

    def __init__(self, decay: float = 0.8):
        self.decay, self.t, self.fit = decay, {}, None

    def observe(self, rows: int, seconds: float):
        k = bucket(rows)
        self.t[k] = seconds if k not in self.t else self.decay * self.t[k] + (1 - self.decay) * seconds
        self.fit = None

    def __call__(self, rows: int) -> float:
        if not self.t:
            return 0.0
        if self.fit is None:
            h = lower_hull(sorted(self.t.items()))
            m = min(range(len(h)), key=lambda i: h[i][1])  # the hull falls until here (noise: flat), then rises
            self.fit = ([(h[0][0], h[m][1])] if m else []) + h[m:]
        f = self.fit
        if rows <= f[0][0]:  # at or below every measure: in proportion (no fixed part assumed)
            return f[0][1] * rows / f[0][0]
        for (x0, y0), (x1, y1) in zip(f, f[1:]):
            if rows <= x1:
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = f[-2] if len(f) > 1 else (0, 0.0), f[-1]
        return y1 + max(y1 - y0, 0.0) / (x1 - x0) * (rows - x1)  # above: the last slope


def ranks(bud: Budget) -> list[float]:
    """The acceptance bud.tokens() reads at each node rank 1 .. nodes - 1 (an untried rank: the last tried one's)."""
    out, last = [], None
    for i in range(1, bud.nodes):
        if bud.trials[i] > 0 or last is None:
            last = bud.p(i)
        out.append(last)
    return out


def tokens(bud: Budget) -> dict[int, float]:
    """{size: bud.tokens(size)} for every size of bud, in one sweep over the node ranks."""
    out, total, sizes = {1: 1.0}, 1.0, set(bud.sizes)
    for i, p in enumerate(ranks(bud), 2):
        total += p
        if i in sizes:
            out[i] = total
    return out


class BatchBudget:
    """Sizes for the sequences of a step (sequence.Seq: .budgets {source: Budget}, .key, .drafter, .alone), one
    alone or a batch. memory: the budget_memory.BudgetMemory a lone sequence's budget reads and leaves its
    sources to (settle, pass_s: its Budgets'); fixed: every step verifies every whole tree (nothing is measured)."""

    def __init__(self, nodes: int, sizes_of=None, decay: float = 0.8, memory=None, settle: int = 1,
                 pass_s: dict | None = None, fixed: bool = False):
        self.nodes, self.sizes_of, self.decay = nodes, sizes_of, decay
        self.memory, self.settle, self.alone_pass, self.fixed = memory, settle, pass_s, fixed
        self.pass_s, self.draft_s = PassCosts(decay), {}  # draft_s: (source, size) -> a sequence's seconds
        self.by_batch = {}  # sequences in the step -> [sequence-steps, of them speculative]
        # every size a source's budget may take (hopeless)
        given = (sizes_of(None) if sizes_of else None) or []
        self.sizes = sorted({x for x in given if x > 1} | {x for x in SIZES if 1 < x < nodes} | {max(nodes, 2)})
        self._bounds, self._tokens = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()  # budget -> (steps, .)
        self._priors = {}  # source -> its untried Budget (prior())
        self.common = {}  # source -> Budget: every sequence's acceptance
        self.tokens = self.seconds = 0.0  # running sums of steps: the measured rate is their ratio

    def admit(self, s):
        """A sequence joins: its budget for the steps it runs alone. Why its own: the batch's rule, fresh each
        request, had a lone server request speculate on 12-21% of its steps (serve.py 1.05x llama-server at one
        client; 1.3x now)."""
        d = s.drafter
        s.alone = None if self.fixed else budget.Budgets(
            d.nodes, d.budget_sizes, d.budget_start, settle=self.settle, pass_s=self.alone_pass,
            memory=self.memory.sources, setup_of=d.budget_setup, needs_of=d.budget_needs)

    def pick(self, seqs: list) -> list[int]:
        """Each sequence's tree size for the next step (1: no draft; its source: seq.key): a lone sequence's from
        its own budget (lone), a batch's from choose()."""
        if self.fixed:
            return [s.drafter.nodes for s in seqs]
        if len(seqs) == 1:
            return [self.lone(seqs[0])]
        sizes = self.choose(seqs, lambda s: s.drafter.budget_keys(s.prompt + s.out))
        for s in seqs:
            s.drafter.budget_use(s.key)
        return sizes

    def lone(self, s) -> int:
        """A sequence alone: its Budgets' size and source (the batch's policy has no step to observe)."""
        # tokens still to come (a request's length is not known): as many again as so far, or what the engine's
        # requests ran to where that is more, at most max_new's
        n = len(s.out)
        b = s.alone.pick(s.drafter.budget_keys(s.prompt + s.out),
                         min(s.max_new - n, max(n, self.memory.length - n)))
        s.key, s.chosen = s.alone.key, None
        s.drafter.budget_use(s.key)
        return b

    def observe_lone(self, s, b: int, accepted: list[int], seconds: float):
        """A lone sequence's step: less a set-up paid inside (billed to one size, it would look slow for good)."""
        if s.alone is not None:
            s.alone.observe(b, accepted, seconds - s.paid)

    def finish(self, s) -> dict:
        """A sequence is done: its sources go to the memory; its lone budget's statistics."""
        if s.alone is None:
            return {}
        s.alone.keep()
        self.memory.ran(s.alone.emitted)
        self.memory.save()
        return s.alone.stats()

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None

    def _new(self, key: str) -> Budget:
        sizes = self.sizes_of(key) if self.sizes_of else None
        return Budget(self.nodes, sizes=sizes, decay=self.decay)

    OWN = 3.0  # decayed trials of a source's first rank past which every sequence's acceptance counts

    def budget(self, seq) -> Budget:
        """The acceptance the sequence's choice reads: its own, started from every sequence's worth one step
        (sources differ by text: a summary copies what a story never does)."""
        own = seq.budgets.get(seq.key)
        if own is None:
            own = seq.budgets[seq.key] = self._new(seq.key)
            if seq.key in self.common:
                own.carry(self.common[seq.key], weight=1.0)
        return own

    def source(self, s, keys: list, share: float, draft, rows) -> tuple[str | None, bool]:
        """(the sequence's source for the step, None for no draft; whether it is a trial): budget_policy.Policy, as at
        batch 1, over its share of a step (share: a row's part of the pass; draft(key, b): its drafting; rows(b):
        what a tree of b nodes adds to the pass)."""
        if len(keys) == 1:
            s.chosen = None
            return keys[0], False
        if getattr(s, "policy", None) is None:
            s.policy = Policy()
        ar = share + draft(keys[0], 1)
        left = min(s.max_new - len(s.out), len(s.out)) if hasattr(s, "out") else float("inf")

        def may_try(k):  # a set-up (the late head's start) pays back at the prior's or the batch's estimate
            setup = s.drafter.budget_setup(k, self.nodes)
            if setup <= 0:
                return True
            bud = self.common.get(k) or self.prior(k)
            E = self.expect(bud)
            # with the rows its trees add to the pass: without them, where each row costs its share, the untried
            # prior (a node as likely as not) repaid any start, and a start stalls the whole batch (38 ms, Zen 4)
            best = max((E[x] / (ar + rows(x) + draft(k, x)) for x in bud.sizes[1:]), default=0.0)
            return pays_back(setup, left, best, max([1 / ar if ar else 0.0] + [s.policy.rate(o) for o in keys]))

        s.chosen = s.policy.choose(keys, 1 / ar if ar else 0.0, may_try)
        return s.chosen, s.policy.trying

    def observe_seq(self, seq, b: int, accepted: list[int]):
        """A sequence's step of size b (1: no draft): its accepted node indices, root first."""
        if self.fixed:
            return
        if getattr(seq, "policy", None) is not None:  # what its policy's source paid (None: its time alone)
            seq.policy.observe(seq.chosen, len(accepted), seq.step_s or 1e-9, b > 1)
        if b == 1:
            return
        for own, d in ((seq.budgets, seq.key), (self.common, seq.key)):
            if d not in own:
                own[d] = self._new(d)
            own[d].observe(b, accepted, 0.0)

    def draft(self, key: str, b: int) -> float:
        """A sequence's drafting seconds at size b for this source: measured, else the nearest size measured."""
        if (key, b) in self.draft_s:
            return self.draft_s[key, b]
        near = [x for k, x in self.draft_s if k == key and (x > 1) == (b > 1)]
        return self.draft_s[key, min(near, key=lambda x: abs(x - b))] if near else 0.0

    def prior(self, key: str) -> Budget:
        """Source key's untried budget, read and never observed: one per source (made anew, 3,148 of them had taken
        a fifth of choose()'s time at 4 sequences)."""
        if key not in self._priors:
            self._priors[key] = self._new(key)
        return self._priors[key]

    def expect(self, bud: Budget) -> dict[int, float]:
        """tokens(bud), kept while bud's steps stay the same."""
        got = self._tokens.get(bud)
        if got is None or got[0] != bud.steps:
            got = self._tokens[bud] = (bud.steps, tokens(bud))
        return got[1]

    def bound(self, bud: Budget | None) -> dict[int, float]:
        """{size: the most tokens a tree of that size may bring} at the most likely acceptance per node rank a
        source's choice could read (the untried prior's 1/2, or bud's: every sequence's, which a sequence's own
        starts from, or the sequence's own), kept while bud's steps stay the same."""
        got = self._bounds.get(bud) if bud is not None else None
        if got is not None and got[0] == bud.steps:
            return got[1]
        u = [0.5] * (self.sizes[-1] - 1)
        for i, p in enumerate(ranks(bud)[:len(u)] if bud is not None else ()):
            u[i] = max(u[i], p)
        out, total, at = {}, 1.0, 1
        for x in self.sizes:
            total, at = total + sum(u[at - 1:x - 1]), x
            out[x] = total
        if bud is not None:
            self._bounds[bud] = (bud.steps, out)
        return out

    def bars(self, rows: int, lam: float, cost, draft) -> dict | None:
        """source -> ({size: the tokens a tree must beat}, whether bound(every sequence's) stays under them) at this
        step's rows: 1 + lam * (what its nodes add to the pass and to its source's drafting), as choose() prices a
        size (less a set-up, which only lowers a size's value). Key None: a source nobody has measured. None where
        no sequence is hopeless."""
        out = {}
        for k in [None] + list(set(self.common) | {k for k, _ in self.draft_s if k}):  # ("": a skipped, unkeyed one)
            bar = {x: 1.0 + lam * (cost(rows + x - 1) - cost(rows) + (draft(k, x) - draft(k, 1) if k else 0.0))
                   for x in self.sizes}
            out[k] = bar, not any(v > bar[x] - self.TIE for x, v in self.bound(self.common.get(k)).items())
            if k is None and not out[k][1]:
                return None  # a source nobody measured might pay, for any sequence (where rows are cheap)
        return out

    TIE = 1e-9  # bound() sums in another order than tokens(): a size whose value ties 1 is asked

    def hopeless(self, seq, bars: dict | None) -> bool:
        """True where no tree of any source and size can pay for seq this step, even at the most likely acceptance
        per node rank its choice could read (bound()): its size is 1 without asking its drafter or its policy (nor
        for a trial). Why: under load, where the rows' cost turns every tree off, asking every sequence took 0.9 ms
        of a 16-sequence step's 22 (SmolLM2, Zen 4; 0.15 ms with this)."""
        if bars is None:
            return False
        for k, (bar, common_under) in bars.items():
            own = seq.budgets.get(k)
            if not common_under if own is None else any(v > bar[x] - self.TIE for x, v in self.bound(own).items()):
                return False
        return True

    def choose(self, seqs: list, key_of) -> list[int]:
        """Each sequence's size for the next step (key_of(seq): its source now, or the sources its drafter offers,
        of which its budget_policy.Policy picks one; set as seq.key), one after the other, each pricing its rows on the
        pass as the sequences before it left it. A source no sequence has evidence on yet is priced by one
        sequence a step at the prior (each node as likely as not): tried where rows are cheap, not where they
        are not. The first step drafts nothing: it measures the batch's rate."""
        n = len(seqs)
        rows, tried, out, P, D = n, set(), [], {}, {}  # rows: the pass so far (each sequence one, then its tree)
        cost = lambda r: P[r] if r in P else P.setdefault(r, self.pass_s(r))
        draft = lambda k, x: D[k, x] if (k, x) in D else D.setdefault((k, x), self.draft(k, x))
        lam = max(self.rate or 0.0, n / cost(n) if cost(n) else 0.0)
        bars = (-1, None)  # (rows, hopeless' bars at those rows)
        for s in seqs:
            if lam and bars[0] != rows:
                bars = (rows, self.bars(rows, lam, cost, draft))
            if lam and self.hopeless(s, bars[1]):
                s.chosen, s.step_s = None, cost(n) / n + draft(s.key, 1)  # (its share, as b = 1 below)
                out.append(1)
                continue
            keys = key_of(s)
            keys = [keys] if isinstance(keys, str) else keys
            key, trial = self.source(s, keys, cost(n) / n if lam else 0.0, draft,
                                     lambda x, r=rows: cost(r + x - 1) - cost(r))
            s.key = keys[0] if key is None else key  # (None: no draft, this step)
            c = self.common.get(s.key)
            new = c is None or c.trials[1] < self.OWN  # a source without evidence: one sequence a step tries it
            if key is None or not lam or (new and s.key in tried):
                b = 1
            else:
                tried.add(s.key)
                bud, setup = self.prior(s.key) if new else self.budget(s), s.drafter.budget_setup
                base, E = cost(rows) + draft(s.key, 1), self.expect(bud)
                value = {x: E[x] - lam * (  # a set-up (a lazy head's start) too, unless the policy weighed it
                    cost(rows + x - 1) + draft(s.key, x) - base + (setup(s.key, x) if x > 1 and not trial else 0.0))
                    for x in bud.sizes}
                # a trial drafts, at a size without a set-up where the source has one (the policy weighed the
                # set-up of sources that need it): n-gram trials of the merged tree had started 4 heads in a step
                free = [x for x in bud.sizes[1:] if not s.drafter.budget_needs(s.key, x)] or bud.sizes[1:]
                b = max(free if trial and len(bud.sizes) > 1 else bud.sizes, key=value.get)
            # the sequence's share of the step, which its policy's rates read
            s.step_s = (cost(n) / n if lam else 0.0) + cost(rows + b - 1) - cost(rows) + draft(s.key, b)
            rows += b - 1  # the next sequence's rows cost what they add to this pass
            out.append(b)
        n, spec = len(seqs), sum(b > 1 for b in out)
        c = self.by_batch.setdefault(n, [0, 0])
        c[0], c[1] = c[0] + n, c[1] + spec
        return out

    def observe(self, rows: int, pass_s: float, tokens: int, step_s: float):
        """A step: rows verified in pass_s seconds, tokens emitted in step_s seconds all told."""
        if self.fixed:
            return
        self.pass_s.observe(rows, pass_s)
        self.tokens = self.decay * self.tokens + tokens
        self.seconds = self.decay * self.seconds + step_s

    def observe_draft(self, key: str, b: int, seconds: float):
        """A sequence's drafting (its updates and its draft) for a step of size b."""
        if self.fixed:
            return
        k = (key, b)
        old = self.draft_s.get(k)
        self.draft_s[k] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def stats(self) -> dict:
        """The share of sequence-steps that speculated, over all and per batch size."""
        n, spec = sum(c[0] for c in self.by_batch.values()), sum(c[1] for c in self.by_batch.values())
        return dict(speculated_share=round(spec / max(n, 1), 4),
                    speculated_share_by_batch={str(k): round(c[1] / c[0], 4) for k, c in sorted(self.by_batch.items())})
