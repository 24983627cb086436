"""sampling.py: the acceptance rules on hand-made trees (the engine-level losslessness and chi-square
tests of sampled acceptance are in test_generate.py)."""
import pytest
import torch

import draft as dr
import sampling
from sampling import accept_greedy


def test_accept_greedy_handcrafted():
    # root(0) -> 1 (a), 2 (b); 1 -> 3 (c); 3 -> 4 (d); 2 -> 5 (e)
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    tokens = torch.tensor([9, 1, 2, 3, 4, 5])
    depth = torch.tensor([0, 1, 1, 2, 3, 2])
    tree = dr.Tree(tokens, parents, depth, dr.ancestor_mask(parents, 3), torch.ones(6, dtype=torch.bool), None, 3)
    V = 10
    pred = torch.tensor([1, 3, 7, 8, 0, 0])  # root->1 ok, 1->3 ok, 3->8 (draft had 4): stop at node 3
    logits = torch.nn.functional.one_hot(pred, V).float()
    path, L, bonus = accept_greedy(tree, logits)
    assert int(L) == 3 and path[:3].tolist() == [0, 1, 3] and int(bonus) == 8
    pred[0] = 2  # root->2 ok, 2->5 needs pred[2] == 5
    pred[2] = 5
    path, L, bonus = accept_greedy(tree, torch.nn.functional.one_hot(pred, V).float())
    assert int(L) == 3 and path[:3].tolist() == [0, 2, 5] and int(bonus) == int(pred[5])


def test_greedy_path_is_accept_greedy():
    """The eager CPU steps' host-side acceptance (greedy_path over the target's argmax) gives accept_greedy's path
    (padding included), accepted length and bonus on random trees: random parents, invalid (padded) nodes,
    prefixes of a tree (budget.py), and targets that agree with a node often, so deep paths, ties between
    equally deep paths and chains occur."""
    g = torch.Generator().manual_seed(0)
    V, seen = 6, set()
    for trial in range(400):
        N = int(torch.randint(1, 14, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, N)]
        if trial % 4 == 0:
            parents = [-1] + list(range(N - 1))  # a chain (prompt lookup)
        depth = [0] * N
        for i in range(1, N):
            depth[i] = depth[parents[i]] + 1
        D = max(depth) + int(torch.randint(0, 2, (1,), generator=g))  # (a prefix keeps its tree's max_depth)
        P = torch.tensor(parents)
        valid = torch.rand(N, generator=g) < 0.9
        tree = dr.Tree(torch.randint(0, V, (N,), generator=g), P, torch.tensor(depth), dr.ancestor_mask(P, max(D, 1)),
                       valid, None, D)
        logits = torch.randn(N, V, generator=g)
        for i in range(1, N):  # the target often agrees with node i (its parent's row's argmax is its token)
            if torch.rand(1, generator=g) < 0.6:
                logits[parents[i], tree.tokens[i]] = 10.0
        for t in ([tree] + [tree.prefix(b) for b in (2, 4) if b < N]):
            path, L, bonus = accept_greedy(t, logits[:t.tokens.shape[0]].clone())
            hp, hL, hb = sampling.greedy_path(t, sampling.argmax(logits[:t.tokens.shape[0]]).tolist())
            assert (hp, hL, hb) == (path.tolist(), int(L), int(bonus)), (trial, parents)
            seen.add(hL)
    assert {1, 2, 3, 4} <= seen  # the trees accepted paths of several lengths


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_is_torchs(dtype):
    """The C argmax (greedy decoding and acceptance) returns torch.argmax's indices: the first of tied maxima,
    the first NaN where a row has one, -0 equal to +0, rows of any length (vector body and scalar tail)."""
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 49152), (16, 4099), (3, 7), (5, 17), (2, 8), (2, 3, 24), (4, 1)]:
        for kind in ("random", "ties", "nan", "zeros"):
            x = torch.randn(shape, generator=g)
            if kind == "ties":
                x = torch.randint(-2, 3, shape, generator=g).float()
            elif kind == "nan":
                x.view(-1)[torch.randint(0, x.numel(), (3,), generator=g)] = float("nan")
            elif kind == "zeros":
                x = torch.where(torch.rand(shape, generator=g) < 0.5, 0.0, -0.0)
                x.view(-1)[::3] = float("-inf")
            x = x.to(dtype)
            assert torch.equal(sampling.argmax(x), torch.argmax(x, dim=-1)), (shape, kind)
    x = torch.randn(6, 100).to(dtype)
    assert sampling.argmax(x[:, ::2]).tolist() == torch.argmax(x[:, ::2], -1).tolist()  # strided rows
    if sampling._argmax_fn() is not None:  # where the C loop built, it is what ran above
        y = x.clone()
        y[:, 7] = 1e4
        assert sampling._argmax_c(y).tolist() == [7] * 6
    compiled = torch.compile(sampling.argmax, fullgraph=True, backend="eager")  # one node in a traced step
    assert torch.equal(compiled(x), torch.argmax(x, dim=-1))


