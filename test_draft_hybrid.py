"""draft_hybrid.py: the merged tree, chain-only steps, budget sources apart, and the lazy head (late start,
catch-up, its price in the budget); outputs stay autoregressive decoding's."""
import pytest
import torch

import budget as budget_module
import draft as dr
import draft_eagle as de
from engine import Engine
import generate as g
from model import Plan
from test_generate import (  # noqa: F401 (tiny: a fixture)
    PROMPTS, Autoregressive, Cycle, Turns, autoregressive, make_drafter, prefilled, recorded_budgets, target, tiny)


def test_hybrid_tree_merges_the_chain(tiny):
    """The prompt-lookup chain follows the EAGLE tree where they agree and hangs its rest below: every tree
    node is kept once, the chain is one root-to-leaf path, parents come first, masks are the closure."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec", late_head=False)  # (its head drafts alone first)
    tok, n = prefilled(m, [d], PROMPTS[2])
    with torch.no_grad():
        t = d.tree.draft(tok, n)
        first = int(torch.nonzero(t.parents == 0)[0])  # a first-level tree node
        absent = [v for v in range(256) if v not in set(t.tokens.tolist())][:2]  # tokens the tree lacks
        for chain in ([int(t.tokens[first]), *absent], [], absent):
            d.ngram.propose = lambda hist, c=chain: c
            h = d.draft(tok, n)
            N = h.tokens.shape[0]
            assert sorted(h.tokens.tolist()) == sorted(t.tokens.tolist() + chain[1 if chain and chain[0] ==
                                                                                 int(t.tokens[first]) else 0:])
            assert (h.parents[1:] < torch.arange(1, N)).all() and int(h.parents[0]) == -1
            assert torch.equal(h.anc, dr.ancestor_mask(h.parents, h.max_depth))
            if chain:  # the chain is the path from the root through nodes 1..len(chain)
                assert h.tokens[1:1 + len(chain)].tolist() == chain
                assert h.parents[1:1 + len(chain)].tolist() == list(range(len(chain)))
                assert d.source[1:1 + len(chain)] == (["both"] + ["ngram"] * 2 if chain[0] == int(t.tokens[first])
                                                      else ["ngram"] * 2)
            else:
                assert torch.equal(h.tokens, t.tokens)


def test_hybrid_skips_the_eagle_tree_when_the_budget_verifies_only_the_chain(tiny):
    """A budget below the whole tree gets the root + chain without the EAGLE tree being drafted (where the
    budget reaches no further than the chain, that is the merged tree's prefix of the same size), or where
    there is no chain an EAGLE tree drafted for that budget; the whole tree's budget (or none) drafts the
    whole tree."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec")
    tok, n = prefilled(m, [d], PROMPTS[2])
    chain = [7, 8, 9]
    d.ngram.propose = lambda hist: chain
    d.ngram.lookup_tree = lambda hist: (chain, [0, 1, 2])  # the continuations agree: the lookup tree is the chain
    with torch.no_grad():
        full = d.draft(tok, n)
        calls = []
        real = d.tree.draft
        d.tree.draft = lambda *a, **k: calls.append(1) or real(*a, **k)
        for b in (2, 3, 4):
            t = d.draft(tok, n, b)
            assert not calls and t.tokens.tolist() == [int(tok)] + chain and t.parents.tolist() == [-1, 0, 1, 2]
            assert torch.equal(t.prefix(b).tokens, full.prefix(b).tokens), b
            assert torch.equal(t.prefix(b).anc, full.prefix(b).anc), b
        assert d.draft(tok, n, 9).tokens.tolist() == [int(tok)] + chain and not calls
        d.ngram.lookup_tree = lambda hist: ([7, 8, 5], [0, 1, 0])  # they differ: siblings below the root
        t = d.draft(tok, n, 4)
        assert not calls and t.tokens.tolist() == [int(tok), 7, 8, 5] and t.parents.tolist() == [-1, 0, 1, 0]
        assert t.anc.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]] and t.max_depth == 2
        assert d.source == ["eagle", "ngram", "ngram", "ngram"]
        d.ngram.lookup_tree = lambda hist: (chain, [0, 1, 2])
        assert torch.equal(d.draft(tok, n, d.nodes).tokens, full.tokens) and len(calls) == 1
        assert torch.equal(d.draft(tok, n).tokens, full.tokens) and len(calls) == 2
        d.ngram.propose = lambda hist: []
        t4 = d.draft(tok, n, 4)
        assert torch.equal(t4.tokens, real(tok, n, 4).tokens) and t4.tokens.shape[0] == 4 and len(calls) == 3
        assert d.source == ["eagle"] * 4
        assert d.draft(tok, n, d.nodes).tokens.shape[0] == d.tree.nodes and len(calls) == 4
    assert d.stats()["chain_only_steps"] == 5  # the 5 lookup steps above (b = 2, 3, 4, 9, and 4 with siblings)


