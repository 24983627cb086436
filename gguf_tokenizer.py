"""The tokenizer of a GGUF file as tokenizer.json and tokenizer_config.json: the `tokenizers` library's BPE with the
file's vocabulary and merges, its pre-tokenizer rule, special tokens and chat template, splitting text as llama.cpp
does (src/llama-vocab.cpp; its `llama-tokenize` is the oracle, see test_gguf_tokenizer.py and bench_tokenizer.py)."""
import json
import pathlib
import re
from dataclasses import dataclass

from errors import CheckpointError

# llama.cpp's regexes (llm_tokenizer_bpe), in the forms it adapted them to; each splits the pieces of the one before.
_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # contractions, either case
_WORD = r"[^\r\n\p{L}\p{N}]?\p{L}+|"
_SPACE = r"|\s*[\r\n]+|\s+(?!\S)|\s+"
_REST = r" ?[^\s\p{L}\p{N}]+[\r\n]*" + _SPACE
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = _C + "|" + _WORD + r"\p{N}{1,3}|" + _REST
QWEN2 = _C + "|" + _WORD + r"\p{N}|" + _REST
QWEN35 = _C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*" + _SPACE
SEED_CODER = _C + "|" + _WORD + r"\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+" + _SPACE
BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|" + _WORD
              + r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
_CASED = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+{c}|"
          r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*{c}|")
TEKKEN = _CASED.replace("{c}", "") + r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _SPACE
GPT4O = _CASED.replace("{c}", _C + "?") + r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _SPACE
BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"
DEEPSEEK3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*" + _SPACE)

# llama.cpp's character classes are Unicode 15.1's, the tokenizers library's (Oniguruma) 16.0's: the 5,185 characters
# Unicode 16 added are in no class for llama.cpp (as unassigned ones), so every \p{..} here leaves them out.
_UNICODE_16 = """897 1B4E-1B4F 1B7F 1C89-1C8A 2427-2429 31E4-31E5 A7CB-A7CD A7DA-A7DC 105C0-105F3 10D40-10D65
    10D69-10D85 10D8E-10D8F 10EC2-10EC4 10EFC 11380-11389 1138B 1138E 11390-113B5 113B7-113C0 113C2 113C5
    113C7-113CA 113CC-113D5 113D7-113D8 113E1-113E2 116D0-116E3 11BC0-11BE1 11BF0-11BF9 11F5A 13460-143FA
    16100-16139 16D40-16D79 18CFF 1CC00-1CCF9 1CD00-1CEB3 1E5D0-1E5FA 1E5FF 1F8B2-1F8BB 1F8C0-1F8C1 1FA89 1FA8F
    1FABE 1FAC6 1FADC 1FADF 1FAE9 1FBCB-1FBEF"""
_NEW = "".join(re.sub(r"([0-9A-F]+)", r"\\x{\1}", _UNICODE_16).split())


def as_llama(regex: str) -> str:
    return re.sub(r"\\p\{(\w+)\}", lambda m: rf"[\p{{{m[1]}}}&&[^{_NEW}]]", regex)


@dataclass(frozen=True)
class Rule:
    regexes: tuple
    ignore_merges: bool = False  # a piece that is a whole vocabulary entry is that token, merges or not
    add_bos: bool = False  # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token


def _rules(names: str, rule: Rule) -> dict:
    return dict.fromkeys(names.split(), rule)


