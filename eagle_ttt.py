"""The EAGLE-3 head built for training, its training-time-test (TTT) forward and loss, and the target pass.

Targets are computed online: every batch runs the (frozen) target once with teacher forcing, capturing the
inputs of the aux layers (2, L//2, L-3) and its final hidden state; the target's next-token distributions
are formed from that hidden state per batch (a 49k-128k wide distribution per token is far too big to store).

Training-time test (TTT), matching the inference path of draft.EagleDrafter exactly. Draft row t at unrolled
step i stands for the chain whose real context ends at target position t:
  step 0: input (fc(aux_t), token x_{t+1}) at RoPE position t, attends the step-0 keys 0..t (causal);
  step i: input (the step i-1 output of row t (pre-norm), token x_{t+i+1}) at RoPE position t+i, attends the
          step-0 keys 0..t plus the keys of its own steps 1..i (the "diagonal");
  every step predicts x_{t+i+2}: loss = sum_i 0.8^i * soft cross-entropy against the target distribution
  at position t+i+1, over assistant tokens. This is SpecForge's flex-attention EAGLE-3 path
  (specforge/modeling/draft/flex_attention.py `generate_eagle3_mask`: causal OR same-position suffix keys;
  llama3_eagle.py `LlamaFlexAttention`: position_ids + lck, lck = steps so far).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from eagle import EagleConfig, EagleHead, attach
from eagle_data import TrainError
from model import ModelArgs, Plan, Transformer, apply_rope, rope_cache

LOSS_DECAY = 0.8


# ---------------------------------------------------------------- the head and its TTT forward

def aux_layer_ids(target: Transformer, spec: str | None) -> tuple:
    L = target.args.n_layers
    ids = tuple(int(x) for x in spec.split(",")) if spec else target.eagle3_aux_layers()
    if len(ids) != 3 or any(not 0 <= i < L for i in ids):
        raise TrainError(f"EAGLE-3 needs the inputs of 3 target layers; aux layers {list(ids)} do not exist in "
                         f"this {L}-layer target")
    return ids


def new_head(target: Transformer, aux_layers, rope_theta: float | None = None, seed: int = 0):
    """An EAGLE-3 head (eagle.EagleHead) over the full vocabulary, its lm_head a copy of the target's."""
    ta = target.args
    args = ModelArgs(arch="eagle", dim=ta.dim, n_layers=1, n_heads=ta.n_heads, n_kv_heads=ta.n_kv_heads,
                     head_dim=ta.head_dim, intermediate_size=ta.intermediate_size, vocab_size=ta.vocab_size,
                     norm_eps=ta.norm_eps, rope_theta=float(rope_theta or ta.rope_theta),
                     rope_scaling=ta.rope_scaling, max_position_embeddings=ta.max_position_embeddings)
    c = EagleConfig(3, args, 3 * ta.dim, False, ta.vocab_size, tuple(aux_layers))
    g = torch.Generator().manual_seed(seed)
    with torch.device("cpu"):
        head = EagleHead(c).float()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)  # HF initializer_range
        head.lm_head.weight.copy_(target.lm_head.weight.float().cpu())
    head.to(target.lm_head.weight.device)
    attach(head, target)
    return head


def head_config(head) -> dict:
    c, a = head.c, head.c.args
    return dict(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, head_dim=a.head_dim,
                intermediate_size=a.intermediate_size, vocab_size=a.vocab_size, norm_eps=a.norm_eps,
                rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
                max_position_embeddings=a.max_position_embeddings, fc_in=c.fc_in, aux_layers=list(c.aux_layers))


def head_from_config(hc: dict, target: Transformer):
    args = ModelArgs(arch="eagle", dim=hc["dim"], n_layers=1, n_heads=hc["n_heads"], n_kv_heads=hc["n_kv_heads"],
                     head_dim=hc["head_dim"], intermediate_size=hc["intermediate_size"], vocab_size=hc["vocab_size"],
                     norm_eps=hc["norm_eps"], rope_theta=hc["rope_theta"], rope_scaling=hc["rope_scaling"],
                     max_position_embeddings=hc["max_position_embeddings"])
    head = EagleHead(EagleConfig(3, args, hc["fc_in"], False, hc["vocab_size"], tuple(hc["aux_layers"]))).float()
    head.to(target.lm_head.weight.device)
    attach(head, target)
    return head


