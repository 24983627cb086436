import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpu_gemm
import vocab
from vocab import FreqVocab, FullVocab, NanoSpecVocab


# --------------------------------------------------------------------------------------
# Plain-Python reference: the window is the list of the last W valid appended ids.
# --------------------------------------------------------------------------------------


class RefWindow:
    def __init__(self, V, W, k_pre, k_ver):
        self.V, self.W, self.k_pre, self.k_ver = V, W, k_pre, k_ver
        self.win = []

    def reset(self, prompt, topk, ablation=None):
        if ablation == "ext":
            stream = list(topk[-1][: self.k_pre]) if topk is not None and len(topk) else []
        elif topk is None:
            stream = list(prompt)
        else:
            stream = [x for p, row in zip(prompt, topk) for x in [p, *row[: self.k_pre]]]
        self.win = [x for x in stream if 0 <= x < self.V][-self.W:]

    def update(self, draft, dvalid, ver, vvalid):
        new = [t for t, ok in zip(draft, dvalid) if ok]
        new += [t for row, ok in zip(ver, vvalid) if ok for t in row[: self.k_ver]]
        self.win = (self.win + new)[-self.W:]


def check_state(v, ref, weight, h=None):
    V, W = v.V, v.W
    token_of, slot_of, count = v.token_of.tolist(), v.slot_of.tolist(), v.count.tolist()
    want = collections.Counter(ref.win)
    # counts == reference multiplicities (never negative), active set == window set
    assert count == [want.get(t, 0) for t in range(V)]
    active = {t for t in token_of if t >= 0}
    assert active == set(ref.win)
    assert int(v.active_size()) == len(active)
    # slot maps are mutually inverse, no slot owned twice
    owners = [t for t in token_of if t >= 0]
    assert len(owners) == len(set(owners))
    for s, t in enumerate(token_of):
        if t >= 0:
            assert slot_of[t] == s
    for t in range(V):
        if t in active:
            assert token_of[slot_of[t]] == t
        else:
            assert slot_of[t] == -1
    # the ring holds the window in order, ending just before head
    head, ring = int(v.head), v.ring[:W].tolist()
    n = len(ref.win)
    assert [ring[(head - n + i) % W] for i in range(n)] == ref.win
    # packed rows == LM-head rows of the owners
    act = v.token_of >= 0
    if v.rows is not None:
        assert torch.equal(v.rows[act], weight[v.token_of[act]])
    # fill: a free slot scores its fill token unless the window holds that token (no id scored twice), with
    # that token's row in place
    fill = v.fill_tok[:W].tolist()
    scored = torch.tensor([token_of[s] >= 0 or (fill[s] >= 0 and fill[s] not in active) for s in range(W)])
    if not v.has_fill:
        assert torch.equal(scored, act)
    ids_now = v.ids.clone()
    assert torch.equal(ids_now[~act & scored], v.fill_tok[:W][~act & scored])
    assert len(set(ids_now[scored].tolist())) == int(scored.sum())
    if v.rows is not None:
        assert torch.equal(v.rows[scored], weight[ids_now[scored]])
    # logits: h @ weight[token].T on active slots, -inf elsewhere, ids map back
    if h is not None:
        scores, ids = v.logits(h)
        assert scores.shape == (*h.shape[:-1], W) and ids.shape == (W,)
        assert ((ids >= 0) & (ids < V)).all()
        assert torch.equal(ids[act], v.token_of[act])
        torch.testing.assert_close(scores[..., act], h @ weight[v.token_of[act]].T)
        assert torch.isneginf(scores[..., ~scored]).all() and torch.isfinite(scores[..., scored]).all()
        torch.testing.assert_close(scores[..., scored], h @ weight[ids[scored]].T)
        probe = torch.arange(V)
        assert v.contains(probe).tolist() == [t in set(ids[scored].tolist()) for t in range(V)]
        if not v.has_fill:
            assert v.contains(probe).tolist() == [t in active for t in range(V)]


