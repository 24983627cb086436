"""GGUF files as HF folders the engine loads: llama.cpp's tensor names and metadata (llama, qwen2, qwen3) mapped to
HF's, llama's q/k rows unpermuted, every tensor widened to bf16 or (native) its quantized matrices kept as their
codes (quant.QWeight: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), the embedding's too (qlinear.QEmbedding)."""
import os
import pathlib
import re
import sys

import numpy as np

from errors import CheckpointError
from gguf_tokenizer import meta, write_json, write_tokenizer

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's end-of-generation tokens besides the eos id (llama-vocab.cpp: special_eog_ids), by text
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF name; None for tensors HF has no slot for (e.g. rope_freqs)."""
    base, _, suffix = name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}" if base in _TOP_NAMES else None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (llama only): it rotates interleaved pairs, HF rotates halves, so per
    head GGUF rows are ordered (i, half) and HF's (half, i)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path):
    """A gguf.GGUFReader of path, or one CheckpointError: a file cut short or not a GGUF at all."""
    import gguf
    path = pathlib.Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader fails with IndexError, ValueError, ... on damaged headers
        line = next((s.strip() for s in str(e).splitlines() if s.strip()), type(e).__name__)[:160]
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated or corrupt: {line})") from None
    size = path.stat().st_size
    if (end := max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)) > size:
        raise CheckpointError(f"{path} is truncated: its tensors need {end:,} bytes, the file has {size:,}")
    return reader


def convert_gguf(gguf_path: pathlib.Path | str, out: pathlib.Path | str, native: bool = False) -> None:
    """Write an HF folder (safetensors, configs, tokenizer) from a GGUF file: every tensor widened to bf16, or
    (native) its quantized matrices kept as they are in quant.py's layout (q/k rows unpermuted with their scales)."""
    from safetensors.torch import save_file

    reader = open_gguf(gguf_path)
    arch = meta(reader, "general.architecture")
    if arch not in ARCHS:
        raise CheckpointError(f"{gguf_path}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHS)})")
    key = lambda k, default=None: meta(reader, f"{arch}.{k}", default)
    n_head = int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", n_head))
    names = {t.name for t in reader.tensors}
    tensors, kinds = _tensors(reader, arch, n_head, n_kv, native), {}
    for t in reader.tensors:
        if gguf_to_hf_name(t.name) and t.tensor_type.name not in ("F32", "F16", "BF16") and native:
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    save_file(tensors, str(pathlib.Path(out) / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(pathlib.Path(out) / "model.safetensors", 0o644)  # safetensors writes 0600; others may read it
    d, emb = int(key("embedding_length")), _rows(tensors, "model.embed_tokens")
    ids = _special_ids(reader)
    head_dim = int(key("attention.key_length", key("rope.dimension_count", d // n_head)))
    f32 = lambda x: float(str(np.float32(x)))  # GGUF stores f32: keep 1e-05, not 9.99999974e-06
    ctx = int(key("context_length", 4096))
    write_json(pathlib.Path(out) / "config.json", {
        "architectures": [ARCHS[arch]], "model_type": arch, "hidden_size": d,
        "intermediate_size": int(key("feed_forward_length", _rows(tensors, "model.layers.0.mlp.gate_proj"))),
        "num_hidden_layers": int(key("block_count")), "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "head_dim": head_dim, "hidden_act": "silu", "vocab_size": emb, "max_position_embeddings": ctx,
        "rms_norm_eps": f32(key("attention.layer_norm_rms_epsilon")), "rope_theta": f32(key("rope.freq_base", 1e4)),
        "rope_scaling": _rope_scaling(reader, key), "attention_bias": arch == "qwen2", "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "torch_dtype": "bfloat16", "use_cache": True,
        **({"quantization_config": {"quant_method": "nanospec", "mode": "gguf", "gguf_types": kinds}}
           if kinds else {})})
    write_json(pathlib.Path(out) / "generation_config.json", {"bos_token_id": ids["bos"], "eos_token_id": ids["eog"],
                                                              "pad_token_id": ids["pad"]})
    write_tokenizer(reader, pathlib.Path(out), ids, ctx)


def _tensors(reader, arch: str, n_head: int, n_kv: int, native: bool) -> dict:
    """HF-named tensors: bf16, or (native) quantized matrices as quant.QWeight's checkpoint tensors."""
    import gguf
    import torch
    from tqdm import tqdm

    import quant
    tensors = {}
    for t in tqdm(reader.tensors, desc="converting", unit="tensor", file=sys.stderr):
        if (name := gguf_to_hf_name(t.name)) is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        heads = n_head if ".attn_q." in t.name else n_kv if ".attn_k." in t.name else 0
        heads = heads if arch == "llama" else 0  # llama.cpp permutes q/k rows for llama only (NEOX RoPE elsewhere)
        kind = t.tensor_type.name
        if native and len(shape) == 2 and kind not in ("F32", "F16", "BF16"):
            if kind not in quant.GGUF_TYPES:
                raise CheckpointError(f"tensor {t.name} has type {kind}; GGUF files load as they are with "
                                      f"{', '.join(quant.GGUF_TYPES)} matrices (or F32 / F16 / BF16)")
            qw = quant.from_gguf(np.asarray(t.data).reshape(shape[0], -1), kind, shape[1])
            if heads:  # every per-row tensor moves with its row
                qw = qw.take(torch.from_numpy(unpermute_qk(np.arange(shape[0]), heads).copy()))
            tensors.update(qw.tensors(name.removesuffix(".weight")))
            continue
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if heads:
            w = unpermute_qk(w, heads)
        tensors[name] = torch.from_numpy(np.array(w, order="C")).to(torch.bfloat16)  # copy: memmap is read-only
    return tensors


def _rope_scaling(reader, key) -> dict | None:
    """HF's rope_scaling from the file: linear scaling, or Llama 3.1's frequency factors (its rope_freqs tensor)."""
    kind = key("rope.scaling.type")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return {"rope_type": "freq_factors", "factors": [float(x) for x in np.asarray(freqs.data).reshape(-1)]}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    raise CheckpointError(f"RoPE scaling {kind!r} is not supported (linear, or Llama 3.1's frequency factors)")


def _special_ids(reader) -> dict:
    """bos, eos, unk and pad ids, and the ids that end a generation (eog: eos first, as llama.cpp finds them)."""
    get = lambda k: None if meta(reader, k) is None else int(meta(reader, k))
    names = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding", "eot": "eot", "eom": "eom"}
    ids = {k: get(f"tokenizer.ggml.{n}_token_id") for k, n in names.items()}
    ids["pad"] = ids["eos"] if ids["pad"] is None else ids["pad"]
    tokens, types = meta(reader, "tokenizer.ggml.tokens") or [], meta(reader, "tokenizer.ggml.token_type") or []
    control = [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3 and t in EOG_TEXTS]  # 3: CONTROL
    eog = [ids["eos"], ids["eot"], ids["eom"]] + control
    ids["eog"] = list(dict.fromkeys(i for i in eog if i is not None))
    return ids


def _rows(tensors: dict, base: str) -> int:
    return (tensors[base + ".weight"] if base + ".weight" in tensors else tensors[base + ".qweight"]).shape[0]
