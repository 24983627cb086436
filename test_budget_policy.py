"""Which source drafts a step (budget_policy.py, through budget.Budgets): a set-up waits until the tokens left would
repay it (pays_back); explore then exploit: a source never accepted is dropped after bounded trials, one that starts
paying is picked up, two that pay by stretches are both followed; re-trials keep to a share of the time; a trial
drafts past the source's best size; thin evidence does not lock a set-up out."""
import pytest

from budget import Budget, Budgets
from budget_policy import Policy, pays_back
from test_budget import trained


def test_a_set_up_waits_until_the_tokens_left_would_repay_it():
    """A draft that first pays a one-time set-up (the hybrid's late head) waits, decoding autoregressively, until
    the tokens the request has left, at the best size's estimated rate instead of the best rate without it, would
    save the set-up (pays_back), and is chosen then; a source whose drafts save nothing never pays one; other
    sources do not wait."""
    assert pays_back(10.0, 15, 10 / 3, 1.0) and not pays_back(10.0, 14, 10 / 3, 1.0)  # 0.7 s saved a token
    assert not pays_back(0.0, 100, 1.0, 1.0) and not pays_back(1.0, 100, 2.0, 0.0)
    cost = {1: 1.0, 2: 1.1, 4: 1.2, 8: 2.0}
    mem = {"eagle": trained(8, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], cost),  # 4 tokens / 1.2 s at size 4
           "ngram": trained(8, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], cost),
           "novel": trained(8, [1.0] + [0.0] * 7, {1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0})}  # speculation loses
    setup = {"eagle": 10.0, "novel": 10.0, "ngram": 0.0}
    bs = Budgets(8, memory=mem, settle=1, probe=10 ** 9, setup_of=lambda key, b: setup[key])
    picks = []
    for left in (5, 10, 14, 15, 20):
        picks.append(bs.pick("eagle", left=left))
        bs.observe(picks[-1], [0, 1, 2, 3][:picks[-1]], cost[picks[-1]])
        if picks[-1] > 1:
            setup["eagle"] = 0.0  # the drafter paid it: nothing to wait for any more
    assert picks == [1, 1, 1, 4, 4]
    assert bs.of["eagle"].chosen == {1: 3, 4: 2}
    assert bs.pick("ngram", left=1) == 4
    assert [bs.pick("novel", left=10 ** 6) for _ in range(20)] == [1] * 20
    # where only the largest size needs the set-up (prompt lookup's chain + the head's tree: the merged tree),
    # it is weighed against the chain alone, not autoregressive decoding: 4 tokens in 2.0 s lose to 4 in 1.2 s,
    # so it never pays the set-up, however much the chain saves
    chain = Budgets(8, memory={"ngram": trained(8, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], cost)}, settle=1,
                    probe=10 ** 9, setup_of=lambda key, b: 10.0 if b == 8 else 0.0)
    assert chain.pick("ngram") == 4
    bud = chain.of["ngram"]
    bud.pick = lambda: (bud.chosen.update({8: bud.chosen.get(8, 0) + 1}), 8)[1]  # a probe of the merged tree
    assert [chain.pick("ngram") for _ in range(30)] == [4] * 30


def offered(steps, accept, setup_of=None, left=lambda i: 10 ** 6, keys=("ngram3", "eagle")):
    """Budgets over steps where the drafter offers both keys: accept(i, key) -> tokens a draft of that source
    emits at step i (up to its size), a step of b nodes costs 1 + 0.05 b seconds (b > 1), 1 s without a draft.
    -> ([the step's source, None for no draft], the Budgets)."""
    bs = Budgets(16, settle=1, setup_of=setup_of)
    picks = []
    for i in range(steps):
        b = bs.pick(list(keys), left(i))
        picks.append(bs.key if b > 1 else None)
        n = min(b, accept(i, bs.key)) if b > 1 else 1
        bs.observe(b, list(range(n)), 1.0 if b == 1 else 1.0 + 0.05 * b)
    return picks, bs