@st.composite
def scenarios(draw):
    W = draw(st.integers(4, 32))
    V = draw(st.integers(W, 96))
    alpha = draw(st.sampled_from([2, 5, W, V]))                  # small alphabets -> duplicates
    k_pre = draw(st.integers(1, 3))
    k_ver = draw(st.integers(1, 3))
    A = draw(st.integers(0, W // k_ver))
    burst = draw(st.booleans())                                  # append width == W
    n_draft = W - A * k_ver if burst else draw(st.integers(0, W - A * k_ver))
    tok = st.integers(0, alpha - 1)
    p_valid = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        if draw(st.integers(0, 9)) == 0:
            T = draw(st.integers(0, 2 * W))
            prompt = draw(st.lists(tok, min_size=T, max_size=T))
            topk = None
            if draw(st.booleans()):
                topk = [draw(st.lists(st.one_of(tok, st.just(-1)), min_size=k_pre + 1, max_size=k_pre + 1))
                        for _ in range(T)]
            ops.append(("reset", prompt, topk))
        else:
            draft = draw(st.lists(tok, min_size=n_draft, max_size=n_draft))
            dvalid = [draw(st.floats(0, 1)) < p_valid for _ in range(n_draft)]
            draft = [t if ok else -1 for t, ok in zip(draft, dvalid)]  # garbage on invalid entries
            ver = [draw(st.lists(tok, min_size=k_ver + 1, max_size=k_ver + 1)) for _ in range(A)]
            vvalid = [draw(st.floats(0, 1)) < p_valid for _ in range(A)]
            ops.append(("update", draft, dvalid, ver, vvalid))
    return W, V, k_pre, k_ver, ops


def run_ops(v, ref, ops, weight, h):
    for op in ops:
        if op[0] == "reset":
            _, prompt, topk = op
            T = len(prompt)
            v.reset(torch.tensor(prompt, dtype=torch.long),
                    None if topk is None else torch.tensor(topk, dtype=torch.long).reshape(T, v.k_pre + 1))
            ref.reset(prompt, topk, v.ablation)
        else:
            _, draft, dvalid, ver, vvalid = op
            v.update(torch.tensor(draft, dtype=torch.long), torch.tensor(dvalid, dtype=torch.bool),
                     torch.tensor(ver, dtype=torch.long).reshape(len(ver), v.k_ver + 1),
                     torch.tensor(vvalid, dtype=torch.bool))
            if v.ablation != "ctx":
                ref.update(draft, dvalid, ver, vvalid)
        check_state(v, ref, weight, h)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([None, None, "ctx", "ext", "noasync", "nofill"]),
       st.sampled_from([0, 0, 3, 1.0, 1.5]))
def test_nanospec_matches_reference_window(sc, ablation, n_fill):
    """The window against a reference, after every reset and update, with and without fill tokens in the free
    slots (none, 3, W, more than W ids; "nofill" ignores them)."""
    W, V, k_pre, k_ver, ops = sc
    g = torch.Generator().manual_seed(V * 1000 + W)
    weight = torch.randn(V, 8, generator=g)
    h = torch.randn(2, 8, generator=g)
    n_fill = min(V, n_fill if isinstance(n_fill, int) else int(n_fill * W))
    fill = torch.randperm(V, generator=g)[:n_fill] if n_fill else None
    v = NanoSpecVocab(weight, W, k_pre, k_ver, ablation=ablation, fill=fill)
    assert v.has_fill == (fill is not None and ablation != "nofill")
    ref = RefWindow(V, W, k_pre, k_ver)
    check_state(v, ref, weight, h)
    run_ops(v, ref, ops, weight, h)


def test_long_run_no_drift():
    # 2000 steps x 64 = 128k appended ids through a 128-slot window, then compare.
    V, W, d, steps, n = 512, 128, 8, 2000, 64
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, d, generator=g)
    v = NanoSpecVocab(weight, W, k_pre=3, k_ver=4)
    ref = RefWindow(V, W, 3, 4)
    prompt, topk = torch.randint(0, V, (50,), generator=g), torch.randint(0, V, (50, 3), generator=g)
    v.reset(prompt, topk)
    ref.reset(prompt.tolist(), topk.tolist())
    # Zipf-ish ids so tokens keep entering and leaving the window
    probs = 1.0 / torch.arange(1, V + 1, dtype=torch.float)
    draft = torch.multinomial(probs, steps * 32, replacement=True, generator=g).view(steps, 32)
    ver = torch.multinomial(probs, steps * 32, replacement=True, generator=g).view(steps, 8, 4)
    dvalid = torch.rand(steps, 32, generator=g) < 0.8
    vvalid = torch.rand(steps, 8, generator=g) < 0.7
    window = collections.deque(ref.win, maxlen=W)
    for s in range(steps):
        v.update(draft[s], dvalid[s], ver[s], vvalid[s])
    for s in range(steps):
        window.extend(draft[s][dvalid[s]].tolist())
        window.extend(ver[s][vvalid[s]].reshape(-1).tolist())
    ref.win = list(window)
    check_state(v, ref, weight, torch.randn(3, d, generator=g))


