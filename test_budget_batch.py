"""budget_batch.py: the monotone pass-cost table, and the batch budget on simulated batches: speculation on where
extra rows are nearly free (bandwidth-bound), off where each row costs its share (compute-bound), back on as the
batch thins, and never far below drafting off."""
from dataclasses import dataclass, field

import pytest

from budget_batch import BatchBudget, PassCosts, bucket, lower_hull
from budget_policy import Policy


def test_lower_hull_slopes_never_fall():
    assert lower_hull([(1, 1.0), (2, 2.0), (3, 3.0)]) == [(1, 1.0), (3, 3.0)]
    assert lower_hull([(1, 5.0), (2, 1.0), (4, 2.0), (8, 9.0), (9, 9.5)]) == [(1, 5.0), (2, 1.0), (4, 2.0), (9, 9.5)]
    assert lower_hull([]) == []


def test_pass_costs_interpolate_and_never_fall():
    p = PassCosts(decay=0.5)
    assert p(8) == 0.0
    p.observe(1, 0.010)
    assert p(4) == pytest.approx(0.040)  # one measure: in proportion
    p.observe(16, 0.014)
    p.observe(32, 0.030)
    assert p(8) == pytest.approx(0.010 + 0.004 * 7 / 15)
    assert p(48) == pytest.approx(0.030 + 0.001 * 16)  # above: the last slope
    p.observe(16, 0.030)  # (means: 0.022) above the line from 1 to 32: the hull goes under it
    assert p(16) == pytest.approx(0.010 + 0.020 * 15 / 31)
    p.observe(24, 0.005)  # a noisy dip
    p.observe(1, 0.020)  # a noisy peak at the start
    assert all(p(r) <= p(r + 1) for r in range(1, 60))  # never falls
    slopes = [p(r + 1) - p(r) for r in range(1, 60)]
    assert all(b >= a - 1e-12 for a, b in zip(slopes, slopes[1:]))  # an extra row never gets cheaper
    assert [bucket(r) for r in (5, 16, 17, 33, 100)] == [5, 16, 18, 32, 104]  # 8 an octave past 16


@dataclass
class Seq:
    p: float  # acceptance of each next node of its chain
    key: str = "eagle"
    budgets: dict = field(default_factory=dict)
    drafter: object = None


@dataclass
class Drafter:
    needs: object = None  # needs(key, b): a one-time set-up not yet paid (the hybrid's late head)
    setup: float = 0.0  # its price (0: not measured yet)

    def budget_needs(self, key, b):
        return bool(self.needs and self.needs(key, b))

    def budget_setup(self, key, b):
        return self.setup if self.budget_needs(key, b) else 0.0


def simulate(n: int, pass_s, draft_s: float, p, steps: int = 400, bb=None) -> tuple[BatchBudget, list, list]:
    """n sequences whose chains of b nodes accept each next node with probability p (a list: theirs by turns; in
    expectation: the first round(E) - 1 ranks each step); a step costs pass_s(rows) + draft_s per drafting sequence.
    -> (budget, the batch's tokens per second of each step, the share of its sequences that drafted)."""
    bb = bb or BatchBudget(16, sizes_of=lambda k: [1, 2, 4, 8, 16])
    for r in (1, 2, 4, 8, 16, 32, 64, 128, 256):  # as BatchEngine measures the pass once per machine
        bb.pass_s.observe(r, pass_s(r))
    seqs = [Seq(p[i % len(p)] if isinstance(p, list) else p, drafter=Drafter()) for i in range(n)]
    rates, spec = [], []
    for _ in range(steps):
        sizes = bb.choose(seqs, lambda s: s.key)
        toks = [sum(s.p ** i for i in range(b)) for s, b in zip(seqs, sizes)]
        rows = sum(sizes)
        step = pass_s(rows) + draft_s * sum(b > 1 for b in sizes)
        for s, b, t in zip(seqs, sizes, toks):
            if b > 1:
                bb.observe_draft(s.key, b, draft_s)
                bb.observe_seq(s, b, list(range(max(1, round(t)))))
        bb.observe(rows, pass_s(rows), round(sum(toks)), step)
        rates.append(sum(toks) / step)
        spec.append(sum(b > 1 for b in sizes) / n)
    return bb, rates, spec