def test_hybrid_offers_the_chain_and_the_tree_alone(tiny):
    """Where prompt lookup has a chain the hybrid offers two budget sources (the chain's, whose sizes end at the
    merged tree, and the tree drafter's); the policy's choice of the tree drafter drafts its tree alone, as
    at a step without a chain."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec")
    tok, n = prefilled(m, [d], PROMPTS[2])
    hist = d.ngram.hist + [int(tok)]
    d.ngram.match = lambda h: (2, [7, 8, 9])
    d.ngram.lookup_tree = lambda h: ([7, 8, 9], [0, 1, 2])
    assert d.budget_keys(hist) == ["ngram2", "eagle"]
    with torch.no_grad():
        d.budget_use("ngram2")
        assert d.draft(tok, n, 4).tokens.tolist() == [int(tok), 7, 8, 9]
        d.budget_keys(hist)
        d.budget_use("eagle")
        t = d.draft(tok, n, d.tree.nodes)
        assert torch.equal(t.tokens, d.tree.draft(tok, n, d.tree.nodes).tokens)
        assert d.source == ["eagle"] * t.tokens.shape[0]
    d.ngram.match = lambda h: (0, [])
    assert d.budget_keys(hist) == ["eagle"]


def test_hybrid_budgets_chain_and_tree_steps_apart(tiny, monkeypatch):
    """With the fitted budget the hybrid's steps with a prompt-lookup chain and those without keep separate
    statistics (budget.Budgets, keyed by budget_key), the draft reuses the key's proposal, and the output is
    still autoregressive decoding's."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec")
    real, calls = d.ngram.match, []
    d.ngram.match = lambda hist: calls.append(len(hist)) or (real(hist) if len(hist) % 2 else (0, []))
    budgets = recorded_budgets(monkeypatch)
    eng = Engine(m, drafter=d, budget=True)
    out, st = eng.generate(PROMPTS[1] * 3, 40)
    assert out == autoregressive(m, PROMPTS[1] * 3, 40)
    srcs = st.extra["budget_sources"]
    chains = [s for s in srcs if s != "eagle"]  # one source per suffix-match length (draft_lookup.match_key)
    assert "eagle" in srcs and chains and set(chains) <= {"ngram1", "ngram2", "ngram3"}
    assert abs(sum(x["share"] for x in srcs.values()) - 1) < 1e-3
    assert sum(st.extra["budget_hist"].values()) == sum(sum(x["budget_hist"].values()) for x in srcs.values())
    assert len(calls) == len(set(calls))  # one proposal per step: the draft took budget_key's
    # each source picks from the drafter's sizes for it: the chain steps stop at the whole chain, then the
    # merged tree; the engine timed the passes of both sets
    k = d.ngram.k
    chain_sizes = [s for s in (1, 2, 4, 8) if s <= k] + [1 + k, d.nodes]
    for c in chains:
        assert budgets[-1].of[c].sizes == d.budget_sizes(c) == chain_sizes
        assert budgets[-1].of[c].start == 1 + k and str(1 + k) in srcs[c]["budget_curve"]
    assert budgets[-1].of["eagle"].sizes == d.budget_sizes("eagle") and 1 + k not in d.budget_sizes("eagle")
    assert d.budget_sizes("eagle")[-1] == d.tree.nodes  # (no chain: sizes past the EAGLE tree draft the same)
    assert budgets[-1].of["eagle"].start == d.tree.nodes
    assert set(d.budget_sizes()) == set(d.budget_sizes("ngram1") + d.budget_sizes("eagle"))


