"""draft.py: loaders (official layouts, bad input), EAGLE-2 tree invariants, and sync-free tracing of the
draft step, the verify forward, acceptance and KV compaction."""
import json

import pytest
import torch

import draft as dr
from conftest import write_eagle_head, write_tiny_hf
from generate import Engine, Sampling, accept_greedy, accept_sample, logits_to_probs
from model import ModelError, load_model
from vocab import make_vocab


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    path, _ = write_tiny_hf(root / "target")
    cfg = json.loads((path / "config.json").read_text())
    return root, path, cfg


def loaded(env, version=3, **kw):
    root, path, cfg = env
    m = load_model(path, dtype=torch.float32)
    name = f"h{version}_" + "_".join(f"{k}{v}" for k, v in sorted(kw.items()))
    head = dr.load_eagle(write_eagle_head(root / name, cfg, version=version, **kw), m, torch.float32, "cpu")
    if version == 3:
        m.aux_layers = head.c.aux_layers
    return m, head


@pytest.mark.parametrize("kw", [dict(version=2, fmt="bin", fc_bias=True), dict(version=2),
                                dict(version=3), dict(version=3, prefix="layers.0."),
                                dict(version=3, draft_vocab=100, fmt="bin")])
def test_loaders_official_layouts(env, kw):
    m, head = loaded(env, **kw)
    assert head.c.version == kw["version"]
    assert head.embed_tokens is m.embed_tokens  # the target's embedding, not the shipped copy
    if kw.get("draft_vocab"):
        t2r = dr.EagleDrafter.token_to_row_map(head)
        rows = torch.arange(100)
        assert torch.equal(t2r[rows + head.d2t], rows)  # d2t and the inverse map agree
        assert head.lm_weight().shape[0] == 100
    if kw["version"] == 2:
        assert head.lm_weight() is m.lm_head.weight and (head.fc.bias is not None) == kw.get("fc_bias", False)


def test_eagle3_rope_base_from_own_config(env):
    root, path, cfg = env
    m = load_model(path, dtype=torch.float32)
    h = dr.load_eagle(write_eagle_head(root / "r1", cfg, version=3), m, torch.float32, "cpu")
    assert h.c.args.rope_theta == 10000.0  # official heads omit rope_theta
    h = dr.load_eagle(write_eagle_head(root / "r2", cfg, version=3, extra_cfg=dict(rope_theta=5e5)), m, torch.float32, "cpu")
    assert h.c.args.rope_theta == 5e5


def test_loader_errors(env, tmp_path):
    root, path, cfg = env
    m = load_model(path, dtype=torch.float32)
    with pytest.raises(ModelError, match="hidden size"):
        dr.load_eagle(write_eagle_head(tmp_path / "a", dict(cfg, hidden_size=32, intermediate_size=64), version=2), m, torch.float32, "cpu")
    bad = write_eagle_head(tmp_path / "b", cfg, version=3)
    from safetensors.torch import load_file, save_file
    sd = load_file(f"{bad}/model.safetensors")
    sd["fc.weight"] = sd["fc.weight"][:, :128].contiguous()
    save_file(sd, f"{bad}/model.safetensors")
    with pytest.raises(ModelError, match="EAGLE-3 fc takes 128 inputs"):
        dr.load_eagle(bad, m, torch.float32, "cpu")
    with pytest.raises(ModelError, match="aux layers"):
        dr.load_eagle(write_eagle_head(tmp_path / "c", cfg, version=3, extra_cfg=dict(eagle_config=dict(eagle_aux_hidden_state_layer_ids=[1, 2, 9]))), m, torch.float32, "cpu")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="holds no weights"):
        dr.detect_draft_kind(tmp_path / "d")
    with pytest.raises(ModelError, match="not found"):
        dr.detect_draft_kind(tmp_path / "nope")
    assert dr.detect_draft_kind(path) == "model"
    assert dr.detect_draft_kind(write_eagle_head(tmp_path / "e", cfg, version=2)) == "eagle"