def ttt_mask(T: int, step: int, device=None) -> Tensor:
    """[T, (step + 1) * T] bool over the keys [step-0 keys | step-1 keys | ... | step-`step` keys]: row t sees
    the step-0 keys 0..t (the real context, causal) and, in every later step's block, only column t (its own
    chain: the diagonal). The fast attention below computes exactly this without materialising it."""
    ar = torch.arange(T, device=device)
    causal = ar[None, :] <= ar[:, None]
    eye = ar[None, :] == ar[:, None]
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_attention(q: Tensor, k0: Tensor, v0: Tensor, ks: list, vs: list) -> Tensor:
    """q [B, H, T, hd]; k0, v0 [B, Hkv, T, hd] step-0 keys/values; ks, vs: the same row's keys/values of
    steps 1..i. Causal over k0 plus one diagonal score per earlier step, one joint softmax (fp32).
    On CPU the causal part runs in torch's flash kernel: the dense path's [T, T] fp32 scores took 0.53 s
    (forward and backward) of a 2,000-token step-0 attention, the flash kernel 0.18 s (Zen 5, 2 threads)."""
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        G = q.shape[1] // k0.shape[1]  # query head h uses kv head h // G, as HF repeat_kv
        rep = lambda x: x.repeat_interleave(G, dim=1)
        kd = torch.stack([rep(k) for k in ks], dim=3) if ks else None
        vd = torch.stack([rep(v) for v in vs], dim=3) if vs else None
        return _FlashTTTAttention.apply(q, rep(k0), rep(v0), kd, vd)
    B, H, T, hd = q.shape
    Hkv = k0.shape[1]
    qg = q.view(B, Hkv, H // Hkv, T, hd)
    scale = 1.0 / math.sqrt(hd)
    s0 = (qg @ k0[:, :, None].transpose(-1, -2)).float() * scale  # [B, Hkv, G, T, T]
    ar = torch.arange(T, device=q.device)
    s0 = s0.masked_fill(ar[None, :] > ar[:, None], float("-inf"))
    if ks:
        sd = torch.stack([(qg * k[:, :, None]).sum(-1) for k in ks], dim=-1).float() * scale  # [B, Hkv, G, T, i]
        p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)
        p0, pd = p[..., :T], p[..., T:]
    else:
        p0 = torch.softmax(s0, dim=-1)
    out = p0.to(v0.dtype) @ v0[:, :, None]  # [B, Hkv, G, T, hd]
    for j, v in enumerate(vs):
        out = out + pd[..., j, None].to(v.dtype) * v[:, :, None]
    return out.reshape(B, H, T, hd)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _f32(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 stays fp64)