def test_hybrid_head_catches_up_only_when_it_drafts(tiny):
    """The hybrid's head sees the accepted steps only when it drafts next (or at 64 pending): every head update
    comes right before an EAGLE draft, chain-alone and autoregressive steps never pay one, and the output is
    still autoregressive decoding's."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec")
    events, real_update, real_draft = [], d.tree.update, d.tree.draft
    d.tree.update = lambda a: events.append("update") or real_update(a)
    d.tree.draft = lambda *a, **k: events.append("draft") or real_draft(*a, **k)
    eng = Engine(m, drafter=d, budget=True)
    prompt = PROMPTS[1] * 3
    out, st = eng.generate(prompt, 40)
    assert out == autoregressive(m, prompt, 40)
    assert st.extra["chain_only_steps"] > 0 and events.count("draft") > 0
    assert all(e == "draft" for prev, e in zip(events, events[1:]) if prev == "update"), events
    assert events.count("update") <= events.count("draft")


def test_hybrid_head_starts_late_and_drafts_as_if_it_had_not(tiny, monkeypatch):
    """The hybrid's head waits for its first draft (its pass over the prompt, the prompt logits NanoSpec's
    window starts from, the window's reset), then catches up: under a budget that mixes chain-alone,
    autoregressive and whole-tree steps every EAGLE tree it drafts equals an eagerly prefilled head's, and the
    engine's prefill projects one logit row for it, not the window's. A request that never drafts with the head
    never runs it. Outputs are autoregressive decoding's."""
    monkeypatch.setattr(budget_module, "Budget", Cycle)
    monkeypatch.setattr(budget_module, "Policy", Turns)
    monkeypatch.setattr(de.VocabDrafter, "PROJECT_ROWS", 3)
    m = target(tiny[0])
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 40)
    trees, prefills = {}, {}
    for late in (True, False):
        d = make_drafter("hybrid", tiny, m, "nanospec", late_head=late)
        got, pre = trees.setdefault(late, []), prefills.setdefault(late, [])
        draft = d.tree.draft
        d.tree.draft = lambda *a, f=draft, got=got, **k: (t := f(*a, **k), got.append(t.tokens.tolist()))[0]
        reset = d.tree.vocab.reset  # the prompt's top-k the window starts from (late: projected in 3-row chunks)
        d.tree.vocab.reset = lambda rows, top, f=reset, pre=pre: (pre.append(top.clone()), f(rows, top))[1]
        assert d.prompt_logits == (0 if late else d.tree.prompt_logits)
        out, st = Engine(m, drafter=d, budget=True).generate(prompt, 40)
        assert out == ref and st.extra["head_started"]
    assert trees[True] == trees[False] and len(trees[True]) > 2
    assert len(prefills[True]) == len(prefills[False]) == 1
    assert prefills[True][0].shape[0] > 6 and torch.equal(prefills[True][0], prefills[False][0])  # projected later
    monkeypatch.setattr(budget_module, "Budget", Autoregressive)
    monkeypatch.setattr(budget_module, "Policy", Turns)
    d = make_drafter("hybrid", tiny, m, "nanospec")
    d.tree.prefill = lambda p: pytest.fail("the head ran without drafting")
    out, st = Engine(m, drafter=d, budget=True).generate(prompt, 40)
    assert out == ref and not st.extra["head_started"] and "vocab_coverage" not in st.extra


