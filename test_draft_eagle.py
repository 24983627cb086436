"""draft_eagle.py: EAGLE-2 tree invariants and budget-sized searches, the NanoSpec window's reset and appends,
and sync-free tracing of the draft step, the verify forward, acceptance, KV compaction and the engine's two steps."""
import pytest
import torch

import draft as dr
import draft_eagle as de
from conftest import load_head
from engine import Engine
from exact import PassRows
from sampling import Sampling, accept_greedy, accept_sample, logits_to_probs
from test_generate import PROMPTS, autoregressive, make_drafter, prefilled, target, tiny  # noqa: F401 (tiny: a fixture)
from vocab import make_vocab
from model import Plan


def test_tree_invariants(draft_env):
    m, head = load_head(draft_env, version=3)
    for topk, depth, nodes in [(4, 4, 25), (3, 2, 13), (1, 3, 4)]:
        d = de.EagleDrafter(head, make_vocab("full", head.lm_weight()), topk, depth, nodes)
        d.setup(128)
        m.setup_caches(1, 128)
        p = torch.arange(30, 50)
        logits, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True, plan=Plan(d.aux_layers))
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


def test_ancestor_mask_and_tree_invariants(tiny):
    m = target(tiny[0])
    d = make_drafter("eagle3", tiny, m, topk=4, depth=4, nodes=25)
    d.setup(128)
    m.setup_caches(1, 128)
    p = torch.tensor(PROMPTS[2])
    logits, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True, plan=Plan(d.aux_layers))
    d.prefill(dr.Prefill(p, torch.tensor([3]), logits[0], h, aux))
    tree = d.draft(torch.tensor([3]), torch.tensor(len(p)))
    N = tree.tokens.shape[0]
    assert N == 25 and int(tree.parents[0]) == -1
    for i in range(1, N):
        par = int(tree.parents[i])
        assert 0 <= par < i  # parents before children
        assert int(tree.depth[i]) == int(tree.depth[par]) + 1
        slow = {i}
        j = par
        while j >= 0:
            slow.add(j)
            j = int(tree.parents[j])
        assert set(torch.nonzero(tree.anc[i]).flatten().tolist()) == slow
    # siblings are distinct tokens
    for i in range(N):
        kids = tree.tokens[tree.parents == i].tolist()
        assert len(kids) == len(set(kids))


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
        d = de.VocabDrafter()
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
    toks, logits, weight = (torch.randint(0, V, (T,), generator=g), torch.randn(T, V, generator=g),
                            torch.randn(V, 8, generator=g))
    ds = []
    for rows in (T, None):
        d = de.VocabDrafter()
        d.vocab = make_vocab("nanospec", weight, w_max=W, k_pre=k_pre, k_ver=3)
        R = min(T, d.prompt_logits) if rows is None else rows
        assert rows is not None or R * (1 + k_pre) >= min(W, T * (1 + k_pre)) and (R < T) == (W < T * (1 + k_pre))
        d.reset_vocab(dr.Prefill(toks, toks[-1:], logits[T - R:], None, None))
        ds.append(d.vocab)
    for name in ("ring", "head", "count_", "slot_of_", "token_of_", "ids", "bias", "rows"):
        assert torch.equal(getattr(ds[0], name), getattr(ds[1], name)), name
    d.vocab = make_vocab("full", weight)
    assert d.prompt_logits == 0


@pytest.mark.parametrize("version,spec", [(3, "full"), (3, "nanospec"), (1, "full"), (1, "nanospec")])
def test_draft_verify_accept_compact_trace_without_graph_breaks(draft_env, version, spec):
    """The draft step, verify forward, acceptance, compaction and drafter/vocab updates trace with
    torch.compile(fullgraph=True): static shapes, no host syncs, no data-dependent Python control flow."""
    torch._dynamo.reset()  # each case traces afresh (no recompile-limit carry-over between cases)
    m, head = load_head(draft_env, version=version)
    vocab = make_vocab(spec, head.lm_weight(), w_max=64, max_append=10 + 4 * 3)
    d = de.EagleDrafter(head, vocab, 4, 3, 10)
    eng = Engine(m, drafter=d)
    m.setup_caches(1, 128)
    d.setup(128)
    p = torch.arange(3, 20)
    n = torch.tensor(len(p))
    logits, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True, plan=Plan(d.aux_layers))
    d.prefill(dr.Prefill(p, torch.tensor([3]), logits[0], h, aux))
    vocab.reset(p, torch.topk(torch.randn(len(p), 256), 3).indices)
    c = lambda f: torch.compile(f, fullgraph=True, backend="eager")
    tree = c(d.draft)(torch.tensor([3]), n)
    logits, hid, aux = c(eng.runner._verify)(tree.tokens, tree.depth, tree.anc, n, PassRows(1, 1))
    path, L, bonus = c(accept_greedy)(tree, logits)
    c(accept_sample)(tree, logits_to_probs(logits, Sampling(1.0)))
    c(m.compact_kv)(n + path, n)
    c(d.update)(dr.Accepted(tree, path, L, bonus, logits, hid, aux, n))  # the drafter's and its vocabulary's
    ver = torch.topk(logits.index_select(0, path), 3, dim=-1).indices
    c(vocab.update)(tree.tokens, tree.valid, ver, torch.arange(4) < L)
    # the engine's two steps whole: the tree and the verification's outcome pass through as dataclasses
    host, acc = c(eng.runner._spec_verify)(tree, n, PassRows(1, 1))
    assert isinstance(acc, dr.Accepted) and host.shape == (2 + 2 * 4,)
    assert isinstance(c(eng.runner._spec_advance)(acc), dr.Tree)


