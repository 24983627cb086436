"""The fused CPU pass: the PyTorch layers' numbers to bf16 rounding, the same KV, every row's bits independent
of its pass (tree nodes = autoregressive decoding), aux states, one-tensor KV compaction, compile, the switch;
an EAGLE-3 head's layer in the same C pass, and lossless drafting through it."""
import json
import time

import pytest
import torch

import cpu_forward
import cpu_gemm
import draft_config as dc
import draft_eagle as de
import exact
import model as M
import qlinear
from conftest import advised_huge, write_eagle_head, write_tiny_hf
from eagle import load_eagle
from engine import Engine
from vocab import make_vocab

pytestmark = pytest.mark.skipif(cpu_forward.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """Real head size (64) and 3 query heads per KV head, as SmolLM2; 3 layers; Qwen2 for the q/k/v bias."""
    path, _ = write_tiny_hf(tmp_path_factory.mktemp("fused"), arch="qwen2", hidden_size=192, intermediate_size=256,
                            num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, vocab_size=300,
                            max_position_embeddings=512)
    return path


AUX = M.Plan((2, 0, 2))  # aux layers: repeats and any order, as EAGLE-3 heads of shallow targets have


def load(path, fused: bool, monkeypatch):
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    monkeypatch.setenv(cpu_forward.ENV, "on" if fused else "off")
    m = M.load_model(path, dtype=torch.bfloat16)
    assert (m.cpu_pass is not None) == fused
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
    out = {f: m(p, torch.arange(40), return_hidden=True, plan=AUX) for f, m in ms.items()}
    nxt = {f: m(toks(1, 1), torch.tensor([40]), return_hidden=True, plan=AUX) for f, m in ms.items()}
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
                  return_hidden=True, plan=AUX)
    for i in range(9):
        path = torch.nonzero(anc[i])[:, 0].tolist()  # ancestors in index order = depth order (parents first)
        m(p, torch.arange(T))
        for t, j in enumerate(path):
            lo, _, ao = m(tk[j].view(1, 1), torch.tensor([T + t]), return_hidden=True, plan=AUX)
        assert torch.equal(lo[0, 0], lt[0, i]) and torch.equal(ao[0, 0], at[0, i]), i
    m(p, torch.arange(T))
    chain = m(tk[None, :5], T + torch.arange(5))
    m(p, torch.arange(T))
    steps = torch.cat([m(tk[None, j:j + 1], torch.tensor([T + j])) for j in range(5)], 1)
    assert torch.equal(chain, steps)
    assert exact.Invariance(m).pass_rows(9, 256) == exact.PassRows(9, 9)


@torch.no_grad()
def test_batch_rows_in_windows_are_their_own_bits(target, monkeypatch):
    """A batch's pass (batch.py): 6 sequences in ranges of 40 slots (not multiples of the attention's 16-slot
    blocks), their rows in a shuffled order of ranges, masks as windows over each range (mask_base). Each row's
    logits equal its sequence's batch-1 pass bit for bit, and the windowed masks equal the dense [T, S] ones."""
    m = load(target, True, monkeypatch)
    R, lens, order = 40, [7, 33, 1, 20, 39, 12], [3, 0, 5, 1, 4, 2]
    m.setup_caches(1, R, slots=6 * R)
    for b, n in enumerate(lens):  # each sequence's prompt into its range, less its last token
        if n > 1:
            pos = torch.arange(n - 1)
            m(toks(n, b)[:, :-1], pos, mask=m.seq_range[None, :R] <= pos[:, None],
              mask_base=torch.full((n - 1,), b * R), cache_pos=b * R + pos)
    last = torch.cat([toks(lens[b], b)[:, -1] for b in order])[None]
    pos = torch.tensor([lens[b] - 1 for b in order])
    base = torch.tensor([b * R for b in order])
    win = m(last, pos, mask=m.seq_range[None, :R] <= pos[:, None], mask_base=base, cache_pos=base + pos)
    j = m.seq_range[None, :] - base[:, None]
    dense = m(last, pos, mask=(j >= 0) & (j <= pos[:, None]), cache_pos=base + pos)
    assert torch.equal(win, dense)
    m.setup_caches(1, 64)
    for i, b in enumerate(order):
        assert torch.equal(m(toks(lens[b], b), torch.arange(lens[b]))[0, -1], win[0, i]), b


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
    if cpu_gemm.ISA in ("avx512bf16", "avx512"):  # the keys' transposed copy moves with them
        assert m.kt.numel() and torch.equal(m.kt, cpu_forward.transposed_keys(m.kv))
    else:
        assert m.kt.numel() == 0
    step = torch.compile(m.compact_kv, fullgraph=True, backend="eager")  # the verify step traces it
    step(torch.tensor([12, 13, 14, 0, 1]), torch.tensor(20))
    want[:, :, :, 20:25] = want[:, :, :, [12, 13, 14, 0, 1]]
    assert torch.equal(m.kv, want)
    if m.kt.numel():
        assert torch.equal(m.kt, cpu_forward.transposed_keys(m.kv))