def test_hybrid_head_starts_where_the_budget_says_it_pays(tiny, monkeypatch):
    """The late head's start is priced by the last one (its seconds per waiting token) and budget.Budgets
    holds EAGLE drafts back until the tokens left would repay it (budget.pays_back): a first start measures the
    price, a start priced far above what the head saves never comes, one that pays back does. The start's
    seconds are reported and taken out of the step times (setup_paid); outputs are autoregressive decoding's."""
    monkeypatch.setattr(budget_module, "Budget", Cycle)  # every size in turn: the head's drafts are asked for
    monkeypatch.setattr(budget_module, "Policy", Turns)
    m = target(tiny[0])
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 40)
    d = make_drafter("hybrid", tiny, m, "nanospec")
    eng = Engine(m, drafter=d, budget=True)
    out, st = eng.generate(prompt, 40)
    assert out == ref and st.extra["head_started"] and st.extra["head_start_s"] > 0
    assert d.start_rate > 0 and d.head.start_s == 0.0  # measured, and the engine took it out of the steps' times
    d.start_rate = 1e6
    out, st = eng.generate(prompt, 40)
    assert out == ref and not st.extra["head_started"] and st.extra["budget_hist"].get("1", 0) > 0
    monkeypatch.setattr(budget_module, "pays_back", lambda *a: True)
    d.start_rate = 1e-9
    out, st = eng.generate(prompt, 40)
    assert out == ref and st.extra["head_started"]


def test_hybrid_head_waiting_keeps_only_the_accepted_positions(tiny):
    """While the head waits, the steps it has not seen are folded every 64 into one chain of their accepted
    positions (draft.chained: the target logits of the path rows, not of whole trees), each run once (a later
    run is a chunk of its own, not the earlier ones copied again); its first draft then equals an eagerly
    prefilled head's that caught up at 64 and 128."""
    m = target(tiny[0])
    late, eager = (make_drafter("hybrid", tiny, m, "nanospec", late_head=f) for f in (True, False))
    tok, n = prefilled(m, [late, eager], PROMPTS[0])
    with torch.no_grad():
        for _ in range(134):  # one-token steps, as the engine hands autoregressive runs over
            logits, hid, aux = m(tok[None], n.view(1), return_hidden=True, plan=Plan(late.aux_layers))
            nxt = logits[0, -1].argmax()
            acc = dr.Accepted(dr.chain_tree(tok), torch.zeros(1, dtype=torch.long), torch.tensor(1), nxt, logits[0],
                              hid, aux, n)
            for d in (late, eager):
                d.update(acc)
            tok, n = nxt.view(1), n + 1
        held = late.head.behind.steps
        chunks, pending = held[:late.head.chunks], held[late.head.chunks:]
        assert len(pending) == 6 and len(chunks) == 2 and sum(int(c.L) for c in chunks) == 128
        k = late.tree.vocab.k_ver  # (each chunk keeps the target's top-k_ver per position, not its logits)
        assert all(int(c.L) == 64 and c.top.shape == (64, k) and c.logits.shape[0] == 0 for c in chunks)
        assert len(eager.head.behind) == 6 and not eager.head.chunks and late.head.deferred is not None
        assert torch.equal(late.draft(tok, n).tokens, eager.draft(tok, n).tokens)
    assert late.head.deferred is None and not late.head.behind and not late.head.chunks


def test_hybrid_reports_where_accepted_tokens_came_from(tiny):
    m = target(tiny[0])
    eng = Engine(m, drafter=make_drafter("hybrid", tiny, m, "nanospec"))
    out, st = eng.generate(PROMPTS[1] * 3, 40)  # repetitive: prompt lookup finds continuations
    assert out == autoregressive(m, PROMPTS[1] * 3, 40)
    share = st.extra["accepted_from"]
    assert set(share) == {"ngram", "eagle", "both"} and abs(sum(share.values()) - 1) < 1e-3
    assert "accepted draft tokens from" in g.stats_line(st, m)
