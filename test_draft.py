"""draft.py: draft kinds, drafter construction errors, EAGLE-2 tree invariants, n-gram lookup, and sync-free
tracing of the draft step, the verify forward, acceptance, KV compaction and the engine's two steps."""
import pytest
import torch

import draft as dr
from budget import Budget
from conftest import load_head, write_eagle_head, write_tiny_hf
from generate import Engine, main
from model import ModelError, load_model
from sampling import Sampling, accept_greedy, accept_sample, logits_to_probs
from vocab import make_vocab


def test_draft_kind_errors(draft_env, tmp_path):
    root, path, cfg = draft_env
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="holds no weights"):
        dr.detect_draft_kind(tmp_path / "d")
    with pytest.raises(ModelError, match="not found"):
        dr.detect_draft_kind(tmp_path / "nope")
    assert dr.detect_draft_kind(path) == "model"
    assert dr.detect_draft_kind(write_eagle_head(tmp_path / "e", cfg, version=1)) == "eagle"


def test_head_folder_freq_fills_nanospec(draft_env, tmp_path):
    """A freq.pt in the head folder fills NanoSpec's free slots (most frequent first), through the one place
    drafters are built; "nofill" and the other vocabularies do without it."""
    root, path, cfg = draft_env
    head = write_eagle_head(tmp_path / "h", cfg, version=3)
    m = load_model(path, dtype=torch.float32)
    plain = dr.make_drafter(dr.DraftConfig(str(head), "nanospec", 4, 3, 10, w_max=64), m)
    assert not plain.vocab.has_fill
    torch.save([17, 3, 99, 3, 250], head / "freq.pt")  # (a repeated id keeps its first rank)
    d = dr.make_drafter(dr.DraftConfig(str(head), "nanospec", 4, 3, 10, w_max=64), m)
    assert d.vocab.has_fill and d.vocab.fill_tok[:5].tolist()[:4] == [17, 3, 99, 250]
    assert not dr.make_drafter(dr.DraftConfig(str(head), "nanospec", 4, 3, 10, w_max=64, ablation="nofill"),
                               m).vocab.has_fill
    assert not hasattr(dr.make_drafter(dr.DraftConfig(str(head), "full", 4, 3, 10), m).vocab, "has_fill")


def test_cli_draft_mismatch_errors(draft_env, tmp_path, capsys):
    root, path, cfg = draft_env
    other, _ = write_tiny_hf(tmp_path / "other", vocab_size=300)
    for argv in (["--draft", str(other)], ["--tree-nodes", "500", "--draft", str(write_eagle_head(tmp_path / "h", cfg, version=3))],
                 ["--vocab", "nanospec"], ["--draft", "ngram", "--ngram-min", "4", "--ngram-max", "2"],
                 ["--draft", "ngram", "--ngram-occurrences", "0"],
                 ["--draft", str(tmp_path / "missing")]):
        assert main(["--checkpoint", str(path), "--raw", "--prompt", "x", "--max-new-tokens", "2", *argv]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Writing model shards" not in ln]
        assert len(err) == 1 and err[0].startswith("error:"), (argv, err)


def test_tree_invariants(draft_env):
    m, head = load_head(draft_env, version=3)
    for topk, depth, nodes in [(4, 4, 25), (3, 2, 13), (1, 3, 4)]:
        d = dr.EagleDrafter(head, make_vocab("full", head.lm_weight()), topk, depth, nodes)
        d.setup(128)
        m.setup_caches(1, 128)
        p = torch.arange(30, 50)
        logits, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True)
        d.prefill(dr.Prefill(p, torch.tensor([3]), logits[0], h, aux))
        tree = d.draft(torch.tensor([3]), torch.tensor(len(p)))
        N = tree.tokens.shape[0]
        assert N == nodes and int(tree.parents[0]) == -1 and int(tree.tokens[0]) == 3
        assert int(tree.depth.max()) <= depth
        for i in range(1, N):
            par = int(tree.parents[i])
            assert 0 <= par < i  # parents before children
            assert int(tree.depth[i]) == int(tree.depth[par]) + 1  # positions = depth
            slow, j = {i}, par
            while j >= 0:
                slow.add(j)
                j = int(tree.parents[j])
            assert set(torch.nonzero(tree.anc[i]).flatten().tolist()) == slow  # mask = ancestor closure
        for i in range(N):
            kids = tree.tokens[(tree.parents == i)].tolist()
            assert len(kids) == len(set(kids)) <= topk