@torch.no_grad()
def test_transposed_keys_follow_the_cache(target, monkeypatch):
    """The AVX-512 passes score from a transposed copy of the keys (cpu_forward.transposed_keys): every fused
    pass writes it with the keys, a pass through the PyTorch layers (a [1, 1, T, S] mask) rebuilds it, and
    its scores give the logits of the pass that reads K (to bf16 rounding) with rows still independent of
    their pass (the tree test above)."""
    m = load(target, True, monkeypatch)
    if cpu_gemm.ISA not in ("avx512bf16", "avx512"):
        pytest.skip("the transposed keys are read by the AVX-512 builds only")
    assert torch.equal(m.kt, cpu_forward.transposed_keys(m.kv))  # a new cache's, made without copies
    m(toks(40), torch.arange(40))
    assert torch.equal(m.kt, cpu_forward.transposed_keys(m.kv))
    mask = (m.seq_range[None, :] <= torch.arange(40, 45)[:, None])[None, None]
    m(toks(5, 2), torch.arange(40, 45), mask=mask)  # the PyTorch layers write slots 40..44
    assert torch.equal(m.kt, cpu_forward.transposed_keys(m.kv))
    q = toks(3, 4)
    with_kt = m(q, torch.arange(45, 48))
    kt, m.kt = m.kt, m.kt[:0]
    without = m(q, torch.arange(45, 48))
    m.kt = kt
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert rel(with_kt, without) < 0.02  # another order of sums: the same numbers to bf16 rounding
    saved = kt.clone()
    kt[:, :, :2] = 0  # the scores read the copy: slots 0..31 with zero keys there change the logits
    assert not torch.equal(m(q, torch.arange(45, 48)), with_kt)
    kt.copy_(saved)
    assert torch.equal(m(q, torch.arange(45, 48)), with_kt)


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


@torch.no_grad()
def test_phase_timing_build_is_the_same_pass(target, monkeypatch):
    """bench_ar.py --profile's build of the pass (cpu_forward.timed) gives the plain build's bits, and its phases
    are times of that pass: none negative, GEMMs and attention among them, together within the pass's time."""
    m = load(target, True, monkeypatch)
    p = toks(30)
    plain = m(p, torch.arange(30))
    cpu_forward.phase_times()
    cpu_forward.timed(True)
    try:
        t0 = time.perf_counter()
        got = m(p, torch.arange(30))
        whole = (time.perf_counter() - t0) * 1e3
        ph = cpu_forward.phase_times()
    finally:
        cpu_forward.timed(False)
    assert torch.equal(got, plain)
    assert list(ph) == list(cpu_forward.PHASES) and all(v >= 0 for v in ph.values())
    assert ph["GEMMs"] > 0 and ph["attention"] > 0 and sum(ph.values()) <= whole
    assert cpu_forward.phase_times()["GEMMs"] == 0  # read and reset