class _FlashTTTAttention(torch.autograd.Function):
    """ttt_attention with the causal block in the flash kernel, which also returns its log-sum-exp lse0;
    the diagonal scores sd [B, H, T, i] join through lse = logaddexp(lse0, lse(sd)):
      out = exp(lse0 - lse) * out0 + sum_j exp(sd_j - lse) * v_j.
    Backward: the flash kernel's backward given the joint output and lse yields exactly the joint softmax's
    gradients for q (its causal share), k0 and v0; the diagonal terms add theirs. q, k0, v0 [B, H, T, hd]
    (kv heads already repeated), kd, vd [B, H, T, i, hd] or None."""

    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd):
        scale = 1.0 / math.sqrt(q.shape[-1])
        out0, lse0 = _CPU_FLASH(q, k0, v0, 0.0, True, scale=scale)
        pd, f = None, _f32
        if kd is None:
            out, lse = out0, lse0
        else:
            with torch.autocast(q.device.type, enabled=False):  # the scores in fp32, as the backward's
                sd = torch.einsum("bhtd,bhtid->bhti", f(q), f(kd)) * scale
                lse = torch.logaddexp(lse0, torch.logsumexp(sd, -1))
                pd = torch.exp(sd - lse[..., None])
                out = (torch.exp(lse0 - lse)[..., None] * f(out0)
                       + torch.einsum("bhti,bhtid->bhtd", pd, f(vd))).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse, pd)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k0, v0, kd, vd, out, lse, pd = ctx.saved_tensors
        g = g.contiguous()
        dq, dk0, dv0 = _CPU_FLASH_BWD(g, q, k0, v0, out, lse, 0.0, True, scale=ctx.scale)
        if kd is None:
            return dq, dk0, dv0, None, None
        f = _f32
        gf = f(g)
        D = (gf * f(out)).sum(-1, keepdim=True)  # [B, H, T, 1]: the softmax backward's row term
        ds = pd * (torch.einsum("bhtd,bhtid->bhti", gf, f(vd)) - D) * ctx.scale
        dq = (f(dq) + torch.einsum("bhti,bhtid->bhtd", ds, f(kd))).to(q.dtype)
        dkd = (ds[..., None] * f(q)[:, :, :, None]).to(kd.dtype)
        dvd = (pd[..., None] * gf[:, :, :, None]).to(vd.dtype)
        return dq, dk0, dv0, dkd, dvd


def ttt_forward(head, aux: Tensor, tokens: Tensor, steps: int, cos: Tensor, sin: Tensor) -> list[Tensor]:
    """Cache-free unrolled forward of an EAGLE-3 head (the weights of eagle.EagleHead's submodules).
    aux [B, T, 3d] target aux states, tokens [B, T] the sequence, cos/sin [>= T + steps, hd].
    Returns per step the LM-head input (final-normed) [B, T, d]; row t of step i predicts x_{t+i+2}."""
    L = head.midlayer
    at = L.self_attn
    B, T = tokens.shape
    feat = head.fc(aux.to(head.fc.weight.dtype))
    k0 = v0 = None
    ks, vs, outs = [], [], []
    for i in range(steps):
        nxt = F.pad(tokens[:, i + 1:], (0, i + 1))  # x_{t+i+1}, zero past the end (never supervised)
        emb = head.embed_tokens(nxt)
        x = torch.cat([L.input_layernorm(emb), L.hidden_norm(feat)], dim=-1)  # embedding first
        q = at.q_proj(x).view(B, T, at.n_heads, at.head_dim).transpose(1, 2)
        k = at.k_proj(x).view(B, T, at.n_kv_heads, at.head_dim).transpose(1, 2)
        v = at.v_proj(x).view(B, T, at.n_kv_heads, at.head_dim).transpose(1, 2)
        c, s = cos[i:i + T], sin[i:i + T]  # positions t + i
        q, k = apply_rope(q, c, s), apply_rope(k, c, s)
        if i == 0:
            k0, v0 = k, v
        else:
            ks.append(k), vs.append(v)
        a = ttt_attention(q, k0, v0, ks, vs)
        h = feat + at.o_proj(a.transpose(1, 2).reshape(B, T, -1))
        h = h + L.mlp(L.post_attention_layernorm(h))
        outs.append(head.norm(h))
        feat = h  # the next step's feature: this step's pre-norm output, same row
    return outs


def target_probs(tgt_logits: Tensor, bias: Tensor | None = None):
    """The target's distributions over the loss columns, fp32 [P, V'], and its argmax [P]: formed once per
    position, shared by the TTT steps that predict it."""
    tz = tgt_logits.float() if bias is None else tgt_logits.float() + bias
    return torch.softmax(tz, -1), tz.argmax(-1)