def test_tree_budget_errors():
    with pytest.raises(ValueError, match="depth"):
        dr.check_tree_budget(4, 0, 5)
    with pytest.raises(ValueError, match="cannot fit"):
        dr.check_tree_budget(2, 2, 8)  # at most 1 + 2 + 2*2 = 7
    with pytest.raises(ValueError, match="topk"):
        dr.check_tree_budget(0, 2, 2)
    dr.check_tree_budget(10, 5, 60)


def accepted(tree, L, bonus, n=0, V=256):
    """An Accepted for tree whose first L path nodes (root included) were accepted, then bonus."""
    N, D = tree.tokens.shape[0], tree.max_depth
    path = torch.arange(D + 1).clamp(max=N - 1)
    z = torch.zeros(1, N, 8)
    return dr.Accepted(tree, path, torch.tensor(L), torch.tensor(bonus), torch.zeros(N, V), z, z, torch.tensor(n))


def test_long_catch_up_chain_fits_the_window():
    """A catch-up chain (draft.chained over a run of autoregressive steps) whose append outruns the NanoSpec
    window goes in as its newest positions: no error mid-generation, and the window ends as if the steps had
    been appended one by one."""
    V, K, W = 200, 40, 64
    g = torch.Generator().manual_seed(0)
    toks, logits = torch.randint(0, V, (K,), generator=g), torch.randn(K, V, generator=g)
    steps = [dr.Accepted(dr.chain_tree(toks[i:i + 1]), torch.zeros(1, dtype=torch.long), torch.tensor(1),
                         toks[(i + 1) % K], logits[i:i + 1], torch.zeros(1, 1, 8), None, torch.tensor(i))
             for i in range(K)]
    ds = []
    for _ in range(2):
        d = dr.VocabDrafter()
        d.vocab = make_vocab("nanospec", torch.randn(V, 8, generator=g), w_max=W, k_pre=1, k_ver=3)
        d.reset_vocab(dr.Prefill(toks[:3], toks[3:4], logits[:3], None, None))
        ds.append(d)
    a = dr.chained(steps)
    assert a.tree.tokens.shape[0] + 3 * a.path.shape[0] > W  # one append would not fit
    ds[0].observe(a, a.next_tokens())
    for st in steps:
        ds[1].observe(st, st.next_tokens())
    assert torch.equal(ds[0].vocab.count, ds[1].vocab.count)


@pytest.mark.parametrize("k_pre,W", [(3, 64), (3, 66), (1, 7), (2, 180)])
def test_prompt_logits_cover_the_window(k_pre, W):
    """The engine projects only the last prompt_logits prompt positions (NanoSpec: as many as the window holds,
    1 + k_pre entries a position), and the window is the one every position's logits give, prompts shorter
    than that included (W = 180)."""
    V, T = 200, 50
    g = torch.Generator().manual_seed(W)
    toks, logits, weight = torch.randint(0, V, (T,), generator=g), torch.randn(T, V, generator=g), torch.randn(V, 8, generator=g)
    ds = []
    for rows in (T, None):
        d = dr.VocabDrafter()
        d.vocab = make_vocab("nanospec", weight, w_max=W, k_pre=k_pre, k_ver=3)
        R = min(T, d.prompt_logits) if rows is None else rows
        assert rows is not None or R * (1 + k_pre) >= min(W, T * (1 + k_pre)) and (R < T) == (W < T * (1 + k_pre))
        d.reset_vocab(dr.Prefill(toks, toks[-1:], logits[T - R:], None, None))
        ds.append(d.vocab)
    for name in ("ring", "head", "count_", "slot_of_", "token_of_", "ids", "bias", "rows"):
        assert torch.equal(getattr(ds[0], name), getattr(ds[1], name)), name
    d.vocab = make_vocab("full", weight)
    assert d.prompt_logits == 0


