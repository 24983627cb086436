"""draft.py: the protocol's trees and what steps hand each other (Tree prefixes, chained, ancestor masks), the
Drafter defaults, the tree budget's checks."""
import pytest
import torch

import draft as dr


def test_tree_budget_errors():
    with pytest.raises(ValueError, match="depth"):
        dr.check_tree_budget(4, 0, 5)
    with pytest.raises(ValueError, match="cannot fit"):
        dr.check_tree_budget(2, 2, 8)  # at most 1 + 2 + 2*2 = 7
    with pytest.raises(ValueError, match="topk"):
        dr.check_tree_budget(0, 2, 2)
    dr.check_tree_budget(10, 5, 60)


def test_chained_keeps_each_steps_accepted_rows_and_may_leave_the_states_out():
    """draft.chained over an autoregressive step, a tree step whose accepted path is not 0, 1, .. and a chain
    step: the accepted tokens in order, each step's logits / hidden / aux rows of its path (gathered or cut as
    a slice); states=False (a drafter that reads only tokens: prompt lookup) the same chain without them;
    top=k (NanoSpec reads the target's top-K_ver) the top-k tokens of those rows instead of the logits."""
    g = torch.Generator().manual_seed(0)
    V, d = 50, 4
    tree = dr.Tree(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 2]), torch.tensor([0, 1, 1, 2]),
                   dr.ancestor_mask(torch.tensor([-1, 0, 0, 2]), 2), torch.ones(4, dtype=torch.bool), None, 2)
    trees = [dr.chain_tree(torch.tensor([3])), tree, dr.chain_tree(torch.tensor([11, 12, 13]))]
    paths = [torch.tensor([0]), torch.tensor([0, 2, 3]), torch.tensor([0, 1, 0])]  # (padded past L)
    Ls = [1, 3, 2]
    steps = [dr.Accepted(t, p, torch.tensor(L), torch.tensor(20 + i), torch.randn(t.tokens.shape[0], V, generator=g),
                         torch.randn(1, t.tokens.shape[0], d, generator=g),
                         torch.randn(1, t.tokens.shape[0], 3 * d, generator=g),
                         torch.tensor(100))
             for i, (t, p, L) in enumerate(zip(trees, paths, Ls))]
    rows = [p[:L] for p, L in zip(paths, Ls)]
    for states in (True, False):
        a = dr.chained(steps, states=states)
        assert a.tree.tokens.tolist() == [3, 7, 9, 10, 11, 12] and a.path.tolist() == list(range(6))
        assert int(a.L) == 6 and int(a.bonus) == 22 and int(a.n) == 100
        if states:
            assert torch.equal(a.logits, torch.cat([s.logits[r] for s, r in zip(steps, rows)]))
            assert torch.equal(a.hidden, torch.cat([s.hidden[:, r] for s, r in zip(steps, rows)], 1))
            assert torch.equal(a.aux, torch.cat([s.aux[:, r] for s, r in zip(steps, rows)], 1))
        else:
            assert a.logits.shape == (0, V) and a.hidden.shape == (1, 0, d) and a.aux.shape == (1, 0, 3 * d)
    # top=k: each position's top-k target tokens instead of its logits row, also through a chain of chains
    want = torch.cat([torch.topk(s.logits[r], 3).indices for s, r in zip(steps, rows)])
    a = dr.chained(steps, top=3)
    assert a.logits.shape == (0, V) and a.top is not None and torch.equal(a.top, want)
    assert torch.equal(a.hidden, torch.cat([s.hidden[:, r] for s, r in zip(steps, rows)], 1))
    b = dr.chained([dr.chained(steps[:2], top=3), steps[2]], top=3)
    assert torch.equal(b.top, want) and torch.equal(b.tree.tokens, a.tree.tokens) and torch.equal(b.aux, a.aux)


class Row:
    """A held row as batch.py keeps one: a token, chained per run by its class."""

    def __init__(self, t):
        self.t = t

    @staticmethod
    def chain(run):
        toks = torch.tensor([x.t for x in run])
        K = len(run)
        return dr.Accepted(dr.chain_tree(toks), torch.arange(K), torch.tensor(K), torch.tensor(run[-1].t + 1),
                           torch.zeros(K, 5), torch.zeros(1, K, 2), None, torch.tensor(0))


def test_behind_hands_over_its_steps_as_one_chain():
    """draft.Behind: steps and runs of rows in order (each run chained by its class, then all as one chain);
    nothing held after a take; a lone step handed over as it is; fold(i) chains the steps
    from i on in their place, and a later take gives the same chain."""
    step = lambda toks: Row.chain([Row(t) for t in toks])
    b = dr.Behind(top=0)
    assert b.take() is None and len(b) == 0
    a = step([1])
    b.add(a)
    assert b.take() is a and not b
    for x in (Row(2), Row(3), step([4, 5]), Row(6), step([7])):
        b.add(x)
    got = b.take()
    assert got.tree.tokens.tolist() == [2, 3, 4, 5, 6, 7] and int(got.L) == 6 and int(got.bonus) == 8 and not b
    for x in (step([1]), Row(2), Row(3), step([4])):
        b.add(x)
    b.fold(1)
    assert len(b) == 2 and b.steps[1].tree.tokens.tolist() == [2, 3, 4]
    assert b.take().tree.tokens.tolist() == [1, 2, 3, 4]


def test_drafter_defaults_are_the_protocols_optional_parts():
    """Drafter gives every optional hook of the protocol its default, so the engine calls them on any drafter."""

    class Minimal(dr.Drafter):
        nodes, depth = 3, 2

    d = Minimal()
    d.setup(64)
    assert d.graphable and d.reads_states and d.reads_top == 0 and d.prompt_logits == 0 and d.start_rate == 0.0
    assert d.budget_sizes() is None and d.budget_sizes("x") is None and d.budget_start("x") is None
    assert d.budget_setup("x", 4) == 0.0 and d.setup_paid() == 0.0 and d.stats() == {}
