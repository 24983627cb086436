"""The batch's speculative budget: each sequence's tree size for the next step (1: no draft), chosen for the whole
batch's tokens per second. A step costs the target pass over every sequence's rows, P(R), plus each sequence's
drafting. With λ the batch's tokens per second, a sequence takes the size b that maximises

    E_i(b) - λ * (P(R_others + b) - P(R_others + 1) + draft(b) - draft(1))

(Dinkelbach's rule for a ratio: at λ the current rate, a size pays iff it raises the batch's rate). At batch 1 this
is budget.py's choice. When the pass turns compute-bound, extra rows cost what they verify and trees lose, so
speculation turns itself off; as the batch thins it comes back. E_i is the sequence's own acceptance per node rank
and per source (budget.Budget) once it has its own evidence, until then every sequence's (a new sequence's
untried ranks would count as likely as not: with a few sources each, exploring had cost more than it found); P,
draft and λ are running means of what every step measured.

The model can be wrong (noisy costs, acceptance that drifts), so the batch also measures what it gets: per batch
size group it runs steps with drafting off and steps with the rule above, keeps the faster, and retries the other
in short runs, less often each time it loses (as budget.py's probes). λ is the faster one's rate.
"""
from budget import Budget


def bucket(rows: int) -> int:
    """Row counts measured together: exact to 16, then 8 buckets an octave."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return (rows + step // 2) // step * step


def nondecreasing(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(c)]


class PassCosts:
    """Seconds of the target pass by rows: running means per bucket, made non-decreasing in rows (one step's
    contexts and load make the means noisy: a noisy dip had made extra rows look free), linear between them."""

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
            ks = sorted(self.t)
            self.fit = dict(zip(ks, nondecreasing([self.t[r] for r in ks])))
        f, k = self.fit, rows  # (between bucket means: rows in one bucket still differ)
        if k in f:
            return f[k]
        lo = max((r for r in f if r < k), default=None)
        hi = min((r for r in f if r > k), default=None)
        if lo is None:  # below every measure: in proportion (no fixed part assumed)
            return f[hi] * k / hi
        if hi is None:  # above: the slope of the two largest measures, else in proportion
            below = [r for r in f if r < lo]
            slope = (f[lo] - f[max(below)]) / (lo - max(below)) if below else f[lo] / lo
            return f[lo] + slope * (k - lo)
        return f[lo] + (f[hi] - f[lo]) * (k - lo) / (hi - lo)


class BatchBudget:
    """Sizes for the sequences of a batch (sequence objects with .budgets {source: Budget}, .key, .b, .index)."""

    def __init__(self, nodes: int, sizes_of=None, start_of=None, decay: float = 0.8):
        self.nodes, self.sizes_of, self.start_of, self.decay = nodes, sizes_of, start_of, decay
        self.pass_s, self.draft_s = PassCosts(decay), {}  # draft_s: (source, size) -> a sequence's seconds
        self.by_batch = {}  # sequences in the step -> [sequence-steps, of them speculative]
        self.common = {}  # source -> Budget: every sequence's acceptance
        self.groups = {}  # batch size group -> its modes' rates and schedule (_mode)
        self.mode = self.group = None  # the current step's

    RUN, GAP, MAX_GAP = 4, 32, 512  # a retry's steps; steps between retries, doubling while they lose

    def _mode(self, n: int) -> str:
        """'ar' (no drafts) or 'spec' for a step of n sequences."""
        g = self.groups.setdefault(n.bit_length(), dict(rate={}, run=0, run_mode=None, gap=self.GAP, due=0, steps=0))
        g["steps"] += 1
        if g["run"] == 0:
            if g["run_mode"] is not None:  # a retry ended: it keeps the lead, or waits twice as long
                won = g["rate"][g["run_mode"]] >= max(g["rate"].values())
                g["gap"], g["run_mode"] = self.GAP if won else min(2 * g["gap"], self.MAX_GAP), None
            new = [m for m in ("ar", "spec") if m not in g["rate"]]
            if new or g["steps"] >= g["due"]:
                best = max(g["rate"], key=g["rate"].get) if g["rate"] else None
                g["run_mode"] = new[0] if new else ("spec" if best == "ar" else "ar")
                g["run"], g["due"] = self.RUN, g["steps"] + self.RUN + g["gap"]
        if g["run"]:
            g["run"] -= 1
            return g["run_mode"]
        return max(g["rate"], key=g["rate"].get)

    @property
    def rate(self) -> float | None:
        """λ: the batch's tokens per second in its current group, the faster mode's."""
        r = self.groups.get(self.group, {}).get("rate")
        return max(r.values()) if r else None

    def _new(self, key: str) -> Budget:
        sizes = self.sizes_of(key) if self.sizes_of else None
        return Budget(self.nodes, sizes=sizes, start=self.start_of(key) if self.start_of else None, decay=self.decay)

    OWN = 3.0  # decayed trials of a sequence's first rank past which its own acceptance counts

    def budget(self, seq) -> Budget:
        """The acceptance the sequence's choice reads: its own, or every sequence's while it has little."""
        own = seq.budgets.get(seq.key)
        if (own is None or own.trials[1] < self.OWN) and seq.key in self.common:
            return self.common[seq.key]
        if own is None:
            own = seq.budgets[seq.key] = self._new(seq.key)
        return own

    def observe_seq(self, seq, b: int, accepted: list[int]):
        """A sequence's step of size b > 1: its accepted node indices, root first."""
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

    def choose(self, seqs: list, key_of) -> list[int]:
        """Each sequence's size for the next step (its .b holds the last one; key_of(seq): its source now, set as
        seq.key where drafting is on). A source no sequence has evidence on yet is tried by one sequence a step at
        its start size (the whole tree), after a first step without drafts has measured the batch's rate."""
        self.group, self.mode = len(seqs).bit_length(), self._mode(len(seqs))
        rows, tried = sum(s.b for s in seqs), set()
        out = [1] * len(seqs) if self.mode == "ar" else []
        for s in seqs if self.mode == "spec" else ():
            s.key = key_of(s)
            c = self.common.get(s.key)
            if c is None or c.trials[1] < self.OWN:
                b = 1 if self.rate is None or s.key in tried else self._new(s.key).start
                tried.add(s.key)
            else:
                bud, others, setup = self.budget(s), rows - s.b, s.drafter.budget_setup
                base = self.pass_s(others + 1) + self.draft(s.key, 1)
                b = max(bud.sizes, key=lambda x: bud.tokens(x) - self.rate * (  # a set-up (a lazy head's start) too
                    self.pass_s(others + x) + self.draft(s.key, x) - base + (setup(s.key, x) if x > 1 else 0.0)))
            out.append(b)
        n, spec = len(seqs), sum(b > 1 for b in out)
        c = self.by_batch.setdefault(n, [0, 0])
        c[0], c[1] = c[0] + n, c[1] + spec
        return out

    def observe(self, rows: int, pass_s: float, tokens: int, step_s: float):
        """A step: rows verified in pass_s seconds, tokens emitted in step_s seconds all told."""
        self.pass_s.observe(rows, pass_s)
        r, rates = tokens / max(step_s, 1e-9), self.groups[self.group]["rate"]
        rates[self.mode] = r if self.mode not in rates else self.decay * rates[self.mode] + (1 - self.decay) * r

    def observe_draft(self, key: str, b: int, seconds: float):
        """A sequence's drafting (its updates and its draft) for a step of size b."""
        k = (key, b)
        self.draft_s[k] = seconds if k not in self.draft_s else self.decay * self.draft_s[k] + (1 - self.decay) * seconds

    def stats(self) -> dict:
        """The share of sequence-steps that speculated, over all and per batch size."""
        n, spec = sum(c[0] for c in self.by_batch.values()), sum(c[1] for c in self.by_batch.values())
        return dict(speculated_share=round(spec / max(n, 1), 4),
                    speculated_share_by_batch={str(k): round(c[1] / c[0], 4) for k, c in sorted(self.by_batch.items())})