RULES = {  # tokenizer.ggml.pre -> llama.cpp's rule (llama_vocab::impl::load, llm_tokenizer_bpe)
    **_rules("default", Rule((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    **_rules("gpt-2 phi-2 gigachat a.x-4.0 mellum exaone4 mpt olmo jais trillion granite-docling", Rule((GPT2,))),
    **_rules("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", Rule((r"\p{N}", GPT2))),
    **_rules("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             Rule((LLAMA3,), True, True)),
    **_rules("dbrx smaug-bpe chatglm-bpe", Rule((LLAMA3,))),
    **_rules("glm4 glm5", Rule((LLAMA3,), True)),
    **_rules("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", Rule((QWEN2,))),
    **_rules("qwen35", Rule((QWEN35,))),
    **_rules("laguna", Rule((r"[^\n]+|[\n]+", QWEN2))),
    **_rules("tekken", Rule((TEKKEN,), True, True)),
    **_rules("gpt-4o llama4 kanana2 talkie minimax-m2", Rule((GPT4O,))),
    **_rules("deepseek-coder", Rule((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"))),
    **_rules("deepseek-v3 hunyuan-dense hy_v4 joyai-llm", Rule((r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3))),
    **_rules("falcon", Rule((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"))),
    **_rules("poro-chat bloom gpt3-finnish", Rule((BLOOM,))),
    **_rules("viking", Rule((BLOOM, r"\p{N}"))),
    **_rules("seed-coder", Rule((SEED_CODER,))),
    **_rules("minicpm5", Rule((r"\p{N}{1,3}", _C + "|" + _WORD + r"\p{N}+|" + _REST), True)),
    **_rules("bailingmoe bailingmoe2 llada-moe", Rule((BAILINGMOE,))),
    **_rules("ufakzeka", Rule((_WORD + r"\p{N}|" + _REST,))),
}
# Tokens llama.cpp makes control by name whatever their type (end of generation; FIM where the file names no FIM id,
# which real files mark control anyway), and gpt-oss's tokens it makes user-defined.
CONTROL_NAMES = set("""<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|end_of_text|> <EOT> _<EOT> [EOT]
    <｜end▁of▁sentence｜> <end_of_utterance> <|eom_id|> <|return|> <|call|> <|flush|> <|calls|> </s> [EOS] <eos>
    <turn|> <|tool_response> [e~[ <|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> ▁<PRE>
    <|code_prefix|>
    <|prefix|> <|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> ▁<SUF> <|code_suffix|> <|suffix|>
    <|fim_middle|> <fim-middle> <fim_middle> <｜fim▁end｜> <MID> ▁<MID> <|code_middle|> <|middle|> <|fim_pad|>
    <fim-pad> <fim_pad> <PAD> [PAD] <|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame> <|file_sep|>""".split())
USER_NAMES = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}


def meta(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def write_tokenizer(reader, out: pathlib.Path, ids: dict, ctx: int) -> None:
    """Rebuild the byte-level BPE tokenizer.json from the GGUF vocab and merges, with llama.cpp's splitting rule."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers

    model, pre = meta(reader, "tokenizer.ggml.model"), meta(reader, "tokenizer.ggml.pre", "default")  # as llama.cpp
    if model != "gpt2" or pre not in RULES:  # other models and rules split text differently: no guessing
        raise CheckpointError(f"unsupported GGUF tokenizer {model}/{pre} (want gpt2 with a pre-tokenizer of "
                              f"gguf_tokenizer.RULES: llama-bpe, qwen2, qwen35, smollm, gpt-2, tekken, gpt-4o, ...)")
    rule = RULES[pre]
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(meta(reader, "tokenizer.ggml.tokens"))]  # as llama.cpp
    tok = Tokenizer(_bpe(tokens, meta(reader, "tokenizer.ggml.merges"), rule.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(as_llama(r)), "isolated")
                                                 for r in rule.regexes]
                                                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(_specials(tokens, meta(reader, "tokenizer.ggml.token_type")))
    add_bos = bool(meta(reader, "tokenizer.ggml.add_bos_token", rule.add_bos))
    add_eos = bool(meta(reader, "tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(tokens, {k: ids[k] for k, on in (("bos", add_bos), ("eos", add_eos)) if on})
    tok.save(str(out / "tokenizer.json"))
    name = lambda i: None if i is None else tokens[i]
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(ids["bos"]), "eos_token": name(ids["eos"]),
        "pad_token": name(ids["pad"]), "unk_token": name(ids["unk"]), "add_bos_token": add_bos,
        "add_eos_token": add_eos, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": ctx, "chat_template": meta(reader, "tokenizer.chat_template")})


def _bpe(tokens: list, merges: list, ignore_merges: bool):
    from tokenizers import models
    vocab = {t: i for i, t in enumerate(tokens)}
    # llama.cpp keeps a pair's first rank; a merge outside the vocabulary would only fall back to bytes there
    pairs = (tuple(m.split(" ", 1)) for m in dict.fromkeys(merges))
    merges = [p for p in pairs if len(p) == 2 and p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab]
    return models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)


def _specials(tokens: list, types: list | None) -> list:
    """llama-tokenize parses special tokens: control (and unknown) tokens and user-defined ones split out of text;
    only control ones are special (skipped when decoding)."""
    from gguf import TokenType
    from tokenizers import AddedToken
    types = types or [TokenType.NORMAL] * len(tokens)
    control = [(ty in (TokenType.CONTROL, TokenType.UNKNOWN) or t in CONTROL_NAMES) and t not in USER_NAMES
               for t, ty in zip(tokens, types)]
    return [AddedToken(t, special=c, normalized=False) for t, ty, c in zip(tokens, types, control)
            if c or ty == TokenType.USER_DEFINED or t in USER_NAMES]


def _post_processor(tokens: list, ends: dict):
    """llama_tokenize(add_special=true): BOS and / or EOS around the text, as the file asks."""
    from tokenizers import processors
    if None in ends.values():
        raise CheckpointError(f"this GGUF tokenizer adds {'/'.join(ends).upper()} but names no such token")
    if not ends:
        return processors.ByteLevel(trim_offsets=False)
    b, e = ([tokens[ends[k]]] if k in ends else [] for k in ("bos", "eos"))
    return processors.TemplateProcessing(single=b + ["$A"] + e, pair=b + ["$A"] + e + b + ["$B:1"] + e,
                                         special_tokens=[(tokens[i], i) for i in ends.values()])


def write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
