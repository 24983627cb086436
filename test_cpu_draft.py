"""The EAGLE-2 search in one C call: the same tree as the PyTorch loop (tokens, parents, depths, ancestor mask)
for every tree shape and draft vocabulary, a pruned head vocabulary included; lossless generation through
it; the switch and where it applies."""
import json

import pytest
import torch

import cpu_draft
import cpu_forward
import cpu_gemm
import draft as dr
import draft_config as dc
import draft_eagle as de
import model as M
from conftest import write_eagle_head, write_tiny_hf
from eagle import load_eagle
from engine import Engine
from vocab import FreqVocab, make_vocab

pytestmark = pytest.mark.skipif(cpu_draft.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A bf16 target on the fused pass (head size 64, 3 query heads per KV head, as SmolLM2) and two EAGLE-3
    heads: the full vocabulary and a pruned one (d2t)."""
    root = tmp_path_factory.mktemp("cpu_draft")
    path, _ = write_tiny_hf(root / "target", hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=3, num_key_value_heads=1, vocab_size=300, max_position_embeddings=512)
    cfg = json.loads((path / "config.json").read_text())
    heads = {v: write_eagle_head(root / f"head{v}", cfg, version=3, seed=v or 0, draft_vocab=v) for v in (None, 120)}
    return path, heads


def load(env, monkeypatch, pruned=False):
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    monkeypatch.setenv(cpu_forward.ENV, "on")
    path, heads = env
    m = M.load_model(path, dtype=torch.bfloat16)
    head = load_eagle(heads[120 if pruned else None], m, torch.bfloat16, "cpu")
    assert m.cpu_pass is not None and head.cpu_pass is not None
    return m, head


def stable_topk(x, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties to the lower index, the C search's order (torch.topk leaves ties unordered)."""
    v, i = torch.sort(x, dim=dim, descending=True, stable=True)
    return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))


def vocab_of(kind, head):
    if kind == "nanospec":
        return make_vocab("nanospec", head.lm_weight(), w_max=96, max_append=dc.append_width(25, 4, 3))
    if kind == "freq":
        return FreqVocab(head.lm_weight(), torch.arange(3, 83))
    return make_vocab("full", head.lm_weight())