def test_a_source_never_accepted_is_dropped_after_bounded_trials():
    """Explore, then exploit: a source whose drafts are never accepted is tried a bounded number of times (its
    first trials, then at gaps doubling up to Policy.max_gap) while the one that pays drafts the rest; where
    neither pays, the steps decode autoregressively with as few trials."""
    picks, _ = offered(400, lambda i, key: 4 if key == "eagle" else 1)
    assert picks.count("ngram3") <= 2 + 4 + 400 // 64 and picks[200:].count("ngram3") <= 200 // 64 + 1
    assert picks[200:].count("eagle") >= 180  # (the rest: the head's budget's own probes of a one-row step)
    picks, _ = offered(400, lambda i, key: 1)
    assert sum(p is not None for p in picks[200:]) <= 2 * (200 // 64 + 1)


def test_retrials_stay_under_a_share_of_the_requests_time():
    """Where nothing pays (four sources, none ever accepted), the sources' re-trials after their first trials take
    at most Policy.share of the request's seconds (one step over at most); without the cap, gaps back to 8 steps
    each time a leader stopped paying had let them take more."""
    def run(share):
        bs = Budgets(16, settle=1, policy=Policy(share=share))
        keys, retry_s, total_s = ["ngram1", "ngram2", "ngram3", "eagle"], 0.0, 0.0
        for i in range(600):
            b = bs.pick(keys)
            # the first sources lead now and then (a lucky step), so gaps go back to their start
            n = min(b, 6) if b > 1 and bs.key == "eagle" and i % 50 == 0 else 1
            s = 1.0 if b == 1 else 1.0 + 0.05 * b
            retry_s, total_s = retry_s + s * bs.policy.retrying, total_s + s
            bs.observe(b, list(range(n)), s)
        return retry_s, total_s
    retry_s, total_s = run(0.05)
    assert 0 < retry_s <= 0.05 * total_s + 1.8
    retry_s, total_s = run(1.0)
    assert retry_s > 0.05 * total_s + 1.8


def test_a_source_whose_set_up_does_not_pay_leaves_the_other_alone():
    """Where the head's start would not pay back (a short request), the chain source is the step's only choice:
    no trials, every size its own Budget's, step for step what prompt lookup alone picks."""
    accept = lambda i, key: 3 if i % 3 else 1
    picks, bs = offered(60, accept, setup_of=lambda key, b: 10 ** 6 if key == "eagle" else 0.0)
    assert "eagle" not in picks and not bs.policy.trying
    assert bs.policy.n.get("ngram3") == sum(p is not None for p in picks) > 0  # its drafts (a step without is nobody's)
    alone, sizes = Budgets(16, settle=1), []
    for i in range(60):
        b = alone.pick(["ngram3"])
        sizes.append(b)
        n = min(b, accept(i, "ngram3")) if b > 1 else 1
        alone.observe(b, list(range(n)), 1.0 if b == 1 else 1.0 + 0.05 * b)
    assert bs.of["ngram3"].chosen == alone.of["ngram3"].chosen and [p is not None for p in picks] == [
        b > 1 for b in sizes]


def test_a_step_without_a_draft_is_no_sources_trial():
    """Where lookup has no chain, the hybrid offers its waiting head alone, whose Budget decodes (the start would
    not pay): that step is no draft of the head's. Counted as one, the head had joined the chains' steps at
    decoding's rate, and the chains were re-tried past their best size (0.89x lookup alone on a Spec-Bench QA
    answer). So the chain steps are lookup alone's, size for size, and no step is a trial."""
    chain = lambda i: i % 4 != 3  # every fourth step lookup has no chain
    accept = lambda i: 3 if i % 2 else 1
    cost = lambda b: 1.0 if b == 1 else 1.0 + 0.05 * b
    hybrid = Budgets(16, settle=1, setup_of=lambda key, b: 10 ** 6 if key == "eagle" else 0.0)
    alone = Budgets(16, settle=1, sizes_of=lambda key: [1] if key == "ngram0" else None)  # (NgramDrafter's sizes)
    got, want, trials = [], [], 0
    for i in range(120):
        b = hybrid.pick(["ngram3", "eagle"] if chain(i) else ["eagle"], left=200 - i)
        trials += hybrid.policy.trying
        got.append(b)
        hybrid.observe(b, list(range(min(b, accept(i)) if b > 1 else 1)), cost(b))
        a = alone.pick(["ngram3"] if chain(i) else ["ngram0"])
        want.append(a)
        alone.observe(a, list(range(min(a, accept(i)) if a > 1 else 1)), cost(a))
    assert trials == 0 and "eagle" not in hybrid.policy.n
    assert got == want and hybrid.of["ngram3"].chosen == alone.of["ngram3"].chosen


def test_a_source_that_starts_paying_mid_request_is_picked_up():
    """Prompt lookup's chains miss for 150 steps (the answer has not started copying), then are right 8 tokens
    deep: within a retrial gap the policy moves from the head's tree (3 tokens a step) to the chain."""
    picks, bs = offered(400, lambda i, key: 3 if key == "eagle" else (1 if i < 150 else 8))
    assert picks[:150].count("ngram3") <= 2 + 4 + 150 // 64 and picks[100:150].count("eagle") >= 45
    assert picks[150 + 64 + 16:].count("ngram3") >= 0.9 * len(picks[150 + 64 + 16:])
    assert bs.policy.rate("ngram3") > bs.policy.rate("eagle")


def test_the_policy_follows_two_sources_that_pay_by_stretches():
    """Code, then prose, then code again: each source pays on its own stretches of 100 steps (8 tokens where it
    is right, none where not) and the policy drafts with the paying one for most of each stretch."""
    pays = lambda i, key: 8 if (key == "ngram3") == ((i // 100) % 2 == 0) else 1
    picks, _ = offered(600, pays)
    for s in range(6):
        want = "ngram3" if s % 2 == 0 else "eagle"
        assert picks[100 * s + 40:100 * (s + 1)].count(want) >= 50, (s, picks[100 * s:100 * (s + 1)])


def test_the_heads_set_up_is_deferred_until_it_pays_back():
    """The head's set-up (its prefill over the prompt, 20 s here) is not paid while the tokens the request is
    expected to emit still (as many again as so far) could not repay it at the head's estimated rate; once they
    could, the policy tries the head, pays it once, and keeps it where it pays (6 tokens a step against the
    chain's 2). A short request never pays it."""
    def run(left):
        paid = []
        setup = lambda key, b: 20.0 if key == "eagle" and not paid else 0.0
        picks, bs = offered(200, lambda i, key: (paid.append(i) if key == "eagle" else None) or (6 if key == "eagle"
                                                                                                    else 2),
                            setup_of=setup, left=left)
        return picks, paid
    picks, paid = run(lambda i: i + 1)
    first = picks.index("eagle")
    # the chain's 2 tokens in 1.1 s against the untried head's prior, 8.5 tokens a step: 0.43 s a token, 20 s
    # over 46 tokens
    assert 40 <= first <= 50 and paid[0] == first
    assert picks[first + 30:].count("eagle") >= 0.9 * len(picks[first + 30:])
    picks, paid = run(lambda i: 5)
    assert "eagle" not in picks and not paid and picks[100:].count("ngram3") >= 90


def test_a_trial_drafts_one_size_past_the_sources_best():
    """A trial of a source whose sizes are timed drafts one size past its best speculative size (a chain of 11
    cost 2.2 decode steps on Zen 4 and was mostly rejected), not its whole draft; knowing nothing, its start."""
    cost = {1: 1.0, 2: 1.1, 4: 1.8, 8: 4.0}
    b = trained(8, [1.0, 0.9, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0], cost)  # 1.9 tokens / 1.1 s beat 2.6 / 1.8
    assert max(b.sizes[1:], key=b.rate) == 2 and b.trial_size() == 4
    assert Budget(8).trial_size() == 8 and Budget(8, start=4).trial_size() == 4
    deep = trained(8, [1.0] * 8, {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2})
    assert deep.trial_size() == 8  # the best is the whole draft: nothing past it
    mem = {"ngram3": b, "eagle": trained(8, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], cost)}
    bs = Budgets(8, memory=mem, settle=1)
    sizes = {}
    for _ in range(40):
        n = bs.pick(["ngram3", "eagle"])
        if bs.policy.trying and bs.key == "ngram3":
            sizes[n] = sizes.get(n, 0) + 1
        bs.observe(n, [0, 1][:n], cost[n])
    assert sizes and set(sizes) == {4}, sizes
    # the hybrid's chain source: past its best size (the chain alone, 4 here) is the merged tree, which needs the
    # head's set-up; a trial keeps to the sizes without one
    chain = trained(8, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], {1: 1.0, 2: 1.1, 4: 1.2, 8: 2.0})
    assert chain.trial_size() == 8
    bs = Budgets(8, memory={"ngram3": chain}, settle=1, setup_of=lambda key, b: 5.0 if b == 8 else 0.0)
    assert bs.trial_size("ngram3") == 4
    assert Budgets(8, memory={"ngram3": chain}, settle=1).trial_size("ngram3") == 8
    # so before a start has priced the set-up (0 s), where the drafter says the size needs it (budget_needs)
    bs = Budgets(8, memory={"ngram3": chain}, settle=1, setup_of=lambda key, b: 0.0, needs_of=lambda key, b: b == 8)
    assert bs.trial_size("ngram3") == 4


def test_the_policy_rates_a_source_by_its_budgets_best_size():
    """Once a source has drafted (or comes with the engine's memory), the policy rates it by its Budget's estimate at
    its best size without a set-up (per rank acceptance, per size times), so a trial's larger draft, measured
    slower, does not push a source that pays at its best size below decoding; before, by what its steps measured."""
    cost = {1: 1.0, 2: 1.1, 4: 1.8, 8: 4.0}
    chain = trained(8, [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], cost)  # 2 tokens / 1.1 s at size 2
    bs = Budgets(8, memory={"ngram3": chain}, settle=1, setup_of=lambda key, b: 5.0 if b == 8 else 0.0)
    assert bs.policy.rate("ngram3") == 0.0
    bs.pick(["ngram3", "eagle"])  # eagle, new, is tried; ngram3, from the engine's memory, is rated without trials
    assert bs.key == "eagle" and bs.policy.rate("ngram3") == pytest.approx(max(chain.rate(s) for s in (2, 4)))
    bs.observe(1, [0], 1.0)
    bs.pick("ngram3")
    bs.observe(bs.of["ngram3"].trial_size(), [0, 1], 4.0)  # a slow draft
    assert bs.policy.rate("ngram3") == pytest.approx(max(bs.of["ngram3"].rate(s) for s in (2, 4)))
    assert bs.policy.rate("ngram3") > 1.5 > bs.policy.tok["ngram3"] / bs.policy.sec["ngram3"]


def test_a_set_up_weighed_against_decoding_counts_the_tokens_other_sources_leave():
    """The head's set-up, weighed against decoding where the head is the only source offered, pays back only over
    the tokens the chains leave: with chains drafting 9 steps in 10 the same set-up that pays over every token
    left does not."""
    cost = {1: 1.0, 2: 1.1, 4: 1.2, 8: 2.0}

    def run(chain_share, left=20):
        mem = {"eagle": trained(8, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], cost),  # 4 tokens / 1.2 s at size 4
               "ngram": trained(8, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], cost)}
        setup = {"eagle": 10.0, "ngram": 0.0}
        bs = Budgets(8, memory=mem, settle=1, probe=10 ** 9, setup_of=lambda key, b: setup[key])
        for i in range(100):  # the request so far: the chain drafts chain_share of the steps
            key = "ngram" if i < 100 * chain_share else "eagle"
            n = bs.pick(key, left=10 ** 6 if key == "ngram" else 0)
            bs.observe(n, [0, 1, 2, 3][:n], cost[n])
        return bs.pick("eagle", left=left)  # 20 tokens at 4 / 1.2 s save 14 s over decoding
    assert run(0.0) == 4
    assert run(0.9) == 1
    # counted in tokens, not steps: chains drafting half the steps, 4 tokens each against decoding's 1, leave a
    # fifth of the tokens; 30 left: 6 at 0.7 s saved a token do not repay 10 s (15, a half, would have)
    assert run(0.0, left=30) == 4
    assert run(0.5, left=30) == 1


