"""The speculative budget's chooser: expected tokens, the best rate from stubbed costs and acceptance, timing
the ends first, the fallback to autoregressive decoding and back. (The engine's losslessness under every
budget is in test_generate.py.)"""
import json

import pytest

from budget import Budget, Budgets
from budget_batch import BatchBudget
from draft import Drafter
from sampling import Sampling
from sequence import Seq


def trained(nodes, p, cost):
    """A Budget whose node rank i is accepted at rate p[i] (stubbed counts) and whose size b took cost[b] s."""
    b = Budget(nodes, probe=10 ** 9)
    b.time, b.timed = dict(cost), dict.fromkeys(cost, 2)
    b.hits, b.trials = [1000.0 * x for x in p], [1000.0] * nodes
    return b


def test_tokens_add_up_node_acceptance():
    b = Budget(4)
    for _ in range(200):
        b.observe(4, [0, 1, 3], 1.0)  # nodes 1 and 3 always accepted, 2 never
    assert b.tokens(1) == 1.0
    # the prior (1/2 of one pseudo-trial) still weighs against about 10 decayed trials
    assert b.tokens(4) == pytest.approx(3.0, abs=0.1) and b.tokens(3) == pytest.approx(2.0, abs=0.1)


def test_picks_the_size_with_the_best_rate():
    """Stubbed costs and acceptance: a cheap machine takes the whole tree, an expensive one a prefix."""
    p = [1.0, 0.9, 0.6, 0.3, 0.3, 0.1, 0.1, 0.1]
    flat = {1: 1.0, 2: 1.0, 4: 1.05, 8: 1.1}  # a GPU-like machine: rows are nearly free
    steep = {1: 1.0, 2: 1.1, 4: 1.8, 8: 4.0}  # rows cost: deep, unlikely nodes do not pay
    bf, bs = trained(8, p, flat), trained(8, p, steep)
    assert bf.pick() == 8
    assert bs.pick() == 2  # 1.9 tokens / 1.1 s beats 2.8 / 1.8 and 3.4 / 4.0
    assert max(bs.sizes, key=bs.rate) == 2 and bs.rate(2) > bs.rate(1) > bs.rate(8)


def test_falls_back_to_autoregressive_and_probes_back():
    """Acceptance collapses (novel text): the budget turns to 1 (decode autoregressively), keeps probing the
    most promising size and the one above it every probe-th step, and turns speculation back on once the probes are
    accepted again.
    (probe_share=1: the probes' time is not capped here; test_probes_take_a_bounded_share caps it.)"""
    b = Budget(8, probe=4, max_gap=8, probe_share=1.0)
    cost = {1: 1.0, 2: 1.3, 4: 1.6, 8: 2.0}
    chosen, t = [], 0
    for phase, acc in (("good", list(range(8))), ("bad", [0]), ("good", list(range(8)))):
        for _ in range(40):
            k = b.pick()
            chosen.append((phase, k))
            b.observe(k, [i for i in acc if i < k], cost[k])
            t += 1
    good1 = [k for ph, k in chosen[:40]][10:]
    bad = [k for ph, k in chosen[40:80]][15:]
    good2 = [k for ph, k in chosen[80:]][15:]
    assert sum(k > 1 for k in good1) >= len(good1) * 0.8  # speculating (with a few autoregressive probes)
    assert bad.count(1) >= len(bad) * 0.7 and len(set(bad) - {1}) >= 2  # mostly autoregressive, with probes of
    # the most promising size and the one above it
    assert sum(k > 1 for k in good2) >= len(good2) * 0.8  # back on
    st = b.stats()
    assert 0 < st["speculated_share"] < 1 and sum(st["budget_hist"].values()) == 120


def test_ends_are_timed_first_and_the_middle_interpolated():
    b = Budget(16)
    assert b.sizes == [1, 2, 4, 8, 16]
    seen = []
    for _ in range(4):
        k = b.pick()
        seen.append(k)
        b.observe(k, [0], {16: 2.5, 1: 1.0}[k])
    assert seen == [16, 16, 1, 1]
    assert b.seconds(4) == pytest.approx(1.0 + 1.5 * 3 / 15) and b.seconds(16) == 2.5
    b.observe(4, [0], 9.0)  # timed once: still interpolated
    assert b.seconds(4) == pytest.approx(1.3)
    b.observe(4, [0], 1.2)
    assert b.seconds(4) == 1.2 and b.seconds(8) == pytest.approx(1.2 + 1.3 * 4 / 12)


