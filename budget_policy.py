"""Which source drafts a step, where a drafter offers several (the hybrid: prompt lookup's chain, the tree drafter's
tree): the one that has paid best on this request, explore then exploit (Policy); and whether a one-time set-up (the
hybrid's late head) pays back in the tokens a request has left (pays_back). The Budgets of budget.py and
budget_batch.py ask it."""


def pays_back(setup: float, left: float, rate: float, rate_without: float) -> bool:
    """A one-time set-up pays where the tokens the request has left, at the rate it allows instead of the best rate
    without it, save its seconds."""
    return rate > rate_without > 0 and left * (1 / rate_without - 1 / rate) >= setup


class Policy:
    """Which of the sources a drafter offers drafts the next step (that source's Budget then picks the size, an
    autoregressive step among them): the one with the most tokens per second on this request (rate). Explore, then
    exploit: a source first offered gets `trials` steps, where may_try says its set-up pays back; a source that
    loses is tried again after a gap that doubles while it keeps losing (gap..max_gap steps: one that never pays
    costs a bounded share), every gap back to `gap` when the leader stops beating decoding, and the next step again
    after a trial that beat the leader (one that starts paying is taken up). Rates decay per step of their source,
    so the policy follows sources that pay by stretches. Re-trials stay under `share` of the request's seconds (as
    the Budget's probes do while decoding wins): at T 0.7 on Spec-Bench, three chain sources re-tried every 8 steps
    while nothing paid had spent 7% of the time below decoding's rate."""

    def __init__(self, trials: int = 2, gap: int = 8, max_gap: int = 64, decay: float = 0.8, share: float = 0.05):
        self.trials, self.gap0, self.max_gap, self.decay, self.share = trials, gap, max_gap, decay, share
        self.tok, self.sec, self.n = {}, {}, {}  # source -> decayed tokens, decayed seconds, drafted steps
        self.gap, self.last = {}, {}  # source -> steps before its next trial, the step it was last chosen
        self.steps, self.trying, self.retrying, self.leader, self.bar = 0, False, False, None, 0.0
        self.retry_s = self.total_s = 0.0  # seconds of re-trials, of every step observed

    estimate = None  # source -> its Budget's best estimated rate (Budgets sets it; None: the measured rate alone)

    def rate(self, s) -> float:
        """Tokens per second of source s's steps: its Budget's estimate at its best size once it has one (per rank
        acceptance and per size times: a trial's larger draft does not lower it), else the steps' measured rate."""
        est = self.estimate(s) if self.estimate is not None and self.n.get(s) else 0.0
        return est or (self.tok[s] / self.sec[s] if self.sec.get(s) else 0.0)

    def choose(self, sources: list, ar_rate: float = 0.0, may_try=lambda s: True):
        """A source of sources, or None (ar_rate: tokens per second of an autoregressive step, 0: not known)."""
        # a source never drafted whose set-up would not pay back is no choice; where one source is left, the step
        # is its own (no trials: the hybrid whose head waits drafts as prompt lookup alone does; their trials had
        # cost it 7-10% on Spec-Bench's translation and QA answers, the head never started)
        fresh = {s: may_try(s) for s in sources if not self.n.get(s)}  # never drafted: whether each may be tried
        open_ = [s for s in sources if fresh.get(s, True)]
        if len(open_) == 1:
            return self.only(open_[0])
        self.steps += 1
        tried = [s for s in sources if self.n.get(s, 0) >= self.trials]
        best = max(tried, key=self.rate, default=None)
        # below decoding, the best still drafts: its Budget weighs its sizes against an autoregressive step (one
        # place for that choice; this rate also counts its trials' larger drafts)
        pays = best is not None and self.rate(best) >= ar_rate
        if not pays and self.leader is not None:  # the leader stopped paying: what else does, soon
            self.gap = {}
        self.leader, self.trying, self.retrying = best if pays else None, True, False
        self.bar = max(self.rate(best) if best is not None else 0.0, ar_rate)  # what a trial must beat to come back
        for s in sources:
            if s not in tried and (fresh[s] if s in fresh else may_try(s)):  # explore
                return self.take(s)
        for s in tried if self.retry_s <= self.share * self.total_s else ():
            if s != best and self.steps - self.last[s] >= self.gap.get(s, self.gap0) and may_try(s):
                self.gap[s] = min(2 * self.gap.get(s, self.gap0), self.max_gap)
                self.retrying = True
                return self.take(s)
        self.trying = False
        if best is not None:
            self.gap[best] = self.gap0
            self.take(best)
        return best

    def known(self, s):
        """Source s comes with the engine's memory of earlier requests (its Budget's estimate rates it): no trials.
        Each request's trials had cost the Qwen pair's default 0.33 s of a 2.6 s HumanEval/2 (a 3-gram chain's
        trials drafting the merged tree, 26 nodes, at 300 ms against 125 ms)."""
        self.n[s] = max(self.n.get(s, 0), self.trials)
        self.last.setdefault(s, self.steps)

    def only(self, s):
        """The step's one source: its steps count towards its rate as chosen ones."""
        self.steps, self.trying, self.retrying = self.steps + 1, False, False
        return self.take(s)

    def take(self, s):
        self.last[s] = self.steps
        return s

    def observe(self, s, tokens: int, seconds: float, drafted: bool):
        """A step handed to source s (None: to none): tokens emitted in seconds. A step without a draft is no
        source's but a trial's: the hybrid's waiting head, offered alone where lookup had no chain and decoding, had
        counted as tried at decoding's rate, took steps from the chains, and their re-trials drafted past their
        best size."""
        d = self.decay
        self.total_s += seconds
        self.retry_s += seconds if self.retrying else 0.0
        if s is None or not (drafted or self.trying):  # its time alone
            return
        self.tok[s], self.sec[s] = d * self.tok.get(s, 0.0) + tokens, d * self.sec.get(s, 0.0) + seconds
        self.n[s] = self.n.get(s, 0) + 1
        if self.trying and s != self.leader and 0 < self.bar * seconds < tokens:  # a trial that beat the leader
            self.gap[s] = 1