def test_ngram_history_tracks_the_sequence():
    d = dr.NgramDrafter(k=3, nmin=1, nmax=2)
    p = torch.tensor([1, 2, 3, 1, 2])
    d.prefill(dr.Prefill(p, torch.tensor([3]), torch.zeros(5, 256), torch.zeros(1, 5, 8), None))
    tree = d.draft(torch.tensor([3]), torch.tensor(5))  # sequence 1 2 3 1 2 [3]: suffix [2, 3] was followed by [1, 2, 3]
    assert tree.tokens.tolist() == [3, 1, 2, 3]
    d.update(accepted(tree, 2, 9, n=5))  # accepted 1, bonus 9 (the next root)
    assert d.hist == [1, 2, 3, 1, 2, 3, 1]
    assert d.draft(torch.tensor([9]), torch.tensor(7)).tokens.tolist() == [9]  # nothing ever followed 9


def test_ngram_proposals():
    d = dr.NgramDrafter(k=3, nmin=1, nmax=3)
    assert d.propose([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2]  # longest suffix [2, 3] -> what followed it
    assert d.propose([5, 6, 7]) == []
    assert d.propose([1, 2, 1, 3, 1]) == [3, 1]  # most recent earlier occurrence of [1]


def test_ngram_index_matches_the_scan():
    """match() through its n-gram index finds what a scan of the history finds, as the history grows step by
    step (the index extended) and when another text starts (the index rebuilt), repeats and short texts included."""
    import random
    rng, hits = random.Random(1), 0
    for trial in range(200):
        d = dr.NgramDrafter(rng.choice([2, 3, 10]), rng.choice([1, 2]), 3)
        V = rng.choice([3, 5, 20])
        hist = [rng.randrange(V) for _ in range(rng.randrange(0, 5))]
        for step in range(30):
            if rng.random() < 0.05:  # a new request
                hist = [rng.randrange(V) for _ in range(rng.randrange(0, 8))]
            hist = hist + [rng.randrange(V) for _ in range(rng.randrange(1, 4))]
            got = d.match(hist)
            assert got == d.match_scan(hist), (trial, hist)
            hits += got[0] > 0
    assert hits > 1000  # most steps have a chain (the small vocabularies repeat)


def test_lookup_tree_merges_earlier_continuations_best_first():
    """Prompt lookup's tree: the continuations of the suffix's earlier occurrences as a trie, nodes ordered by how
    many continuations pass through them, then the shallower, then the more recent; at most k nodes; one chain
    where they agree."""
    d = dr.NgramDrafter(k=4)
    # [1, 2] was followed by [4, 1, 2] (the most recent) and by [3, 1, 2, 4]: one each, so depth first-level siblings
    assert d.lookup_tree([1, 2, 3, 1, 2, 4, 1, 2]) == ([4, 3, 1, 1], [0, 0, 1, 2])
    # [3, 1, 2] twice and [4, 1, 2] once (the most recent): the more supported path first
    assert dr.NgramDrafter(k=3).lookup_tree([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]) == ([3, 1, 2], [0, 1, 2])
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
    import random
    rng, branched = random.Random(2), 0
    for trial in range(300):
        k, occ = rng.choice([2, 4, 10]), rng.choice([1, 3, 8])
        d = dr.NgramDrafter(k, rng.choice([1, 2]), 3, occurrences=occ)
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
    d = dr.NgramDrafter(k=3, nmin=1, nmax=3)
    assert d.match([1, 2, 3, 4, 1, 2, 3]) == (3, [4, 1, 2]) and d.budget_key([1, 2, 3, 4, 1, 2, 3]) == "ngram3"
    assert d.match([1, 2, 3, 4, 9, 2, 3]) == (2, [4, 9, 2]) and d.budget_key([1, 2, 3, 4, 9, 2, 3]) == "ngram2"
    assert d.budget_key([1, 2, 1, 3, 1]) == "ngram1" and d.budget_key([5, 6, 7]) == "ngram0"
    assert d.budget_sizes("ngram0") == [1] and d.budget_sizes("ngram2") == [1, 2, 4]
    b = Budget(4, sizes=d.budget_sizes("ngram0"), settle=1)
    for _ in range(100):  # nothing to draft: it never probes a speculative size
        assert b.pick() == 1
        b.observe(1, [0], 0.01)


@pytest.mark.parametrize("version,spec", [(3, "full"), (3, "nanospec"), (1, "full"), (1, "nanospec")])
def test_draft_verify_accept_compact_trace_without_graph_breaks(draft_env, version, spec):
    """The draft step, verify forward, acceptance, compaction and drafter/vocab updates trace with
    torch.compile(fullgraph=True): static shapes, no host syncs, no data-dependent Python control flow."""
    torch._dynamo.reset()  # each case traces afresh (no recompile-limit carry-over between cases)
    m, head = load_head(draft_env, version=version)
    vocab = make_vocab(spec, head.lm_weight(), w_max=64, max_append=10 + 4 * 3)
    d = dr.EagleDrafter(head, vocab, 4, 3, 10)
    eng = Engine(m, drafter=d)
    m.setup_caches(1, 128)
    d.setup(128)
    p = torch.arange(3, 20)
    n = torch.tensor(len(p))
    logits, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True)
    d.prefill(dr.Prefill(p, torch.tensor([3]), logits[0], h, aux))
    vocab.reset(p, torch.topk(torch.randn(len(p), 256), 3).indices)
    c = lambda f: torch.compile(f, fullgraph=True, backend="eager")
    tree = c(d.draft)(torch.tensor([3]), n)
    logits, hid, aux = c(eng._verify)(tree.tokens, tree.depth, tree.anc, n)
    path, L, bonus = c(accept_greedy)(tree, logits)
    c(accept_sample)(tree, logits_to_probs(logits, Sampling(1.0)))
    c(m.compact_kv)(n + path, n)
    c(d.update)(dr.Accepted(tree, path, L, bonus, logits, hid, aux, n))  # the drafter's and its vocabulary's
    ver = torch.topk(logits.index_select(0, path), 3, dim=-1).indices
    c(vocab.update)(tree.tokens, tree.valid, ver, torch.arange(4) < L)
    # the engine's two steps whole: the tree and the verification's outcome pass through as dataclasses
    host, acc = c(eng._spec_verify)(tree, n)
    assert isinstance(acc, dr.Accepted) and host.shape == (2 + 2 * 4,)
    assert isinstance(c(eng._spec_advance)(acc), dr.Tree)


def test_model_drafter_draft_traces(draft_env):
    torch._dynamo.reset()
    root, path, cfg = draft_env
    dm = load_model(path, dtype=torch.float32)
    for samp in (None, Sampling(1.0)):
        d = dr.ModelDrafter(dm, make_vocab("nanospec", dm.lm_head.weight, w_max=64), k=3, sampling=samp)
        d.setup(64)
        p = torch.arange(3, 12)
        d.prefill(dr.Prefill(p, torch.tensor([5]), torch.zeros(len(p), 256), torch.zeros(1, len(p), 64), None))
        d.vocab.reset(p, None)
        torch._dynamo.reset()
        tree = torch.compile(d.draft, fullgraph=True, backend="eager")(torch.tensor([5]), torch.tensor(len(p)))
        assert tree.tokens.shape == (4,) and (tree.q is None) == (samp is None)


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
                         torch.randn(1, t.tokens.shape[0], d, generator=g), torch.randn(1, t.tokens.shape[0], 3 * d, generator=g),
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