class LinearSoftCE(torch.autograd.Function):
    """sum_r w_r * CE(p_(r mod P), softmax(h_r W^T)) computed over row chunks, so the [N, V] logits never
    exist at once (128k vocabularies fit); the gradient w.r.t. h (and W when it trains) is formed in the
    forward pass, chunk by chunk. h stacks S blocks of P rows, block s paired row by row with the target
    distributions p [P, V] (fp32, rows sum to 1), so the TTT steps share one p. CE = lse(z) - p.z, and each
    chunk's [rows, V] buffer is rewritten in place (logits, then q, then the gradient): about 10 passes over
    it, where separate temporaries took 17 (and fresh 16 MB buffers each cost page faults, 17 ms an op).
    Also returns per-row top-1 agreement (draft argmax == target argmax `arg`)."""

    @staticmethod
    def forward(ctx, h, W, p, arg, w, chunk, cdtype, bias=None):
        P = p.shape[0]
        N = h.shape[0]
        assert N % max(P, 1) == 0, "h must stack whole blocks of P rows"
        Wc = W.detach().to(cdtype)
        gh = torch.empty_like(h, dtype=torch.float32)
        gW = torch.zeros_like(W, dtype=torch.float32) if W.requires_grad else None
        correct = torch.zeros(N, dtype=torch.bool, device=h.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for base in range(0, N, max(P, 1)):
                for a in range(0, P, chunk):
                    r0, r1 = base + a, base + min(a + chunk, P)
                    hc = h[r0:r1].detach().to(cdtype)
                    pc, wc = p[a:a + chunk], w[r0:r1]
                    z = (hc @ Wc.T).float()
                    if bias is not None:
                        z += bias
                    correct[r0:r1] = z.argmax(-1) == arg[a:a + chunk]
                    lse = torch.logsumexp(z, -1)
                    pz = torch.bmm(pc[:, None, :], z[:, :, None]).view(-1)
                    loss += (wc * (lse - pz)).sum()
                    g = z.sub_(lse[:, None]).exp_().sub_(pc).mul_(wc[:, None]).to(cdtype)  # w * (q - p)
                    gh[r0:r1] = g @ Wc
                    if gW is not None:
                        gW += (g.T @ hc).float()
        ctx.save_for_backward(gh, gW if gW is not None else torch.empty(0))
        ctx.has_gW, ctx.h_dtype, ctx.W_dtype = gW is not None, h.dtype, W.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, gl, _):
        gh, gW = ctx.saved_tensors
        return ((gh * gl).to(ctx.h_dtype), (gW * gl).to(ctx.W_dtype) if ctx.has_gW else None,
                None, None, None, None, None, None)


def loss_columns(tokens: Tensor, vocab_size: int, n: int):
    """Sampled-softmax columns for --loss-vocab n: every token id of the batch (for greedy data these include
    the target's argmax at every supervised position) plus uniform negatives up to n columns. Returns
    (cols [n'], bias [n']) where bias = log(#unsampled / #sampled) on the negatives, 0 elsewhere; adding it to
    both the draft's and the target's logits makes the softmax over cols an estimate of the full one."""
    if not n or n >= vocab_size:
        return None, None
    present = torch.zeros(vocab_size, dtype=torch.bool, device=tokens.device)
    present[tokens.flatten()] = True
    pos = present.nonzero(as_tuple=True)[0]
    rest = (~present).nonzero(as_tuple=True)[0]
    r = max(0, min(n - pos.shape[0], rest.shape[0]))
    neg = rest[torch.randperm(rest.shape[0], device=tokens.device)[:r]]
    bias = torch.cat([torch.zeros(pos.shape[0], device=tokens.device),
                      torch.full((r,), math.log(rest.shape[0] / max(r, 1)), device=tokens.device)])
    return torch.cat([pos, neg]), bias


