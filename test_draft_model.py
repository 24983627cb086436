"""draft_model.py: a draft model's chains and trees with every vocabulary equal autoregressive decoding (greedy, across
eos and the token budget; sampled, in distribution), its KV cache follows the accepted path, the budget's shapes, the
hybrid over it, its traced steps, and the CLI's defaults for draft models."""
import json

import pytest
import torch

import budget as budget_module
import cpu_forward
import draft as dr
import draft_config as dc
import draft_lookup as dl
import test_generate as tg
from draft_hybrid import HybridDrafter
from draft_model import ModelDrafter
from engine import Engine
from generate import main
from model import load_model
from sampling import Sampling
from test_generate import PROMPTS, Cycle, Turns, autoregressive, tiny  # noqa: F401 (tiny: a fixture)
from vocab import make_vocab

CHAIN, TREE = (1, 4, 5), (3, 3, 9)
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(cpu_forward.kernel() is None,
                                                             reason="the fused CPU pass does not build here"))


def target(tiny, dtype=torch.float32):
    return load_model(tiny[0], dtype=dtype)


def model_drafter(tiny, spec="full", shape=CHAIN, w_max=None, sampling=None, dtype=torch.float32, path=None, chain=0,
                  k_ver=3, at="verified"):
    """A ModelDrafter over the tiny draft model (path: another), spec full | freq (a frequency file written here) |
    nanospec | nanospec+fill (the lowest ids in free slots, as make_drafter's default), its window (w_max None: 64,
    or one step's append if larger, with a merged chain of `chain` tokens)."""
    dm = load_model(path or tiny[2], dtype=dtype)
    if spec == "freq":
        torch.save(list(range(255, -1, -3)), tiny[3] / "freq.pt")
        spec = f"freq:{tiny[3] / 'freq.pt'}:40"
    topk, depth, nodes = shape
    width = dc.append_width(nodes + chain, max(depth, chain), k_ver, at == "verified")
    W = w_max or max(64, width)
    vocab = make_vocab(spec.removesuffix("+fill"), dm.lm_head.weight, w_max=W, k_pre=3, k_ver=k_ver, max_append=width,
                       fill=torch.arange(W) if spec.endswith("+fill") else None)
    d = ModelDrafter(dm, vocab, sampling=sampling, tree=shape)
    d.k_ver_at = at
    return d


def hybrid(tiny, spec="nanospec", shape=TREE, m=None, k=4, **kw):
    """The hybrid over the draft model; m: the target, whose LM head lets it start the draft model late."""
    d = model_drafter(tiny, spec, shape, chain=k, **kw)
    d.project = None if m is None else m.lm_head
    return HybridDrafter(d, dl.NgramDrafter(k=k))


@pytest.mark.parametrize("shape", [CHAIN, TREE, (4, 2, 6)])
@pytest.mark.parametrize("spec", ["full", "freq", "nanospec", "nanospec+fill"])
@pytest.mark.parametrize("max_new", [1, 13, 40])
def test_greedy_lossless_chains_and_trees(tiny, shape, spec, max_new):
    m = target(tiny)
    eng = Engine(m, drafter=model_drafter(tiny, spec, shape))
    for p in PROMPTS:
        out, st = eng.generate(p, max_new)
        assert out == autoregressive(m, p, max_new), (shape, spec, p)
        assert st.new_tokens == len(out) and 0.0 <= st.extra.get("vocab_coverage", 1.0) <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_greedy_lossless_across_eos_and_with_every_budget(tiny, monkeypatch, dtype):
    """A mid-output token made eos stops speculative decoding where autoregressive decoding stops; under a budget
    that cycles through every size (autoregressive steps, chains, trees) the output stays the target's own."""
    m = target(tiny, dtype)
    ref = autoregressive(m, PROMPTS[0], 60)
    m.args.eos_ids = [ref[10]]
    ref = autoregressive(m, PROMPTS[0], 60)
    assert ref[-1] == m.args.eos_ids[0] and len(ref) <= 11
    for shape in (CHAIN, TREE):
        out = Engine(m, drafter=model_drafter(tiny, "nanospec+fill", shape, dtype=dtype)).generate(PROMPTS[0], 60)[0]
        assert out == ref, shape
    m = target(tiny, dtype)
    monkeypatch.setattr(budget_module, "Budget", Cycle)
    monkeypatch.setattr(budget_module, "Policy", Turns)
    for spec in ("full", "nanospec"):
        d = model_drafter(tiny, spec, (4, 4, 16), dtype=dtype)
        eng = Engine(m, drafter=d, budget=True)
        for p in PROMPTS:
            out, st = eng.generate(p, 40)
            assert out == autoregressive(m, p, 40), (spec, p)
            if len(out) == 40:
                assert len(st.extra["budget_hist"]) >= 3, st.extra["budget_hist"]