def test_prefix_is_the_smaller_budgets_tree(tiny):
    """EAGLE-2 nodes come best first with parents before children: every prefix is ancestor-closed and is
    what the drafter keeps with that node budget."""
    m = target(tiny[0])
    d = make_drafter("eagle3", tiny, m, topk=4, depth=3, nodes=12)
    small = make_drafter("eagle3", tiny, m, topk=4, depth=3, nodes=5)
    tok, n = prefilled(m, [d, small], PROMPTS[2])
    with torch.no_grad():
        tree, tree5 = d.draft(tok, n), small.draft(tok, n)
    assert (tree.parents[1:] < torch.arange(1, 12)).all()  # parents first
    for b in range(1, 13):
        sub = tree.prefix(b)
        assert sub.tokens.shape[0] == b and (sub.parents < b).all()
        assert torch.equal(sub.anc, tree.anc[:b, :b])
    assert torch.equal(tree.prefix(5).tokens, tree5.tokens) and torch.equal(tree.prefix(5).parents, tree5.parents)


def test_eagle_tree_for_a_small_budget_is_drafted_at_its_size(tiny):
    """A budget below the configured tree drafts a search scaled to it (EagleDrafter.shape_for): b nodes, parents
    first, the ancestor masks their closure, depth below b; 2 nodes are the root's best child, found without a
    single head forward; the whole budget (or none) drafts the configured tree."""
    m = target(tiny[0])
    d = make_drafter("eagle3", tiny, m, topk=4, depth=3, nodes=12)
    tok, n = prefilled(m, [d], PROMPTS[2])
    forwards = []
    real = d.head.forward
    d.head.forward = lambda *a, **k: forwards.append(1) or real(*a, **k)
    with torch.no_grad():
        for b, fw in ((2, 0), (4, 2), (8, 2)):
            forwards.clear()
            t = d.draft(tok, n, b)
            N = t.tokens.shape[0]
            assert N == b and len(forwards) == fw and d.shape_for(b) == (min(4, b // 2), min(3, b - 1), b), b
            assert int(t.parents[0]) == -1 and (t.parents[1:] < torch.arange(1, N)).all()
            assert torch.equal(t.anc, dr.ancestor_mask(t.parents, t.max_depth)) and int(t.depth.max()) < b
        logp, ids = d._logp(d.last_lm_in[None])
        assert d.draft(tok, n, 2).tokens.tolist() == [int(tok), int(d.tokens_of(ids[logp[0].argmax()]))]
        assert torch.equal(d.draft(tok, n, 12).tokens, d.draft(tok, n).tokens) and d.shape_for(12) == (4, 3, 12)


def test_eagle_takes_the_prompts_top_k_itself_as_from_the_engines_logits(tiny, monkeypatch):
    """An EAGLE drafter given the target's LM head (as make_drafter gives it) projects the prompt rows NanoSpec's
    window starts from itself, in chunks each reduced to its top-k, from the prefill's hidden states: the
    engine's prefill then projects one row, and the window, the trees and the output are those from the
    engine's [R, V] prompt logits."""
    monkeypatch.setattr(de.VocabDrafter, "PROJECT_ROWS", 3)
    m = target(tiny[0])
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 24)
    tops, trees = [], []
    for project in (m.lm_head, None):
        d = make_drafter("eagle3", tiny, m, "nanospec")
        d.project = project
        assert d.prompt_logits == (0 if project is not None else d.window_rows) and d.window_rows > 6
        reset, draft, got = d.vocab.reset, d.draft, []
        d.vocab.reset = lambda rows, top, f=reset: (tops.append(top.clone()), f(rows, top))[1]
        d.draft = lambda *a, f=draft, **k: (t := f(*a, **k), got.append(t.tokens.tolist()))[0]
        out, _ = Engine(m, drafter=d).generate(prompt, 24)
        assert out == ref
        trees.append(got)
    assert tops[0].shape[0] == min(len(prompt), d.window_rows) and torch.equal(tops[0], tops[1])
    assert trees[0] == trees[1] and len(trees[0]) > 2