def test_thin_evidence_does_not_lock_a_set_up_out():
    """One unlucky step carried in the engine's memory (the head's tree with nothing accepted: ~0.02 a node)
    must not lock a set-up out for good: while the source's first rank has under START_EVIDENCE decayed steps, the
    set-up is weighed at the untried prior (Budget.hoped), so it is paid where the tokens left would repay it
    there, and the head's steps then speak for themselves; with more evidence, pays_back weighs the evidence, and
    a set-up the tokens left could not repay even at the prior is never paid."""
    cost = {1: 1.0, 2: 1.05, 4: 1.2, 8: 2.0}

    def unlucky(trials):
        b = Budget(8)
        b.time, b.timed = dict(cost), dict.fromkeys(cost, 1)
        b.hits, b.trials = [0.0] * 8, [0.0] + [trials] * 7
        return b

    def request(trials, setup_s, steps=40):
        setup = {"eagle": setup_s}
        bs = Budgets(8, memory={"eagle": unlucky(trials)}, settle=1, probe=4, setup_of=lambda key, b: setup[key])
        picks = []
        for _ in range(steps):
            b = bs.pick("eagle", left=40.0)
            picks.append(b)
            if b > 1:
                setup["eagle"] = 0.0  # the drafter paid it
            bs.observe(b, [0, 1][:b], cost[b])  # the head's first node is right every time
        return picks, bs

    picks, bs = request(1.0, 2.0)
    # the first step starts the head: at the prior its whole tree, 4.5 tokens in 2 s, saves 22 s over 40 tokens
    assert picks[0] == 8 and unlucky(1.0).hoped(8, Budgets.START_EVIDENCE) == pytest.approx(2.25)
    assert unlucky(1.0).rate(8) < 1.0 / cost[1]  # what the one step alone says: below decoding
    assert picks[1:].count(2) >= 25  # then its steps show it pays (and the speculating budget's own probes every
    # 4 steps: an autoregressive step, the next size up)
    assert request(Budgets.START_EVIDENCE, 2.0)[0] == [1] * 40  # enough evidence: pays_back weighs it
    assert request(1.0, 100.0)[0] == [1] * 40  # 22 s saved at the prior do not repay 100 s: never


def test_sources_from_the_engines_memory_are_not_tried_again():
    """A source the engine's memory knows is rated by its Budget's estimate from the request's first step: no
    trials of it per request (a 3-gram chain's trials had drafted the 26-node merged tree at 2.4x its chain's time
    on HumanEval/2, the Qwen pair); a source new to the engine is tried."""
    cost = {1: 1.0, 2: 1.1, 4: 1.2, 8: 2.0}

    def picks(memory):
        bs = Budgets(8, memory=memory, settle=1, probe=10 ** 9)
        out = []
        for _ in range(6):
            b = bs.pick(["ngram3", "eagle"])
            out.append(bs.key)
            bs.observe(b, list(range(min(b, 4))) if bs.key == "ngram3" else [0], cost[b])
        return out
    mem = lambda: {"ngram3": trained(8, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], cost),  # 4 tokens / 1.2 s
                   "eagle": trained(8, [1.0] + [0.0] * 7, cost)}  # nothing accepted
    assert picks(mem()) == ["ngram3"] * 6
    assert "eagle" in picks({"ngram3": mem()["ngram3"]})[:3]