def test_the_self_draft_accepts_everything(tiny):
    """The target drafting for itself: a chain is always accepted whole, and a tree's best node (its draft's greedy
    choice) always (deeper greedy nodes only where rerank keeps them: a random tiny model's log-probs are flat)."""
    m = target(tiny)
    for shape, least in ((CHAIN, CHAIN[1] + 1), (TREE, 2)):
        eng = Engine(m, drafter=model_drafter(tiny, "full", shape, path=tiny[0]))
        for p in PROMPTS:
            out, st = eng.generate(p, 40)
            assert out == autoregressive(m, p, 40)
            assert min(st.accept_hist) >= least or len(st.accept_hist) == 1 and 40 < least, (shape, st.accept_hist)


def fresh_kv(m, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's K and V of a plain prefill of tokens."""
    m.setup_caches(1, tokens.shape[0] + 8)
    with torch.no_grad():
        m(tokens[None], torch.arange(tokens.shape[0]))
    return kv_rows(m, tokens.shape[0])


def kv_rows(m, c: int) -> list[torch.Tensor]:
    if m.kv is not None:  # the fused pass's one tensor [L, 2, Hkv, S, hd]
        return [m.kv[:, :, :, :c].float()]
    return [x[0, :, :c] for layer in m.layers for x in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("kind", ["chain", "tree", "budget", "hybrid"])
def test_the_draft_cache_follows_the_accepted_path(tiny, monkeypatch, dtype, kind):
    """After a request, the draft model's cached prefix (slots 0 .. c-1) is a fresh prefill's of the tokens it holds
    (the prompt, the accepted tokens, the last root): the fed accepted nodes moved there, the others fed later. Bit
    for bit through the fused CPU pass (row-invariant; keys reduced in logical order wherever they sit)."""
    if kind in ("budget", "hybrid"):
        monkeypatch.setattr(budget_module, "Budget", Cycle)  # autoregressive steps, chains and trees in turn
        monkeypatch.setattr(budget_module, "Policy", Turns)
    m = target(tiny, dtype)
    moved = []
    for p in (PROMPTS[1] * 3, PROMPTS[2]):
        d = (hybrid(tiny, m=m, dtype=dtype, path=tiny[0]) if kind == "hybrid" else
             model_drafter(tiny, "nanospec", CHAIN if kind == "chain" else TREE, dtype=dtype, path=tiny[0]))
        md = d.tree if kind == "hybrid" else d
        real = md.model.compact_kv
        md.model.compact_kv = lambda src, dst, f=real: (moved.append(src.tolist() != list(range(int(dst),
                                                        int(dst) + src.shape[0]))), f(src, dst))[1]
        out, _ = Engine(m, drafter=d, budget=kind in ("budget", "hybrid")).generate(p, 40)
        if kind == "hybrid":
            d.head.catch_up()  # the steps since its last draft (the engine is done with them)
        c, seq = int(md.c), p + out
        assert md.hist[:min(c, len(seq))].tolist() == seq[:c] and c > len(p) + 20, (c, len(p))
        got, want = kv_rows(md.model, c), fresh_kv(load_model(tiny[0], dtype=dtype), md.hist[:c])
        for x, y in zip(got, want):
            assert torch.equal(x, y) if dtype == torch.bfloat16 else torch.allclose(x, y, atol=1e-5, rtol=1e-4)
    assert any(moved) or kind == "chain"  # tree nodes off the first slots were accepted and moved


def test_shape_for_chains_then_trees(tiny):
    """Small budgets draft chains (a level is a pass of the model), larger ones trees of the configured depth; every
    size is a tree of exactly that many nodes, parents first, and costs one pass per level; the budget starts with
    the longest chain. --spec-k alone is a chain and its shorter chains."""
    m = target(tiny)
    d = model_drafter(tiny, "nanospec", (4, 6, 16))
    assert d.budget_sizes() == d.budget_sizes("model") == [1, 3, 4, 5, 6, 7, 8, 16] and d.budget_key([1]) == "model"
    assert [d.shape_for(b) for b in (3, 7, 8, 16, None)] == [(1, 2, 3), (1, 6, 7), (2, 6, 8), (4, 6, 16), (4, 6, 16)]
    assert d.budget_start("model") == 7
    tok, n = tg.prefilled(m, [d], PROMPTS[2])
    passes = []
    real = d._forward
    d._forward = lambda *a: passes.append(1) or real(*a)
    with torch.no_grad():
        for b in d.budget_sizes()[1:]:
            passes.clear()
            k, D, N = d.shape_for(b)
            t = d.draft(tok, n, b)
            assert t.tokens.shape[0] == b == N and len(passes) == D and int(t.depth.max()) <= D
            assert (t.parents[1:] < torch.arange(1, b)).all() and torch.equal(t.anc, dr.ancestor_mask(t.parents, D))
            if k == 1:
                assert t.parents.tolist() == list(range(-1, b - 1))
            for i in range(b):
                kids = t.tokens[t.parents == i].tolist()
                assert len(kids) == len(set(kids)) <= k
    c = ModelDrafter(d.model, d.vocab, k=5)
    assert c.budget_sizes() == [1, 3, 4, 5, 6] and all(c.shape_for(b)[0] == 1 for b in c.budget_sizes()[1:])
    assert c.budget_start("model") == 6 and (c.depth, c.nodes) == (5, 6)
    with pytest.raises(ValueError, match="--spec-k must be >= 1"):
        ModelDrafter(d.model, d.vocab, k=0)


def test_a_chain_is_the_draft_models_greedy_continuation(tiny):
    """A chain is the tree with top-k 1: the draft model's own greedy continuation (a plain forward pass over the
    whole sequence each token is the oracle), whose first token is a tree's best node."""
    m = target(tiny)
    chain, tree = model_drafter(tiny, "full", (1, 4, 5)), model_drafter(tiny, "full", (3, 3, 9))
    tok, n = tg.prefilled(m, [chain, tree], PROMPTS[0])
    ref, seq = load_model(tiny[2], dtype=torch.float32), PROMPTS[0] + [int(tok)]
    with torch.no_grad():
        c, t = chain.draft(tok, n).tokens.tolist(), tree.draft(tok, n).tokens.tolist()
        ref.setup_caches(1, 64)
        for _ in range(4):
            seq.append(int(ref(torch.tensor([seq]), torch.arange(len(seq)))[0, -1].argmax()))
    assert c == seq[len(PROMPTS[0]):] and t[:2] == c[:2]


@pytest.mark.parametrize("kind,samp,prefix", [("model_tree", Sampling(1.0), None),
                                              ("model_tree", Sampling(0.8, top_k=6, top_p=0.9), 3),
                                              ("model_chain", Sampling(1.0), None),
                                              ("model_hybrid", Sampling(1.0), None)])
def test_speculative_sampling_is_exact(tmp_path, monkeypatch, kind, samp, prefix):
    """test_generate's chi-square test (the joint law of tokens 2 and 3 over 1500 seeded runs, p < 1e-4: a false
    failure once in 10,000 seed sets per case): trees of the draft model's top-k (deterministic proposals, tree
    acceptance), its sampled chain (q, the p/q rule), a budget's prefix of the tree, the hybrid over it."""
    real = tg.make_drafter

    def make(kind, tiny, m, topk=3, depth=2, nodes=6, w_max=8, sampling=None, **kw):
        if not kind.startswith("model_"):
            return real(kind, tiny, m, topk=topk, depth=depth, nodes=nodes, w_max=w_max, sampling=sampling, **kw)
        if kind == "model_chain":  # its q over a NanoSpec window of 8 of the 12 tokens
            return model_drafter(tiny, "nanospec", (1, depth, depth + 1), w_max, sampling, k_ver=1, at="accepted")
        d = model_drafter(tiny, "full", (topk, depth, nodes), sampling=sampling)
        return HybridDrafter(d, dl.NgramDrafter(k=2)) if kind == "model_hybrid" else d

    monkeypatch.setattr(tg, "make_drafter", make)
    tg.test_speculative_sampling_is_exact(tmp_path, monkeypatch, kind, samp, prefix)


def test_sampled_chains_carry_q_and_trees_do_not(tiny):
    m = target(tiny)
    s = Sampling(1.0)
    chain, tree = model_drafter(tiny, "nanospec", CHAIN, sampling=s), model_drafter(tiny, "nanospec", TREE, sampling=s)
    tok, n = tg.prefilled(m, [chain, tree], PROMPTS[0])
    with torch.no_grad():
        c, t = chain.draft(tok, n), tree.draft(tok, n)
    assert c.q is not None and c.q.shape == (5, 256) and torch.allclose(c.q[:4].sum(-1), torch.ones(4))
    assert (c.q[torch.arange(4), c.tokens[1:]] > 0).all() and t.q is None


def test_sampled_chain_catches_a_biased_acceptance(tmp_path, monkeypatch):
    """The guard of the chi-square test above (test_generate's): always accepting the first child must fail it."""
    monkeypatch.setattr(tg.sampling_rules, "accept_sample", tg.accept_sample_biased)
    with pytest.raises(AssertionError):
        test_speculative_sampling_is_exact(tmp_path, monkeypatch, "model_tree", Sampling(1.0), None)


def test_hybrid_over_a_draft_model_is_lossless_and_starts_it_late(tiny, monkeypatch):
    """The hybrid takes a draft model through the same protocol as an EAGLE head: merged trees, budget sources
    ("model" without a chain), the draft model started late (its prefill when it first drafts, the steps since in
    one catch-up) drafting the trees an eagerly started one drafts; outputs are autoregressive decoding's."""
    monkeypatch.setattr(budget_module, "Budget", Cycle)
    monkeypatch.setattr(budget_module, "Policy", Turns)
    m = target(tiny)
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 40)
    trees = {}
    for late in (True, False):
        d = hybrid(tiny, m=m if late else None)
        got = trees.setdefault(late, [])
        draft = d.tree.draft
        d.tree.draft = lambda *a, f=draft, got=got, **k: (t := f(*a, **k), got.append(t.tokens.tolist()))[0]
        out, st = Engine(m, drafter=d, budget=True).generate(prompt, 40)
        assert out == ref and st.extra["head_started"]
        assert set(st.extra.get("accepted_from", {})) <= {"ngram", "model", "both"}
        assert d.budget_key([250, 9]) == "model"  # no chain: the draft model's source
        assert d.budget_sizes("model") == d.tree.budget_sizes() and d.budget_start("model") == d.tree.start
    assert trees[True] == trees[False] and len(trees[True]) > 2
    for spec in ("full", "freq"):
        assert Engine(m, drafter=hybrid(tiny, spec, m=m), budget=True).generate(prompt, 40)[0] == ref


def test_window_takes_the_targets_top_k_at_every_verified_node(tiny):
    """k_ver_at "verified" (a draft model's default): the target's top-k_ver at every verified node goes into
    NanoSpec's window, not only at the accepted positions ("accepted", the paper's)."""
    m = target(tiny)
    windows = {}
    for at in ("accepted", "verified"):
        d = model_drafter(tiny, "nanospec", TREE, w_max=256)
        d.k_ver_at = at
        tok, n = tg.prefilled(m, [d], PROMPTS[2][:3])
        with torch.no_grad():
            t = d.draft(tok, n)
            g = torch.Generator().manual_seed(0)
            logits = torch.randn(7, 256, generator=g)  # the first 7 nodes verified
            path = torch.tensor([0, 1, 0, 0])
            d.update(dr.Accepted(t, path, torch.tensor(2), torch.tensor(5), logits, None, None, n))
        windows[at] = set(torch.nonzero(d.vocab.count > 0).flatten().tolist())
        top = torch.topk(logits, 3).indices
        want = set(top[:2].flatten().tolist() if at == "accepted" else top.flatten().tolist())
        assert want <= windows[at]
    assert windows["accepted"] < windows["verified"]


def test_model_drafter_draft_traces(draft_env):
    """draft and update trace with torch.compile(fullgraph=True): static shapes, no host syncs (chains, sampled
    chains with q, trees)."""
    root, path, cfg = draft_env
    dm = load_model(path, dtype=torch.float32)
    for shape, samp in (((1, 3, 4), None), ((1, 3, 4), Sampling(1.0)), ((3, 3, 8), None)):
        d = ModelDrafter(dm, make_vocab("nanospec", dm.lm_head.weight, w_max=64), sampling=samp, tree=shape)
        d.setup(64)
        p = torch.arange(3, 12)
        d.prefill(dr.Prefill(p, torch.tensor([5]), torch.zeros(len(p), 256), torch.zeros(1, len(p), 64), None))
        d.vocab.reset(p, None)
        torch._dynamo.reset()
        c = lambda f: torch.compile(f, fullgraph=True, backend="eager")
        tree = c(d.draft)(torch.tensor([5]), torch.tensor(len(p)))
        assert tree.tokens.shape == (shape[2],) and (tree.q is None) == (samp is None) and d.traced
        a = dr.Accepted(tree, torch.arange(4).clamp(max=shape[2] - 1), torch.tensor(2), torch.tensor(7),
                        torch.randn(shape[2], 256), None, None, torch.tensor(len(p)))
        c(d.update)(a)  # (node 1, the best, is a level-1 frontier node: fed, so the cache holds it)
        assert int(d.c) == len(p) + 2


def test_cli_draft_models_default_to_trees_nanospec_and_prompt_lookup(tiny, capsys, monkeypatch):
    """--draft MODEL: the hybrid over the draft model's budgeted trees; --spec-k alone a chain, --tree-* a tree,
    --no-ngram the draft model alone. A named model with a named draft (download.default_draft) drafts with it,
    NanoSpec and prompt lookup, one prompt at a time (--prompts decodes without it)."""
    base = ["--checkpoint", str(tiny[0]), "--max-new-tokens", "12", "--raw", "--prompt", "abcabcabc", "--dtype",
            "float32", "--json"]
    outs = []
    for argv in ([], ["--spec-k", "3", "--no-ngram", "--budget", "fixed"],
                 ["--tree-topk", "2", "--tree-depth", "3", "--tree-nodes", "6", "--budget", "fixed", "--no-ngram"]):
        assert main(base + ["--draft", str(tiny[2])] + argv) == 0, capsys.readouterr().err
        outs.append(json.loads(capsys.readouterr().out))
    assert "chain_only_steps" in outs[0] and "budget_hist" in outs[0]
    assert max(map(int, outs[1]["accept_hist"])) <= 4 and "chain_only_steps" not in outs[1]
    assert all(o["text"] == outs[0]["text"] for o in outs)
    args = tg.g.parse_args(["--checkpoint", "qwen2.5-coder-1.5b"])
    assert dc.from_flags(args, tg.g.DEFAULT_HEAD).draft == "qwen2.5-coder-0.5b"
    monkeypatch.setattr(dc, "default_draft", lambda name: str(tiny[2]))
    c = dc.from_flags(tg.g.parse_args(["--checkpoint", "x"]), tg.g.DEFAULT_HEAD)
    assert (c.draft, c.vocab, c.ngram) == (str(tiny[2]), "nanospec", None)
    assert main(base + ["--k-ver", "3"]) == 0  # (MODEL_WINDOW's k_ver 16 appends more than 256 tokens a step)
    d = json.loads(capsys.readouterr().out)
    assert "chain_only_steps" in d and d["text"] == outs[0]["text"]
    assert dc.from_flags(tg.g.parse_args(["--checkpoint", "x", "--prompts", "f"]), tg.g.DEFAULT_HEAD).draft == "none"
    assert dc.from_flags(tg.g.parse_args(["--checkpoint", "x", "--draft", "none"]), tg.g.DEFAULT_HEAD).vocab == "full"


def test_draft_models_window_defaults(tiny, tmp_path):
    """A draft model's NanoSpec window through make_drafter: the target's top-k at every verified node, free slots
    filled with the lowest token ids (a BPE vocabulary's merge order) or the draft folder's freq.pt or --vocab-fill's
    file, none with the nofill ablation; an EAGLE head keeps the paper's appends at the accepted positions."""
    m = target(tiny)
    cfg = lambda **kw: dc.DraftConfig(str(tiny[2]), "nanospec", ngram=False, **kw)
    d = dc.make_drafter(cfg(w_max=64, k_ver=2), m)
    assert d.k_ver_at == "verified" and d.vocab.W == 64 and d.vocab.fill_tok[:64].tolist() == list(range(64))
    assert (d.vocab.k_pre, d.vocab.k_ver) == (dc.MODEL_WINDOW["k_pre"], 2)
    assert dc.make_drafter(cfg(k_ver=2), m).vocab.W == 256  # MODEL_WINDOW's, at most the vocabulary
    torch.save([9, 8, 7], tmp_path / "f.pt")
    assert dc.make_drafter(cfg(w_max=64, k_ver=2, fill=str(tmp_path / "f.pt")), m).vocab.fill_tok[:4].tolist() == \
        [9, 8, 7, -1]
    assert not dc.make_drafter(cfg(w_max=64, k_ver=2, ablation="nofill"), m).vocab.has_fill
    assert dc.make_drafter(cfg(w_max=64, k_ver=2, k_ver_at="accepted"), m).k_ver_at == "accepted"
    e = dc.make_drafter(dc.DraftConfig(str(tiny[1]["eagle3"]), "nanospec", 4, 3, 10, w_max=64), m)
    assert e.k_ver_at == "accepted" and not e.vocab.has_fill and (e.vocab.k_pre, e.vocab.k_ver) == (3, 3)
    assert dc.make_drafter(dc.DraftConfig(str(tiny[1]["eagle3"]), "nanospec", 4, 3, 10, w_max=64, fill="ids"),
                           m).vocab.has_fill
