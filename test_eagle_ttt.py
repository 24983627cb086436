"""eagle_ttt.py: TTT mask and attention, the unrolled TTT forward against the inference path, the fused soft
cross-entropy and the sampled loss columns (fixtures: conftest.py)."""
import math

import pytest
import torch

import eagle_ttt as ttt
from model import Plan

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


# ---------------------------------------------------------------- TTT attention

def slow_ttt_mask(T, step):
    cols = (step + 1) * T
    m = torch.zeros(T, cols, dtype=torch.bool)
    for t in range(T):
        for s in range(T):
            m[t, s] = s <= t  # the real context: step-0 keys, causal
        for j in range(1, step + 1):
            m[t, j * T + t] = True  # the same row's key at each later step
    return m


@pytest.mark.parametrize("T,step", [(1, 0), (5, 0), (5, 1), (7, 3), (4, 6)])
def test_ttt_mask_matches_explicit_construction(T, step):
    assert torch.equal(ttt.ttt_mask(T, step), slow_ttt_mask(T, step))


@pytest.mark.parametrize("flash", [True, False])
def test_ttt_attention_equals_masked_dense_attention(flash, monkeypatch):
    if not flash:
        monkeypatch.setattr(ttt, "_CPU_FLASH", None)
    elif ttt._CPU_FLASH is None:
        pytest.skip("this torch has no CPU flash attention")
    torch.manual_seed(0)
    B, H, Hkv, T, hd = 2, 4, 2, 6, 8
    q = torch.randn(B, H, T, hd, dtype=torch.float64, requires_grad=True)
    ks = [torch.randn(B, Hkv, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    vs = [torch.randn(B, Hkv, T, hd, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    for step in range(4):
        fast = ttt.ttt_attention(q, ks[0], vs[0], ks[1:step + 1], vs[1:step + 1])
        K = torch.cat(ks[:step + 1], dim=2).repeat_interleave(H // Hkv, dim=1)  # [B, H, (step+1)T, hd]
        V = torch.cat(vs[:step + 1], dim=2).repeat_interleave(H // Hkv, dim=1)
        ref = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=slow_ttt_mask(T, step))
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
        # gradients w.r.t. q and every key and value, through a random projection of the output
        r = torch.randn_like(ref)
        got = torch.autograd.grad((fast * r).sum(), [q] + ks[:step + 1] + vs[:step + 1])
        want = torch.autograd.grad((ref * r).sum(), [q] + ks[:step + 1] + vs[:step + 1])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # under the trainer's bf16 autocast the scores stay fp32: the same output as without it
    qf, kf, vf = q.detach().float(), [k.detach().float() for k in ks], [v.detach().float() for v in vs]
    plain = ttt.ttt_attention(qf, kf[0], vf[0], kf[1:], vf[1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = ttt.ttt_attention(qf, kf[0], vf[0], kf[1:], vf[1:])
    if flash:
        torch.testing.assert_close(cast, plain, atol=1e-5, rtol=1e-5)


def test_ttt_forward_matches_the_inference_path(tiny):
    """Row t of unrolled step i == the KV-cache head of draft.py fed the real context 0..t and then a chain of
    i tokens, each step feeding back its own output (what EagleDrafter does inside a tree)."""
    m = tiny["model"]
    aux_layers = m.eagle3_aux_layers()
    head = ttt.new_head(m, aux_layers, seed=3)
    with torch.no_grad():  # non-trivial norms
        for n, p in head.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    toks = torch.tensor([tiny["recs"][0]["ids"][:20]])
    T, steps = toks.shape[1], 4
    m.setup_caches(1, 32)
    _, _, aux = m(toks, torch.arange(T), return_hidden=True, plan=Plan(aux_layers))
    cos, sin = ttt.rope_cache(T + steps, head.c.args.head_dim, head.c.args.rope_theta, None)
    with torch.no_grad():
        outs = ttt.ttt_forward(head, aux, toks, steps, cos, sin)
    head.setup_caches(64)
    for t in [0, 5, 13]:
        pos = torch.arange(t + 1)
        mask = head.seq_range[None, :] <= pos[:, None]
        with torch.no_grad():
            out, lm_in = head(toks[:, 1:t + 2], head.fc(aux[:, :t + 1]), pos, pos, mask)
            torch.testing.assert_close(lm_in[0, t], outs[0][0, t], atol=1e-5, rtol=1e-5)
            feat = out[:, t:t + 1]
            for i in range(1, steps):
                if t + i + 1 >= T:
                    break
                p = torch.tensor([t + i])
                mask = (head.seq_range <= t) | ((head.seq_range > t) & (head.seq_range <= t + i))
                feat, lm_in = head(toks[:, t + i + 1:t + i + 2], feat, p, p, mask[None])
                torch.testing.assert_close(lm_in[0, 0], outs[i][0, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("train_w,blocks", [(False, 1), (True, 1), (True, 3)])
def test_fused_soft_ce_matches_autograd(train_w, blocks):
    torch.manual_seed(0)
    N, d, V = 37, 16, 50
    h = torch.randn(blocks * N, d, requires_grad=True)
    W = torch.randn(V, d, requires_grad=train_w)
    tgt = torch.randn(N, V) * 3
    w = torch.rand(blocks * N)
    p, arg = ttt.target_probs(tgt)
    loss, correct = ttt.LinearSoftCE.apply(h, W, p, arg, w, 8, torch.float32)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    W2 = W.detach().clone().requires_grad_(train_w)
    z = h2 @ W2.T
    ref = -(w * (torch.softmax(tgt, -1).repeat(blocks, 1) * torch.log_softmax(z, -1)).sum(-1)).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(h.grad, h2.grad, atol=1e-5, rtol=1e-4)
    if train_w:
        torch.testing.assert_close(W.grad, W2.grad, atol=1e-5, rtol=1e-4)
    assert torch.equal(correct, z.argmax(-1) == tgt.argmax(-1).repeat(blocks))


def test_target_probs_leave_the_logits_alone():
    tgt = torch.randn(5, 9)
    keep = tgt.clone()
    p, arg = ttt.target_probs(tgt, torch.full((9,), 2.0))
    assert torch.equal(tgt, keep)
    torch.testing.assert_close(p, torch.softmax(tgt, -1))  # a constant bias leaves the softmax
    assert torch.equal(arg, tgt.argmax(-1))


def head_and_batch(tiny):
    """The tiny target with its aux layers, a fresh head, 2 x 12 random tokens and no supervised token yet."""
    torch.manual_seed(0)
    target = tiny["model"]
    head = ttt.new_head(target, target.eagle3_aux_layers(), seed=5)
    return target, head, torch.randint(0, target.args.vocab_size, (2, 12)), torch.zeros(2, 12, dtype=torch.bool)


def test_ttt_loss_equals_its_definition(tiny):
    """sum_i 0.8^i / n_i * sum over supervised j with row t = j - 2 - i >= 0 of CE(p_(j-1), q_i(row t))."""
    target, head, tokens, sup = head_and_batch(tiny)
    sup[0, 3:9] = True
    sup[1, 2:12] = True
    steps = 3
    aux, tgt = ttt.target_pass(target, head.c.aux_layers, tokens, sup)
    loss, acc, cnt = ttt.TTTLoss(head, steps, 4, torch.float32)(aux, tokens, sup, tgt.float())
    a = head.c.args
    cos, sin = ttt.rope_cache(12 + steps, a.head_dim, a.rope_theta, a.rope_scaling)
    with torch.no_grad():
        outs = ttt.ttt_forward(head, aux, tokens, steps, cos, sin)
    sb, sj = sup.nonzero(as_tuple=True)
    ref, ref_acc, ref_cnt = 0.0, [], []
    for i, o in enumerate(outs):
        terms, hits = [], []
        for k in range(sb.shape[0]):
            b, j = int(sb[k]), int(sj[k])
            if j - 2 - i < 0:
                continue
            with torch.no_grad():
                z = head.lm_head(o[b, j - 2 - i]).float()
            terms.append(-(torch.softmax(tgt[k].float(), -1) * torch.log_softmax(z, -1)).sum())
            hits.append(float(z.argmax() == tgt[k].argmax()))
        ref = ref + ttt.LOSS_DECAY ** i * torch.stack(terms).mean()
        ref_acc.append(sum(hits) / len(hits))
        ref_cnt.append(len(terms))
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(acc, torch.tensor(ref_acc))
    assert cnt.tolist() == ref_cnt


def test_ttt_accuracy_counts_only_the_rows_a_step_supervises(tiny):
    """The target's logits are the head's own step-1 outputs (its row max(j - 3, 0) for token j), so every row step
    1 supervises is right: its accuracy is exactly 1. Token 2's step-1 row would be t = -1: it reads row 0, is
    'right' too, and must not count (n + 1 of n otherwise)."""
    target, head, tokens, sup = head_and_batch(tiny)
    sup[0, 4:9] = True
    sup[1, 2:12] = True  # token 2: no row at step 1
    aux, _ = ttt.target_pass(target, head.c.aux_layers, tokens, sup)
    a = head.c.args
    cos, sin = ttt.rope_cache(12 + 2, a.head_dim, a.rope_theta, a.rope_scaling)
    sb, sj = sup.nonzero(as_tuple=True)
    with torch.no_grad():
        o1 = ttt.ttt_forward(head, aux, tokens, 2, cos, sin)[1]
        tgt = head.lm_head(o1[sb, (sj - 3).clamp(min=0)]).float()
    _, acc, cnt = ttt.TTTLoss(head, 2, 4, torch.float32)(aux, tokens, sup, tgt)
    assert cnt.tolist() == [15, 14] and acc[1].item() == 1.0


def test_sampled_loss_columns():
    torch.manual_seed(0)
    tokens = torch.tensor([[3, 5, 5, 9], [9, 0, 2, 2]])
    cols, bias = ttt.loss_columns(tokens, 100, 20)
    assert cols.shape == bias.shape == (20,) and len(set(cols.tolist())) == 20
    assert set(cols[:5].tolist()) == {0, 2, 3, 5, 9} and bias[:5].eq(0).all()  # every batch token, exact
    torch.testing.assert_close(bias[5:], torch.full((15,), math.log(95 / 15)))  # negatives stand for the rest
    assert ttt.loss_columns(tokens, 100, 0) == (None, None) and ttt.loss_columns(tokens, 100, 100) == (None, None)
    # bias added to both sides: with every column sampled the loss is the exact one
    h, W, tgt, w = torch.randn(6, 8), torch.randn(30, 8), torch.randn(6, 30), torch.ones(6)
    p, arg = ttt.target_probs(tgt)
    exact, _ = ttt.LinearSoftCE.apply(h, W, p, arg, w, 4, torch.float32)
    p, arg = ttt.target_probs(tgt, torch.zeros(30))
    same, _ = ttt.LinearSoftCE.apply(h, W, p, arg, w, 4, torch.float32, torch.zeros(30))
    torch.testing.assert_close(exact, same)