def test_off_switch_and_domain(target, monkeypatch):
    """NANOSPEC_CPU_FORWARD=off keeps the PyTorch layers; fp32 models and a bad value are refused."""
    load(target, False, monkeypatch)
    monkeypatch.setenv(cpu_forward.ENV, "on")
    assert M.load_model(target, dtype=torch.float32).cpu_pass is None
    monkeypatch.setenv(cpu_forward.ENV, "maybe")
    with pytest.raises(ValueError, match="on or off"):
        M.load_model(target, dtype=torch.bfloat16)


def head_for(target, m, tmp_path, fused, monkeypatch):
    cfg = json.loads((target / "config.json").read_text())
    monkeypatch.setenv(cpu_forward.ENV, "on" if fused else "off")
    path = tmp_path / "head" if (tmp_path / "head").is_dir() else write_eagle_head(tmp_path / "head", cfg, version=3)
    head = load_eagle(path, m, torch.bfloat16, "cpu")
    assert (head.cpu_pass is not None) == fused
    return head


@torch.no_grad()
def test_eagle3_head_layer_matches_its_pytorch_layer(target, tmp_path, monkeypatch):
    """An EAGLE-3 head's layer in the C pass (q/k/v from [norm(embedding); norm(hidden)], the hidden as the
    residual) agrees with its PyTorch layer to bf16 rounding over a prompt and over a drafting level (4 rows
    at scattered draft slots under a tree mask), and writes the same K and V bits (nothing is summed in
    another order before them)."""
    g = torch.Generator().manual_seed(5)
    feats, feats2 = torch.randn(1, 30, 192, generator=g).bfloat16(), torch.randn(1, 4, 192, generator=g).bfloat16()
    res = {}
    for fused in (True, False):
        m = load(target, True, monkeypatch)
        head = head_for(target, m, tmp_path, fused, monkeypatch)
        head.setup_caches(96)
        pos = torch.arange(30)
        o1 = head(toks(30), feats, pos, pos, head.seq_range[None, :] <= pos[:, None])
        slots = torch.tensor([33, 30, 37, 31])
        mask = (head.seq_range[None, :] < 30) | (head.seq_range[None, :] == slots[:, None])
        o2 = head(toks(4, 1), feats2, torch.full((4,), 30), slots, mask)
        c = head.layer.self_attn.kv_cache
        res[fused] = (*o1, *o2, c.k.clone(), c.v.clone())
    for i, (a, b) in enumerate(zip(res[True], res[False])):
        assert a.shape == b.shape, i
        if i < 4:
            assert a.dtype == b.dtype == torch.bfloat16, i
            rel = (a.float() - b.float()).norm() / b.float().norm()
            assert rel < 0.02, (i, rel)
        else:  # K, V (bf16 values in both; the PyTorch layer's CPU cache is fp32), zeros where never written
            assert torch.equal(a.float(), b.float()), i
    assert res[True][4][:, :, :38].abs().sum() > 0


@torch.no_grad()
def test_eagle3_drafting_in_c_is_lossless(target, tmp_path, monkeypatch):
    """The whole CPU drafting path in C (the target's pass, the head's layer, NanoSpec's packed LM head)
    reproduces autoregressive greedy output token for token, with the fitted budget and with the whole tree."""
    m = load(target, True, monkeypatch)
    head = head_for(target, m, tmp_path, True, monkeypatch)
    for budget in (True, False):
        vocab = make_vocab("nanospec", head.lm_weight(), w_max=64, max_append=dc.append_width(10, 3, 3))
        assert vocab.packed is not None
        eng = Engine(m, drafter=de.EagleDrafter(head, vocab, 4, 3, 10), budget=budget)
        for p in ([5, 17, 99, 3, 42, 42, 8], list(range(30, 60))):
            assert eng.generate(p, 40)[0] == Engine(m).generate(p, 40)[0], (budget, p)


