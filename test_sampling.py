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
