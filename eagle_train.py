"""Train full-vocabulary EAGLE-3 draft heads: aux-state capture, training-time test, export, CLI (data: eagle_data).

    # data: self-generated (Magpie-style, the default when no dataset is at hand) ...
    python eagle_train.py data --out data/smol.jsonl --num 1000
    # ... or regenerate the assistant turns of a ShareGPT / UltraChat jsonl with the target
    python eagle_train.py data --dataset sharegpt.jsonl --out data/sg.jsonl --num 5000
    # train (online target pass per batch), then export an EAGLE-3 folder
    python eagle_train.py train --data data/smol.jsonl --out runs/smol --export heads/smol
    torchrun --nproc-per-node 8 eagle_train.py train --checkpoint meta-llama/Llama-3.1-8B-Instruct ...
    python eagle_train.py export --run runs/smol --out heads/smol [--no-lm-head]

Data format (jsonl, one conversation a line): {"ids": [token ids], "spans": [[start, end], ...]}; the
half-open spans mark the assistant tokens the head learns to predict (the loss mask). A sidecar
`<data>.meta.json` records how the file was made, so the same command reuses it instead of regenerating.

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
import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import draft as dr
from draft import EagleConfig, EagleHead, attach
from download import CheckpointError, resolve_checkpoint
from eagle_data import (TrainError, answer_conversations, log, magpie_data, progress, read_conversations, read_records,
                        write_records)
from generate import Engine, Tokenizer
from model import ModelArgs, ModelError, Transformer, apply_rope, load_model, rope_cache
from vocab import make_vocab

LOSS_DECAY = 0.8
CKPT_NAME = "checkpoint.pt"
CKPT_FORMAT = 1


# ---------------------------------------------------------------- the head and its TTT forward

def aux_layer_ids(target: Transformer, spec: str | None) -> tuple:
    L = target.args.n_layers
    ids = tuple(int(x) for x in spec.split(",")) if spec else target.eagle3_aux_layers()
    if len(ids) != 3 or any(not 0 <= i < L for i in ids):
        raise TrainError(f"EAGLE-3 needs the inputs of 3 target layers; aux layers {list(ids)} do not exist in "
                         f"this {L}-layer target")
    return ids


def new_head(target: Transformer, aux_layers, rope_theta: float | None = None, seed: int = 0):
    """An EAGLE-3 head (draft.EagleHead) over the full vocabulary, its lm_head a copy of the target's."""
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
    steps 1..i. Causal over k0 plus one diagonal score per earlier step, one joint softmax (fp32)."""
    B, H, T, hd = q.shape
    Hkv = k0.shape[1]
    qg = q.view(B, Hkv, H // Hkv, T, hd)  # query head h uses kv head h // (H / Hkv), as HF repeat_kv
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


def ttt_forward(head, aux: Tensor, tokens: Tensor, steps: int, cos: Tensor, sin: Tensor) -> list[Tensor]:
    """Cache-free unrolled forward of an EAGLE-3 head (the weights of draft.EagleHead's submodules).
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


class LinearSoftCE(torch.autograd.Function):
    """sum_n w_n * CE(softmax(target_n), softmax(h_n W^T)) computed over row chunks, so the [N, V] logits
    never exist at once (128k vocabularies fit); the gradient w.r.t. h (and W when it trains) is formed in
    the forward pass, chunk by chunk. Also returns per-row top-1 agreement (draft argmax == target argmax)."""

    @staticmethod
    def forward(ctx, h, W, tgt, w, chunk, cdtype, bias=None):
        N = h.shape[0]
        Wc = W.detach().to(cdtype)
        gh = torch.empty_like(h, dtype=torch.float32)
        gW = torch.zeros_like(W, dtype=torch.float32) if W.requires_grad else None
        correct = torch.zeros(N, dtype=torch.bool, device=h.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for a in range(0, N, chunk):
                hc = h[a:a + chunk].detach().to(cdtype)
                z = (hc @ Wc.T).float()
                tz = tgt[a:a + chunk].float()
                if bias is not None:
                    z, tz = z + bias, tz + bias
                logq = torch.log_softmax(z, dim=-1)
                p = torch.softmax(tz, dim=-1)
                wc = w[a:a + chunk]
                loss -= (wc * (p * logq).sum(-1)).sum()
                g = ((logq.exp() - p) * wc[:, None]).to(cdtype)
                gh[a:a + chunk] = (g @ Wc).float()
                if gW is not None:
                    gW += (g.T @ hc).float()
                correct[a:a + chunk] = z.argmax(-1) == tz.argmax(-1)
        ctx.save_for_backward(gh, gW if gW is not None else torch.empty(0))
        ctx.has_gW, ctx.h_dtype, ctx.W_dtype = gW is not None, h.dtype, W.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, gl, _):
        gh, gW = ctx.saved_tensors
        return ((gh * gl).to(ctx.h_dtype), (gW * gl).to(ctx.W_dtype) if ctx.has_gW else None,
                None, None, None, None, None)


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
        P = sb.shape[0]
        rows, tgt_idx, weights, step_of = [], [], [], []
        pidx = torch.arange(P, device=tokens.device)
        for i, o in enumerate(outs):
            t = sj - 2 - i  # draft row whose step i predicts token j
            keep = t >= 0
            n = int(keep.sum())
            if n == 0:
                continue
            rows.append(o[sb[keep], t[keep]])
            tgt_idx.append(pidx[keep])
            weights.append(torch.full((n,), LOSS_DECAY ** i / n, device=tokens.device))
            step_of.append(torch.full((n,), i, device=tokens.device))
        h = torch.cat(rows)
        tgt = tgt_logits[torch.cat(tgt_idx)]
        step_of = torch.cat(step_of)
        W = self.head.lm_head.weight if cols is None else self.head.lm_head.weight[cols]
        loss, correct = LinearSoftCE.apply(h, W, tgt, torch.cat(weights), self.chunk, self.cdtype, bias)
        cnt = torch.bincount(step_of, minlength=self.steps).float()
        acc = torch.bincount(step_of, weights=correct.float(), minlength=self.steps) / cnt.clamp(min=1)
        return loss, acc, cnt


@torch.no_grad()
def target_pass(target: Transformer, tokens: Tensor, sup: Tensor, chunk: int = 512, cols: Tensor | None = None):
    """Teacher-forced target pass: aux states [B, T, 3d] and the logits at positions j - 1 of the supervised
    tokens j (the distributions the head learns), [P, V] (or [P, len(cols)]) in the model's dtype."""
    B, T = tokens.shape
    # caches of exactly this batch's shape: attention kernels round differently with the KV length, so a
    # cache grown by earlier batches would make a resumed run (fresh cache) compute other aux states
    target.setup_caches(B, T)
    pos = torch.arange(T, device=tokens.device)
    _, hid, aux = target(tokens, pos, return_hidden=True, compute_logits=False)
    sb, sj = sup.nonzero(as_tuple=True)
    hp = hid[sb, sj - 1]
    W = target.lm_head.weight if cols is None else target.lm_head.weight[cols]
    logits = torch.cat([F.linear(hp[a:a + chunk], W) for a in range(0, hp.shape[0], chunk)]) if hp.shape[0] else \
        hid.new_zeros(0, W.shape[0])
    return aux, logits


# ---------------------------------------------------------------- batching

def make_batches(recs: list[dict], batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches of at most batch_tokens (padded) tokens; a long record gets a batch alone."""
    order = sorted(range(len(recs)), key=lambda i: len(recs[i]["ids"]))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(recs[i]["ids"])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


def collate(recs: list[dict], idx: list[int], pad_id: int, device):
    T = max(len(recs[i]["ids"]) for i in idx)
    tokens = torch.full((len(idx), T), pad_id, dtype=torch.long)
    sup = torch.zeros(len(idx), T, dtype=torch.bool)
    for b, i in enumerate(idx):
        ids = recs[i]["ids"]
        tokens[b, :len(ids)] = torch.tensor(ids)
        for s, e in recs[i]["spans"]:
            sup[b, max(s, 2):e] = True
    return tokens.to(device), sup.to(device)


# ---------------------------------------------------------------- checkpoints and export

def signature(target: Transformer, head, freeze_lm_head: bool) -> dict:
    return dict(target=dict(vocab_size=target.args.vocab_size, dim=target.args.dim, n_layers=target.args.n_layers),
                head=head_config(head), freeze_lm_head=freeze_lm_head)


def atomic_save(obj, path: Path):
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a partial write never carries the final name


def load_checkpoint(path: Path, expect: dict | None = None) -> dict:
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise TrainError(f"cannot resume from {path}: not a readable checkpoint ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(ck, dict) or ck.get("format") != CKPT_FORMAT or "signature" not in ck:
        raise TrainError(f"cannot resume from {path}: not an eagle_train.py checkpoint")
    if expect is not None and ck["signature"] != expect:
        diff = _first_diff(ck["signature"], expect)
        raise TrainError(f"cannot resume from {path}: it was trained with {diff[0]}={diff[1]!r}, this run has {diff[2]!r}")
    return ck


def _first_diff(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_diff(a.get(k), b.get(k), f"{prefix}{k}.")
    return prefix.rstrip("."), a, b


def export_head(head, out_dir, dtype=torch.bfloat16, with_lm_head: bool = True):
    """An EAGLE-3 folder in the official / SpecForge layout (config.json + model.safetensors: fc, midlayer.*,
    norm, lm_head), as vLLM's and SGLang's LlamaForCausalLMEagle3 load it. Without lm_head the config omits
    draft_vocab_size: SGLang (load_lm_head_from_target), vLLM and draft.load_eagle then use the target's."""
    from safetensors.torch import save_file
    c, a = head.c, head.c.args
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
               hidden_size=a.dim, intermediate_size=a.intermediate_size, num_attention_heads=a.n_heads,
               num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.norm_eps,
               rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings,
               vocab_size=a.vocab_size, draft_vocab_size=c.draft_vocab_size, num_hidden_layers=1,
               tie_word_embeddings=False, target_hidden_size=c.fc_in // 3,
               eagle_config=dict(eagle_aux_hidden_state_layer_ids=list(c.aux_layers), use_aux_hidden_state=True),
               torch_dtype=str(dtype).removeprefix("torch."))
    if a.rope_scaling:
        cfg["rope_scaling"] = a.rope_scaling
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    if not with_lm_head:
        del sd["lm_head.weight"], cfg["draft_vocab_size"]
        cfg["load_lm_head_from_target"] = True
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    if out.exists():
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------- training loop

def lr_lambda(warmup: int, total: int, min_ratio: float = 0.0):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def autocast_ctx(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def train(args) -> dict:
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    device = torch.device(args.device)
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank = dist.get_rank()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    try:
        return _train(args, device, rank, world)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(args, device, rank, world) -> dict:
    from torch.utils.data import DistributedSampler
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    ck_path = out / CKPT_NAME
    if not args.resume and ck_path.exists():
        raise TrainError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
    if args.resume and not ck_path.exists():
        raise TrainError(f"nothing to resume: no {CKPT_NAME} in {out}")
    path = resolve_checkpoint(args.checkpoint)
    target = load_model(path, dtype=getattr(torch, args.target_dtype), device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    aux = aux_layer_ids(target, args.aux_layers)
    target.aux_layers = aux
    recs = [r for p in ([args.data] if isinstance(args.data, (str, Path)) else args.data)
            for r in read_records(p, target.args.vocab_size, min(args.max_len, target.args.max_position_embeddings))]
    head = new_head(target, aux, args.rope_theta, seed=args.seed)
    head.lm_head.weight.requires_grad_(not args.freeze_lm_head)
    sig = signature(target, head, args.freeze_lm_head)
    ck = load_checkpoint(ck_path, sig) if args.resume else None
    if ck is not None:
        head.load_state_dict(ck["model"])
    model = TTTLoss(head, args.ttt_steps, args.logits_chunk,
                    torch.bfloat16 if args.bf16 else torch.float32)
    ddp = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    batches = make_batches(recs, args.batch_tokens)
    sampler = DistributedSampler(batches, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    per_epoch = len(sampler)
    total = per_epoch * args.epochs if args.max_steps is None else min(args.max_steps, per_epoch * args.epochs)
    warmup = max(1, int(args.warmup * total) if args.warmup < 1 else int(args.warmup))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total, args.min_lr_ratio))
    step = 0
    if ck is not None:
        opt.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
        torch.set_rng_state(ck["rng"])
        if ck.get("cuda_rng") is not None and device.type == "cuda":
            torch.cuda.set_rng_state(ck["cuda_rng"], device)
    pad_id = target.args.eos_ids[0] if target.args.eos_ids else 0
    hist_path = out / "history.json"
    history = json.loads(hist_path.read_text())[:step] if ck is not None and hist_path.is_file() else []
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        n_sup = sum(e - max(s, 2) for r in recs for s, e in r["spans"])
        log(f"{len(recs)} records, {sum(len(r['ids']) for r in recs)} tokens ({n_sup} supervised), "
            f"{len(batches)} batches/epoch, {total} steps, world {world}, ttt steps {args.ttt_steps}")

    def save():
        if rank == 0:
            atomic_save(dict(format=CKPT_FORMAT, signature=sig, model=head.state_dict(), optim=opt.state_dict(),
                             sched=sched.state_dict(), step=step, rng=torch.get_rng_state(),
                             cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                             args={k: v for k, v in vars(args).items() if k != "func"}), ck_path)

    bar = progress(total=total, initial=step, desc="train", unit="step")
    t_start = time.perf_counter()
    ema = None
    stop = min(total, args.stop_after) if args.stop_after else total
    while step < stop:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for k, bi in enumerate(sampler):
            if k < skip:
                continue
            tokens, sup = collate(recs, batches[bi], pad_id, device)
            cols, bias = loss_columns(tokens, target.args.vocab_size, args.loss_vocab)
            with autocast_ctx(device, args.bf16):
                aux_states, tgt = target_pass(target, tokens, sup, args.logits_chunk, cols)
                loss, acc, cnt = ddp(aux_states, tokens, sup, tgt, cols, bias)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            sched.step()
            step += 1
            lv = float(loss.detach())
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            accs = [round(float(a), 3) for a in acc]
            history.append(dict(step=step, loss=lv, acc=accs, grad_norm=float(gnorm), lr=sched.get_last_lr()[0]))
            bar.set_postfix_str(f"loss {ema:.3f} acc {' '.join(f'{a:.2f}' for a in accs)}")
            bar.update(1)
            if args.save_every and step % args.save_every == 0:
                save()
            if step >= stop:
                break
    bar.close()
    save()
    elapsed = time.perf_counter() - t_start
    res = dict(steps=step, seconds=elapsed, history=history)
    if rank == 0:
        hist_path.write_text(json.dumps(history))
        if args.export and step >= total:
            export_head(head, args.export, getattr(torch, args.export_dtype), with_lm_head=not args.no_lm_head)
            log(f"exported {args.export}")
    return res


# ---------------------------------------------------------------- evaluation

@torch.no_grad()
def mean_accepted_length(target: Transformer, head_dir, prompts: list[list[int]], max_new_tokens: int = 64,
                         topk: int = 10, depth: int = 5, nodes: int = 60) -> float:
    """Greedy speculative decoding with the exported head (full vocabulary) through generate.Engine:
    tokens emitted per target forward, bonus included (Spec-Bench / vLLM convention)."""
    w = target.lm_head.weight
    head = dr.load_eagle(head_dir, target, w.dtype, w.device)
    saved = target.aux_layers
    target.aux_layers = head.c.aux_layers
    try:
        eng = Engine(target, drafter=dr.EagleDrafter(head, make_vocab("full", head.lm_weight()), topk, depth, nodes))
        emitted = forwards = 0
        for p in prompts:
            out, st = eng.generate(list(p), max_new_tokens)
            emitted += sum(k * v for k, v in st.accept_hist.items())
            forwards += sum(st.accept_hist.values())
    finally:
        target.aux_layers = saved
    return emitted / max(forwards, 1)


# ---------------------------------------------------------------- CLI

def data_meta(args, ckpt_path: Path) -> dict:
    cfg = (ckpt_path / "config.json").read_bytes()
    w = ckpt_path / "model.safetensors"
    ident = hashlib.sha256(cfg + (str(w.stat().st_size).encode() if w.is_file() else b"")).hexdigest()[:16]
    keys = ["dataset", "num", "seed", "batch_size", "max_new_tokens", "request_tokens", "temperature", "sampled_frac",
            "min_request_chars"]
    return dict(kind="regenerated" if args.dataset else "magpie", target=ident,
                **{k: getattr(args, k) for k in keys if hasattr(args, k)})


def cmd_data(args):
    path = resolve_checkpoint(args.checkpoint)
    meta = data_meta(args, path)
    out = Path(args.out)
    meta_path = Path(str(out) + ".meta.json")
    if out.is_file() and meta_path.is_file() and not args.overwrite:
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in meta} == meta:
            log(f"{out} is up to date ({old.get('records')} records); reusing it")
            return 0
        log(f"{out} was made with other settings; regenerating")
    torch.manual_seed(args.seed)
    tok = Tokenizer(path)
    model = load_model(path, dtype=getattr(torch, args.dtype), device=args.device)
    if not model.args.eos_ids:
        raise TrainError(f"no eos_token_id in {path}; cannot tell where generations end")
    t0 = time.perf_counter()
    if args.dataset:
        convs = read_conversations(args.dataset)
        if args.num:
            rng = random.Random(args.seed)
            rng.shuffle(convs)
            convs = convs[:args.num]
        recs = answer_conversations(model, tok, convs, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, sampled_frac=1.0 if args.temperature > 0 else 0.0,
                                    seed=args.seed)
    else:
        recs = magpie_data(model, tok, args.num, batch_size=args.batch_size, request_tokens=args.request_tokens,
                           max_new_tokens=args.max_new_tokens, answer_temperature=args.temperature,
                           sampled_frac=args.sampled_frac, min_request_chars=args.min_request_chars, seed=args.seed)
    dt = time.perf_counter() - t0
    write_records(out, recs, meta)
    n_tok = sum(e - s for r in recs for s, e in r["spans"])
    log(f"wrote {len(recs)} records to {out}: {n_tok} generated tokens in {dt:.0f} s ({n_tok / max(dt, 1e-9):.0f} tok/s)")
    return 0


def cmd_export(args):
    ck = load_checkpoint(Path(args.run) / CKPT_NAME if Path(args.run).is_dir() else Path(args.run))
    path = resolve_checkpoint(args.checkpoint or ck["args"].get("checkpoint"))
    target = load_model(path, dtype=torch.float32)
    head = head_from_config(ck["signature"]["head"], target)
    head.load_state_dict(ck["model"])
    if args.no_lm_head and not torch.equal(head.lm_head.weight, target.lm_head.weight.float()):
        raise TrainError("--no-lm-head needs the head's lm_head to equal the target's (train with --freeze-lm-head)")
    export_head(head, args.out, getattr(torch, args.dtype), with_lm_head=not args.no_lm_head)
    log(f"exported {args.out}")
    return 0


def cmd_train(args):
    if args.no_lm_head and not args.freeze_lm_head:
        raise TrainError("--no-lm-head needs --freeze-lm-head (the exported head then shares the target's lm_head)")
    if args.ttt_steps < 1:
        raise TrainError(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    train(args)
    return 0


def parse_args(argv=None):
    cpu = not torch.cuda.is_available()
    p = argparse.ArgumentParser(description="Train full-vocabulary EAGLE-3 draft heads (training-time test)")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("data", help="generate training data with the target (cached jsonl)")
    d.add_argument("--checkpoint", default=None, help="target HF folder or hub id (default: embedded SmolLM2)")
    d.add_argument("--out", required=True, help="output jsonl (a .meta.json sidecar records how it was made)")
    d.add_argument("--dataset", default=None, help="ShareGPT/UltraChat jsonl whose assistant turns are regenerated; "
                                                   "omitted: self-generated (Magpie-style) instructions")
    d.add_argument("--num", type=int, default=1000, help="conversations (self-generated) or at most this many from --dataset")
    d.add_argument("--max-new-tokens", type=int, default=256, help="assistant tokens per turn")
    d.add_argument("--request-tokens", type=int, default=64, help="self-generated request budget (unfinished ones are dropped)")
    d.add_argument("--min-request-chars", type=int, default=12, help="self-generated: drop shorter requests")
    d.add_argument("--temperature", type=float, default=0.0, help="answer temperature (0 = greedy)")
    d.add_argument("--sampled-frac", type=float, default=0.0, help="self-generated: fraction of answers sampled at --temperature")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cuda" if not cpu else "cpu")
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    d.add_argument("--overwrite", action="store_true", help="regenerate even if the cached file matches")
    d.set_defaults(func=cmd_data)

    t = sub.add_parser("train", help="train an EAGLE-3 head with training-time test")
    t.add_argument("--checkpoint", default=None, help="target HF folder or hub id (default: embedded SmolLM2)")
    t.add_argument("--data", required=True, nargs="+", help="jsonl file(s) from `eagle_train.py data`")
    t.add_argument("--out", required=True, help="run folder (checkpoint.pt, history.json)")
    t.add_argument("--export", default=None, help="write the EAGLE-3 folder here at the end")
    t.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    t.add_argument("--ttt-steps", type=int, default=3 if cpu else 7, help="unrolled training-time-test steps")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--max-steps", type=int, default=None, help="schedule length: at most this many optimizer steps")
    t.add_argument("--stop-after", type=int, default=None,
                   help="end this invocation after step N (checkpointed; continue with --resume), schedule unchanged")
    t.add_argument("--batch-tokens", type=int, default=2048 if cpu else 16384, help="padded tokens per batch (per rank)")
    t.add_argument("--max-len", type=int, default=2048, help="truncate records to this many tokens")
    t.add_argument("--lr", type=float, default=5e-4 if cpu else 1e-4)
    t.add_argument("--min-lr-ratio", type=float, default=0.0)
    t.add_argument("--warmup", type=float, default=0.03, help="warmup steps (< 1: fraction of all steps)")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--freeze-lm-head", action=argparse.BooleanOptionalAction, default=cpu,
                   help="keep lm_head = the target's LM head (default on CPU)")
    t.add_argument("--aux-layers", default=None, help="three target layer ids, e.g. 2,15,27 (default 2,L//2,L-3)")
    t.add_argument("--rope-theta", type=float, default=None, help="the head's RoPE base (default: the target's)")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    t.add_argument("--target-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    t.add_argument("--logits-chunk", type=int, default=512, help="rows per LM-head chunk in the loss")
    t.add_argument("--loss-vocab", type=int, default=0,
                   help="0: exact soft CE over the full vocabulary; N: sampled softmax over N columns (the batch's "
                        "tokens + uniform negatives, log-corrected), much cheaper on CPU")
    t.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (0: only at the end)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cuda" if not cpu else "cpu")
    t.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    t.add_argument("--no-lm-head", action="store_true", help="export without lm_head.weight (frozen head only)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("export", help="export a run's checkpoint as an EAGLE-3 folder")
    e.add_argument("--run", required=True, help="run folder or checkpoint.pt")
    e.add_argument("--out", required=True)
    e.add_argument("--checkpoint", default=None, help="target (default: the one the run used)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    e.add_argument("--no-lm-head", action="store_true", help="omit lm_head.weight (it must equal the target's)")
    e.set_defaults(func=cmd_export)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return args.func(args)
    except (TrainError, ModelError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