def test_first_time_of_a_size_is_not_kept():
    """A size's first step also pays one-time set-up: it must not decide (it would never be re-measured)."""
    b = Budget(2, probe=10 ** 9)
    for k, t in ((2, 1.0), (2, 1.0), (1, 9.0), (1, 0.4)):  # the first autoregressive step was slow
        assert b.pick() == k
        b.observe(k, [0], t)
    assert b.time[1] == 0.4 and b.pick() == 1


def test_eager_cpu_steps_settle_after_one_timing():
    """settle=1 (eager CPU steps: no one-time set-up per shape): each end is timed once, the first time counts,
    and the choice follows right after; the engine uses it exactly there."""
    b = Budget(16, probe=10 ** 9, settle=1)
    seen = []
    for _ in range(3):
        k = b.pick()
        seen.append(k)
        b.observe(k, list(range(12)) if k == 16 else [0], {16: 2.5, 1: 1.0}[k])
    assert seen == [16, 1, 16] and b.seconds(16) == 2.5 and b.seconds(1) == 1.0
    assert b.seconds(4) == pytest.approx(1.0 + 1.5 * 3 / 15)


def test_probes_take_a_bounded_share_of_hopeless_text():
    """Nothing is ever accepted and the whole tree costs 8 autoregressive steps: over 600 steps the probes take at
    most probe_share of the time (plus the one probe that crossed it), yet they keep coming (the fallback's
    way back), and once the text turns predictable speculation comes back on."""
    b = Budget(16, probe=8, max_gap=64, probe_share=0.05)
    cost = lambda k: 1.0 if k == 1 else 1.0 + 7.0 * k / 16
    ks = []
    for _ in range(600):
        k = b.pick()
        ks.append(k)
        b.observe(k, [0], cost(k))
    probes = [k for k in ks[10:] if k > 1]
    assert probes and b.probe_s <= 0.05 * b.total_s + cost(16), (b.probe_s, b.total_s)
    assert ks[-200:].count(1) >= 190
    for _ in range(400):
        k = b.pick()
        ks.append(k)
        b.observe(k, list(range(k)), cost(k))
    assert sum(k > 1 for k in ks[-50:]) >= 40  # (slowly: after a long hopeless run probes come 64 steps apart)


def test_each_source_keeps_its_own_budget():
    """Budgets: steps drafted by prompt lookup (a chain accepted to the end) and by the EAGLE head alone (nothing
    accepted) keep apart, so the chain's size pays where there is a chain and the other steps fall back to
    autoregressive decoding; observe() goes to the budget that picked; stats() merge the histograms."""
    bs = Budgets(8, probe=10 ** 9, settle=1)
    cost = lambda k: 1.0 + 0.1 * k
    picks = {"ngram": [], "eagle": []}
    for step in range(40):
        key = "ngram" if step % 2 else "eagle"
        k = bs.pick(key)
        picks[key].append(k)
        bs.observe(k, list(range(k)) if key == "ngram" else [0], cost(k))
    assert picks["ngram"][-5:] == [8] * 5 and picks["eagle"][-5:] == [1] * 5
    d = bs.stats()
    assert sum(d["budget_hist"].values()) == 40 and set(d["budget_sources"]) == {"ngram", "eagle"}
    assert d["budget_sources"]["ngram"]["share"] == 0.5 and 0.4 < d["speculated_share"] < 0.6
    assert bs.settle == 1