@torch.no_grad()
@pytest.mark.parametrize("kind,pruned", [("nanospec", False), ("full", False), ("freq", False), ("nanospec", True)])
def test_same_tree_as_the_pytorch_loop(env, monkeypatch, kind, pruned):
    """After a prefill and after an accepted step, every shape's tree from C equals the PyTorch loop's (run
    with ties to the lower index), node for node; the LM head's time is counted either way."""
    m, head = load(env, monkeypatch, pruned)
    p = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1))
    for topk, depth, nodes in [(4, 4, 25), (3, 2, 7), (1, 3, 4), (4, 1, 4), (5, 3, 12)]:
        vocab = vocab_of(kind, head)
        d = de.EagleDrafter(head, vocab, topk, depth, nodes)
        d.setup(128)
        monkeypatch.setenv(cpu_draft.ENV, "on")
        assert cpu_draft.usable(d)
        m.setup_caches(1, 128)
        logits, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True, plan=M.Plan(d.aux_layers))
        d.prefill(dr.Prefill(p, torch.tensor([7]), logits[0], h, aux))
        trees = {}
        for c in ("on", "off"):
            monkeypatch.setenv(cpu_draft.ENV, c)
            with monkeypatch.context() as mp:
                if c == "off":
                    mp.setattr(torch, "topk", stable_topk)
                t0 = d.lm_head_s
                trees[c] = d.draft(torch.tensor([7]), torch.tensor(len(p)))
                assert d.lm_head_s > t0
        a, b = trees["on"], trees["off"]
        for f in ("tokens", "parents", "depth", "anc", "valid"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (kind, topk, depth, nodes, f)
        assert a.max_depth == b.max_depth == depth
        if pruned:  # tokens are target ids (d2t applied), all inside the head's vocabulary
            assert bool(head.t2d[a.tokens[1:]].all())


@torch.no_grad()
def test_lossless_through_the_c_search(env, monkeypatch):
    """Generation drafting through the C search reproduces autoregressive greedy output token for token (the
    whole tree and the fitted budget), with its trees in use."""
    m, head = load(env, monkeypatch)
    calls = []
    real = cpu_draft.tree
    monkeypatch.setattr(cpu_draft, "tree", lambda *a: calls.append(1) or real(*a))
    for budget in (True, False):
        vocab = make_vocab("nanospec", head.lm_weight(), w_max=64, max_append=dc.append_width(10, 3, 3))
        eng = Engine(m, drafter=de.EagleDrafter(head, vocab, 4, 3, 10), budget=budget)
        for p in ([5, 17, 99, 3, 42, 42, 8], list(range(30, 60))):
            assert eng.generate(p, 40)[0] == Engine(m).generate(p, 40)[0], (budget, p)
    assert calls


def test_switch_and_domain(env, monkeypatch):
    m, head = load(env, monkeypatch)
    d = de.EagleDrafter(head, vocab_of("nanospec", head), 4, 3, 10)
    assert not cpu_draft.usable(d)  # no cache yet
    d.setup(64)
    assert cpu_draft.usable(d)
    monkeypatch.setenv(cpu_draft.ENV, "off")
    assert not cpu_draft.usable(d)
    monkeypatch.setenv(cpu_draft.ENV, "maybe")
    with pytest.raises(ValueError, match="on or off"):
        cpu_draft.usable(d)
    monkeypatch.setenv(cpu_draft.ENV, "on")
    d = de.EagleDrafter(head, make_vocab("nanospec", head.lm_weight(), w_max=64, ablation="noasync",
                                         max_append=dc.append_width(10, 3, 3)), 4, 3, 10)
    d.setup(64)
    assert not cpu_draft.usable(d)  # no packed rows: the PyTorch loop


@pytest.mark.parametrize("R,n,k", [(16, 4099, 3), (5, 1000, 10), (3, 7, 7), (8, 300, 64), (4, 40, 1)])
def test_topk_rows_is_torch_topk(R, n, k):
    """The C top-k of chosen bf16 rows has torch.topk's values and, ties to the lower index, a stable sort's
    indices (coarse values make ties common); other inputs take torch.topk; bad rows raise."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(R, n, generator=g) * 4).round().bfloat16()  # integers: many ties
    x[0, n // 2] = float("-inf")
    rows = torch.randint(0, R, (6,), generator=g)
    got = cpu_draft.topk_rows(x, rows, k)
    sel = x.index_select(0, rows).float()
    assert torch.equal(sel.gather(1, got), torch.topk(sel, k, dim=-1).values)
    assert torch.equal(got, torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k])
    xf = x.float()
    assert torch.equal(xf.index_select(0, rows).gather(1, cpu_draft.topk_rows(xf, rows, k)),
                       torch.topk(sel, k, dim=-1).values)  # fp32: torch's
    assert torch.equal(cpu_draft.topk_rows(x, None, k), cpu_draft.topk_rows(x, torch.arange(R), k))  # every row
    with pytest.raises(IndexError):
        cpu_draft.topk_rows(x, torch.tensor([R]), k)


STATE = ("ring", "head", "count_", "slot_of_", "token_of_", "ids", "bias", "rows", "packed")


@pytest.mark.parametrize("fill", [False, True])
def test_window_append_in_c_is_the_pytorch_append(monkeypatch, fill):
    """NanoSpec's append in C leaves the same state as the PyTorch version (ring but its sink, counts, slots,
    ids, bias, both row copies) after every one of a long run of appends: repeats, invalid and out-of-range
    ids, the window wrapping, tokens leaving and coming back, fill rows returning to freed slots."""
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    cpu_gemm.switch(True)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(90, 32, generator=g).bfloat16()
    fill_ids = torch.randperm(90, generator=g)[:20] if fill else None
    vs = {}
    for c in ("on", "off"):
        monkeypatch.setenv(cpu_draft.ENV, c)
        vs[c] = make_vocab("nanospec", weight, w_max=24, k_pre=2, k_ver=2, max_append=14, fill=fill_ids)
        assert vs[c].c_rows
        vs[c].reset(torch.tensor([5, 6, 7, 5]), torch.tensor([[1, 2], [3, 1], [8, 9], [1, 1]]))
    used = []
    real = cpu_draft.append_kernel
    monkeypatch.setattr(cpu_draft, "append_kernel", lambda: used.append(1) or real())
    for step in range(60):
        hi = 30 if step < 30 else 95  # first a small vocabulary (many repeats), then out-of-range ids too
        d = torch.randint(-2, hi, (6,), generator=g)
        ver = torch.randint(0, hi, (3, 2), generator=g)
        dv, vv = torch.rand(6, generator=g) > 0.2, torch.rand(3, generator=g) > 0.3
        for c in ("on", "off"):
            monkeypatch.setenv(cpu_draft.ENV, c)
            vs[c].update(d, dv, ver, vv)
        for f in STATE:
            a, b = getattr(vs["on"], f), getattr(vs["off"], f)
            if f == "ring":
                a, b = a[:-1], b[:-1]  # the sink holds whatever was written last
            assert torch.equal(a, b), (step, f)
    assert used and int((vs["on"].token_of >= 0).sum()) > 5


@torch.no_grad()
def test_head_update_in_c_is_the_pytorch_pass(env, monkeypatch):
    """EagleDrafter.update's head pass in C (fc over the path's aux states, the layer, the KV write) leaves the
    same last output and head KV bits as the PyTorch pass, and the same LM-head input to bf16 rounding, for
    steps of every accepted length seen in a generation (chained catch-up steps included)."""
    m, head = load(env, monkeypatch)
    vocab = make_vocab("nanospec", head.lm_weight(), w_max=64, max_append=dc.append_width(10, 3, 3))
    d = de.EagleDrafter(head, vocab, 4, 3, 10)
    steps, real = [], d.update
    monkeypatch.setattr(d, "update", lambda a: steps.append(a) or real(a))
    Engine(m, drafter=d).generate(list(range(30, 60)), 40)
    used, c_update = [], cpu_draft.update
    monkeypatch.setattr(cpu_draft, "update", lambda *x: used.append(1) or c_update(*x))
    lengths = set()
    # in order (a step rewrites only slots past its n), then a chain of the last four (L = 4, the catch-up form)
    for a in steps + [dr.chained(steps[-4:], top=d.reads_top)]:  # (steps keep top-k rows, not logits)
        n, R = int(a.n), a.path.shape[0]
        out = {}
        for c in ("off", "on"):
            monkeypatch.setenv(cpu_draft.ENV, c)
            real(a)
            out[c] = (d.last_out.clone(), d.last_lm_in.clone(), head.kv[..., n:n + R, :].clone())
        assert torch.equal(out["on"][0], out["off"][0]) and torch.equal(out["on"][2], out["off"][2])
        lm_on, lm_off = out["on"][1].float(), out["off"][1].float()
        assert ((lm_on - lm_off).abs() <= lm_off.abs() * 2 ** -7).all()
        lengths.add(int(a.L))
    assert used and len(lengths) > 1


@torch.no_grad()
@pytest.mark.parametrize("pruned,fill", [(False, False), (False, True), (True, False)])
def test_window_metrics_in_c_are_the_pytorch_metrics(env, monkeypatch, pruned, fill):
    """observe's coverage and active-size metrics in C (cpu_draft.metrics) add up to the PyTorch version's over a
    whole generation: hits, emitted, active sum and max, steps; with fill rows and with a pruned head."""
    m, head = load(env, monkeypatch, pruned)
    # fill rows: the tokens the target emits, so some of its tokens score through a fill row (free slot)
    fill_ids = torch.tensor(sorted(set(Engine(m).generate(list(range(30, 60)), 40)[0]))) if fill else None
    got, used, real = {}, [], cpu_draft.metrics
    for c in ("on", "off"):
        monkeypatch.setattr(cpu_draft, "metrics", (lambda *x: used.append(1) or real(*x)) if c == "on"
                            else (lambda *x: False))
        # a small window of the target's top-1 misses some emitted tokens, which fill rows may then score
        vocab = make_vocab("nanospec", head.lm_weight(), w_max=24, k_pre=1, k_ver=1,
                           max_append=dc.append_width(10, 3, 1), fill=fill_ids)
        d = de.EagleDrafter(head, vocab, 4, 3, 10)
        out, _ = Engine(m, drafter=d).generate(list(range(30, 60)), 40)
        got[c] = (out, d.metrics.tolist())
    assert used and got["on"] == got["off"]
    hits, emitted, act_sum, act_max, steps = got["on"][1]
    assert steps > 3 and 0 < hits <= emitted and act_max > 0 and act_sum >= act_max
