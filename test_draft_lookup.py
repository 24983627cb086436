"""draft_lookup.py: prompt lookup's history, its n-gram index against a scan, its trees of earlier continuations,
and its budget sources by match length."""
import random

import torch

import draft as dr
import draft_lookup as dl
from budget import Budget
from test_draft_eagle import accepted


def test_ngram_history_tracks_the_sequence():
    d = dl.NgramDrafter(k=3, nmin=1, nmax=2)
    p = torch.tensor([1, 2, 3, 1, 2])
    d.prefill(dr.Prefill(p, torch.tensor([3]), torch.zeros(5, 256), torch.zeros(1, 5, 8), None))
    # sequence 1 2 3 1 2 [3]: suffix [2, 3] was followed by [1, 2, 3]
    tree = d.draft(torch.tensor([3]), torch.tensor(5))
    assert tree.tokens.tolist() == [3, 1, 2, 3]
    d.update(accepted(tree, 2, 9, n=5))  # accepted 1, bonus 9 (the next root)
    assert d.hist == [1, 2, 3, 1, 2, 3, 1]
    assert d.draft(torch.tensor([9]), torch.tensor(7)).tokens.tolist() == [9]  # nothing ever followed 9


def test_ngram_proposals():
    d = dl.NgramDrafter(k=3, nmin=1, nmax=3)
    assert d.propose([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2]  # longest suffix [2, 3] -> what followed it
    assert d.propose([5, 6, 7]) == []
    assert d.propose([1, 2, 1, 3, 1]) == [3, 1]  # most recent earlier occurrence of [1]


def match_scan(d, hist: list[int]) -> tuple[int, list[int]]:
    """d.match() by scanning the history: its reference."""
    for n in range(min(d.nmax, len(hist) - 1), d.nmin - 1, -1):
        for s in range(len(hist) - n - 1, -1, -1):  # most recent earlier occurrence first
            if hist[s:s + n] == hist[-n:]:
                return n, hist[s + n:s + n + d.k]
    return 0, []


def test_ngram_index_matches_the_scan():
    """match() through its n-gram index finds what a scan of the history finds, as the history grows step by
    step (the index extended) and when another text starts (the index rebuilt), repeats and short texts included."""
    rng, hits = random.Random(1), 0
    for trial in range(200):
        d = dl.NgramDrafter(rng.choice([2, 3, 10]), rng.choice([1, 2]), 3)
        V = rng.choice([3, 5, 20])
        hist = [rng.randrange(V) for _ in range(rng.randrange(0, 5))]
        for step in range(30):
            if rng.random() < 0.05:  # a new request
                hist = [rng.randrange(V) for _ in range(rng.randrange(0, 8))]
            hist = hist + [rng.randrange(V) for _ in range(rng.randrange(1, 4))]
            got = d.match(hist)
            assert got == match_scan(d, hist), (trial, hist)
            hits += got[0] > 0
    assert hits > 1000  # most steps have a chain (the small vocabularies repeat)


def test_lookup_tree_merges_earlier_continuations_best_first():
    """Prompt lookup's tree: the continuations of the suffix's earlier occurrences as a trie, nodes ordered by how
    many continuations pass through them, then the shallower, then the more recent; at most k nodes; one chain
    where they agree."""
    d = dl.NgramDrafter(k=4)
    # [1, 2] was followed by [4, 1, 2] (the most recent) and by [3, 1, 2, 4]: one each, so depth first-level siblings
    assert d.lookup_tree([1, 2, 3, 1, 2, 4, 1, 2]) == ([4, 3, 1, 1], [0, 0, 1, 2])
    # [3, 1, 2] twice and [4, 1, 2] once (the most recent): the more supported path first
    assert dl.NgramDrafter(k=3).lookup_tree([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]) == ([3, 1, 2], [0, 1, 2])
    assert d.lookup_tree([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]) == ([3, 1, 2, 4], [0, 1, 2, 0])
    assert d.lookup_tree([1, 2, 3, 1, 2]) == ([3, 1, 2], [0, 1, 2])  # one occurrence: match()'s chain
    assert d.lookup_tree([5, 6, 7]) == ([], [])
    t = dr.lookup_tree_of(torch.tensor(2), [4, 3, 1, 1], [0, 0, 1, 2])
    assert t.tokens.tolist() == [2, 4, 3, 1, 1] and t.parents.tolist() == [-1, 0, 0, 1, 2]
    assert t.depth.tolist() == [0, 1, 1, 2, 2] and t.max_depth == 2 and t.valid.all()
    assert torch.equal(t.anc, dr.ancestor_mask(t.parents, 2))
    p = dr.lookup_tree_of(torch.tensor(2), [4, 3, 1, 1], [0, 0, 1, 2], pad_to=6)  # --compile: k + 1 nodes always
    assert p.tokens.shape[0] == 7 and p.valid.tolist() == [True] * 5 + [False] * 2
    assert p.max_depth == 6 == dr.lookup_tree_of(torch.tensor(2), [4, 3], [0, 1], pad_to=6).max_depth  # a static bound
    assert torch.equal(p.anc, dr.ancestor_mask(p.parents, 2)) and torch.equal(p.prefix(5).anc, t.anc)


def test_lookup_tree_properties():
    """On random histories: at most k nodes, parents first, distinct siblings, every root-to-node path a prefix of
    one of the last `occurrences` continuations, each node's support at least its later siblings'; one
    occurrence gives match()'s chain; the first node is the most common next token."""
    rng, branched = random.Random(2), 0
    for trial in range(300):
        k, occ = rng.choice([2, 4, 10]), rng.choice([1, 3, 8])
        d = dl.NgramDrafter(k, rng.choice([1, 2]), 3, occurrences=occ)
        V = rng.choice([3, 5, 9])
        hist = [rng.randrange(V) for _ in range(rng.randrange(2, 60))]
        tok, par = d.lookup_tree(hist)
        n, chain = d.match(hist)
        assert (n == 0) == (tok == [])
        if not tok:
            continue
        starts = [s for s in range(len(hist) - n) if hist[s:s + n] == hist[len(hist) - n:]][-occ:]
        conts = [hist[s + n:s + n + k] for s in starts]
        assert len(tok) <= k and all(0 <= p <= i for i, p in enumerate(par))
        paths = [[]]
        for t, p in zip(tok, par):
            paths.append(paths[p] + [t])
            assert any(c[:len(paths[-1])] == paths[-1] for c in conts)
        for i in range(len(tok)):
            kids = [tok[j] for j in range(len(tok)) if par[j] == i]
            assert len(kids) == len(set(kids))
        support = [sum(c[:len(q)] == q for c in conts) for q in paths[1:]]
        for i in range(len(tok)):
            later = [j for j in range(i + 1, len(tok)) if par[j] == par[i]]
            assert all(support[i] >= support[j] for j in later)
        firsts = [c[0] for c in conts]
        assert firsts.count(tok[0]) == max(firsts.count(x) for x in firsts)
        if occ == 1:
            assert tok == chain and par == list(range(len(tok)))
        branched += len(set(par)) < len(par)
    assert branched > 50  # most random histories repeat with variations


def test_ngram_budget_sources_by_match_length():
    """Each suffix-match length is a budget source of its own (a one-token match is right less often than a
    three-token one), and a step without a chain is autoregressive decoding: its only size is 1."""
    d = dl.NgramDrafter(k=3, nmin=1, nmax=3)
    assert d.match([1, 2, 3, 4, 1, 2, 3]) == (3, [4, 1, 2]) and d.budget_key([1, 2, 3, 4, 1, 2, 3]) == "ngram3"
    assert d.match([1, 2, 3, 4, 9, 2, 3]) == (2, [4, 9, 2]) and d.budget_key([1, 2, 3, 4, 9, 2, 3]) == "ngram2"
    assert d.budget_key([1, 2, 1, 3, 1]) == "ngram1" and d.budget_key([5, 6, 7]) == "ngram0"
    assert d.budget_sizes("ngram0") == [1] and d.budget_sizes("ngram2") == [1, 2, 4]
    b = Budget(4, sizes=d.budget_sizes("ngram0"), settle=1)
    for _ in range(100):  # nothing to draft: it never probes a speculative size
        assert b.pick() == 1
        b.observe(1, [0], 0.01)
