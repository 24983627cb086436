"""sampling.py: the acceptance rules on hand-made trees (the engine-level losslessness and chi-square
tests of sampled acceptance are in test_generate.py)."""
import torch

import draft as dr
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
