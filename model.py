"""The target transformer (Llama-3.x / SmolLM2 / Qwen2 / Qwen3 in HF weight layout), gpt-fast style: one forward
serves prefill, decode and tree verification (explicit mask over the static KV cache)."""
import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

import cpu_forward
import cpu_gemm
import qlinear
import quant
from errors import ModelError

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class ModelArgs:
    arch: str = "LlamaForCausalLM"
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    vocab_size: int = 49152
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    eos_ids: list = field(default_factory=list)
    bos_id: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        arch = (cfg.get("architectures") or [None])[0]
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        try:
            dim, n_heads, eos = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("eos_token_id")
            rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests RoPE settings here
            scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            return cls(arch=arch, dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                       intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                       n_kv_heads=cfg.get("num_key_value_heads") or n_heads, norm_eps=cfg.get("rms_norm_eps", 1e-6),
                       head_dim=cfg.get("head_dim") or dim // n_heads, bos_id=cfg.get("bos_token_id"),
                       rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))), rope_scaling=scaling,
                       max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                       qk_norm=arch == "Qwen3ForCausalLM", eos_ids=[eos] if isinstance(eos, int) else list(eos or []))
        except KeyError as e:
            raise ModelError(f"config.json lacks required field {e.args[0]!r}") from None


def kv_dtype(dtype, device) -> torch.dtype:
    # CPU SDPA in bf16/fp16 is ~10x slower than in fp32 (head_dim 64): the CPU cache and attention run in fp32.
    return torch.float32 if torch.device(device).type == "cpu" else dtype


class KVCache(nn.Module):
    def __init__(self, max_batch, max_seq, n_kv_heads, head_dim, dtype, device=None, kv: Tensor | None = None):
        # kv: this layer's [2, Hkv, S, hd] slice of the model's one cache tensor (the fused CPU pass, batch 1)
        super().__init__()
        dtype = kv_dtype(dtype, device if device is not None else "cpu")
        shape = (max_batch, n_kv_heads, max_seq, head_dim)
        for i, name in enumerate("kv"):
            buf = torch.zeros(shape, dtype=dtype, device=device) if kv is None else kv[i][None]
            self.register_buffer(name, buf, persistent=False)

    def update(self, cache_pos: Tensor, k: Tensor, v: Tensor):
        # cache_pos [T]; k, v [B, Hkv, T, hd]. index_copy_ keeps shapes static (no slicing by Python ints).
        B = k.shape[0]
        self.k[:B].index_copy_(2, cache_pos, k)
        self.v[:B].index_copy_(2, cache_pos, v)
        return self.k[:B], self.v[:B]


