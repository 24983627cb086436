"""Tests for gguf_tokenizer.py: for every pre-tokenizer rule of gguf_tokenizer.RULES, a tiny GGUF file (the 256 GPT-2
byte tokens, merges across the boundaries the rules split at, control / user-defined / unused tokens) whose
tokenizer.json must give, for each of TEXTS, the ids llama.cpp's `llama-tokenize` gives on the same file. The literal
ids (EXPECTED, BOS_EXPECTED) were recorded with llama.cpp commit 0c1e570 (vendored by llama-cpp-python 0.3.36) by

    python test_gguf_tokenizer.py /path/to/llama.cpp/build/bin/llama-tokenize

which writes the tiny files as the tests do, runs `llama-tokenize -m tiny.gguf -f text.txt --ids --log-disable
--no-escape [--no-bos]` on each text and prints the tables to paste here (IDS and WHICH make EXPECTED). With
LLAMA_TOKENIZE=/path/to/llama-tokenize set, test_live_llama_tokenize compares against the binary itself."""
import os
import pathlib
import sys

import pytest

import gguf_tokenizer
from conftest import gguf_byte_chars
from errors import CheckpointError
from tokenizer import Tokenizer

TEXTS = [
    "Hello world, it's HELLO's day: don't SHOUT'LL 'Re x'same",  # contractions and their case
    "1 12 123 1234 12345 x9y 3.14",  # digit runs
    "a!!! ... ?!\n b--c (x) [y] {z} <w> 'q' \"r\"",  # punctuation runs, a space before them, newlines after
    "x  y   z\t\tw \n\n  \r\n\r\nend  ",  # whitespace runs, newlines, CRLF, trailing spaces
    "héllo naïve e\u0301 中文 日本 😀 👍🏽 "
    "١٢٣ \u0897\U00013460x",  # letters, marks, CJK, emoji, digits, Unicode 16
    "a<|im_start|>b <|im_end|>\n<tool>x</tool> [PAD9]<|eot_id|>y",  # control / user-defined / unused tokens in text
    "camelCase XMLHttpRequest ABCdef",  # case runs
    "x=1;y+=2<3>$5^6|7~8`9 =`= a,b.c!d?e…f。g，h",  # symbols against punctuation, BLOOM's delimiters
]
# one name per distinct rule of gguf_tokenizer.RULES (test_every_rule_is_tested)
PRES = ["default", "gpt-2", "smollm", "llama-bpe", "dbrx", "glm4", "qwen2", "qwen35", "laguna", "tekken", "gpt-4o",
        "deepseek-coder", "deepseek-v3", "falcon", "bloom", "viking", "seed-coder", "minicpm5", "bailingmoe",
        "ufakzeka"]
# (text, GGUF token type): <|eot_id|> is control by its name alone; no merge reaches camelCase (ignore_merges)
FIRST_TOKENS = [("<s>", 3), ("</s>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool>", 4), ("</tool>", 4),
            ("[PAD9]", 5), ("<|eot_id|>", 1), ("camelCase", 1)]


def _whole(ch: str) -> list:  # the merges that build a multi-byte character from its bytes
    b = ch.encode()
    return [(b[:i], b[i:i + 1]) for i in range(1, len(b))]


MERGES = [m for ch in "é\u0301中文😀👍🏽١٢٣…\u0897\U00013460" for m in _whole(ch)] \
    + [(a.encode(), b.encode()) for a, b in [
    (" ", "1"), ("s", "a"), ("!", "\n"), (" ", " "), ("  ", " "), ("\t", "\t"), ("\n", "\n"), ("\r", "\n"),
    ("\r\n", "\r\n"), (" ", "\n"), (" ", "w"), (" w", "o"), ("H", "e"), ("He", "l"), ("Hel", "l"), ("Hell", "o"),
    ("'", "s"), ("'", "S"), ("'", "L"), ("'L", "L"), ("'", "R"), ("'R", "e"), ("n", "'"), ("1", "2"), ("12", "3"),
    ("123", "4"), ("1234", "5"), ("x", "9"), ("9", "y"), ("!", "!"), ("!!", "!"), (".", "."), ("..", "."), (" ", "."),
    ("?", "!"), ("-", "-"), (" ", "("), ("(", "x"), ("h", "é"), ("é", "l"), ("e", "\u0301"), (" ", "中"),
    ("中", "文"),
    (" ", "😀"), ("👍", "🏽"), ("١", "٢"), ("١٢", "٣"), ("\u0897", "\U00013460"), ("\U00013460", "x"),
    ("l", "C"),
    ("p", "R"), (";", "y"), ("+", "="), ("~", "8"), (",", "b"), ("…", "f"), ("<", "3"), ("$", "5"), ("=", "`")]]