def test_untimed_sizes_follow_the_machines_pass_costs():
    """With the machine's pass costs (budget_memory.pass_costs), an untimed size costs the nearest smaller timed size's
    step plus the passes' difference (flat then rising, as a CPU's), not a straight line from one row to the
    whole tree; without them the line stays."""
    pass_s = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.8, 16: 3.5}
    b, line = Budget(16, settle=1, pass_s=pass_s), Budget(16, settle=1)
    for x in (b, line):
        x.observe(16, [0], 4.0)
        x.observe(1, [0], 1.2)
    # + the drafting overhead the whole tree's step showed beyond its pass: 4.0 - 1.2 - (3.5 - 1.0) = 0.3
    assert b.overhead() == pytest.approx(0.3)
    assert b.seconds(4) == pytest.approx(1.2 + 0.1 + 0.3) and b.seconds(8) == pytest.approx(1.2 + 0.8 + 0.3)
    assert line.seconds(4) == pytest.approx(1.2 + 2.8 * 3 / 15) and line.overhead() == 0.0
    b.observe(4, [0], 1.5)  # from a timed speculative size: its time already holds its drafting
    assert b.seconds(8) == pytest.approx(1.5 + 0.7) and b.seconds(4) == 1.5
    assert b.overhead() == pytest.approx(1.5 - 1.2 - 0.1)  # the least over the timed sizes'


def test_a_set_up_is_not_paid_for_drafts_that_cost_more_than_they_gain():
    """A size that needs the set-up is weighed at its estimated step time: from an autoregressive step, its pass
    and the drafting the source's timed steps showed. A head whose first node is right 60% of the time but whose
    drafting costs 1.5 autoregressive steps never starts; the same head with cheap drafting starts once the
    tokens the request has left would repay it."""
    pass_s = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.2, 16: 1.5}

    def picks(whole_tree_s):
        b = Budget(16, pass_s=pass_s)
        b.time, b.timed = {1: 1.0, 16: whole_tree_s}, {1: 2, 16: 2}
        b.hits, b.trials = [0.0, 3.0] + [0.0] * 14, [0.0] + [5.0] * 15  # rank 1: 60%, deeper ranks never
        bs = Budgets(16, memory={"eagle": b}, pass_s=pass_s, probe=10 ** 9, setup_of=lambda key, s: 2.0)
        return [bs.pick("eagle", left=left) for left in range(1, 13)]

    assert picks(3.0) == [1] * 12  # overhead 3.0 - 1.0 - 0.5 = 1.5 s: size 2 would take 2.52 s for 1.6 tokens
    cheap = picks(1.6)  # overhead 0.1 s: 1.6 tokens in 1.12 s save 0.3 s a token, 2 s over 7 tokens
    assert cheap[:6] == [1] * 6 and cheap[6:] == [2] * 6


def test_sources_share_the_autoregressive_time_and_the_probe_cap():
    """An autoregressive step is the same whatever drafts next: a source that starts later takes the time the
    others measured (no timing step of its own), and every source's AR time follows the latest. The probes of
    all sources together stay under probe_share of the request (not probe_share each)."""
    bs = Budgets(16, probe=8, max_gap=64, probe_share=0.05, settle=1)
    cost = lambda k: 1.0 if k == 1 else 1.0 + 7.0 * k / 16  # hopeless text: nothing is ever accepted
    first = []
    for step in range(600):
        key = "eagle" if step < 5 else ("ngram" if step % 3 == 0 else "eagle")
        k = bs.pick(key)
        if step in (5, 6):  # "ngram" starts at step 6 (step 5 is eagle's): one whole-tree step, no AR timing
            first.append((key, k))
        bs.observe(k, [0], cost(k))
    assert bs.of["ngram"].chosen.get(16) == 1 and bs.of["ngram"].timed[1] > 1
    assert bs.of["ngram"].time[1] == bs.of["eagle"].time[1] == 1.0
    probe = bs.of["eagle"].spent
    assert probe is bs.of["ngram"].spent is bs.spent
    big = cost(16)
    assert 0 < probe["probe"] <= 0.05 * probe["total"] + 2 * big, probe  # (each source's start-up is not a probe)
    later = [s for bud in bs.of.values() for s, v in bud.chosen.items() if s > 4 and s != 16]
    assert not later  # the climb from the cheapest size, never straight to the whole tree