def test_speculates_where_rows_are_nearly_free():
    """Bandwidth-bound (10 ms a pass, 0.05 ms a row) and a good drafter: every sequence drafts, and the batch
    runs well above drafting off (16 tokens per 10.8 ms)."""
    bb, rates, spec = simulate(16, lambda r: 0.010 + 0.00005 * r, 0.0002, 0.8)
    assert min(spec[-50:]) == 1.0
    assert sum(rates[-50:]) / 50 > 1.5 * 16 / (0.010 + 0.00005 * 16)


def test_drafting_turns_off_when_rows_cost_their_share():
    """Compute-bound (1 ms a row) with a mediocre drafter: drafting stays off past the first tries, and the batch
    loses at most 5% against drafting off over its whole run."""
    bb, rates, spec = simulate(16, lambda r: 0.001 * r, 0.0005, 0.5)
    assert max(spec[-100:]) == 0.0
    ar = 16 / 0.016
    assert sum(rates[-100:]) / 100 == pytest.approx(ar)
    assert sum(rates) / len(rates) > 0.95 * ar
    share = bb.stats()
    assert share["speculated_share"] < 0.05 and share["speculated_share_by_batch"]["16"] < 0.05


class Asking(BatchBudget):
    """A BatchBudget that asks every sequence's sources and sizes (hopeless() never answers), counting what it
    would have answered."""
    skipped = asked = 0

    def hopeless(self, seq, bars):
        self.asked += 1
        self.skipped += super().hopeless(seq, bars)
        return False


@pytest.mark.parametrize("n,pass_s,draft_s,p", [
    (16, lambda r: 0.001 * r, 0.0005, 0.5),  # compute-bound: every tree off
    (16, lambda r: 0.010 + 0.00005 * r, 0.0002, 0.8),  # bandwidth-bound: every tree on
    (12, lambda r: 0.006 + 0.0004 * r, 0.0002, [0.95, 0.3, 0.3]),  # between: a third of the sequences draft
    (16, lambda r: 0.004 + 0.0002 * r, 0.0002, [0.99, 0.5, 0.2, 0.2])])
def test_a_hopeless_sequence_is_sized_as_its_sources_would_size_it(n, pass_s, draft_s, p):
    """A sequence skipped as hopeless (no source's tree of any size could pay, at the most likely acceptance it
    could be priced at) gets the size asking its sources gives, step for step; and under load most are skipped."""
    asking = Asking(16, sizes_of=lambda k: [1, 2, 4, 8, 16])
    _, rates, spec = simulate(n, pass_s, draft_s, p, bb=asking)
    bb, rates2, spec2 = simulate(n, pass_s, draft_s, p)
    assert rates2 == rates and spec2 == spec
    if max(spec[-100:]) == 0.0:
        assert asking.skipped > 0.9 * asking.asked
    if min(spec[-100:]) == 1.0:
        assert asking.skipped == 0
    if isinstance(p, list):  # those that draft are asked, the others mostly not
        assert 0.05 < sum(spec) / len(spec) < 0.5 and 0.3 * asking.asked < asking.skipped < 0.9 * asking.asked


def test_one_sequence_keeps_its_gain():
    """Batch 1 on a bandwidth-bound pass: speculation on, as the one-sequence budget would have it."""
    bb, rates, spec = simulate(1, lambda r: 0.006 + 0.0001 * r, 0.001, 0.7)
    assert min(spec[-50:]) == 1.0 and sum(rates[-50:]) / 50 > 1.3 / 0.0061


def test_tokens_in_one_sweep_equal_the_budgets():
    from budget import Budget
    from budget_batch import tokens
    b = Budget(26, sizes=[1, 2, 4, 8, 11, 26])
    for acc in ([0, 1, 2], [0], [0, 1, 2, 3, 4, 5, 6], [0, 1]):
        b.observe(11, acc, 0.0)
    assert tokens(b) == pytest.approx({x: b.tokens(x) for x in b.sizes})