class Linear(nn.Linear):
    """nn.Linear whose bf16 CPU products go through cpu_gemm where chosen: row-invariant, cheap extra rows."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("packed", None, persistent=False)  # cpu_gemm.pack(weight), set by cpu_gemm.pack_linears

    def forward(self, x: Tensor) -> Tensor:
        return cpu_gemm.linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 as HF does, then cast back before the weight multiply (HF order).
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [B, H, T, hd]; cos/sin [T, hd] or [B, 1, T, hd] (HF rotate-half layout: HF q/k weights need no permutation)
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def rope_cache(max_seq: int, head_dim: int, base: float, scaling: dict | None) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # fp32 as HF
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":  # Llama-3.1 frequency-dependent scaling
        factor, lo, hi = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "freq_factors":  # a GGUF's rope_freqs (Llama 3.1's llama3 scaling, as llama.cpp stores it)
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    elif kind not in (None, "default"):
        raise ModelError(f"unsupported rope_scaling type {kind!r}")
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, hd]
    return emb.cos(), emb.sin()


# Exact attention: speculative output must equal autoregressive output bit for bit, but SDPA's reductions depend on
# where the unmasked keys sit, so bf16 near-ties flip. Keys split at logical position p - RECENT + 1: earlier ones in
# one flash pass at their own slots, the last RECENT gathered into logical order, then a log-sum-exp merge (exact for
# chains of any length and trees shallower than RECENT).
RECENT = 16


def causal_recent(input_pos: Tensor, W: int = RECENT) -> Tensor:
    """[T] positions of rows whose keys sit at slot == position -> [T, W] slots of their last W keys (-1: none)."""
    j = input_pos[:, None] - (W - 1) + torch.arange(W, device=input_pos.device)
    return torch.where(j >= 0, j, -1)


def tree_mask(seq_range: Tensor, anc: Tensor, n: Tensor) -> Tensor:
    """[N, S] bool: every node sees the cached prefix (slots < n) and its own ancestors (slots n + j)."""
    N = anc.shape[0]
    cols = torch.zeros(N, seq_range.shape[0], dtype=torch.bool, device=anc.device)
    cols = cols.index_copy(1, n + torch.arange(N, device=anc.device), anc)
    return (seq_range[None, :] < n) | cols


def tree_recent(anc: Tensor, depth: Tensor, n: Tensor, W: int = RECENT) -> Tensor:
    """[N, W] slots of each node's last W keys in logical order: the prefix at slot == position, ancestors at n + j."""
    N, dev = anc.shape[0], anc.device
    lv = torch.arange(N, device=dev)  # depth < N: chains of any length work too
    anc_at = torch.argmax((anc[:, None, :] & (depth[None, None, :] == lv[None, :, None])).int(), dim=-1)  # [N, N]
    j = (n + depth)[:, None] - (W - 1) + torch.arange(W, device=dev)  # [N, W] logical positions
    in_tree = n + anc_at.gather(1, (j - n).clamp(0, N - 1))
    return torch.where(j < n, torch.where(j >= 0, j, -1), in_tree)


def exact_plan(input_pos: Tensor, recent: Tensor, seq_range: Tensor, n_groups: int, rows: int | None = None) -> tuple:
    """Every layer's exact_attention inputs: the flash half's additive mask [g*T', S], its emptiness [T'] and the
    recent half's slots. rows: attention's pass size T' >= T (exact.py), padded with copies of the last row."""
    T = input_pos.shape[0]
    if rows is not None and rows > T:
        input_pos = torch.cat([input_pos, input_pos[-1:].expand(rows - T)])
        recent = torch.cat([recent, recent[-1:].expand(rows - T, -1)])
    split = input_pos - (recent.shape[1] - 1)  # [T]
    mask = torch.zeros(input_pos.shape[0], seq_range.shape[0], device=input_pos.device)
    mask = mask.masked_fill(seq_range[None, :] >= split[:, None], float("-inf")).repeat(n_groups, 1)
    return mask, split > 0, recent.clamp(min=0).flatten(), recent < 0