class TTTLoss(nn.Module):
    """The trainable head plus its training objective, one module so DDP sees every parameter use."""

    def __init__(self, head, steps: int, chunk: int = 512, cdtype=torch.bfloat16):
        super().__init__()
        self.head, self.steps, self.chunk, self.cdtype = head, steps, chunk, cdtype
        self.max_seq = 0

    def rope(self, T: int, device):
        if T + self.steps > self.max_seq:
            a = self.head.c.args
            self.max_seq = T + self.steps
            cos, sin = rope_cache(self.max_seq, a.head_dim, a.rope_theta, a.rope_scaling)
            self.cos, self.sin = cos.to(device), sin.to(device)
        return self.cos, self.sin

    def forward(self, aux, tokens, sup, tgt_logits, cols=None, bias=None):
        """aux [B, T, 3d]; tokens [B, T]; sup [B, T] bool: token j is supervised (an assistant token, j >= 2);
        tgt_logits [P, V] the target's logits at positions j - 1 of the supervised tokens (row-major order),
        or [P, len(cols)] over the sampled columns `cols` (with `bias`, see loss_columns).
        Returns (loss, per-step accuracy [steps], per-step counts [steps])."""
        B, T = tokens.shape
        cos, sin = self.rope(T, tokens.device)
        outs = ttt_forward(self.head, aux, tokens, self.steps, cos, sin)
        sb, sj = sup.nonzero(as_tuple=True)
        # step i's draft row t = j - 2 - i predicts token j; rows with t < 0 (the first tokens) weigh 0
        t = sj[None] - 2 - torch.arange(self.steps, device=tokens.device)[:, None]  # [steps, P]
        keep = t >= 0
        n = keep.sum(-1)  # [steps]
        h = torch.cat([o[sb, t[i].clamp(min=0)] for i, o in enumerate(outs)])
        decay = LOSS_DECAY ** torch.arange(self.steps, device=tokens.device, dtype=torch.float32)
        w = (keep * (decay / n.clamp(min=1))[:, None]).flatten()
        p, arg = target_probs(tgt_logits, bias)
        W = self.head.lm_head.weight if cols is None else self.head.lm_head.weight[cols]
        loss, correct = LinearSoftCE.apply(h, W, p, arg, w, self.chunk, self.cdtype, bias)
        cnt = n.float()
        acc = (correct.view(self.steps, sb.shape[0]) & keep).sum(-1) / cnt.clamp(min=1)
        return loss, acc, cnt


@torch.no_grad()
def target_pass(target: Transformer, aux_layers: tuple[int, ...], tokens: Tensor, sup: Tensor, chunk: int = 512,
                cols: Tensor | None = None):
    """Teacher-forced target pass: aux states [B, T, 3d] (the inputs of aux_layers) and the logits at positions
    j - 1 of the supervised tokens j (the distributions the head learns), [P, V] (or [P, len(cols)]) in the model's
    dtype."""
    B, T = tokens.shape
    pos, plan = torch.arange(T, device=tokens.device), Plan(tuple(aux_layers))
    # caches of exactly this batch's shape: attention kernels round differently with the KV length, so a
    # cache grown by earlier batches would make a resumed run (fresh cache) compute other aux states
    if target.cpu_pass is not None:
        # the fused CPU pass is batch 1: a sequence at a time (2 x 1,000 rows 0.86 s, the PyTorch layers'
        # batched pass 1.6 s; Zen 5, 2 threads)
        target.setup_caches(1, T)
        outs = [target(tokens[b:b + 1], pos, return_hidden=True, compute_logits=False, plan=plan) for b in range(B)]
        hid, aux = torch.cat([o[1] for o in outs]), torch.cat([o[2] for o in outs])
    else:
        target.setup_caches(B, T)
        _, hid, aux = target(tokens, pos, return_hidden=True, compute_logits=False, causal=True, plan=plan)
    sb, sj = sup.nonzero(as_tuple=True)
    hp = hid[sb, sj - 1]
    W = target.lm_head.weight if cols is None else target.lm_head.weight[cols]
    logits = torch.cat([F.linear(hp[a:a + chunk], W) for a in range(0, hp.shape[0], chunk)]) if hp.shape[0] else \
        hid.new_zeros(0, W.shape[0])
    return aux, logits
