"""GGUF files as HF folders the engine loads: llama.cpp's tensor names and metadata mapped to HF's, q/k rows
unpermuted, every tensor widened to bf16 or (native) its quantized matrices kept as their codes (quant.py)."""
import os
import pathlib
import re
import sys

import numpy as np

from errors import CheckpointError
from gguf_tokenizer import meta, write_json, write_tokenizer


_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF Llama name; None for tensors HF has no slot for (e.g. rope_freqs)."""
    base, _, suffix = name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}" if base in _TOP_NAMES else None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: it rotates interleaved pairs, HF rotates halves, so per head GGUF rows
    are ordered (i, half) and HF's (half, i)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: pathlib.Path | str, out: pathlib.Path | str, native: bool = False) -> None:
    """Write an HF Llama folder (safetensors, configs, tokenizer) from a llama GGUF: every tensor widened to bf16,
    or (native) its Q8_0 / Q4_0 / Q4_1 matrices kept as they are, in quant.py's layout (codes, fp16 scales and
    offsets; q/k rows unpermuted with their scales), the embedding's rows widened for lookups only."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    import quant

    out, reader = pathlib.Path(out), gguf.GGUFReader(str(gguf_path))
    if (arch := meta(reader, "general.architecture")) != "llama":
        raise CheckpointError(f"{gguf_path}: only llama GGUFs are supported, got {arch!r}")
    n_head = int(meta(reader, "llama.attention.head_count"))
    n_kv = int(meta(reader, "llama.attention.head_count_kv", n_head))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    tensors, kinds = {}, {}
    for t in tqdm(reader.tensors, desc="converting", unit="tensor", file=sys.stderr):
        if (name := gguf_to_hf_name(t.name)) is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        rows = n_head if ".attn_q." in t.name else n_kv if ".attn_k." in t.name else 0  # permuted rows' heads
        kind = t.tensor_type.name
        matrix = len(shape) == 2 and not name.endswith("norm.weight")
        if native and matrix and kind not in ("F32", "F16", "BF16"):
            if kind not in quant.GGUF_TYPES:
                raise CheckpointError(f"{gguf_path}: tensor {t.name} has type {kind}; GGUF files load as they are "
                                      f"with {', '.join(quant.GGUF_TYPES)} matrices (or F32 / F16 / BF16)")
            q = quant.from_gguf_blocks(np.asarray(t.data).reshape(shape[0], -1), kind, shape[1])
            if rows:
                q = tuple(None if x is None else torch.from_numpy(unpermute_qk(x.numpy(), rows).copy()) for x in q)
            base = name.removesuffix(".weight")
            if name == "model.embed_tokens.weight":  # widened below for lookups; tied, its codes are the LM head
                base = "lm_head" if tied else None
            if base is not None:
                tensors[f"{base}.qweight"], tensors[f"{base}.scales"] = q[0], q[1]
                if q[2] is not None:
                    tensors[f"{base}.offsets"] = q[2]
                kinds[kind] = kinds.get(kind, 0) + 1
            if name != "model.embed_tokens.weight":
                continue
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if rows:
            w = unpermute_qk(w, rows)
        tensors[name] = torch.from_numpy(np.array(w, order="C")).to(torch.bfloat16)  # copy: memmap is read-only
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; others may read it
    get = lambda k: None if meta(reader, k) is None else int(meta(reader, k))
    names = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    ids = {k: get(f"tokenizer.ggml.{n}_token_id") for k, n in names.items()}
    ids["pad"] = ids["eos"] if ids["pad"] is None else ids["pad"]
    d, ctx = int(meta(reader, "llama.embedding_length")), int(meta(reader, "llama.context_length"))
    f32 = lambda x: float(str(np.float32(x)))  # GGUF stores f32: keep 1e-05, not 9.99999974e-06
    write_json(out / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": _rows(tensors, "model.layers.0.mlp.gate_proj"),
        "num_hidden_layers": int(meta(reader, "llama.block_count")), "num_attention_heads": n_head,
        "num_key_value_heads": n_kv, "head_dim": int(meta(reader, "llama.rope.dimension_count", d // n_head)),
        "hidden_act": "silu", "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "max_position_embeddings": ctx, "rms_norm_eps": f32(meta(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(meta(reader, "llama.rope.freq_base", 10000.0)), "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in tensors and "lm_head.qweight" not in tensors,
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "torch_dtype": "bfloat16", "use_cache": True,
        **({quant.CONFIG_KEY: {"quant_method": quant.METHOD, "mode": "gguf", "gguf_types": kinds}} if kinds else {})})
    # <|endoftext|> (the GGUF's unk id) ends documents; stop on it too in chat.
    eos = [ids["eos"]] + ([ids["unk"]] if ids["unk"] is not None and ids["unk"] != ids["eos"] else [])
    write_json(out / "generation_config.json", {"bos_token_id": ids["bos"], "eos_token_id": eos,
                                                 "pad_token_id": ids["pad"]})
    write_tokenizer(reader, out, ids, ctx)


def _rows(tensors: dict, base: str) -> int:
    return (tensors[base + ".weight"] if base + ".weight" in tensors else tensors[base + ".qweight"]).shape[0]
