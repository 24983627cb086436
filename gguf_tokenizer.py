"""The tokenizer of a GGUF file as tokenizer.json and tokenizer_config.json (the `tokenizers` library's BPE with the
file's vocabulary, merges and pre-tokenizer rule, its special tokens and chat template)."""
import json
import pathlib

from errors import CheckpointError


def meta(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def write_tokenizer(reader, out: pathlib.Path, ids: dict, ctx: int) -> None:
    """Rebuild the byte-level BPE tokenizer.json from the GGUF vocab and merges."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model, pre = meta(reader, "tokenizer.ggml.model"), meta(reader, "tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":  # other pre-tokenizers split text differently: no guessing
        raise CheckpointError(f"unsupported GGUF tokenizer {model}/{pre} (want gpt2/smollm)")
    tokens = list(meta(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ")) for m in meta(reader, "tokenizer.ggml.merges")]
    assert all(len(m) == 2 for m in merges), "byte-level merges never contain a raw space"
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=None,
                               fuse_unk=False, byte_fallback=False))
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then the GPT-2 regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta(reader, "tokenizer.ggml.token_type")
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == gguf.TokenType.CONTROL])
    tok.save(str(out / "tokenizer.json"))
    name = lambda i: None if i is None else tokens[i]
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(ids["bos"]), "eos_token": name(ids["eos"]),
        "pad_token": name(ids["pad"]), "unk_token": name(ids["unk"]),
        "add_bos_token": bool(meta(reader, "tokenizer.ggml.add_bos_token", False)), "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "model_max_length": ctx,
        "chat_template": meta(reader, "tokenizer.chat_template")})


def write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