@torch.no_grad()
def test_auto_mode_times_the_whole_pass_once(target, monkeypatch, tmp_path):
    """NANOSPEC_CPU_GEMM=auto: load_model times the fused pass against the PyTorch layers on the model's own
    weights once per machine (a second load reads the cached answer) and applies the answer: the fused pass,
    or the layers with the GEMM cpu_gemm's check chose, every linear packed exactly when the kernel is on."""
    monkeypatch.setenv(cpu_gemm.ENV, "auto")
    monkeypatch.setenv(cpu_forward.ENV, "on")
    calls, real = [], cpu_forward.fused_wins

    def spy(*a, **k):
        calls.append(real(*a, **k))
        return calls[-1]

    monkeypatch.setattr(cpu_forward, "fused_wins", spy)
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "real"))
    ms = [M.load_model(target, dtype=torch.bfloat16) for _ in range(2)]
    assert len(calls) == 1 and all((m.cpu_pass is not None) == calls[0] for m in ms)
    p = toks(12)
    outs = []
    for m in ms:
        m.setup_caches(1, 64)
        outs.append(m(p, torch.arange(12)))
    assert torch.equal(outs[0], outs[1]) and torch.isfinite(outs[0].float()).all()
    for wins in (True, False):
        monkeypatch.setattr(cpu_forward, "fused_wins", lambda *a, **k: wins)
        monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / str(wins)))
        m = M.load_model(target, dtype=torch.bfloat16)
        assert (m.cpu_pass is not None) == wins and cpu_gemm.enabled() >= wins
        lins = [l for l in m.modules() if isinstance(l, M.Linear)]
        fused_away = {id(l) for b in m.layers for l in (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj,
                                                          b.mlp.gate_proj, b.mlp.up_proj)}
        for l in lins:
            assert (l.packed is not None) == (cpu_gemm.enabled() and not (wins and id(l) in fused_away))
        m.setup_caches(1, 64)
        torch.testing.assert_close(m(p, torch.arange(12)).float(), outs[0].float(), rtol=0.05, atol=0.05)


@torch.no_grad()
def test_training_target_pass_runs_a_batch_a_sequence_at_a_time(target, monkeypatch):
    """eagle_ttt.target_pass with the fused pass: each row of a batch exactly as that sequence alone, and the
    batch as the PyTorch layers' batched pass to bf16 rounding."""
    from eagle_ttt import target_pass
    tokens = torch.cat([toks(24, s) for s in range(3)])
    sup = torch.zeros(3, 24, dtype=torch.bool)
    sup[:, 5:] = True
    sup[1, 20:] = False
    cols = torch.arange(0, 300, 3)
    ms = {f: load(target, f, monkeypatch) for f in (True, False)}
    aux, logits = target_pass(ms[True], AUX.aux_layers, tokens, sup, 16, cols)
    n = sup.sum(1).tolist()
    for b in range(3):
        a1, l1 = target_pass(ms[True], AUX.aux_layers, tokens[b:b + 1], sup[b:b + 1], 16, cols)
        assert torch.equal(aux[b:b + 1], a1)
        assert torch.equal(logits[sum(n[:b]):sum(n[:b + 1])], l1)
    aux_t, logits_t = target_pass(ms[False], AUX.aux_layers, tokens, sup, 16, cols)
    for a, b in ((aux, aux_t), (logits, logits_t)):
        assert a.shape == b.shape
        assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2


def test_layers_from_is_the_crossover_it_measures(target, monkeypatch, tmp_path):
    """layers_from: the smallest LAYER_SIZES size from which the PyTorch layers (torch's GEMMs: the kernel off while
    they run) beat the fused pass there and at every larger size, None where they never do; timed once per
    machine (cached), None without a fused pass."""
    m = load(target, True, monkeypatch)
    fused = {16: 1.0, 32: 2.0, 64: 4.0, 128: 8.0, 256: 16.0}
    for case, (layers, want) in enumerate([({16: 3.0, 32: 2.5, 64: 3.0, 128: 5.0, 256: 9.0}, 64),
                                           ({16: 0.5, 32: 2.5, 64: 3.0, 128: 5.0, 256: 9.0}, 64),  # 16 alone: no
                                           ({16: 0.5, 32: 1.0, 64: 2.0, 128: 4.0, 256: 8.0}, 16),
                                           ({16: 3.0, 32: 2.5, 64: 5.0, 128: 9.0, 256: 17.0}, None)]):
        calls = []

        def fake(model, rows, reps=3, ctx=256, layers=layers):
            calls.append((model.cpu_pass is None, cpu_gemm.enabled()))
            return {r: (layers if model.cpu_pass is None else fused)[r] for r in rows}

        monkeypatch.setattr(cpu_forward, "pass_seconds", fake)
        monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / str(case)))
        assert cpu_forward.layers_from(m) == want and cpu_forward.layers_from(m) == want
        assert len(calls) == 8 and set(calls) == {(True, False), (False, True)}  # 4 rounds each, once
        assert m.cpu_pass is not None and cpu_gemm.enabled()
    assert cpu_forward.layers_from(load(target, False, monkeypatch)) is None