def write_tiny_gguf(path, pre, model="gpt2", **keys):
    """The tiny vocabulary: FIRST_TOKENS, the 256 byte tokens, then each merge's result (deterministic bytes)."""
    import gguf
    chars = gguf_byte_chars()
    enc = lambda b: "".join(chars[x] for x in b)
    merged = list(dict.fromkeys(enc(a + b) for a, b in MERGES))
    tokens = [t for t, _ in FIRST_TOKENS] + chars + merged
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([ty for _, ty in FIRST_TOKENS] + [gguf.TokenType.NORMAL] * (len(chars) + len(merged)))
    w.add_token_merges([f"{enc(a)} {enc(b)}" for a, b in MERGES])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for k, v in keys.items():
        getattr(w, f"add_{k}")(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def convert(path) -> Tokenizer:
    import gguf
    out = path.parent / (path.stem + "_tok")
    out.mkdir()
    gguf_tokenizer.write_tokenizer(gguf.GGUFReader(str(path)), out, {"bos": 0, "eos": 1, "unk": None, "pad": 1}, 64)
    return Tokenizer(out)


# ---------------------------------------------------------------- recorded ids

# the distinct ids of each of TEXTS over the rules (IDS[i]), and which of them each rule gives (WHICH[rule][i])
IDS = [
    [  # TEXTS[0]
        [303, 299, 123, 117, 109, 53, 41, 114, 125, 48, 124, 41, 81, 78, 85, 85, 88, 48, 124, 41, 109, 106, 130, 67,
         41, 109, 120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 48, 85, 85, 41, 48, 91, 110, 41, 129, 48, 289, 118, 110],
        [303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41, 109,
         120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 48, 85, 85, 41, 48, 91, 110, 41, 129, 304, 106, 118, 110],
        [303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41, 109,
         120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 307, 41, 48, 91, 110, 41, 129, 304, 106, 118, 110],
        [303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41, 109,
         120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 307, 41, 48, 91, 110, 41, 129, 48, 289, 118, 110],
        [303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41, 109,
         120, 310, 125, 41, 92, 81, 88, 94, 93, 307, 41, 48, 91, 110, 41, 129, 304, 106, 118, 110],
        [303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41, 109,
         120, 310, 125, 41, 92, 81, 88, 94, 93, 307, 41, 309, 41, 129, 48, 289, 118, 110],
    ],
    [  # TEXTS[1]
        [58, 41, 311, 41, 312, 41, 312, 61, 41, 312, 61, 62, 41, 129, 66, 130, 41, 60, 55, 58, 61],
        [58, 288, 59, 288, 59, 60, 288, 59, 60, 61, 288, 59, 60, 61, 62, 41, 129, 66, 130, 41, 60, 55, 58, 61],
        [58, 41, 58, 59, 41, 58, 59, 60, 41, 58, 59, 60, 61, 41, 58, 59, 60, 61, 62, 41, 129, 66, 130, 41, 60, 55,
         58, 61],
        [58, 288, 59, 41, 312, 41, 312, 61, 41, 312, 61, 62, 41, 129, 66, 130, 41, 60, 55, 58, 61],
        [58, 288, 59, 288, 59, 60, 288, 59, 60, 61, 288, 59, 60, 61, 62, 41, 315, 130, 41, 60, 55, 58, 61],
    ],
    [  # TEXTS[2]
        [106, 318, 41, 320, 41, 322, 19, 41, 107, 323, 108, 41, 49, 129, 50, 41, 100, 130, 102, 41, 132, 131, 134,
         41, 69, 128, 71, 41, 48, 122, 48, 41, 43, 123, 43],
        [106, 318, 41, 320, 41, 322, 19, 41, 107, 323, 108, 324, 129, 50, 41, 100, 130, 102, 41, 132, 131, 134, 41,
         69, 128, 71, 41, 48, 122, 48, 41, 43, 123, 43],
        [106, 318, 41, 320, 41, 72, 290, 41, 107, 323, 108, 324, 129, 50, 41, 100, 130, 102, 41, 132, 131, 134, 41,
         69, 128, 71, 41, 48, 122, 48, 41, 43, 123, 43],
    ],
    [  # TEXTS[3]
        [129, 41, 41, 130, 291, 41, 131, 18, 18, 128, 41, 294, 291, 295, 22, 19, 110, 119, 109, 291],
        [129, 41, 41, 130, 291, 41, 131, 18, 18, 128, 41, 294, 291, 296, 110, 119, 109, 291],
        [129, 41, 41, 130, 291, 41, 131, 18, 18, 128, 41, 294, 291, 22, 19, 22, 19, 110, 119, 109, 291],
        [129, 41, 41, 130, 291, 41, 131, 18, 18, 128, 41, 19, 19, 291, 22, 19, 22, 19, 110, 119, 109, 291],
        [129, 41, 41, 130, 291, 41, 131, 293, 128, 41, 294, 291, 296, 110, 119, 109, 291],
    ],
    [  # TEXTS[4]
        [326, 117, 117, 120, 41, 119, 106, 204, 184, 127, 110, 41, 110, 266, 329, 270, 41, 239, 160, 174, 239, 165,
         181, 331, 41, 332, 41, 334, 41, 335, 129],
        [326, 117, 117, 120, 41, 119, 106, 204, 184, 127, 110, 41, 110, 266, 329, 270, 41, 239, 160, 174, 239, 165,
         181, 331, 41, 332, 41, 278, 279, 280, 41, 335, 129],
        [326, 117, 117, 120, 41, 119, 106, 204, 184, 127, 110, 41, 328, 329, 270, 41, 239, 160, 174, 239, 165, 181,
         331, 41, 332, 41, 278, 279, 280, 41, 335, 129],
        [326, 117, 117, 120, 41, 119, 106, 204, 184, 127, 110, 41, 110, 266, 41, 330, 41, 239, 160, 174, 239, 165,
         181, 331, 41, 332, 41, 278, 279, 280, 41, 284, 287, 129],
        [326, 117, 117, 120, 41, 119, 106, 204, 184, 127, 110, 41, 328, 41, 330, 41, 239, 160, 174, 239, 165, 181,
         331, 41, 332, 41, 334, 41, 284, 336],
        [326, 117, 117, 120, 41, 119, 106, 204, 184, 127, 110, 41, 328, 329, 270, 41, 239, 160, 174, 239, 165, 181,
         331, 41, 332, 41, 334, 41, 335, 129],
    ],
    [  # TEXTS[5]
        [106, 2, 107, 41, 3, 19, 4, 129, 5, 41, 100, 89, 74, 77, 66, 102, 7, 130],
    ],
    [  # TEXTS[6]
        [108, 106, 118, 110, 337, 106, 124, 110, 41, 97, 86, 85, 81, 125, 125, 338, 110, 122, 126, 110, 124, 125, 41,
         74, 75, 76, 109, 110, 111],
        [8, 41, 97, 86, 85, 81, 125, 125, 338, 110, 122, 126, 110, 124, 125, 41, 74, 75, 76, 109, 110, 111],
        [108, 106, 118, 110, 117, 76, 106, 124, 110, 41, 97, 86, 85, 81, 125, 125, 121, 91, 110, 122, 126, 110, 124,
         125, 41, 74, 75, 76, 109, 110, 111],
    ],
    [  # TEXTS[7]
        [129, 70, 58, 68, 130, 340, 59, 69, 60, 71, 45, 62, 103, 63, 133, 64, 135, 65, 105, 66, 41, 70, 105, 70, 41,
         106, 53, 107, 55, 108, 42, 109, 72, 110, 282, 111, 236, 137, 139, 112, 248, 197, 149, 113],
        [129, 70, 58, 68, 130, 340, 59, 69, 60, 71, 45, 62, 103, 63, 133, 64, 135, 65, 105, 66, 41, 346, 70, 41, 106,
         53, 107, 55, 108, 42, 109, 72, 110, 282, 111, 236, 137, 139, 112, 248, 197, 149, 113],
        [129, 70, 58, 339, 340, 59, 69, 60, 71, 45, 62, 103, 63, 133, 64, 135, 65, 105, 66, 41, 346, 70, 41, 106,
         342, 55, 108, 42, 109, 72, 110, 343, 236, 137, 139, 112, 248, 197, 149, 113],
        [129, 70, 58, 339, 340, 59, 69, 60, 71, 45, 62, 103, 63, 133, 64, 135, 65, 105, 66, 41, 346, 70, 41, 106,
         342, 55, 108, 42, 109, 72, 110, 282, 111, 236, 137, 139, 112, 248, 197, 149, 113],
        [129, 70, 58, 339, 340, 59, 344, 71, 345, 103, 63, 133, 64, 341, 105, 66, 41, 346, 70, 41, 106, 53, 107, 55,
         108, 42, 109, 72, 110, 282, 111, 236, 137, 139, 112, 248, 197, 149, 113],
        [129, 70, 58, 339, 340, 59, 69, 60, 71, 45, 62, 103, 63, 133, 64, 135, 65, 105, 66, 41, 346, 70, 41, 106, 53,
         107, 55, 108, 42, 109, 72, 110, 282, 111, 236, 137, 139, 112, 248, 197, 149, 113],
    ],
]
WHICH = {
    'default': [0, 0, 0, 0, 0, 0, 0, 0],
    'gpt-2': [1, 1, 1, 0, 0, 0, 0, 1],
    'smollm': [1, 2, 1, 0, 1, 0, 0, 1],
    'llama-bpe': [2, 0, 2, 1, 0, 0, 1, 2],
    'dbrx': [2, 0, 2, 1, 0, 0, 0, 2],
    'glm4': [2, 0, 2, 1, 0, 0, 1, 2],
    'qwen2': [2, 2, 2, 1, 1, 0, 0, 2],
    'qwen35': [2, 2, 2, 1, 2, 0, 0, 2],
    'laguna': [2, 2, 1, 2, 1, 0, 0, 2],
    'tekken': [3, 2, 2, 1, 1, 0, 2, 2],
    'gpt-4o': [4, 0, 2, 1, 0, 0, 2, 2],
    'deepseek-coder': [0, 2, 1, 3, 3, 0, 0, 1],
    'deepseek-v3': [3, 0, 2, 1, 4, 0, 0, 3],
    'falcon': [0, 3, 0, 0, 0, 0, 0, 1],
    'bloom': [5, 4, 2, 4, 5, 0, 0, 4],
    'viking': [5, 2, 2, 4, 2, 0, 0, 5],
    'seed-coder': [2, 2, 1, 1, 1, 0, 0, 2],
    'minicpm5': [2, 0, 2, 1, 0, 0, 1, 2],
    'bailingmoe': [2, 2, 2, 1, 1, 0, 0, 2],
    'ufakzeka': [3, 2, 2, 1, 1, 0, 0, 2],
}
EXPECTED = {rule: [IDS[i][j] for i, j in enumerate(w)] for rule, w in WHICH.items()}
BOS_EXPECTED = {
    'qwen2': [
        [303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41, 109,
         120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 307, 41, 48, 91, 110, 41, 129, 304, 106, 118, 110],
    ],
    'qwen2 add_bos': [
        [0, 303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41,
         109, 120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 307, 41, 48, 91, 110, 41, 129, 304, 106, 118, 110],
    ],
    'llama-bpe': [
        [0, 303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41,
         109, 120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 307, 41, 48, 91, 110, 41, 129, 304, 106, 118, 110],
    ],
    'llama-bpe no add_bos': [
        [303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41, 109,
         120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 307, 41, 48, 91, 110, 41, 129, 304, 106, 118, 110],
    ],
    'smollm add_bos add_eos': [
        [0, 303, 299, 123, 117, 109, 53, 41, 114, 125, 304, 41, 81, 78, 85, 85, 88, 304, 41, 109, 106, 130, 67, 41,
         109, 120, 119, 48, 125, 41, 92, 81, 88, 94, 93, 48, 85, 85, 41, 48, 91, 110, 41, 129, 304, 106, 118, 110, 1],
    ],
}


# ---------------------------------------------------------------- tests

def test_every_rule_is_tested():
    assert {gguf_tokenizer.RULES[p] for p in PRES} == set(gguf_tokenizer.RULES.values())
    assert set(EXPECTED) == set(PRES) and all(len(v) == len(TEXTS) for v in EXPECTED.values())


@pytest.mark.parametrize("pre", PRES)
def test_ids_equal_llama_tokenize(tmp_path, pre):
    tok = convert(write_tiny_gguf(tmp_path / "tiny.gguf", pre))
    assert [tok.encode(t, add_special_tokens=False) for t in TEXTS] == EXPECTED[pre]


BOS_CASES = {"qwen2": ("qwen2", {}), "qwen2 add_bos": ("qwen2", {"add_bos_token": True}),
             "llama-bpe": ("llama-bpe", {}), "llama-bpe no add_bos": ("llama-bpe", {"add_bos_token": False}),
             "smollm add_bos add_eos": ("smollm", {"add_bos_token": True, "add_eos_token": True})}


@pytest.mark.parametrize("case", BOS_CASES)
def test_bos_as_the_file_asks(tmp_path, case):
    """add_bos_token (or the rule's default: on for llama-bpe) adds BOS with add_special_tokens=True (and
    add_eos_token EOS), never without: as llama-tokenize without and with --no-bos."""
    pre, keys = BOS_CASES[case]
    tok = convert(write_tiny_gguf(tmp_path / "tiny.gguf", pre, **keys))
    assert tok.encode(TEXTS[0]) == BOS_EXPECTED[case][0]
    assert tok.encode(TEXTS[0], add_special_tokens=False) == EXPECTED[pre][0]
    assert tok.config["add_bos_token"] == (BOS_EXPECTED[case][0][0] == 0)


def test_decode_skips_control_tokens_only(tmp_path):
    tok = convert(write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2"))
    assert tok.decode(tok.encode(TEXTS[5])) == "ab \n<tool>x</tool> [PAD9]y"
    for t in TEXTS[:5] + TEXTS[6:]:
        assert tok.decode(tok.encode(t)) == t


@pytest.mark.parametrize("model,pre", [("gpt2", "kimi-k2"), ("gpt2", "no-such-rule"), ("llama", "default")])
def test_unsupported_tokenizer_is_one_line(tmp_path, model, pre):
    import gguf
    reader = gguf.GGUFReader(str(write_tiny_gguf(tmp_path / "tiny.gguf", pre, model)))
    with pytest.raises(CheckpointError, match=f"unsupported GGUF tokenizer {model}/{pre}") as e:
        gguf_tokenizer.write_tokenizer(reader, tmp_path, {"bos": 0, "eos": 1, "unk": None, "pad": 1}, 64)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not os.environ.get("LLAMA_TOKENIZE"), reason="set LLAMA_TOKENIZE to a llama-tokenize binary")
@pytest.mark.parametrize("pre", PRES + list(BOS_CASES))
def test_live_llama_tokenize(tmp_path, pre):
    from bench_tokenizer import llama_ids
    pre, keys, bos = (*BOS_CASES[pre], True) if pre in BOS_CASES else (pre, {}, False)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", pre, **keys)
    tok = convert(path)
    for text in TEXTS:
        theirs = llama_ids(os.environ["LLAMA_TOKENIZE"], str(path), text, bos)
        assert tok.encode(text, add_special_tokens=bos) == theirs


def _record(binary: str) -> None:
    """Print EXPECTED and BOS_EXPECTED from llama-tokenize on the tiny files (the docstring's command)."""
    import tempfile
    import textwrap

    from bench_tokenizer import llama_ids
    with tempfile.TemporaryDirectory() as d:
        rows = {}
        for pre in PRES:
            path = write_tiny_gguf(pathlib.Path(d) / f"{pre}.gguf", pre)
            rows[pre] = [llama_ids(binary, str(path), t) for t in TEXTS]
        bos = {}
        for case, (pre, keys) in BOS_CASES.items():
            path = write_tiny_gguf(pathlib.Path(d) / "bos.gguf", pre, **keys)
            bos[case] = [llama_ids(binary, str(path), TEXTS[0], bos=True)]
    fill = lambda ids, ind: textwrap.fill(", ".join(map(str, ids)), 117, initial_indent=" " * ind + "[",
                                          subsequent_indent=" " * (ind + 1)) + "],"
    distinct = [list(dict.fromkeys(tuple(rows[pre][i]) for pre in PRES)) for i in range(len(TEXTS))]
    print("IDS = [")  # as Python source, lines under 120 characters
    for i, lists in enumerate(distinct):
        print(f"    [  # TEXTS[{i}]")
        for ids in lists:
            print(fill(ids, 8))
        print("    ],")
    print("]\nWHICH = {")
    for pre in PRES:
        print(f"    {pre!r}: {[distinct[i].index(tuple(rows[pre][i])) for i in range(len(TEXTS))]},")
    print("}\nBOS_EXPECTED = {")
    for key, lists in bos.items():
        print(f"    {key!r}: [")
        for ids in lists:
            print(fill(ids, 8))
        print("    ],")
    print("}")


if __name__ == "__main__":
    _record(sys.argv[1])