def test_a_source_chooses_from_its_own_sizes():
    """Budgets(sizes_of=...): each source picks from its own set (the hybrid's chain steps: the chain alone,
    1 + k nodes, then the merged tree). A chain accepted to its end and a tree beyond it never accepted: the
    chain source settles on the whole chain, a size the default set (powers of two, then 26) lacks."""
    chain = [1, 2, 4, 8, 11, 26]
    for start_of in (None, lambda key: 11 if key == "ngram" else None):
        bs = Budgets(26, sizes_of=lambda key: chain if key == "ngram" else None, start_of=start_of, probe=10 ** 9,
                     settle=1)
        cost = lambda k: 1.0 + 0.05 * k
        picks = []
        for step in range(60):
            k = bs.pick("ngram")
            picks.append(k)
            bs.observe(k, list(range(min(k, 11))), cost(k))
        assert bs.of["ngram"].sizes == chain and picks[-5:] == [11] * 5
        assert picks[:2] == ([26, 1] if start_of is None else [11, 1])  # start_of: the size tried first
        # the merged tree is tried once: first, or (from the chain) next, as its unseen ranks' prior promises
        # tokens; its trial finds the ranks past the chain never accepted
        assert picks.count(26) == 1
        assert bs.pick("eagle") == 26 and bs.of["eagle"].sizes == [1, 2, 4, 8, 16, 26]
    assert Budget(4, sizes=[4, 2, 1, 2]).sizes == [1, 2, 4] and Budget(1, sizes=[1, 3]).nodes == 3
    assert Budget(16, start=4).pick() == 4 and Budget(16, start=5).pick() == 16  # (a start off the set: the tree)


def test_untried_ranks_count_as_the_deepest_tried_rank():
    """A rank never tried counts as likely as the deepest tried rank before it (the prior where none was):
    after a chain whose deep nodes are never accepted, the untried merged tree promises little and is not
    tried; after a chain accepted to its end it promises as much and is tried once."""
    chain = [1, 2, 4, 8, 11, 26]
    for accepted, tries in ((2, 0), (11, 1)):
        b = Budget(26, sizes=chain, start=11, probe=10 ** 9, settle=1)
        cost = lambda k: 1.0 + 0.05 * k
        picks = []
        for step in range(40):
            k = b.pick()
            picks.append(k)
            b.observe(k, list(range(min(k, accepted))), cost(k))
        assert picks.count(26) == tries, (accepted, picks)
        if not tries:
            assert b.tokens(26) == pytest.approx(b.tokens(11) + 15 * b.p(10))
    fresh = Budget(8)
    assert fresh.tokens(8) == pytest.approx(1 + 7 * 0.5)  # nothing tried: the prior


def test_a_source_starts_from_the_engines_last_request():
    """With memory (the engine's), a source's next request starts from its last state: no whole-tree or
    autoregressive timing steps before the first choice, which is the size the carried acceptance and times
    favour; without memory (or for a source with other sizes) each request times both ends first."""
    cost = {1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6, 16: 2.6}
    mem = {}

    def request(memory, key="ngram", steps=30, nodes=16):
        bs = Budgets(nodes, memory=memory, settle=1, probe=10 ** 9)
        picks = []
        for _ in range(steps):
            k = bs.pick(key)
            picks.append(k)
            bs.observe(k, [0, 1, 2, 3], cost[k])  # nodes 1-3 always accepted, deeper ones never
        bs.keep()
        return picks, bs

    first, _ = request(mem)
    assert first[:2] == [16, 1] and set(mem) == {"ngram"}
    second, bs = request(mem)
    assert second[0] == 4 and set(second) == {4}  # 4 tokens / 1.2 s: the best rate, chosen at once
    assert bs.of["ngram"].hits == mem["ngram"].hits and bs.of["ngram"] is mem["ngram"]
    fresh, _ = request(None)
    assert fresh[:2] == [16, 1]
    other, _ = request(mem, nodes=8)  # other sizes (another tree): nothing carried
    assert other[:2] == [8, 1]


def test_a_new_source_starts_from_a_speculating_sibling():
    """A source new to the engine takes a sibling's state (same sizes, speculating), weighed as one step, instead
    of its own whole-tree step; a sibling that decodes autoregressively is not copied (the new source may
    differ: it times its ends as usual)."""
    cost = {1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6, 16: 2.6}
    bs = Budgets(16, settle=1, probe=10 ** 9)
    for _ in range(20):
        k = bs.pick("ngram3")
        bs.observe(k, [0, 1, 2, 3], cost[k])
    assert bs.pick("ngram1") == 4  # the sibling's best, no whole-tree step first
    n1, n3 = bs.of["ngram1"], bs.of["ngram3"]
    assert max(n1.trials) == pytest.approx(1.0) and n1.p(2) == pytest.approx(n3.p(2), rel=0.05)
    hopeless = Budgets(16, settle=1, probe=10 ** 9)
    for _ in range(20):
        k = hopeless.pick("ngram3")
        hopeless.observe(k, [0], cost[k])
    assert hopeless.pick("ngram1") == 16  # nothing to copy from a sibling that does not speculate