@torch.no_grad()
def test_large_passes_run_the_layers_when_asked(target, monkeypatch):
    """Plan(layers_from=n): a pass of n rows or more runs the PyTorch layers with torch's GEMMs on the fused
    pass's cache (K transposed again after them), smaller passes the fused pass; the numbers are the fused pass's
    to bf16 rounding, and a fused decode step after a layers prefill reads the keys the layers wrote."""
    ref, m = load(target, True, monkeypatch), load(target, True, monkeypatch)
    plan = M.Plan(layers_from=8)
    seen = []
    real = M.Transformer._layers
    monkeypatch.setattr(M.Transformer, "_layers", lambda self, *a: seen.append(cpu_gemm.enabled()) or real(self, *a))
    p, q = toks(40), toks(1, 1)
    a, b = ref(p, torch.arange(40)), m(p, torch.arange(40), plan=plan)
    assert seen == [False] and cpu_gemm.enabled()  # the layers, with the kernel off while they ran
    c, d = ref(q, torch.tensor([40])), m(q, torch.tensor([40]), plan=plan)
    assert seen == [False]  # one row: the fused pass
    for x, y in ((a, b), (c, d)):
        assert (x.float() - y.float()).norm() / x.float().norm() < 0.02
    assert c[0, -1].argmax() == d[0, -1].argmax()


def test_engines_sharing_a_model_keep_their_own_pass_choice(target, monkeypatch):
    """An exact engine and a --no-exact one on one model, requests alternating: only the --no-exact engine's large
    passes (its prefill) run the PyTorch layers; the exact one's output is the fused pass's."""
    m = load(target, True, monkeypatch)
    monkeypatch.setattr(cpu_forward, "layers_from", lambda model: 8)
    rows, real = [], M.Transformer._layers
    monkeypatch.setattr(M.Transformer, "_layers", lambda self, x, *a: rows.append(x.shape[1]) or real(self, x, *a))
    p = toks(20)[0].tolist()
    ref = Engine(m).generate(p, 8)[0]
    assert rows == []
    exact, fast = Engine(m), Engine(m, exact=False)
    for _ in range(2):
        assert exact.generate(p, 8)[0] == ref and rows == []
        fast.generate(p, 8)
        assert rows == [20]
        rows.clear()


def test_the_pass_weights_sit_in_one_buffer_on_huge_pages(target, monkeypatch):
    """A bf16 model's fused-pass panels and its LM head's are copies in one buffer each, advised for 2 MiB pages
    (a token's pass streams them all); o_proj and down_proj keep no second copy for the PyTorch layers."""
    m = load(target, True, monkeypatch)
    panels = [kw.tensors[0] for kw in m.cpu_pass.keep if isinstance(kw, qlinear.KernelWeight)]
    assert len(panels) == 4 * m.args.n_layers
    assert len({w.untyped_storage().data_ptr() for w in panels}) == 1
    assert advised_huge(panels[0].data_ptr()) in (True, None)
    assert advised_huge(m.lm_head.packed.data_ptr()) in (True, None)
    for layer in m.layers:
        for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert lin.packed.untyped_storage().data_ptr() == panels[0].untyped_storage().data_ptr()