def test_cli_draft_mismatch_errors(env, tmp_path, capsys):
    from generate import main
    root, path, cfg = env
    other, _ = write_tiny_hf(tmp_path / "other", vocab_size=300)
    for argv in (["--draft", str(other)], ["--tree-nodes", "500", "--draft", str(write_eagle_head(tmp_path / "h", cfg, version=3))],
                 ["--vocab", "nanospec"], ["--draft", "ngram", "--ngram-min", "4", "--ngram-max", "2"],
                 ["--draft", str(tmp_path / "missing")]):
        assert main(["--checkpoint", str(path), "--raw", "--prompt", "x", "--max-new-tokens", "2", *argv]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Writing model shards" not in ln]
        assert len(err) == 1 and err[0].startswith("error:"), (argv, err)


def test_tree_invariants(env):
    m, head = loaded(env, version=3)
    for topk, depth, nodes in [(4, 4, 25), (3, 2, 13), (1, 3, 4)]:
        d = dr.EagleDrafter(head, make_vocab("full", head.lm_weight()), topk, depth, nodes)
        d.setup(128)
        m.setup_caches(1, 128)
        p = torch.arange(30, 50)
        _, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True)
        d.prefill(aux, torch.cat([p[1:], torch.tensor([3])]))
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


def test_ngram_history_tracks_the_sequence():
    d = dr.NgramDrafter(k=3, nmin=1, nmax=2)
    d.prefill([1, 2, 3, 1, 2])
    tree = d.draft(3, "cpu")  # sequence 1 2 3 1 2 [3]: suffix [2, 3] was followed by [1, 2, 3]
    assert tree.tokens.tolist() == [3, 1, 2, 3]
    d.update([1, 9])  # accepted 1, bonus 9 (the next root)
    assert d.hist == [1, 2, 3, 1, 2, 3, 1]
    assert d.draft(9, "cpu").tokens.tolist() == [9]  # nothing ever followed 9


def test_ngram_proposals():
    d = dr.NgramDrafter(k=3, nmin=1, nmax=3)
    assert d.propose([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2]  # longest suffix [2, 3] -> what followed it
    assert d.propose([5, 6, 7]) == []
    assert d.propose([1, 2, 1, 3, 1]) == [3, 1]  # most recent earlier occurrence of [1]


@pytest.mark.parametrize("version,spec", [(3, "full"), (3, "nanospec"), (2, "full"), (2, "nanospec")])
def test_draft_verify_accept_compact_trace_without_graph_breaks(env, version, spec):
    """The draft step, verify forward, acceptance, compaction and drafter/vocab updates trace with
    torch.compile(fullgraph=True): static shapes, no host syncs, no data-dependent Python control flow."""
    torch._dynamo.reset()  # each case traces afresh (no recompile-limit carry-over between cases)
    m, head = loaded(env, version=version)
    vocab = make_vocab(spec, head.lm_weight(), w_max=64, max_append=10 + 4 * 3)
    d = dr.EagleDrafter(head, vocab, 4, 3, 10)
    eng = Engine(m, drafter=d)
    m.setup_caches(1, 128)
    d.setup(128)
    p = torch.arange(3, 20)
    n = torch.tensor(len(p))
    _, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True)
    feats = aux if version == 3 else h
    d.prefill(feats, torch.cat([p[1:], torch.tensor([3])]))
    vocab.reset(p, torch.topk(torch.randn(len(p), 256), 3).indices)
    c = lambda f: torch.compile(f, fullgraph=True, backend="eager")
    tree = c(d.draft)(torch.tensor([3]), n)
    logits, hid, aux = c(eng._verify)(tree.tokens, tree.depth, tree.anc, n)
    path, L, bonus = c(accept_greedy)(tree, logits[0])
    c(accept_sample)(tree, logits_to_probs(logits[0], Sampling(1.0)))
    c(m.compact_kv)(n + path, n)
    feats = (aux if version == 3 else hid).index_select(1, path)
    c(d.update)(feats, torch.cat([tree.tokens[path[1:]], bonus.view(1)]), L, n)
    ver = torch.topk(logits[0].index_select(0, path), 3, dim=-1).indices
    c(vocab.update)(tree.tokens, tree.valid, ver, torch.arange(4) < L)


def test_model_drafter_draft_traces(env):
    torch._dynamo.reset()
    root, path, cfg = env
    dm = load_model(path, dtype=torch.float32)
    for samp in (None, Sampling(1.0)):
        d = dr.ModelDrafter(dm, make_vocab("nanospec", dm.lm_head.weight, w_max=64), k=3, sampling=samp)
        d.setup(64)
        p = torch.arange(3, 12)
        d.prefill(p)
        d.vocab.reset(p, None)
        torch._dynamo.reset()
        tree = torch.compile(d.draft, fullgraph=True, backend="eager")(torch.tensor([5]), torch.tensor(len(p)))
        assert tree.tokens.shape == (4,) and (tree.q is None) == (samp is None)