def test_a_sequence_drafts_with_the_source_that_pays_it():
    """Where a sequence's drafter offers two sources (the hybrid at a step with a chain), its budget.Policy picks
    one, as at batch 1: the source never accepted is tried a bounded number of times, the other drafts."""
    pass_s = lambda r: 0.010 + 0.00005 * r
    bb = BatchBudget(16, sizes_of=lambda k: [1, 2, 4, 8, 16])
    for r in (1, 2, 4, 8, 16, 32, 64):
        bb.pass_s.observe(r, pass_s(r))
    seqs = [Seq(0.8, drafter=Drafter()) for _ in range(4)]
    picks = []
    for _ in range(300):
        sizes = bb.choose(seqs, lambda s: ["ngram3", "eagle"])
        for s, b in zip(seqs, sizes):
            if b > 1:
                bb.observe_draft(s.key, b, 0.0002)
            bb.observe_seq(s, b, list(range(1 if b == 1 or s.key == "ngram3" else min(b, 4))))
            picks.append(s.key if b > 1 else None)
        rows = sum(sizes)
        bb.observe(rows, pass_s(rows), 4, pass_s(rows))
    late = picks[len(picks) // 2:]
    assert late.count("ngram3") <= 4 * (150 // 64 + 1) and late.count("eagle") >= 0.9 * len(late)


def two_sources(pass_s, drafter, steps: int = 60) -> list[tuple[str, int, bool]]:
    """16 sequences offered prompt lookup's chain and the head's tree (sizes 2 .. 16), neither ever accepted past
    its root -> every (source, size, trial) drafted."""
    bb = BatchBudget(16, sizes_of=lambda k: [1, 2, 4, 8, 16])
    for r in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        bb.pass_s.observe(r, pass_s(r))
    seqs = [Seq(0.5, drafter=drafter) for _ in range(16)]
    out = []
    for _ in range(steps):
        sizes = bb.choose(seqs, lambda s: ["ngram3", "eagle"])
        for s, b in zip(seqs, sizes):
            if b > 1:
                out.append((s.key, b, s.policy.trying))
                bb.observe_draft(s.key, b, 0.0002)
            bb.observe_seq(s, b, [0])
        rows = sum(sizes)
        bb.observe(rows, pass_s(rows), 16, pass_s(rows))
    return out


def test_a_step_without_a_draft_counts_for_no_source():
    """A sequence's step of one row is no draft of the source its policy handed it (the source's rate is its drafts'),
    unless the step was that source's trial: as at batch 1 (test_budget_policy)."""
    bb = BatchBudget(16, sizes_of=lambda k: [1, 2, 4, 8, 16])
    s = Seq(0.5, drafter=Drafter())
    s.policy, s.chosen, s.step_s = Policy(), "ngram3", 0.01
    bb.observe_seq(s, 1, [0])
    assert not s.policy.n and s.policy.total_s == pytest.approx(0.01)
    bb.observe_seq(s, 4, [0, 1])
    s.policy.trying = True
    bb.observe_seq(s, 1, [0])
    assert s.policy.n == {"ngram3": 2} and s.policy.tok["ngram3"] == pytest.approx(0.8 * 2 + 1)


def test_a_trial_pays_no_set_up():
    """A source's trial drafts at a size that needs no set-up, where it has one, even while the set-up's price is
    not measured (0): an n-gram trial of the hybrid's merged tree (16 here) had started the head of 4 of a batch's
    16 sequences in one step, 38 ms each."""
    d = Drafter(needs=lambda k, b: b == 16 or k == "eagle")
    got = two_sources(lambda r: 0.010 + 0.00005 * r, d)
    trials = [(k, b) for k, b, trial in got if trial and k == "ngram3"]
    assert trials and all(b < 16 for _, b in trials)


def test_a_set_up_is_weighed_with_the_rows_its_trees_add():
    """Whether the head's start (50 ms) may be tried is weighed with what its trees add to the pass: where a row
    costs its share (1 ms), its untried prior (each node as likely as not) never repays it and no sequence starts
    it; where rows are nearly free, it does."""
    d = Drafter(needs=lambda k, b: k == "eagle", setup=0.05)
    assert not [k for k, _, _ in two_sources(lambda r: 0.001 * r, d) if k == "eagle"]
    assert [k for k, _, _ in two_sources(lambda r: 0.010 + 0.00005 * r, d) if k == "eagle"]