def test_sample_from_draws_each_row_from_its_law():
    """Rows drawn apart, unnormalised, at their probabilities (chi-square, p > 1e-4 over 20,000 draws), entries of
    no mass never drawn (the last ones included), an all-zero row gives 0, and a generator repeats its draws."""
    from test_generate import _chi2_sf
    p = torch.tensor([[0.0, 0.5, 0.0, 1.5, 1.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    n = 20000
    draws = sampling.sample_from(p[:, None, :].expand(2, n, 7).contiguous())  # [2, n]
    for row, d in zip(p, draws):
        counts = torch.bincount(d, minlength=7).double()
        assert counts[row == 0].sum() == 0, counts
        exp = row.double() / row.sum() * n
        stat = float((((counts - exp) ** 2)[row > 0] / exp[row > 0]).sum())
        assert _chi2_sf(stat, int((row > 0).sum()) - 1) > 1e-4, (counts, exp)
    assert sampling.sample_from(torch.zeros(3, 5)).tolist() == [0, 0, 0]
    one = torch.zeros(4, 9)
    one[:, 8] = 1e-30  # the last entry alone has mass: a uniform rounding up to the sum still draws it
    assert sampling.sample_from(one).tolist() == [8] * 4
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    q = torch.rand(5, 100)
    assert torch.equal(sampling.sample_from(q, g1), sampling.sample_from(q, g2))


def test_accept_sample_is_exact_on_a_chain_and_a_tree():
    """accept_sample's first emitted token follows the target's law at the root: on a chain whose tokens are drawn
    from its draft law q, and on siblings proposed without one (whatever they are): chi-square over 6,000 draws."""
    from test_generate import _chi2_sf
    V, n, g = 6, 6000, torch.Generator().manual_seed(1)
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3, 0.0, 0.0]] * 3)
    q = torch.tensor([[0.0, 0.7, 0.1, 0.2, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0, 0.5, 0.0], [0.0] * 5 + [1.0]])
    sib = dr.Tree(torch.tensor([0, 1, 3]), torch.tensor([-1, 0, 0]), torch.tensor([0, 1, 1]),
                  torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool), torch.ones(3, dtype=torch.bool),
                  None, 1)
    for kind in ("chain", "siblings"):
        first = []
        for _ in range(n):
            tree = sib
            if kind == "chain":
                x = torch.multinomial(q[:2], 1, generator=g)[:, 0]
                tree = dr.Tree(torch.cat([torch.tensor([0]), x]), torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2]),
                               torch.tril(torch.ones(3, 3, dtype=torch.bool)), torch.ones(3, dtype=torch.bool), q, 2)
            path, L, bonus = sampling.accept_sample(tree, probs, g)
            first.append(int(tree.tokens[path[1]]) if int(L) > 1 else int(bonus))
        counts = torch.bincount(torch.tensor(first), minlength=V).double()
        exp = probs[0].double() * n
        assert counts[4:].sum() == 0, (kind, counts)
        stat = float((((counts - exp) ** 2)[:4] / exp[:4]).sum())
        assert _chi2_sf(stat, 3) > 1e-4, (kind, counts, exp)