@pytest.mark.parametrize("fill", [None, list(range(40, 56))])
def test_update_and_logits_trace_fullgraph(fill):
    V, W, d = 64, 16, 8
    weight = torch.randn(V, d)
    v_eager, v_comp = NanoSpecVocab(weight, W, 2, 2, fill=fill), NanoSpecVocab(weight, W, 2, 2, fill=fill)
    for v in (v_eager, v_comp):
        v.reset(torch.arange(5), torch.arange(10).view(5, 2))
    update = torch.compile(v_comp.update, fullgraph=True, backend="eager")
    logits = torch.compile(v_comp.logits, fullgraph=True, backend="eager")
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, d)
    for _ in range(20):
        args = (torch.randint(0, V, (6,), generator=g), torch.rand(6, generator=g) < 0.7,
                torch.randint(0, V, (3, 2), generator=g), torch.rand(3, generator=g) < 0.7)
        v_eager.update(*args)
        update(*args)
        assert torch.equal(v_eager.token_of, v_comp.token_of)
        assert torch.equal(v_eager.count, v_comp.count)
        s1, i1 = v_eager.logits(h)
        s2, i2 = logits(h)
        assert torch.equal(s1, s2) and torch.equal(i1, i2)


def test_fewer_active_than_topk():
    weight = torch.randn(64, 8)
    v = NanoSpecVocab(weight, 16, 1, 1)
    v.reset(torch.tensor([5, 9]))
    scores, ids = v.logits(torch.randn(8))
    top = scores.topk(4)
    assert torch.isfinite(top.values[:2]).all() and torch.isneginf(top.values[2:]).all()
    assert set(ids[top.indices[:2]].tolist()) == {5, 9}
    assert ids[top.indices[2:]].tolist() == [0, 0]               # inactive -> valid id 0, -inf


