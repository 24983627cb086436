"""EAGLE draft heads: EAGLE-1/2 (one decoder layer over fc([embedding; feature])) and EAGLE-3 (fc over
three target layers' states, then one layer), read from the official / SpecForge layouts."""
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from torch import Tensor

import cpu_forward
import cpu_gemm
from model import (Attention, KVCache, Linear, MLP, ModelArgs, ModelError, RMSNorm, Transformer, check_tensors,
                   load_state_dict, rope_cache)


@dataclass
class EagleConfig:
    version: int  # 1 = the EAGLE-1 head (EAGLE-2 reuses it, changing only the tree), 3 = EAGLE-3
    args: ModelArgs  # the draft layer's dims, norm eps and RoPE (from the head's own config)
    fc_in: int  # 2d (EAGLE-1/2) or 3 * d_target (EAGLE-3)
    fc_bias: bool
    draft_vocab_size: int
    aux_layers: tuple = ()

    @classmethod
    def from_folder(cls, path: Path, keys: dict, target: ModelArgs) -> "EagleConfig":
        cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        version = 3 if any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in keys) else 1
        if (fc := keys.get("fc.weight")) is None:
            raise ModelError(f"{path} is not an EAGLE head (no fc.weight)")
        d, heads, L = fc[0], cfg.get("num_attention_heads", target.n_heads), target.n_layers
        if d != target.dim:
            raise ModelError(f"draft hidden size {d} does not match the target's {target.dim}")
        rope = cfg.get("rope_parameters") or {}
        ctx = max(cfg.get("max_position_embeddings", 0), target.max_position_embeddings)
        # the draft's RoPE comes from its own config; official EAGLE-3 heads omit it: base 10000
        args = ModelArgs(arch="eagle", dim=d, n_layers=1, n_heads=heads, vocab_size=target.vocab_size,
                         n_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or d // heads,
                         intermediate_size=cfg.get("intermediate_size", target.intermediate_size),
                         norm_eps=cfg.get("rms_norm_eps", target.norm_eps), rope_scaling=cfg.get("rope_scaling"),
                         rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
                         max_position_embeddings=ctx, qkv_bias=any(k.endswith("q_proj.bias") for k in keys))
        eagle_cfg = cfg.get("eagle_config") or {}
        aux = tuple(eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("aux_layer_ids") or (2, L // 2, L - 3))
        if version == 3:
            if fc[1] != 3 * target.dim:
                raise ModelError(f"EAGLE-3 fc takes {fc[1]} inputs, expected 3 x target hidden size = {3 * target.dim}")
            if any(not 0 <= i < L for i in aux):
                raise ModelError(f"EAGLE-3 aux layers {list(aux)} do not exist in a {L}-layer target")
        elif fc[1] != 2 * d:
            raise ModelError(f"EAGLE fc takes {fc[1]} inputs, expected 2 x hidden size = {2 * d}")
        dv = cfg.get("draft_vocab_size", keys["lm_head.weight"][0] if "lm_head.weight" in keys else target.vocab_size)
        if version == 3 and dv > target.vocab_size:
            raise ModelError(f"draft vocabulary {dv} is larger than the target's {target.vocab_size}")
        return cls(version, args, fc[1], "fc.bias" in keys, dv, aux if version == 3 else ())


class EagleHead(nn.Module):
    """The EAGLE-1/2 head (version 1) and the EAGLE-3 head (version 3), parameter names as in the official releases."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.c, a = c, c.args
        self.fc = Linear(c.fc_in, a.dim, bias=c.fc_bias)
        layer = nn.Module()
        layer.self_attn = Attention(a, in_dim=2 * a.dim if c.version == 3 else a.dim)
        layer.mlp = MLP(a)
        layer.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)
        if c.version == 3:
            layer.input_layernorm, layer.hidden_norm = RMSNorm(a.dim, a.norm_eps), RMSNorm(a.dim, a.norm_eps)
            self.midlayer = layer
            self.norm = RMSNorm(a.dim, a.norm_eps)
            self.lm_head = nn.Linear(a.dim, c.draft_vocab_size, bias=False)
            if c.draft_vocab_size != a.vocab_size:
                self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
                self.register_buffer("t2d", torch.zeros(a.vocab_size, dtype=torch.bool))
        else:
            self.layers = nn.ModuleList([layer])
        self.embed_tokens: nn.Embedding | None = None  # the target's, attached by attach()
        self.target_lm_head: nn.Linear | None = None
        self.cpu_pass: cpu_forward.Stack | None = None  # EAGLE-3 on a bf16 CPU: the layer in one C call (load_eagle)
        self.kv: Tensor | None = None  # [1, 2, Hkv, S, hd]: the layer's KV cache as cpu_pass reads it

    @property
    def layer(self):
        return self.midlayer if self.c.version == 3 else self.layers[0]

    def setup_caches(self, max_seq: int):
        if getattr(self, "max_seq", None) == max_seq:
            return  # keep buffer addresses stable (captured CUDA graphs point at them)
        self.max_seq = max_seq
        a, w = self.c.args, self.fc.weight
        self.kv = torch.zeros(1, 2, a.n_kv_heads, max_seq, a.head_dim, dtype=w.dtype, device=w.device) \
            if self.cpu_pass is not None else None
        self.layer.self_attn.kv_cache = KVCache(1, max_seq, a.n_kv_heads, a.head_dim, w.dtype, w.device,
                                                None if self.kv is None else self.kv[0])
        cos, sin = rope_cache(max_seq, a.head_dim, a.rope_theta, a.rope_scaling)
        self.register_buffer("rope_cos", cos.to(w.device, w.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(w.device, w.dtype), persistent=False)
        self.register_buffer("seq_range", torch.arange(max_seq, device=w.device), persistent=False)

    def project(self, feats: Tensor) -> Tensor:
        """Target features -> draft input features: EAGLE-3 fuses the three aux states with fc."""
        return self.fc(feats) if self.c.version == 3 else feats

    def forward(self, tokens: Tensor, feats: Tensor, input_pos: Tensor, cache_pos: Tensor, mask: Tensor):
        """tokens [1, T], feats [1, T, d] (target features, already project()ed, or the draft's own output)
        -> (out [1, T, d] fed to deeper tree steps, lm_in [1, T, d] fed to the LM head)."""
        emb = self.embed_tokens(tokens)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        L = self.layer
        if self.kv is not None and tokens.shape[0] == 1 and mask.dim() == 2 and not torch.is_grad_enabled():
            # the whole layer in one C call (cpu_forward.py): a drafting level costs its weights, not ~100 eager ops
            h = self.cpu_pass(feats[0], cos, sin, mask, cache_pos, self.kv, emb=emb[0])[0][None]
            return h, self.norm(h)
        if self.c.version == 3:
            x = torch.cat([L.input_layernorm(emb), L.hidden_norm(feats)], dim=-1)  # embedding first
            h = feats + L.self_attn(x, cos, sin, mask, cache_pos)
        else:
            x = self.fc(torch.cat([emb, feats], dim=-1))
            h = x + L.self_attn(x, cos, sin, mask, cache_pos)
        h = h + L.mlp(L.post_attention_layernorm(h))
        return h, (self.norm(h) if self.c.version == 3 else h)

    def lm_weight(self) -> Tensor:
        return self.lm_head.weight if self.c.version == 3 else self.target_lm_head.weight

    def twin(self) -> "EagleHead":
        """A head with these weights (the same tensors, packed copies and C pass) and caches of its own: each
        sequence of a batch drafts with one (batch.py)."""
        with torch.device("meta"):
            t = EagleHead(self.c)
        t.load_state_dict(self.state_dict(keep_vars=True), assign=True, strict=True)
        for m, mt in zip(self.modules(), t.modules()):
            if "packed" in m._buffers:
                mt.packed = m.packed
        for k in ("embed_tokens", "target_lm_head", "cpu_pass", "fill_path"):
            object.__setattr__(t, k, getattr(self, k, None))
        return t.eval()


def read_keys(path: Path) -> tuple[dict, Path]:
    """{name: shape} of a head's weights (model.safetensors or pytorch_model.bin), names without 'model.'."""
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.is_file():
        try:
            with safe_open(str(st), framework="pt") as f:
                keys = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:
            raise ModelError(f"cannot read {st}: {str(e).splitlines()[0]}") from None
        return {k.removeprefix("model."): v for k, v in keys.items()}, st
    if pt.is_file():
        sd = torch.load(pt, map_location="meta", weights_only=True, mmap=True)
        return {k.removeprefix("model."): tuple(v.shape) for k, v in sd.items()}, pt
    raise ModelError(f"no model.safetensors or pytorch_model.bin in {path}")


def load_eagle(path, target: Transformer, dtype, device) -> EagleHead:
    path = Path(path)
    keys, wfile = read_keys(path)
    c = EagleConfig.from_folder(path, keys, target.args)
    with torch.device("meta"):
        head = EagleHead(c)
    if wfile.suffix == ".bin":
        sd = {k.removeprefix("model."): v for k, v in torch.load(wfile, map_location="cpu", weights_only=True).items()}
    else:
        sd = load_state_dict([wfile], dtype, device, strip_prefix="model.")
    if c.version == 3:  # SpecForge/vLLM exports sometimes name the midlayer layers.0
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.startswith("embed_tokens")}  # the target's embedding is used
    expected = head.state_dict()
    if c.version == 3 and c.draft_vocab_size != c.args.vocab_size and "d2t" not in sd:
        raise ModelError(f"EAGLE-3 head with draft vocabulary {c.draft_vocab_size} < {c.args.vocab_size} lacks d2t")
    if c.version == 3 and "lm_head.weight" not in sd and "draft_vocab_size" not in json.loads(
            (path / "config.json").read_text() if (path / "config.json").is_file() else "{}"):
        sd["lm_head.weight"] = target.lm_head.weight  # no draft vocabulary, no lm_head: the target's (as SGLang/vLLM)
    check_tensors(sd, expected, f"EAGLE head {path}")
    sd = {k: sd[k].to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in expected.items()}
    head.load_state_dict(sd, assign=True, strict=True)
    attach(head, target)
    cpu_gemm.pack_linears(head)  # where the target's load chose the kernel (bf16 on CPU)
    if c.version == 3 and cpu_forward.switched_on() and cpu_forward.fits(c.args, [head.midlayer]):
        head.cpu_pass = cpu_forward.Stack(c.args, [head.midlayer])
    # a frequency file shipped with the head (FR-Spec's format) fills NanoSpec's free slots (vocab.NanoSpecVocab)
    head.fill_path = path / "freq.pt" if (path / "freq.pt").is_file() else None
    return head.eval()


def attach(head: EagleHead, target: Transformer):
    # Not registered as submodules: the head must not own (or save) the target's tensors.
    object.__setattr__(head, "embed_tokens", target.embed_tokens)
    object.__setattr__(head, "target_lm_head", target.lm_head)