def exact_attention(q: Tensor, k: Tensor, v: Tensor, plan: tuple) -> Tensor:
    """q [B, H, T, hd]; k, v [B, Hkv, S, hd] fp32; plan from exact_plan -> [B, H, T, hd]."""
    mask, has_flash, idx, pad = plan
    B, H, T0, hd = q.shape
    T = has_flash.shape[0]  # the plan's rows: the query rows past T0 are copies of the last one
    if T > T0:
        q = torch.cat([q, q[:, :, -1:].expand(B, H, T - T0, hd)], 2)
    Hkv, W = k.shape[1], pad.shape[-1]
    g, scale = H // Hkv, hd ** -0.5
    # query heads sharing a KV head become extra query rows: no repeat_interleave copy of the cache
    oa, la = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(B, Hkv, g * T, hd), k, v, attn_mask=mask, scale=scale)[:2]
    oa, la = oa.reshape(B, Hkv, g, T, hd), la.reshape(B, Hkv, g, T)
    la = torch.where(has_flash, la, float("-inf"))  # an empty flash half (early positions) has no weight
    # recent half: elementwise products, sums over a fixed axis: a row's arithmetic ignores T (flash kernels do not)
    kb = k.index_select(2, idx).view(B, Hkv, 1, T, W, hd)
    vb = v.index_select(2, idx).view(B, Hkv, 1, T, W, hd)
    s = ((q.view(B, Hkv, g, T, 1, hd) * kb).sum(-1) * scale).masked_fill(pad, float("-inf"))  # [B, Hkv, g, T, W]
    mb = s.amax(-1)  # finite: a row's own key is always in its recent half
    e = torch.exp(s - mb[..., None])
    sb = e.sum(-1)
    ob = (e[..., None] * vb).sum(-2) / sb[..., None]  # [B, Hkv, g, T, hd]
    lb = mb + torch.log(sb)
    # log-sum-exp merge in plain mul/add/exp/div: fused ops (lerp) round differently in vector body and scalar tail
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m)[..., None], torch.exp(lb - m)[..., None]
    return ((wa * oa + wb * ob) / (wa + wb)).reshape(B, H, T, hd)[:, :, :T0]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, in_dim: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        in_dim = in_dim or a.dim
        self.q_proj = Linear(in_dim, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = Linear(in_dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = Linear(in_dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        if a.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(a.head_dim, a.norm_eps), RMSNorm(a.head_dim, a.norm_eps)
        self.qk_norm = a.qk_norm
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache_pos: Tensor, exact=None) -> Tensor:
        # exact: None, or exact_plan(...) for exact_attention (mask then unused)
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        c = self.kv_cache
        k, v = c.update(cache_pos, k.to(c.k.dtype), v.to(c.k.dtype))  # [B, Hkv, S, hd]
        q = q.to(k.dtype)
        if exact is not None:
            y = exact_attention(q, k, v, exact)
        else:  # enable_gqa: SDPA broadcasts KV heads instead of copying them
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(y.to(x.dtype).transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = Linear(a.dim, a.intermediate_size, bias=False)
        self.up_proj = Linear(a.dim, a.intermediate_size, bias=False)
        self.down_proj = Linear(a.intermediate_size, a.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.dim, a.norm_eps)
        self.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, cos, sin, mask, cache_pos, exact=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_pos, exact)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(frozen=True)
class Plan:
    """What an engine asks of the target's passes, passed with each call (engines may share a model; nothing of it
    is set on the model): the layers whose inputs return_hidden also returns (its EAGLE-3 head's aux layers), and
    --no-exact's pass size from which the PyTorch layers run (cpu_forward.layers_from)."""
    aux_layers: tuple[int, ...] = ()
    layers_from: int | None = None


NO_PLAN = Plan()


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.lm_head = Linear(a.dim, a.vocab_size, bias=False)
        self.max_batch = self.max_seq = self.slots = -1
        self.cpu_pass: cpu_forward.Stack | None = None  # the fused CPU pass (bf16 on CPU, cpu_forward.py)
        self.kv: Tensor | None = None  # [L, 2, Hkv, S, hd]: every layer's KV cache in one tensor, for cpu_pass
        self.kt: Tensor | None = None  # the same keys transposed for cpu_pass's scores (cpu_forward.transposed_keys)

    def eagle3_aux_layers(self) -> tuple[int, int, int]:
        return (2, self.args.n_layers // 2, self.args.n_layers - 3)

    def setup_caches(self, max_batch: int, max_seq: int, slots: int | None = None):
        """Allocate the static KV cache and RoPE tables; max_seq bounds prompt + generated + tree nodes; slots: KV
        slots when they outnumber positions (batch.py: one range of max_seq slots per sequence)."""
        slots = slots or max_seq
        if max_seq > self.args.max_position_embeddings:
            raise ModelError(f"sequence of {max_seq} tokens exceeds the model's "
                             f"{self.args.max_position_embeddings} positions")
        if (max_batch, max_seq, slots) == (self.max_batch, self.max_seq, self.slots):
            return
        self.max_batch, self.max_seq, self.slots = max_batch, max_seq, slots
        p, a = self.norm.weight, self.args  # (a quantized head's .weight widens it: 3.8 s for Qwen's)
        # the fused CPU pass's bf16 cache in one tensor, and its keys again, transposed for the AVX-512 BF16 scores
        self.kv = torch.zeros(a.n_layers, 2, a.n_kv_heads, slots, a.head_dim, dtype=p.dtype, device=p.device) \
            if self.cpu_pass is not None and max_batch == 1 else None
        self.kt = None if self.kv is None else cpu_forward.transposed_keys(self.kv, zeros=True)
        for i, layer in enumerate(self.layers):
            att = layer.self_attn  # (its heads: a tensor-parallel rank's share, tp.py)
            att.kv_cache = KVCache(max_batch, slots, att.n_kv_heads, a.head_dim, p.dtype, p.device,
                                   None if self.kv is None else self.kv[i])
        cos, sin = rope_cache(max_seq, a.head_dim, a.rope_theta, a.rope_scaling)
        self.register_buffer("rope_cos", cos.to(p.device, p.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(p.device, p.dtype), persistent=False)
        self.register_buffer("seq_range", torch.arange(slots, device=p.device), persistent=False)

    def causal_mask(self, cache_pos: Tensor) -> Tensor:
        return self.seq_range[None, :] <= cache_pos[:, None]  # [T, S]: query at cache slot p sees slots <= p

    def forward(self, tokens: Tensor, input_pos: Tensor, mask: Tensor | None = None,
                cache_pos: Tensor | None = None, return_hidden: bool = False, compute_logits: bool = True,
                recent: Tensor | None = None, attn_rows: int | None = None, mask_base: Tensor | None = None,
                causal: bool = False, plan: Plan | None = None):
        """tokens [B, T]; input_pos [T] RoPE positions (or [B, T]); cache_pos [T] KV slots (default input_pos); mask
        [T, S] or [B, 1, T, S] bool (default causal), or [T, W] over slots mask_base[t] + [0, W) (batch.py: a row
        reads its sequence's range); recent [T, RECENT] (CPU): exact_attention over attn_rows rows. causal: the rows
        fill the whole cache in order (input_pos = cache_pos = 0..S-1, the trainer's teacher-forced pass), so the
        PyTorch layers take SDPA's is_causal, which skips the masked half (at 2,000 rows 35 ms a layer against
        66 ms with the mask, Zen 5). plan: aux layers and the layers' pass size (Plan).
        -> logits [B, T, V] (None if not compute_logits), or (logits, normed hidden, aux or None) with return_hidden."""
        if causal and (mask is not None or recent is not None or mask_base is not None
                       or tokens.shape[1] != self.slots):
            raise ValueError("causal: the rows must fill the cache, without a mask of their own")
        cache_pos = input_pos if cache_pos is None else cache_pos
        mask = self.causal_mask(cache_pos) if mask is None else mask
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, hd] or [B, T, hd]
        if input_pos.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        x = self.embed_tokens(tokens)  # [B, T, D]
        fused = self.kv is not None and tokens.shape[0] == 1 and input_pos.dim() == 1 and mask.dim() == 2
        plan = plan or NO_PLAN
        aux_ids = plan.aux_layers
        large = fused and plan.layers_from is not None and tokens.shape[1] >= plan.layers_from
        if fused and not large:
            # layers and final norm in one C call, row-invariant by construction: no exact mode needed (cpu_forward.py)
            h, aux = self.cpu_pass(x[0], cos, sin, mask, cache_pos, self.kv, aux_ids, kt=self.kt,
                                   norm=self.norm.weight, mask_base=mask_base)
            h, aux = h[None], (aux[None] if aux_ids else None)
        else:  # (a large --no-exact pass: the PyTorch layers with torch's GEMMs)
            with cpu_gemm.turned_off() if large else contextlib.nullcontext():
                h, aux = self._layers(x, cos, sin, input_pos, mask, cache_pos, recent, attn_rows, mask_base, causal,
                                      aux_ids)
        logits = self.lm_head(h) if compute_logits else None
        return (logits, h, aux) if return_hidden else logits

    def _layers(self, x, cos, sin, input_pos, mask, cache_pos, recent, attn_rows, mask_base, causal, aux_ids=()):
        """The decoder layers and final norm as PyTorch modules -> (normed hidden, aux_ids' inputs or None)."""
        if mask_base is not None:  # the window's columns at their slots
            j = self.seq_range[None, :] - mask_base[:, None]
            mask = (j >= 0) & (j < mask.shape[1]) & mask.gather(1, j.clamp(0, mask.shape[1] - 1))
        exact = None if recent is None else exact_plan(input_pos, recent, self.seq_range,
                                                        self.args.n_heads // self.args.n_kv_heads, attn_rows)
        states = {}
        for i, layer in enumerate(self.layers):
            if i in aux_ids:
                states[i] = x
            x = layer(x, cos, sin, None if causal else mask, cache_pos, exact)
        aux = torch.cat([states[i] for i in aux_ids], dim=-1) if states else None
        if self.kt is not None and self.kt.numel():  # these layers wrote K without its transposed copy
            self.kt.copy_(cpu_forward.transposed_keys(self.kv))
        return self.norm(x), aux

    @torch.no_grad()
    def compact_kv(self, src: Tensor | list[int], dst_start: Tensor | int):
        """Move KV rows at slots src [n] to dst_start + [0, n); a fixed n keeps shapes static (extras are rewritten)."""
        if (self.kv is not None and self.kv.device.type == "cpu" and self.kv.dtype == torch.bfloat16
                and not torch.compiler.is_compiling()):
            # eager CPU: one C call, skipping slots already in place (a chain's accepted path always is)
            d0 = int(dst_start)
            pairs = [(s, d0 + i) for i, s in enumerate(src.tolist() if torch.is_tensor(src) else src) if s != d0 + i]
            if not pairs or cpu_forward.compact(self.kv, self.kt, [a for a, _ in pairs], [b for _, b in pairs]):
                return
        dev = self.norm.weight.device  # (the caches' device: a list of slots would land on the CPU)
        src, dst_start = torch.as_tensor(src, device=dev), torch.as_tensor(dst_start, device=dev)
        dst = dst_start + torch.arange(src.shape[0], device=src.device)
        if self.kv is not None:  # one tensor: one gather and one scatter for every layer
            self.kv.index_copy_(3, dst, self.kv.index_select(3, src))
            if self.kt is not None and self.kt.numel():  # kt [L, Hkv, S/16, hd/2, 16]: slot s is lane s % 16
                self.kt[:, :, dst // 16, :, dst % 16] = self.kt[:, :, src // 16, :, src % 16]
            return
        for layer in self.layers:
            c = layer.self_attn.kv_cache
            # index_select copies first, so overlapping src/dst ranges are safe.
            c.k.index_copy_(2, dst, c.k.index_select(2, src))
            c.v.index_copy_(2, dst, c.v.index_select(2, src))


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise ModelError(f"no model.safetensors or model.safetensors.index.json in {path}")
    if missing := [f for f in files if not f.is_file()]:
        raise ModelError(f"missing weight shard {missing[0].name} in {path}")
    return files


def load_state_dict(files, dtype, device, strip_prefix: str = "") -> dict:
    """Read safetensors tensors one by one, casting each straight to (dtype, device): no fp32 copy of the model.
    Quantized weights' scales and offsets (quant.py) keep their fp16, their codes their integer types."""
    sd = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for k in fh.keys():
                    t = fh.get_tensor(k)
                    keep = not t.is_floating_point() or k.endswith((".scales", ".offsets"))
                    sd[k.removeprefix(strip_prefix)] = t.to(device, t.dtype if keep else dtype)
        except Exception as e:  # safetensors raises several types for corrupt files
            raise ModelError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
    return sd


def check_tensors(sd: dict, expected: dict, where: str):
    """Every tensor the module expects is in sd, with its shape, else one ModelError naming the first."""
    if missing := [k for k in expected if k not in sd]:
        raise ModelError(f"{where} lacks {len(missing)} tensors, e.g. {missing[0]!r}")
    for k, v in expected.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ModelError(f"{where}: tensor {k} has shape {tuple(sd[k].shape)}, expected {tuple(v.shape)}")


def load_model(path, dtype=torch.bfloat16, device="cpu", fast: bool = False) -> Transformer:
    """Build on the meta device, then assign the checkpoint tensors (no init, no conversion step). fast (draft
    models): its matrices on the integer GEMM (qlinear.QLinear.make_fast: other formats than 4 bits in groups of 32
    quantized again to it, once, saved with the kernel cache), not the bf16 GEMM's bits."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"checkpoint folder not found: {path}")
    if not (f := path / "config.json").is_file():
        raise ModelError(f"no config.json in {path}")
    try:
        cfg = json.loads(f.read_text())
        args = ModelArgs.from_hf_config(cfg)
        qrec = quant.read_record(cfg)
    except json.JSONDecodeError as e:
        raise ModelError(f"{f} is not valid JSON ({e.msg}, line {e.lineno})") from None
    except quant.QuantError as e:
        raise ModelError(f"{f}: {e}") from None
    gen = path / "generation_config.json"
    eos = (json.loads(gen.read_text()) if gen.is_file() else {}).get("eos_token_id")
    if eos is not None:  # generation_config's eos list is the one chat models stop on
        args.eos_ids = sorted(set(args.eos_ids) | set([eos] if isinstance(eos, int) else eos))
    with torch.device("meta"):
        model = Transformer(args)
    files = safetensor_files(path)
    sd = load_state_dict(files, dtype, device, strip_prefix="model.")
    tied = args.tie_word_embeddings or not any(k.startswith("lm_head.") for k in sd)
    if tied and "embed_tokens.qweight" in sd:  # a quantized tied embedding: the LM head reads the same codes
        sd.update({"lm_head" + k.removeprefix("embed_tokens"): v for k, v in list(sd.items())
                   if k.startswith("embed_tokens.")})
    if qrec is not None:  # quantized linears (quant.py): their codes, scales and offsets as stored
        cpu = torch.device(device).type == "cpu"
        if cpu:  # this machine picks the C kernel or torch's for them
            qlinear.choose(qlinear.schemes_of(sd))
        packed, fast_names = (qlinear.read_kernel_cache(path, files, fast) if cpu else None) or (None, frozenset())
        try:
            qlinear.swap_linears(model, sd, f"checkpoint {path}", packed, fast_names)
        except quant.QuantError as e:
            raise ModelError(str(e)) from None
        if fast and packed is None:  # other formats quantized again to 4 bits: a draft only proposes
            for m in model.modules():
                if isinstance(m, qlinear.QLinear):
                    m.make_fast(requantize=True)
        if cpu and packed is None:
            qlinear.keep_kernel_layout(model, path, files, fast)
        sd.update({k: v for k, v in model.state_dict().items() if v.device.type != "meta"})  # theirs now
    tied = tied and not isinstance(model.lm_head, qlinear.QLinear)
    if tied and "embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]  # tied: one tensor, two names
    expected = dict(model.state_dict())
    check_tensors(sd, expected, f"checkpoint {path}")
    model.load_state_dict({k: sd[k] for k in expected}, assign=True, strict=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:  # this machine picks its GEMM and its pass
        if shapes := [tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)]:
            cpu_gemm.choose(shapes)
        cpu_forward.attach(model)
    return model.eval()