@pytest.mark.parametrize("c_append", ["on", "off"])
def test_the_window_displaces_the_least_frequent_fill_tokens(c_append, monkeypatch):
    """A born fill token takes its own slot (its fill row scored it already: nothing leaves the GEMM); another born
    token takes the highest free slot, so the least frequent fill tokens leave first. Through the C append and the
    PyTorch one."""
    import cpu_draft
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    cpu_gemm.switch(True)
    monkeypatch.setenv(cpu_draft.ENV, c_append)
    used, real = [], cpu_draft.append_kernel
    monkeypatch.setattr(cpu_draft, "append_kernel", lambda: used.append(1) or real())
    fill = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])  # most frequent first: fill token i sits in slot i
    v = NanoSpecVocab(torch.randn(64, 32).bfloat16(), w_max=8, k_pre=1, k_ver=1, fill=fill)

    def scored():
        s, ids = v.logits(torch.randn(32).bfloat16())
        return sorted(ids[torch.isfinite(s)].tolist())

    v.reset(torch.tensor([7, 40]))
    assert v.token_of.tolist() == [-1, -1, 7, -1, -1, -1, -1, 40]
    assert scored() == [5, 6, 7, 8, 9, 10, 11, 40]
    none = (torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
    v.update(torch.tensor([41, 5, 42]), torch.ones(3, dtype=torch.bool), *none)
    assert v.token_of.tolist() == [5, -1, 7, -1, -1, 42, 41, 40]
    assert scored() == [5, 6, 7, 8, 9, 40, 41, 42]
    # 7 and 40 leave the ring (their slots 2 and 7 free), and five new tokens take the free slots from the top
    v.update(torch.tensor([43, 44, 45, 46, 47]), torch.ones(5, dtype=torch.bool), *none)
    assert v.token_of.tolist() == [5, 47, 46, 45, 44, 42, 41, 43]
    assert scored() == [5, 41, 42, 43, 44, 45, 46, 47]
    assert bool(used) == (c_append == "on" and real() is not None)


def test_out_of_range_valid_ids_dropped():
    weight = torch.randn(32, 8)
    v = NanoSpecVocab(weight, 8, 1, 1)
    v.update(torch.tensor([3, -1, 40, 4]), torch.ones(4, dtype=torch.bool),
             torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
    assert sorted(v.token_of[v.token_of >= 0].tolist()) == [3, 4]


def test_ablations():
    V, W, d = 64, 16, 8
    weight = torch.randn(V, d)
    prompt, topk = torch.tensor([1, 2, 3]), torch.tensor([[10, 11], [12, 13], [14, 15]])
    step = (torch.tensor([20, 21]), torch.tensor([True, True]), torch.tensor([[22, 23]]), torch.tensor([True]))
    base = NanoSpecVocab(weight, W, 2, 2)
    base.reset(prompt, topk)
    assert base.ring[:9].tolist() == [1, 10, 11, 2, 12, 13, 3, 14, 15]   # interleaved per position
    ctx = NanoSpecVocab(weight, W, 2, 2, ablation="ctx")
    ctx.reset(prompt, topk)
    ctx.update(*step)
    assert set(ctx.token_of[ctx.token_of >= 0].tolist()) == {1, 2, 3, 10, 11, 12, 13, 14, 15}
    ext = NanoSpecVocab(weight, W, 2, 2, ablation="ext")
    ext.reset(prompt, topk)
    assert set(ext.token_of[ext.token_of >= 0].tolist()) == {14, 15}
    ext.update(*step)
    assert set(ext.token_of[ext.token_of >= 0].tolist()) == {14, 15, 20, 21, 22, 23}
    ext.reset(prompt, None)
    assert int(ext.active_size()) == 0
    noa = NanoSpecVocab(weight, W, 2, 2, ablation="noasync")
    base.update(*step)
    noa.reset(prompt, topk)
    noa.update(*step)
    assert noa.rows is None and noa.state_bytes() == base.state_bytes() - base.rows.nbytes
    h = torch.randn(2, d)
    (s1, i1), (s2, i2) = base.logits(h), noa.logits(h)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(s1, s2)


def test_nanospec_bad_inputs():
    weight = torch.randn(64, 8)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        NanoSpecVocab(weight, 65)
    with pytest.raises(ValueError, match="k_pre and k_ver"):
        NanoSpecVocab(weight, 16, k_pre=0)
    with pytest.raises(ValueError, match="k_pre and k_ver"):
        NanoSpecVocab(weight, 16, k_ver=0)
    with pytest.raises(ValueError, match=r"w_max \(16\) smaller than one step's append width \(17\)"):
        NanoSpecVocab(weight, 16, max_append=17)
    with pytest.raises(ValueError, match="unknown ablation"):
        NanoSpecVocab(weight, 16, ablation="nope")
    v = NanoSpecVocab(weight, 16, k_ver=3)
    with pytest.raises(ValueError, match=r"w_max \(16\) smaller than one step's append width \(19\)"):
        v.update(torch.zeros(10, dtype=torch.long), torch.ones(10, dtype=torch.bool),
                 torch.zeros(3, 3, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="prompt_topk"):
        v.reset(torch.arange(4), torch.zeros(3, 3, dtype=torch.long))


def test_state_bytes():
    w = torch.randn(100, 16)
    v = NanoSpecVocab(w, 32)
    assert vocab.nanospec_state_bytes(100, 16, 32, torch.float32) == v.state_bytes()
    llama = vocab.nanospec_state_bytes(128256, 4096, 3072, torch.float16)
    rows = 3072 * 4096 * 2
    assert rows < llama < rows + 2 * 128256 * 8                   # rows (24 MiB) + O(V) maps
    assert FullVocab(w).state_bytes() == 100 * 8


# --------------------------------------------------------------------------------------
# Full and frequency vocabularies
# --------------------------------------------------------------------------------------


def test_full_vocab():
    w, h = torch.randn(50, 8), torch.randn(2, 3, 8)
    v = FullVocab(w)
    s, ids = v.logits(h)
    torch.testing.assert_close(s, h @ w.T)
    assert torch.equal(ids, torch.arange(50)) and v.contains(torch.tensor([0, 49])).all()
    v.reset(torch.arange(3))
    v.update(torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool),
             torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.bool))
    assert int(v.active_size()) == 50


def test_freq_vocab_and_factory(tmp_path):
    w, h = torch.randn(40, 8), torch.randn(3, 8)
    p = tmp_path / "freq_32768.pt"
    torch.save([5, 2, 30, 11, 8], p)
    v = vocab.make_vocab(f"freq:{p}:3", w, eos_ids=[39])
    s, ids = v.logits(h)
    assert ids.tolist() == [5, 2, 39] and v.rows.is_contiguous()
    torch.testing.assert_close(s, h @ w[ids].T)
    assert v.contains(torch.tensor([5, 39, 30])).tolist() == [True, True, False]
    assert int(v.active_size()) == 3
    assert vocab.make_vocab(f"freq:{p}", w).ids.tolist() == [5, 2, 30, 11, 8]
    assert isinstance(vocab.make_vocab("full", w), FullVocab)
    n = vocab.make_vocab("nanospec", w, w_max=16, k_pre=2, k_ver=1, ablation="ext", max_append=8)
    assert isinstance(n, NanoSpecVocab) and (n.W, n.k_pre, n.k_ver, n.ablation) == (16, 2, 1, "ext")
    with pytest.raises(ValueError, match="only applies to the 'nanospec'"):
        vocab.make_vocab("full", w, ablation="ctx")
    with pytest.raises(ValueError, match="unknown vocab spec 'topk'"):
        vocab.make_vocab("topk", w)
    with pytest.raises(ValueError, match="FreqVocab"):
        FreqVocab(w, [1, 40])


@pytest.mark.skipif(cpu_gemm.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")
@pytest.mark.parametrize("W,n_fill", [(48, 0), (50, 0), (50, 60)])
def test_packed_rows_follow_the_window(W, n_fill, monkeypatch):
    """Where cpu_gemm's kernel scores LM heads (bf16 on the CPU), NanoSpec's packed copy holds exactly the rows
    buffer after every update (W = 50: the sink row shares the last panel with real rows), also with fill
    tokens in the free slots, a compiled update writes the same rows, and the scores are F.linear's to bf16 rounding
    with the same -inf (free) slots.
    FullVocab and FreqVocab score through packed copies too."""
    monkeypatch.setattr(cpu_gemm, "_ON", [True])
    V, d = 300, 64
    g = torch.Generator().manual_seed(W)
    weight = torch.randn(V, d, generator=g).bfloat16()
    fill = torch.randperm(V, generator=g)[:n_fill] if n_fill else None  # (60 > W: the first W are used)
    v, vc = NanoSpecVocab(weight, W, 2, 3, fill=fill), NanoSpecVocab(weight, W, 2, 3, fill=fill)
    assert v.packed is not None and v.state_bytes() > NanoSpecVocab(weight.float(), W, 2, 3).state_bytes()
    update = torch.compile(vc.update, fullgraph=True, backend="eager")
    logits = torch.compile(vc.logits, fullgraph=True, backend="eager")

    def unpacked(p):
        return cpu_gemm.unpack(p, W)

    h = torch.randn(5, d, generator=g).bfloat16()
    for x in (v, vc):
        x.reset(torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(0)))
    more = 0  # steps whose fill tokens scored beside the window's
    for step in range(25):
        args = (torch.randint(0, V, (12,), generator=g), torch.rand(12, generator=g) < 0.8,
                torch.randint(0, V, (3, 3), generator=g), torch.rand(3, generator=g) < 0.7)
        v.update(*args)
        update(*args)
        assert torch.equal(unpacked(v.packed), v.rows) and torch.equal(unpacked(vc.packed), v.rows), step
        s, ids = v.logits(h)
        ref = torch.nn.functional.linear(h.float(), v.rows.float(), v.bias.float())
        assert torch.equal(torch.isneginf(s), torch.isneginf(ref)) and torch.isfinite(s).any()
        if n_fill:  # free slots score their fill tokens (the window's own tokens elsewhere excepted)
            on = torch.isfinite(s[0])
            assert torch.equal(v.rows[on], weight[ids[on]]) and int(on.sum()) >= int(v.active_size())
            more += int(on.sum()) > int(v.active_size())
        fin = torch.isfinite(ref)
        torch.testing.assert_close(s.float()[fin], ref[fin], rtol=0.02, atol=0.05)
        sc, idc = logits(h)
        assert torch.equal(sc, s) and torch.equal(idc, ids)
    assert more > 0 or not n_fill
    full, freq = FullVocab(weight), FreqVocab(weight, torch.tensor([7, 3, 250, 99]))
    assert full.packed is not None and freq.packed is not None
    for x, rows in ((full, weight), (freq, weight[[7, 3, 250, 99]])):
        torch.testing.assert_close(x.logits(h)[0].float(), h.float() @ rows.float().T, rtol=0.02, atol=0.05)


@pytest.mark.skipif(not cpu_gemm.VNNI or cpu_gemm.kernel() is None, reason="needs AVX-512 VNNI and a C compiler")
@pytest.mark.parametrize("W,n_fill,c_append", [(64, 0, "on"), (100, 0, "on"), (100, 150, "on"), (100, 40, "off")])
def test_a_fast_heads_window_copies_its_codes(W, n_fill, c_append, monkeypatch):
    """A draft model's 4-bit LM head on the integer GEMM (qlinear.QLinear.make_fast): the window copies its rows as they
    are (nibbles shared by two rows a byte, panels of 64, W = 100: a part panel). After every update, each active
    slot scores exactly what the whole head scores for its token (same codes, row-invariant GEMM), free slots -inf,
    the window's tokens as with the widened head, through the C append and the PyTorch one."""
    import qlinear
    import quant
    monkeypatch.setenv("NANOSPEC_CPU_DRAFT", c_append)
    monkeypatch.setattr(qlinear, "_C", [True])  # (an earlier test's model may have left torch's kernels chosen)
    V, d = 300, 64
    g = torch.Generator().manual_seed(W + n_fill)
    head = qlinear.QLinear(quant.quantize(torch.randn(V, d, generator=g) * 0.1, quant.Scheme(4, 32)))
    assert head.make_fast() and vocab.fast_rows(head)
    fill = torch.randperm(V, generator=g)[:n_fill] if n_fill else None
    v = vocab.make_vocab("nanospec", head, w_max=W, k_pre=2, k_ver=3, fill=fill)
    wide = NanoSpecVocab(head.weight, W, 2, 3, fill=fill)
    assert v.src is head and v.rows is None and v.weight is None
    assert v.state_bytes() < wide.state_bytes() - W * d  # 4-bit codes and fp16 scales, not bf16 rows
    h = torch.randn(3, d, generator=g).bfloat16()
    prompt = torch.randint(0, V, (30,), generator=g)
    for x in (v, wide):
        x.reset(prompt, torch.randint(0, V, (30, 2), generator=torch.Generator().manual_seed(1)))
    for step in range(30):
        args = (torch.randint(0, V, (12,), generator=g), torch.rand(12, generator=g) < 0.8,
                torch.randint(0, V, (3, 3), generator=g), torch.rand(3, generator=g) < 0.7)
        v.update(*args)
        wide.update(*args)
        s, ids = v.logits(h)
        sw, idw = wide.logits(h)
        on = torch.isfinite(s[0])
        assert torch.equal(ids, idw) and torch.equal(on, torch.isfinite(sw[0])) and on.any(), step
        assert torch.equal(s[:, on], head(h)[:, ids[on]]) and torch.isneginf(s[:, ~on]).all(), step
        assert torch.equal(v.token_of, wide.token_of) and torch.equal(v.count, wide.count)
    assert vocab.make_vocab("nanospec", head, w_max=W, ablation="noasync").src is None  # its widened rows