def test_state_round_trips_through_json():
    """What the engine keeps across processes (budget_memory.BudgetMemory) carries as the Budget itself does;
    something else is refused."""
    b = trained(8, [1.0, 0.9, 0.6, 0.3, 0.3, 0.1, 0.1, 0.1], {1: 1.0, 2: 1.1, 4: 1.8, 8: 4.0})
    c = Budget.from_state(json.loads(json.dumps(b.state())))
    assert (c.sizes, c.hits, c.trials, c.time, c.timed) == (b.sizes, b.hits, b.trials, b.time, b.timed)
    fresh = Budget(8)
    fresh.carry(c)
    assert fresh.pick() == b.pick() == 2
    for bad in ({}, {"sizes": [1, 2]}, dict(b.state(), hits=[1.0]), dict(b.state(), time={"3": 1.0}), None):
        with pytest.raises(ValueError):
            Budget.from_state(bad)


class Keyed(Drafter):
    """A drafter of one budget source that paid `paid` seconds of set-up in its last draft."""
    nodes, depth, reads_states = 4, 3, False

    def __init__(self):
        self.keys, self.paid = [], 0.0

    def budget_key(self, hist):
        self.keys.append(len(hist))
        return "k"

    def setup_paid(self):
        p, self.paid = self.paid, 0.0
        return p


class Memory:
    def __init__(self, length=0.0):
        self.sources, self.saved, self.length, self.runs = {}, 0, length, []

    def ran(self, tokens):
        self.runs.append(tokens)

    def save(self):
        self.saved += 1


def lone(d, prompt, max_new, mem=None, settle=1):
    """A sequence of d admitted to a BatchBudget of d's nodes (fixed: without a memory)."""
    s = Seq(0, prompt, max_new, Sampling(), None, drafter=d)
    bb = BatchBudget(d.nodes, d.budget_sizes, memory=mem, settle=settle, fixed=mem is None)
    bb.admit(s)
    return bb, s


def test_step_budget_fits_or_verifies_the_whole_tree():
    """Without a memory to fit with (fixed), every step verifies the whole tree and the drafter is never asked for
    a budget source; with one, a lone sequence's step time is observed less the set-up paid inside it, and the
    request's sources go to the memory at the end."""
    d = Keyed()
    fixed, s = lone(d, [1, 2], 10)
    s.out = [3]
    assert fixed.pick([s]) == [4] and not d.keys and fixed.finish(s) == {}
    mem = Memory()
    fit, s = lone(d, [1, 2], 10, mem)
    s.out = [3]
    assert fit.pick([s]) == [4] and d.keys == [3]  # the whole tree first
    s.paid = 0.5
    fit.observe_lone(s, 4, [0, 1], 1.5)
    assert s.alone.of["k"].time[4] == 1.0
    st = fit.finish(s)
    assert mem.saved == 1 and set(mem.sources) == {"k"} and st["budget_hist"] == {"4": 1} and mem.runs == [2]


def test_the_tokens_left_follow_the_engines_requests():
    """The tokens a request is expected to emit still: as many again as so far, or, where the engine's earlier
    requests ran longer, up to their length, at most max_new's."""
    lefts = []

    class Seen(Budgets):
        def pick(self, keys, left=float("inf")):
            lefts.append(left)
            return 1
    import budget
    real, budget.Budgets = budget.Budgets, Seen
    try:
        for length in (0.0, 100.0):
            fit, s = lone(Keyed(), [1], 60, Memory(length))
            for n in (0, 10, 40, 55):
                s.out = list(range(n))
                fit.pick([s])
    finally:
        budget.Budgets = real
    assert lefts == [0, 10, 20, 5, 60, 50, 20, 5]  # (100 tokens: 60 at the start, 50 after 10)
