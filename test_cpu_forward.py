"""The fused CPU pass: the PyTorch layers' numbers to bf16 rounding, the same KV, every row's bits independent
of its pass (tree nodes = autoregressive decoding), aux states, one-tensor KV compaction, compile, the switch."""
import pytest
import torch

import cpu_forward
import cpu_gemm
import exact
import model as M
from conftest import write_tiny_hf

pytestmark = pytest.mark.skipif(cpu_forward.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Real head size (64) and 3 query heads per KV head, as SmolLM2; 3 layers; Qwen2 for the q/k/v bias."""
    path, _ = write_tiny_hf(tmp_path_factory.mktemp("fused"), arch="qwen2", hidden_size=192, intermediate_size=256,
                            num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, vocab_size=300,
                            max_position_embeddings=512)
    return path


def load(path, fused: bool, monkeypatch):
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    monkeypatch.setenv(cpu_forward.ENV, "on" if fused else "off")
    m = M.load_model(path, dtype=torch.bfloat16)
    assert (m.cpu_pass is not None) == fused
    m.aux_layers = (2, 0, 2)  # repeats and any order, as EAGLE-3 heads of shallow targets have
    m.setup_caches(1, 256)
    return m


def toks(n, seed=0):
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_matches_the_pytorch_layers(target, monkeypatch):
    """Prefill then decode: logits, final hidden states and aux states agree with the PyTorch layers to bf16
    rounding; the first layer's K and V (same GEMM, same RoPE rounding, nothing summed in another order
    before them) are bit for bit the same, as is every aux copy of the embeddings' layer 0 input."""
    ms = {f: load(target, f, monkeypatch) for f in (True, False)}
    p = toks(40)
    out = {f: m(p, torch.arange(40), return_hidden=True) for f, m in ms.items()}
    nxt = {f: m(toks(1, 1), torch.tensor([40]), return_hidden=True) for f, m in ms.items()}
    for res in (out, nxt):
        (lf, hf, af), (lt, ht, at) = res[True], res[False]
        assert lf.shape == lt.shape and hf.shape == ht.shape and af.shape == at.shape == (1, lf.shape[1], 3 * 192)
        for a, b in ((lf, lt), (hf, ht), (af, at)):
            rel = (a.float() - b.float()).norm() / b.float().norm()
            assert rel < 0.02, rel
        assert torch.equal(af[..., 192:384], at[..., 192:384])  # layer 0's input: the embeddings themselves
    kf, kt = ms[True].layers[0].self_attn.kv_cache, ms[False].layers[0].self_attn.kv_cache
    assert kf.k.dtype == torch.bfloat16 and ms[True].kv.shape == (3, 2, 1, 256, 64)
    assert torch.equal(kf.k[:, :, :41].float(), kt.k[:, :, :41].float())
    assert torch.equal(kf.v[:, :, :41].float(), kt.v[:, :, :41].float())
    assert (lf[0, -1].argmax() == lt[0, -1].argmax())


def tree(parents):
    N = len(parents)
    anc, depth = torch.zeros(N, N, dtype=torch.bool), torch.zeros(N, dtype=torch.long)
    for i in range(N):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
        depth[i] = anc[i].sum() - 1
    return anc, depth


@torch.no_grad()
def test_tree_rows_are_autoregressive_bits(target, monkeypatch):
    """One pass over a 9-node tree (branches at scattered KV slots, 9 rows: register tiles of 4 and the
    remainder) gives every node the logits and aux bits that decoding its path one token at a time gives,
    and so does a 5-row chain; the tree's pass needs no padding (exact.Invariance trusts the construction)."""
    m = load(target, True, monkeypatch)
    parents = [-1, 0, 0, 1, 2, 2, 4, 3, 0]
    anc, depth = tree(parents)
    tk, T, n = toks(9, 2)[0], 37, torch.tensor(37)
    p = toks(T)
    m(p, torch.arange(T))
    lt, _, at = m(tk[None], n + depth, mask=M.tree_mask(m.seq_range, anc, n), cache_pos=n + torch.arange(9),
                  return_hidden=True)
    for i in range(9):
        path = torch.nonzero(anc[i])[:, 0].tolist()  # ancestors in index order = depth order (parents first)
        m(p, torch.arange(T))
        for t, j in enumerate(path):
            lo, _, ao = m(tk[j].view(1, 1), torch.tensor([T + t]), return_hidden=True)
        assert torch.equal(lo[0, 0], lt[0, i]) and torch.equal(ao[0, 0], at[0, i]), i
    m(p, torch.arange(T))
    chain = m(tk[None, :5], T + torch.arange(5))
    m(p, torch.arange(T))
    steps = torch.cat([m(tk[None, j:j + 1], torch.tensor([T + j])) for j in range(5)], 1)
    assert torch.equal(chain, steps)
    assert exact.Invariance(m).pass_rows(9, 256) == exact.PassRows(9, 9)


@torch.no_grad()
def test_compact_kv_moves_every_layer(target, monkeypatch):
    """compact_kv on the one-tensor cache moves every layer's K and V rows (overlapping ranges included), and
    the layers' own cache views see the move."""
    m = load(target, True, monkeypatch)
    m(toks(30), torch.arange(30))
    before = m.kv.clone()
    src = torch.tensor([22, 25, 29, 3, 11])
    m.compact_kv(src, torch.tensor(10))
    want = before.clone()
    want[:, :, :, 10:15] = before[:, :, :, src]
    assert torch.equal(m.kv, want)
    for i, layer in enumerate(m.layers):
        c = layer.self_attn.kv_cache
        assert torch.equal(c.k[0], m.kv[i, 0]) and torch.equal(c.v[0], m.kv[i, 1])


@torch.no_grad()
def test_compiles_as_one_op(target, monkeypatch):
    """torch.compile traces the pass (the custom op nanospec::cpu_stack, which writes the cache) with
    fullgraph=True, and the compiled pass gives eager's bits and the same cache."""
    m = load(target, True, monkeypatch)
    p = toks(20)
    m(p, torch.arange(20))
    eager = m(toks(1, 3), torch.tensor([20]))
    kv = m.kv.clone()
    m(p, torch.arange(20))
    m.kv[:, :, :, 20:] = 0
    step = torch.compile(lambda t, pos: m(t, pos), fullgraph=True, backend="eager")
    assert torch.equal(step(toks(1, 3), torch.tensor([20])), eager)
    assert torch.equal(m.kv[:, :, :, :21], kv[:, :, :, :21])


def test_off_switch_and_domain(target, monkeypatch):
    """NANOSPEC_CPU_FORWARD=off keeps the PyTorch layers; fp32 models and a bad value are refused."""
    load(target, False, monkeypatch)
    monkeypatch.setenv(cpu_forward.ENV, "on")
    assert M.load_model(target, dtype=torch.float32).cpu_pass is None
    monkeypatch.setenv(cpu_forward.ENV, "maybe")
    with pytest.raises(ValueError, match="on or off"):
        M.load_model(target, dtype=torch.bfloat16)
