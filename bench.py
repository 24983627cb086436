"""Spec-Bench-style side-by-side benchmark: speed, mean accepted length and the NanoSpec paper's tables.

    python bench.py                                             # built-in prompts, every method
    python bench.py --questions ../shared/data/spec_bench/question.jsonl --limit 10 --max-new-tokens 256
    python bench.py --eagle3 PATH/TO/HEAD --methods main,ablations --categories qa,rag --limit 2
    python bench.py --latency --shape llama3.1-8b               # GPU latency table (random weights)
    python bench.py --compile both --methods ar,ngram,eagle3+nanospec   # torch.compile vs eager, side by side

Methods run interleaved question by question (every method back to back on one question, the order
rotated from question to question) so that drift of a shared machine hits all of them alike. Every
method's greedy output is compared with autoregressive decoding, token for token; any difference is
printed with the question id and makes the exit code 1. Reports (Markdown, JSON, PNG plots when
matplotlib is installed) go to --out (default results/).

Method names: `ar`, `ar-fast`, `ngram`, `<head>` (full vocabulary), `<head>+freq-<K>` (FR-Spec top-K, K like 512,
8k, 32k), `<head>+nanospec`, `<head>+nanospec-ctx|-ext|-noasync` (ablations), `<head>+nanospec-w<W>`
(another window size), with <head> = eagle3 or eagle2. Presets: `main`, `ablations`, `sweep`, `all`.
`--compile both` adds a compiled twin `NAME@compile` of every method (its output must equal `ar@compile`:
compiled kernels round differently from eager ones) and a compiled / eager table.

Task = Spec-Bench task: the eight MT-bench categories count as one (`mt_bench`), and `--limit` applies per
task, round-robin over its categories. On CPU the EAGLE-2 tree defaults to top-8 / depth 5 / 16 nodes (a
60-node verify costs 3-4 decode steps there); on CUDA to the papers' top-10 / depth 5 / 60 nodes.

Speed baseline: `ar-fast`, the engine's fastest autoregressive configuration (plain arithmetic, no exact
mode; `ar-fast@compile` too under --compile both): every speedup is a ratio to the fastest AR row of the
run. `ar` is exact-mode AR, the correctness reference; the ratio of the two is exact mode's cost.

On CPU the benchmark runs every method in exact mode (where this machine's check passes, exact.py), which
makes verify and decode do identical arithmetic, so every method must match autoregressive output bit for
bit, bf16 included. With --no-exact or on CUDA the
multi-token verify pass and the 1-token decode step round differently and a near tie of the target's
top two logits can flip: the guard reports every difference and, for the first one of a turn, the
target's logit gap there (a gap within the dtype's rounding = numerics; in exact mode, a bug).
"""
import argparse
import datetime
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

import draft as dr
import generate
import kernels
from download import CheckpointError, resolve_checkpoint
from exact import machine_id
from generate import Engine, Tokenizer, UsageError
from model import ModelArgs, ModelError, Transformer, load_model
from sampling import Sampling, logits_to_probs, sample_from
from vocab import FreqVocab, FullVocab, build_freq, make_vocab, nanospec_state_bytes

REPO = Path(__file__).resolve().parent

# ---------------------------------------------------------------- workload

# Spec-Bench reports the 8 MT-bench categories as one task ("Multi-turn Conversation").
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASK_TITLES = {"mt_bench": "MT-bench", "translation": "Translation", "summarization": "Summarization",
               "qa": "QA", "math_reasoning": "Math", "rag": "RAG", "code": "Code"}

_SUMMARY_1 = (
    "Three years ago the town of Millbrook turned an empty parking lot behind the library into a community "
    "garden. The project began with a dozen volunteers and a small grant from the county, which paid for "
    "soil, fencing and a rain-water tank. Today the garden has sixty plots, a waiting list, and a weekly "
    "market where gardeners sell surplus vegetables; the proceeds fund seeds for the local primary school. "
    "Organisers say the biggest surprise was social rather than agricultural: retired residents and young "
    "families who had never met now share tools, swap recipes and run workshops on composting. The council "
    "is considering a second site near the train station, but some residents worry that the land would be "
    "better used for affordable housing, and a public consultation is planned for the spring.")
_SUMMARY_2 = (
    "Our team of five engineers spent the last quarter moving the billing service from a single MySQL server "
    "to a managed PostgreSQL cluster. The old server had become a bottleneck: nightly invoice runs took "
    "almost four hours and blocked other jobs. We migrated table by table, writing to both databases for two "
    "weeks and comparing the results every night before switching reads over. Two problems cost us time: "
    "differences in how the two systems sort text with accents, and a reporting query that relied on an "
    "undocumented MySQL behaviour. After the switch, invoice runs finish in forty minutes and the on-call "
    "team received no database alerts for a month. Next quarter we plan to remove the old server and "
    "document the migration so that other teams can follow the same steps.")
_RAG_1 = (
    "Passage 1: Kestrel Point Lighthouse stands on a granite headland at the mouth of the Arden estuary. It "
    "was completed in 1871 after two ships were wrecked on the nearby shoals in a single winter.\n"
    "Passage 2: The lighthouse originally burned whale oil and later paraffin. Its lamp was electrified in "
    "1936, and a diesel generator was installed as a backup in 1952.\n"
    "Passage 3: The light was automated in 1989. Its last resident keeper, Margaret Hale, had served there "
    "for twenty-two years and later wrote a memoir about life on the headland.\n"
    "Passage 4: Today the keeper's cottage is a small museum, open from April to October.")
_RAG_2 = (
    "Passage 1: The Ossa is a 212-kilometre river that rises in the Brenner Hills and flows east into Lake "
    "Tamsin. Its largest tributary is the Vell, which joins it at the market town of Carrow.\n"
    "Passage 2: A series of floods in the 1960s led to the construction of the Carrow Dam, finished in 1974, "
    "which also supplies drinking water to about 300,000 people.\n"
    "Passage 3: The river is known for its population of freshwater pearl mussels, which were declared "
    "protected in 1998 after surveys found fewer than a thousand adults.")

BUILTIN_QUESTIONS = [  # written for this project; a few per Spec-Bench task, plus code completion
    dict(question_id="b1", category="mt_bench", turns=[
        "Write a short blog post about a weekend trip to a mountain village, mentioning the food and the people you met.",
        "Rewrite your post as a poem of at most eight lines."]),
    dict(question_id="b2", category="mt_bench", turns=[
        "A farmer has 17 sheep and all but 9 run away. How many sheep are left? Explain your reasoning.",
        "Now make up a similar trick question of your own and give its answer."]),
    dict(question_id="b3", category="translation", turns=[
        "Translate the following German sentence into English: \"Der Zug nach Berlin hat wegen eines Sturms "
        "zwei Stunden Verspätung, deshalb warten viele Reisende im Bahnhofscafé.\""]),
    dict(question_id="b4", category="translation", turns=[
        "Translate into English: \"La bibliothèque municipale ouvrira une nouvelle salle d'étude le mois "
        "prochain, avec des ordinateurs gratuits pour les étudiants.\""]),
    dict(question_id="b5", category="summarization", turns=[_SUMMARY_1 + "\n\nSummarize the text above in two sentences."]),
    dict(question_id="b6", category="summarization", turns=[_SUMMARY_2 + "\n\nSummarize the report above for a manager."]),
    dict(question_id="b7", category="qa", turns=["Why does the sky look blue during the day but red at sunset?"]),
    dict(question_id="b8", category="qa", turns=["What is the difference between a virus and a bacterium?"]),
    dict(question_id="b9", category="math_reasoning", turns=[
        "A shop sells pencils at 3 for $1.20. Tom buys 12 pencils and pays with a $10 bill. How much change "
        "does he get? Think step by step."]),
    dict(question_id="b10", category="math_reasoning", turns=[
        "A train travels 150 km in 2 hours and then 90 km in 1.5 hours. What is its average speed for the "
        "whole trip? Show your work."]),
    dict(question_id="b11", category="rag", turns=[_RAG_1 + "\n\nUsing the passages above, answer: when was the "
                                                   "lamp electrified, and who was the last resident keeper?"]),
    dict(question_id="b12", category="rag", turns=[_RAG_2 + "\n\nUsing the passages above, answer: why was the "
                                                   "Carrow Dam built and what else does it do?"]),
    dict(question_id="b13", category="code", turns=[
        "Write a Python function is_palindrome(s) that ignores case and punctuation, and add a few tests."]),
    dict(question_id="b14", category="code", turns=[
        "Complete this function:\n```python\ndef running_max(xs):\n    \"\"\"Return a list whose element i is "
        "the maximum of xs[:i+1].\"\"\"\n```"]),
]
WARMUP_PROMPT = "Name three colours."


@dataclass
class Question:
    qid: str
    category: str  # as in the file
    task: str  # Spec-Bench task: the MT-bench categories become "mt_bench"
    turns: list


_PROMPT_KEYS = ("turns", "prompt", "question", "instruction", "input", "text", "content")


def parse_question(obj: dict, lineno: int) -> Question:
    turns = None
    for k in _PROMPT_KEYS:
        v = obj.get(k)
        if isinstance(v, str) and v.strip():
            turns = [v]
            break
        if isinstance(v, list) and v and all(isinstance(t, str) for t in v):
            turns = list(v)
            break
    if turns is None:
        raise UsageError(f"line {lineno}: no prompt field (one of {', '.join(_PROMPT_KEYS)})")
    qid = str(obj.get("question_id", obj.get("id", obj.get("idx", lineno))))
    cat = str(obj.get("category", obj.get("task", "default")))
    return Question(qid, cat, "mt_bench" if cat in MT_BENCH else cat, turns)


def load_questions(path: str | None) -> list[Question]:
    if path is None:
        return [parse_question(q, i + 1) for i, q in enumerate(BUILTIN_QUESTIONS)]
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"questions file not found: {p}")
    out = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{p}:{i + 1}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{p}:{i + 1}: expected a JSON object")
        try:
            out.append(parse_question(obj, i + 1))
        except UsageError as e:
            raise UsageError(f"{p}:{e}") from None
    if not out:
        raise UsageError(f"{p} holds no questions")
    return out


def select_questions(qs: list[Question], categories: str | None, limit: int | None) -> list[Question]:
    """Filter by task or file category; keep the first `limit` per task. Within a task made of several
    categories (MT-bench) questions are taken round-robin over the categories, so a limit of 10 covers
    all 8 MT-bench categories instead of 10 writing prompts."""
    if categories:
        want = [c.strip() for c in categories.split(",") if c.strip()]
        known = {q.task for q in qs} | {q.category for q in qs}
        bad = [c for c in want if c not in known]
        if bad:
            raise UsageError(f"unknown categor{'y' if len(bad) == 1 else 'ies'} {', '.join(bad)}; "
                             f"available: {', '.join(sorted(known))}")
        qs = [q for q in qs if q.task in want or q.category in want]
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")
    by_task: dict[str, dict[str, list]] = {}
    for q in qs:
        by_task.setdefault(q.task, {}).setdefault(q.category, []).append(q)
    out = []
    for task, cats in by_task.items():
        lists, picked = list(cats.values()), []
        while any(lists) and (limit is None or len(picked) < limit):
            for lst in lists:
                if lst and (limit is None or len(picked) < limit):
                    picked.append(lst.pop(0))
        out.extend(picked)
    return out


# ---------------------------------------------------------------- model shapes (Table 6, latency mode)

SHAPES = {
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, intermediate_size=14336,
                        vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)),
    "llama3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, intermediate_size=8192,
                        vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)),
    "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536,
                         vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=1024,
                 max_position_embeddings=4096),
}


def shape_args(name: str) -> ModelArgs:
    if name not in SHAPES:
        raise UsageError(f"unknown --shape {name!r}; choose from {', '.join(SHAPES)}")
    return ModelArgs(arch="LlamaForCausalLM", norm_eps=1e-5, **SHAPES[name])


# ---------------------------------------------------------------- heads and frequency files

def write_random_eagle3(path: Path, cfg: dict, seed: int = 0, dtype=torch.bfloat16) -> Path:
    """A randomly initialised full-vocabulary EAGLE-3 head in the official layout (fc over the 3 aux
    states, midlayer.*, norm, lm_head). Untrained: its drafts are almost never accepted; it exists so
    that every code path and the drafting cost can be measured before a trained head is at hand."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    d, V, I = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H = cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads") or H
    hd = cfg.get("head_dim") or d // H

    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=g) / math.sqrt(fan_in)).to(dtype)

    one = lambda: torch.ones(d, dtype=dtype)
    sd = {"fc.weight": rnd(d, 3 * d, fan_in=3 * d),
          "midlayer.input_layernorm.weight": one(), "midlayer.hidden_norm.weight": one(),
          "midlayer.self_attn.q_proj.weight": rnd(H * hd, 2 * d, fan_in=2 * d),
          "midlayer.self_attn.k_proj.weight": rnd(Hkv * hd, 2 * d, fan_in=2 * d),
          "midlayer.self_attn.v_proj.weight": rnd(Hkv * hd, 2 * d, fan_in=2 * d),
          "midlayer.self_attn.o_proj.weight": rnd(d, H * hd, fan_in=H * hd),
          "midlayer.post_attention_layernorm.weight": one(),
          "midlayer.mlp.gate_proj.weight": rnd(I, d, fan_in=d), "midlayer.mlp.up_proj.weight": rnd(I, d, fan_in=d),
          "midlayer.mlp.down_proj.weight": rnd(d, I, fan_in=I),
          "norm.weight": one(), "lm_head.weight": rnd(V, d, fan_in=d)}
    save_file(sd, str(path / "model.safetensors"))
    L = cfg["num_hidden_layers"]
    json.dump(dict(architectures=["LlamaForCausalLMEagle3"], hidden_size=d, intermediate_size=I,
                   num_attention_heads=H, num_key_value_heads=Hkv, head_dim=hd, rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
                   vocab_size=V, draft_vocab_size=V, num_hidden_layers=1,
                   max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                   rope_theta=cfg.get("rope_theta", 10000.0),
                   eagle_config=dict(eagle_aux_hidden_state_layer_ids=[2, L // 2, L - 3]),
                   note=f"random, untrained (bench.py --random-head, seed {seed})"),
              open(path / "config.json", "w"), indent=1)
    return path


def chat_prefix_ids(tok: Tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's text starts (Magpie-style self-prompt)."""
    if tok.chat_template is None:
        return tok.encode("", add_special_tokens=True) or [0]
    mark = "\u2063MAGPIE\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=False)
    return tok.encode(text[:text.index(mark)], add_special_tokens=False) or [0]


@torch.no_grad()
def self_corpus(model: Transformer, tok: Tokenizer, rows: int, new_tokens: int, seed: int = 0,
                temperature: float = 1.0, top_p: float = 0.95) -> torch.Tensor:
    """Text the target writes itself, Magpie-style: `rows` samples that start right after the chat
    template's user header, so the model invents a request, closes the turn, answers it, and goes on.
    One batched pass (every row has the same prefix, hence the same positions). Returns [rows, new_tokens]."""
    dev = model.lm_head.weight.device
    prefix = chat_prefix_ids(tok)
    T = len(prefix)
    if T + new_tokens > model.args.max_position_embeddings:
        new_tokens = model.args.max_position_embeddings - T
    model.setup_caches(rows, (T + new_tokens + 63) // 64 * 64)
    torch.manual_seed(seed)
    s = Sampling(temperature, 0, top_p)
    logits = model(torch.tensor([prefix] * rows, device=dev), torch.arange(T, device=dev))[:, -1]
    out = []
    for i in range(new_tokens):
        t = sample_from(logits_to_probs(logits, s))  # [rows]
        out.append(t)
        logits = model(t[:, None], torch.tensor([T + i], device=dev))[:, -1]
    return torch.stack(out, 1).cpu()


def self_freq_file(model: Transformer, tok: Tokenizer, model_name: str, cache: Path, rows: int, new_tokens: int,
                   seed: int = 0, log=print) -> tuple[Path, dict]:
    """FR-Spec frequency file from text the target generated itself (never from the benchmark's prompts),
    cached. The ranking lists the ids seen in that corpus by count, then every unseen id in ascending id
    order (byte-level BPE ids follow merge order, i.e. roughly the tokenizer corpus' frequency), so that
    any K up to the vocabulary size is defined; info['seen'] says where the measured part ends."""
    V = model.args.vocab_size
    key = f"freq_{model_name}_{rows}x{new_tokens}_s{seed}"
    f, meta = cache / f"{key}.pt", cache / f"{key}.json"
    if f.is_file() and meta.is_file():
        return f, json.loads(meta.read_text())
    log(f"building the FR-Spec frequency file from {rows} x {new_tokens} tokens the target samples itself "
        f"(Magpie-style self-prompts, cached in {f}) ...")
    t0 = time.perf_counter()
    toks = self_corpus(model, tok, rows, new_tokens, seed)
    seen = build_freq(toks.flatten(), V)
    seen_set = set(seen)
    ranked = seen + [i for i in range(V) if i not in seen_set]
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(ranked, f)
    info = dict(source="target self-generated (Magpie-style), temperature 1.0, top-p 0.95", rows=rows,
                new_tokens=new_tokens, corpus_tokens=int(toks.numel()), seen=len(seen), vocab_size=V, seed=seed,
                tail="unseen ids appended in ascending id order", build_s=round(time.perf_counter() - t0, 1))
    meta.write_text(json.dumps(info, indent=1))
    return f, info


def ensure_cache(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    gi = path / ".gitignore"
    if not gi.exists():
        gi.write_text("# bench.py cache (frequency files, random heads): never committed\n*\n")
    return path


# ---------------------------------------------------------------- methods

def parse_k(s: str) -> int:
    m = re.fullmatch(r"(\d+)(k?)", s.strip().lower())
    if not m:
        raise UsageError(f"bad size {s!r} (use e.g. 512, 8k, 32768)")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def fmt_k(k: int) -> str:
    return f"{k // 1024}k" if k % 1024 == 0 else str(k)


@dataclass
class Method:
    name: str
    kind: str  # ar | ngram | eagle
    head: str | None = None  # eagle2 | eagle3
    vocab: str = "full"  # full | freq | nanospec
    k: int | None = None  # freq K or nanospec window
    ablation: str | None = None
    compiled: bool = False  # torch.compile'd steps (--compile; --compile both adds a compiled twin "NAME@compile")
    fast: bool = False  # ar-fast: autoregressive decoding without exact mode (the speed baseline)
    groups: set = field(default_factory=set)
    engine: Engine | None = None
    timers: dict = field(default_factory=dict)

    def order(self):
        """Report order: ar, ngram, then per head: full, freq by K, NanoSpec, other windows, ablations."""
        if self.kind != "eagle":
            return (0 if self.kind == "ar" else 1, self.fast, self.compiled)
        if self.ablation:
            v = (4, ABLATION_ORDER.index(self.ablation))
        elif self.vocab == "nanospec":
            v = (2, 0) if self.name.endswith("+nanospec") else (3, self.k)
        else:
            v = (0 if self.vocab == "full" else 1, self.k or 0)
        return (2, self.head, *v, self.compiled)


ABLATION_ORDER = ("ctx", "ext", "noasync")


def method_from_name(name: str, heads: dict, w_max: int) -> Method:
    if name == "ar":
        return Method("ar", "ar")
    if name == "ar-fast":
        return Method("ar-fast", "ar", fast=True)
    if name == "ngram":
        return Method("ngram", "ngram")
    m = re.fullmatch(r"(eagle[23])(?:\+(.+))?", name)
    if not m:
        raise UsageError(f"unknown method {name!r}")
    head, rest = m.group(1), m.group(2)
    if head not in heads:
        raise UsageError(f"method {name} needs an {head.upper()} head: pass --{head} PATH"
                         + (" or --random-head" if head == "eagle3" else ""))
    if rest is None or rest == "full":
        return Method(head, "eagle", head)
    if rest.startswith("freq-"):
        return Method(name, "eagle", head, "freq", parse_k(rest[5:]))
    if rest == "nanospec":
        return Method(name, "eagle", head, "nanospec", w_max)
    mm = re.fullmatch(r"nanospec-(ctx|ext|noasync|w(\d+k?))", rest)
    if mm:
        if mm.group(2):
            return Method(name, "eagle", head, "nanospec", parse_k(mm.group(2)))
        return Method(name, "eagle", head, "nanospec", w_max, mm.group(1))
    raise UsageError(f"unknown method {name!r}")


def expand_methods(spec: str, heads: dict, freq_ks, sweep_ks, sweep_w, w_max) -> list[Method]:
    """Presets and names -> Method list (ar first, duplicates merged, group tags kept)."""
    preset = {"main": lambda h: [h] + [f"{h}+freq-{fmt_k(k)}" for k in freq_ks] + [f"{h}+nanospec"],
              "ablations": lambda h: [f"{h}+nanospec", f"{h}+nanospec-ctx", f"{h}+nanospec-ext", f"{h}+nanospec-noasync"],
              "sweep": lambda h: [h] + [f"{h}+freq-{fmt_k(k)}" for k in sweep_ks] + [f"{h}+nanospec"]
              + [f"{h}+nanospec-w{fmt_k(w)}" for w in sweep_w if w != w_max]}
    names: dict[str, set] = {"ar": {"main"}, "ar-fast": {"main"}}  # the reference and the speed baseline
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        groups = ["main", "ablations", "sweep"] if item == "all" else [item] if item in preset else None
        if groups is None:
            names.setdefault(item, set()).add("custom")
            continue
        for g in groups:
            if g == "main":
                names.setdefault("ar", set()).add("main")
                names.setdefault("ngram", set()).add("main")
            for h in heads:
                for n in preset[g](h):
                    names.setdefault(n, set()).add(g)
    out = []
    for n, g in names.items():
        m = method_from_name(n, heads, w_max)
        m.groups = g
        out.append(m)
    return sorted(out, key=Method.order)


def _timed(obj, attr: str, acc: dict, key: str, sync):
    """Accumulate the wall time of obj.attr(...) into acc[key] (an instance attribute shadows the method).
    Transparent under torch.compile (--compile fuses the steps: no per-call times there)."""
    fn = getattr(obj, attr)

    def wrapper(*a, **k):
        if torch.compiler.is_compiling():
            return fn(*a, **k)
        t0 = time.perf_counter()
        r = fn(*a, **k)
        sync()
        acc[key] += time.perf_counter() - t0
        return r
    setattr(obj, attr, wrapper)


def build_method(m: Method, model: Transformer, heads: dict, freq_path: Path | None, args, sampling, sync):
    """Attach an Engine to m (EAGLE methods share the loaded head; each has its own vocabulary state)."""
    if m.kind == "ar":
        m.engine = Engine(model, sampling, compile=m.compiled, backend=args.compile_backend,
                          exact=False if m.fast else args.exact)
        return
    if m.kind == "ngram":
        m.engine = Engine(model, sampling, compile=m.compiled, backend=args.compile_backend, exact=args.exact,
                          drafter=dr.NgramDrafter(args.spec_k or 10, args.ngram_min, args.ngram_max,
                                                  static=m.compiled))
        return
    head = heads[m.head]
    rows = head.lm_weight().shape[0]
    t2r = dr.EagleDrafter.token_to_row_map(head)
    if m.vocab == "freq":
        if freq_path is None:
            raise UsageError(f"{m.name} needs a frequency file (--freq PATH, or let bench build one)")
        spec = f"freq:{freq_path}:{m.k}"
    else:
        spec = m.vocab
    w = m.k if m.vocab == "nanospec" else args.w_max
    if m.vocab in ("freq", "nanospec") and m.k >= rows:
        raise UsageError(f"{m.name}: size {m.k} >= the draft vocabulary ({rows}); choose a smaller size")
    max_append = args.tree_nodes + (args.tree_depth + 1) * args.k_ver
    vocab = make_vocab(spec, head.lm_weight(), w_max=w, k_pre=args.k_pre, k_ver=args.k_ver, ablation=m.ablation,
                       eos_ids=model.args.eos_ids, max_append=max_append, token_to_row=t2r)
    d = dr.EagleDrafter(head, vocab, args.tree_topk, args.tree_depth, args.tree_nodes)
    m.timers = dict(drafter_update=0.0, vocab_update=0.0)
    _timed(d, "update", m.timers, "drafter_update", sync)
    _timed(vocab, "update", m.timers, "vocab_update", sync)
    if hasattr(d, "_logp"):  # projection + log-softmax over the active rows
        m.timers["drafter_logp"] = 0.0
        _timed(d, "_logp", m.timers, "drafter_logp", sync)
    m.engine = Engine(model, sampling, compile=m.compiled, backend=args.compile_backend, drafter=d, exact=args.exact)


# ---------------------------------------------------------------- running

def first_diff(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_generation(m: Method, ids: list[int], max_new: int) -> tuple[list[int], dict]:
    for k in m.timers:
        m.timers[k] = 0.0
    out, st = m.engine.generate(ids, max_new)
    d = st.as_dict()
    d["timers"] = {k: round(v, 5) for k, v in m.timers.items()}
    return out, d


@torch.no_grad()
def diagnose(model: Transformer, ids: list[int], prefix: list[int], ta: int, tb: int) -> dict:
    """At a divergence: the target's logits for the two tokens after prompt + common prefix (one prefill
    in the run's dtype). A gap within a few roundings of the dtype means a near tie that the 1-token decode
    and the multi-token verify kernels resolved differently (numerics, not a logic error)."""
    seq = ids + prefix
    dev, dt = model.lm_head.weight.device, model.lm_head.weight.dtype
    if not (model.max_batch == 1 and model.max_seq >= len(seq)):  # keep the cache (captured graphs use it)
        model.setup_caches(1, min((len(seq) + 63) // 64 * 64, model.args.max_position_embeddings))
    logits = model(torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev))[0, -1].float()
    la, lb = float(logits[ta]), float(logits[tb])
    tol = 2 * torch.finfo(dt).eps * max(abs(la), abs(lb), 1.0)
    return dict(logit_expected=round(la, 4), logit_got=round(lb, 4), gap=round(la - lb, 4),
                near_tie=abs(la - lb) <= tol, prefill_argmax=int(logits.argmax()))


def run_benchmark(questions, methods, tok, max_new, log, progress=True, model=None):
    """Every question: every method back to back (order rotated), each turn after its own previous answer.
    Returns (records, mismatches, reference outputs)."""
    records, mismatches, refs = [], [], []
    total = sum(len(q.turns) for q in questions) * len(methods)
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="gen", desc="bench", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            pass
    done, t_start = 0, time.perf_counter()
    for qi, q in enumerate(questions):
        r = qi % len(methods)
        order = methods[r:] + methods[:r]
        outs, prompts = {}, {}
        for m in order:
            msgs, outs[m.name], prompts[m.name] = [], [], []
            for ti, turn in enumerate(q.turns):
                msgs.append({"role": "user", "content": turn})
                ids = tok.encode_chat(msgs) if tok.chat_template else tok.encode("\n".join(x["content"] for x in msgs))
                out, st = run_generation(m, ids, max_new)
                outs[m.name].append(out)
                prompts[m.name].append(ids)
                msgs.append({"role": "assistant", "content": tok.decode(out)})
                records.append(dict(qid=q.qid, category=q.category, task=q.task, turn=ti + 1, method=m.name,
                                    prompt_tokens=len(ids), **st))
                done += 1
                if bar is not None:
                    bar.set_postfix_str(f"{q.task} {q.qid} {m.name}", refresh=False)
                    bar.update(1)
                elif progress and done % max(1, total // 20) == 0:
                    el = time.perf_counter() - t_start
                    log(f"  {done}/{total} generations, {el:.0f} s, ETA {el / done * (total - done):.0f} s")
        refs.append(outs["ar"])
        for m in methods:
            # compiled kernels round differently from eager ones: a compiled method answers to compiled AR
            rn = "ar@compile" if m.compiled and "ar@compile" in outs else "ar"
            if m.fast:  # the speed baseline is not exact: no guard (it may differ at near-ties)
                continue
            ref = outs[rn]
            for ti, (a, b) in enumerate(zip(ref, outs[m.name])):
                if a != b:
                    i = first_diff(a, b)
                    exp = f"{a[i]} {tok.decode([a[i]])!r}" if i < len(a) else "<end>"
                    got = f"{b[i]} {tok.decode([b[i]])!r}" if i < len(b) else "<end>"
                    mm = dict(qid=q.qid, turn=ti + 1, method=m.name, index=i, expected=exp, got=got,
                              len_expected=len(a), len_got=len(b))
                    msg = (f"!!! OUTPUT MISMATCH: question {q.qid} turn {ti + 1}, method {m.name}: first difference "
                           f"at token {i} (autoregressive {exp}, got {got}; lengths {len(a)} vs {len(b)})")
                    if prompts[m.name][ti] != prompts[rn][ti]:
                        mm["diagnosis"] = "follows an earlier turn's difference (different prompt)"
                    elif model is not None and i < len(a) and i < len(b):
                        dg = diagnose(model, prompts[rn][ti], a[:i], a[i], b[i])
                        mm.update(dg)
                        mm["diagnosis"] = (f"near tie: logit gap {dg['gap']:+.4f} is within {str(model.lm_head.weight.dtype)[6:]} "
                                           "rounding (1-token decode and multi-token verify kernels round differently)"
                                           if dg["near_tie"] else f"logit gap {dg['gap']:+.4f}: not a near tie, "
                                           "likely a logic error")
                    if "diagnosis" in mm:
                        msg += f"; {mm['diagnosis']}"
                    mismatches.append(mm)
                    (bar.write(msg, file=sys.stderr) if bar is not None else print(msg, file=sys.stderr))
                    for rec in records:
                        if rec["qid"] == q.qid and rec["turn"] == ti + 1 and rec["method"] == m.name:
                            rec["mismatch"] = True
    if bar is not None:
        bar.close()
    return records, mismatches, refs


# ---------------------------------------------------------------- aggregation

def aggregate(recs: list[dict]) -> dict:
    """Spec-Bench conventions: speed = mean over generations of tokens / wall time (prefill included);
    mean accepted length = tokens per target forward over all speculative steps (bonus included)."""
    if not recs:
        return {}
    hist: dict[int, int] = {}
    for r in recs:
        for k, v in r.get("accept_hist", {}).items():
            hist[int(k)] = hist.get(int(k), 0) + v
    steps = sum(hist.values())
    acc = sum(k * v for k, v in hist.items())
    ph = {}
    for r in recs:
        for k, v in r.get("phase_s", {}).items():
            ph[k] = ph.get(k, 0.0) + v
        for k, v in r.get("timers", {}).items():
            ph[k] = ph.get(k, 0.0) + v
    out = dict(generations=len(recs), new_tokens=sum(r["new_tokens"] for r in recs),
               tokens_per_s=statistics.fmean(r["tokens_per_s"] for r in recs),
               wall_s=sum(r["prefill_s"] + r["decode_s"] for r in recs),
               decode_s=sum(r["decode_s"] for r in recs),
               mean_accepted_length=acc / steps if steps else 1.0, steps=steps, step_tokens=acc)
    if steps:
        per = lambda k: ph.get(k, 0.0) / steps * 1000
        # LM head = projection + log-softmax over the active rows when the drafter's _logp was timed (the
        # vocabulary-dependent part of drafting); generate.py's own lm_head phase (projection only) otherwise
        lm = per("drafter_logp") if "drafter_logp" in ph else per("lm_head")
        out["step_ms"] = dict(
            draft_backbone=per("draft") + per("lm_head") - lm + per("drafter_update"), lm_head=lm,
            gather_update=per("vocab_update"),
            verify=per("verify"),
            bookkeeping=per("sync") + per("update") - per("drafter_update") - per("vocab_update"))
        out["step_ms"]["total"] = out["decode_s"] / steps * 1000
        out["draft_ms"] = out["step_ms"]["draft_backbone"] + out["step_ms"]["lm_head"] + out["step_ms"]["gather_update"]
        out["decode_rate"] = acc / max(out["decode_s"], 1e-9)  # tokens from speculative steps per decode second
    cov = [(r["vocab_coverage"], r["new_tokens"]) for r in recs if "vocab_coverage" in r]
    if cov:
        w = sum(n for _, n in cov) or 1
        out["vocab_coverage"] = sum(c * n for c, n in cov) / w
        act = [(r["vocab_active_mean"], r["target_forwards"]) for r in recs if "vocab_active_mean" in r]
        out["vocab_active_mean"] = sum(a * n for a, n in act) / max(sum(n for _, n in act), 1)
        out["vocab_active_max"] = max(r["vocab_active_max"] for r in recs if "vocab_active_max" in r)
        out["vocab_state_bytes"] = max(r["vocab_state_bytes"] for r in recs if "vocab_state_bytes" in r)
    return out


def fastest_ar(S, methods) -> str:
    """The speed baseline: the autoregressive configuration with the highest overall speed in this run."""
    return max((m.name for m in methods if m.kind == "ar"), key=lambda n: S[n]["overall"].get("tokens_per_s") or 0)


def summarize(records, methods, tasks):
    S = {}
    for m in methods:
        mine = [r for r in records if r["method"] == m.name]
        S[m.name] = {"overall": aggregate(mine), **{t: aggregate([r for r in mine if r["task"] == t]) for t in tasks}}
    base_name = fastest_ar(S, methods)
    for m in methods:
        for t, a in S[m.name].items():
            base = S[base_name][t].get("tokens_per_s")
            if a and base:
                a["speedup"] = a["tokens_per_s"] / base
    return S


def freq_coverage_offline(refs: list, ranked: list[int], ks) -> dict:
    """Fraction of the autoregressive output tokens inside the top-K of the frequency ranking (what the
    freq vocabulary's coverage metric measures, computed for every K without running it)."""
    toks = torch.tensor([t for outs in refs for o in outs for t in o] or [0])
    # a --freq file may rank only the ids its corpus saw (any subset of the vocabulary)
    rank = torch.full((max(max(ranked, default=0), int(toks.max())) + 1,), 1 << 30, dtype=torch.long)
    rank[torch.tensor(ranked)] = torch.arange(len(ranked))
    r = rank[toks]
    return {k: float((r < k).float().mean()) for k in ks}


# ---------------------------------------------------------------- reports

def _f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def md_table(header, rows):
    s = "| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|\n"
    return s + "".join("| " + " | ".join(str(c) for c in r) + " |\n" for r in rows)


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def state_table(shape_name: str, V: int, d: int, w_max: int, ks, elem=2):
    """Table 6 rows for an LM head of V x d (fp16/bf16 rows): from the real constructors on the meta device."""
    dt = torch.float16 if elem == 2 else torch.float32
    W = torch.empty(V, d, dtype=dt, device="meta")
    rows = []
    full = FullVocab(W)
    rows.append(["full", V, human_bytes(V * d * elem), human_bytes(full.state_bytes())])
    for k in ks:
        if k >= V:
            continue
        try:
            b = FreqVocab(W, torch.arange(k)).state_bytes()
        except Exception:  # meta tensors unsupported by some op: same formula by hand
            b = k * d * elem + k * 8 + V
        rows.append([f"freq top-{fmt_k(k)}", k, human_bytes(k * d * elem), human_bytes(b)])
    if w_max < V:
        rows.append([f"nanospec W={w_max}", w_max, human_bytes(w_max * d * elem),
                     human_bytes(nanospec_state_bytes(V, d, w_max, dtype=dt))])
    return rows


def write_reports(out_dir: Path, tag: str, ctx: dict, S: dict, methods, tasks, records, mismatches, fig1, log) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [m.name for m in methods]
    heads = sorted({m.head for m in methods if m.head})
    L = []
    L.append(f"# NanoSpec engine benchmark: {tag}\n")
    L.append(f"Command: `{ctx['command']}`\n")
    L.append(md_table(["setting", "value"], [[k, v] for k, v in ctx["settings"].items()]))
    for w in ctx["warnings"]:
        L.append(f"\n> **WARNING:** {w}\n")
    L.append("\n## Correctness\n")
    # the references (ar@compile is what compiled methods are compared with) and the speed baselines
    ref_names = {"ar", "ar@compile", "ar-fast", "ar-fast@compile"}
    n_cmp = sum(1 for r in records if r["method"] not in ref_names)
    if mismatches:
        L.append(f"**FAILED: {len(mismatches)} of {n_cmp} outputs differ from autoregressive decoding.**\n")
        ties = sum(1 for x in mismatches if x.get("near_tie"))
        if ties:
            L.append(f"{ties} of them start at a near tie of the target's logits (within {ctx['settings']['dtype']} "
                     "rounding): the 1-token decode and the multi-token verify pass round differently there; "
                     "in float32 such ties practically never flip.\n\n")
        L.append(md_table(["question", "turn", "method", "first different token", "autoregressive", "got", "diagnosis"],
                          [[x["qid"], x["turn"], x["method"], x["index"], x["expected"], x["got"],
                            x.get("diagnosis", "")] for x in mismatches]))
    else:
        L.append(f"All {n_cmp} outputs of {len(set(names) - ref_names)} methods are identical to autoregressive decoding, "
                 "token for token (greedy).\n")

    cols = tasks + ["overall"]
    title = lambda t: "Overall" if t == "overall" else TASK_TITLES.get(t, t)
    L.append("\n## Table 2/3 analogue: speed and mean accepted length per task\n")
    base = fastest_ar(S, methods)
    L.append("Speed = mean over generations of new tokens / wall time (prefill included); speedup = ratio of "
             f"mean speeds to the fastest autoregressive configuration of this run, `{base}` (Spec-Bench's "
             "convention, with the fastest AR as the baseline); τ = mean accepted length, tokens per "
             "target forward, bonus included. Each cell: speedup ×, τ.\n\n")
    rows = []
    for n in names:
        row = [n]
        for t in cols:
            a = S[n].get(t) or {}
            row.append(f"{a['speedup']:.2f}×, {a['mean_accepted_length']:.2f}" if a else "-")
        rows.append(row)
    L.append(md_table(["method"] + [title(t) for t in cols], rows))
    L.append("\nTokens/s (mean speed):\n\n")
    L.append(md_table(["method"] + [title(t) for t in cols],
                      [[n] + [_f((S[n].get(t) or {}).get("tokens_per_s")) for t in cols] for n in names]))
    exact_cost = [(n, f) for n, f in (("ar", "ar-fast"), ("ar@compile", "ar-fast@compile"))
                  if n in S and f in S and S[n]["overall"] and S[f]["overall"]]
    if exact_cost:
        L.append("\n## Exact mode's cost (same run, interleaved)\n\n")
        L.append("`ar` decodes in exact mode (every pass padded to sizes this CPU keeps row-invariant, exact "
                 "attention); `ar-fast` uses plain arithmetic. Exact mode is what makes every speculative "
                 "output identical to `ar`.\n\n")
        L.append(md_table(["exact", "plain", "exact tok/s", "plain tok/s", "exact / plain"],
                          [[n, f, _f(S[n]["overall"]["tokens_per_s"]), _f(S[f]["overall"]["tokens_per_s"]),
                            f"{S[n]['overall']['tokens_per_s'] / S[f]['overall']['tokens_per_s']:.3f}x"]
                           for n, f in exact_cost]))
    twins = [(n, f"{n}@compile") for n in names if f"{n}@compile" in S and S[n]["overall"] and S[f"{n}@compile"]["overall"]]
    if twins:
        L.append("\n## torch.compile vs eager (same run, interleaved)\n\n")
        L.append("Compiled outputs are checked against compiled autoregressive decoding (ar@compile): compiled "
                 "kernels round differently from eager ones. Tokens/s include prefill (eager in both).\n\n")
        L.append(md_table(["method", "eager tok/s", "compiled tok/s", "compiled / eager", "τ eager", "τ compiled"],
                          [[n, _f(S[n]["overall"]["tokens_per_s"]), _f(S[c]["overall"]["tokens_per_s"]),
                            f"{S[c]['overall']['tokens_per_s'] / S[n]['overall']['tokens_per_s']:.3f}x",
                            _f(S[n]["overall"]["mean_accepted_length"]), _f(S[c]["overall"]["mean_accepted_length"])]
                           for n, c in twins]))

    spec = [n for n in names if (S[n]["overall"] or {}).get("step_ms")]
    if spec:
        L.append("\n## Table 4 analogue: time per draft step (ms, means over all speculative steps)\n")
        L.append("draft backbone = head forwards of the tree expansion and of the accepted tokens, and the tree's "
                 "top-k / rerank; LM head = draft-vocabulary projection + log-softmax over the active rows; "
                 "gather/update = NanoSpec window update incl. the row gather; verify = target pass over the tree, "
                 "acceptance and KV compaction; bookkeeping = the step's host sync and the coverage metrics. On CUDA "
                 "these are host wall times (see the latency mode for device times); with --compile the update and "
                 "the draft run fused and count as draft backbone.\n\n")
        rows = []
        for n in spec:
            p = S[n]["overall"]["step_ms"]
            rows.append([n, _f(p["draft_backbone"]), _f(p["lm_head"]), _f(p["gather_update"]), _f(p["verify"]),
                         _f(p["bookkeeping"]), _f(p["total"]), _f(S[n]["overall"]["mean_accepted_length"])])
        L.append(md_table(["method", "draft backbone", "LM head", "gather/update", "verify", "bookkeeping",
                           "total", "τ"], rows))

    abl = [m.name for m in methods if m.ablation or "ablations" in m.groups]
    if abl:
        L.append("\n## Table 5 analogue: NanoSpec ablations\n")
        L.append("ctx = context only (no per-step append), ext = extension only (no prompt initialisation), "
                 "noasync = indexed GEMM over non-contiguous rows instead of the packed buffer.\n\n")
        rows = []
        for h in heads:
            base = (S.get(h) or {}).get("overall", {}).get("tokens_per_s")
            for n in ([h] if base else []) + [x for x in abl if x.startswith(h + "+")]:
                a = S[n]["overall"]
                if not a:
                    continue
                rows.append([n, _f(a["tokens_per_s"]), f"{a['tokens_per_s'] / base:.3f}×" if base else "-",
                             _f(a["mean_accepted_length"]), _f(a.get("vocab_coverage"), 3),
                             _f(a.get("vocab_active_mean"), 0), _f(a.get("draft_ms"))])
        L.append(md_table(["method", "tok/s", "vs full vocab", "τ", "coverage", "mean active rows",
                           "draft ms/step"], rows))

    L.append("\n## Table 6 analogue: draft-vocabulary state\n")
    L.append("Bytes of LM-head rows the draft reads per projection, and the device state each strategy keeps "
             "(from the vocab.py constructors; fp16/bf16 rows). 'full' keeps only an id table: its rows are the "
             "model's own LM head.\n")
    for sname, rows in ctx["state_tables"].items():
        L.append(f"\n{sname}:\n\n")
        L.append(md_table(["strategy", "rows", "LM-head rows read per call", "state bytes"], rows))

    if fig1:
        L.append("\n## Figure 1a/1b analogue: coverage and speed versus draft-vocabulary size\n")
        L.append(fig1["definition"] + "\n\n")
        rows = [[p["label"], _f(p["size"], 0), _f(p.get("coverage"), 4), _f(p.get("decode_rate")),
                 _f(p.get("oracle")), p.get("note", "")] for p in fig1["points"]]
        L.append(md_table(["vocabulary", "rows", "coverage", "decode tok/s", "oracle tok/s (Eq. 1)", "note"], rows))
        for img in ("fig1a_coverage", "fig1b_speed"):
            if (out_dir / f"bench_{tag}_{img}.png").is_file():
                L.append(f"\n![{img}](bench_{tag}_{img}.png)\n")
        bt = fig1.get("by_task")
        if bt:
            L.append("\n### Coverage per task\n\nNanoSpec: measured during its runs; freq top-K: the frequency "
                     "ranking of this run (text the target generated, never Spec-Bench) applied to the autoregressive "
                     "outputs of each task.\n\n")
            L.append(md_table(["task"] + bt["columns"], [[t] + [_f(c, 3) for c in r] for t, r in bt["rows"].items()]))

    draft_rows = []
    for n in spec:
        if not any(m.name == n and m.kind == "eagle" for m in methods):
            continue
        draft_rows.append([n] + [_f((S[n].get(t) or {}).get("draft_ms")) for t in cols])
    if draft_rows:
        L.append("\n## Figure 4 analogue: drafting time per task (ms per draft step: backbone + LM head + gather)\n\n")
        L.append(md_table(["method"] + [title(t) for t in cols], draft_rows))
        if (out_dir / f"bench_{tag}_fig4_draft_time.png").is_file():
            L.append(f"\n![fig4](bench_{tag}_fig4_draft_time.png)\n")

    targets = ctx.get("targets") or []
    if targets:
        L.append("\n## Targets of issue 6\n\n")
        L.append(md_table(["head", "target", "value", "met"], targets))
    L.append(f"\nPer-generation records: `bench_{tag}.json` (key `runs`); autoregressive outputs: "
             f"`bench_{tag}_outputs.jsonl`.\n")
    md = "".join(L)
    (out_dir / f"bench_{tag}.md").write_text(md)
    js = dict(settings=ctx["settings"], command=ctx["command"], warnings=ctx["warnings"], summary=S,
              mismatches=mismatches, state_tables=ctx["state_tables"], figure1=fig1, targets=targets,
              methods={m.name: dict(kind=m.kind, head=m.head, vocab=m.vocab, size=m.k, ablation=m.ablation,
                                    groups=sorted(m.groups)) for m in methods}, runs=records)
    (out_dir / f"bench_{tag}.json").write_text(json.dumps(js, indent=1, default=str))
    return js


def make_plots(out_dir: Path, tag: str, fig1, S, methods, tasks, log):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG plots (the Markdown report has the same data as tables)")
        return
    if fig1:
        for what, fname, ylabel in (("coverage", "fig1a_coverage", "coverage of emitted tokens"),
                                    ("decode_rate", "fig1b_speed", "decode tokens/s")):
            fig, ax = plt.subplots(figsize=(6, 4))
            heads = sorted({p["head"] for p in fig1["points"]}, key=str)
            for h in heads:
                pre = f"{h} " if len(heads) > 1 else ""
                for series, style in (("freq", "o-"), ("nanospec", "s-"), ("full", "D")):
                    pts = sorted([p for p in fig1["points"] if p["head"] == h and p["series"] == series
                                  and p.get(what) is not None], key=lambda p: p["size"])
                    if pts:
                        ax.plot([p["size"] for p in pts], [p[what] for p in pts], style, label=pre + series)
                if what == "decode_rate":
                    pts = [p for p in fig1["points"] if p["head"] == h and p.get("oracle") is not None
                           and p["series"] != "full"]
                    if pts:
                        ax.plot([p["size"] for p in pts], [p["oracle"] for p in pts], "kx", ms=8,
                                label=pre + "oracle (Eq. 1)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("draft vocabulary size (rows)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(out_dir / f"bench_{tag}_{fname}.png", dpi=120)
            plt.close(fig)
    eag = [m.name for m in methods if m.kind == "eagle" and m.groups & {"main", "custom"}
           and S[m.name]["overall"].get("draft_ms")]
    if eag:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(tasks)), 4))
        wdt = 0.8 / len(eag)
        for i, n in enumerate(eag):
            ax.bar([j + i * wdt for j in range(len(tasks))], [(S[n].get(t) or {}).get("draft_ms", 0) for t in tasks],
                   wdt, label=n)
        ax.set_xticks([j + 0.4 - wdt / 2 for j in range(len(tasks))], [TASK_TITLES.get(t, t) for t in tasks])
        ax.set_ylabel("drafting ms per step")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"bench_{tag}_fig4_draft_time.png", dpi=120)
        plt.close(fig)


def figure1(S, methods, freq_ranked, refs, sweep_ks, V, tasks_of=None):
    """Coverage/speed points per vocabulary size and the oracle of Eq. 1 for each head."""
    points = []
    defn = ("Coverage = fraction of emitted tokens that were in the draft's active vocabulary at that step "
            "(freq: computed from the autoregressive outputs for every K, also for sizes not run). Speed = decode "
            "tokens/s over speculative steps (prefill excluded). Oracle (Eq. 1) for a vocabulary of the same size: "
            "the full-vocabulary run's tokens per step τ_full divided by a step time of t_step(full) - "
            "t_LMhead(full) + t_LMhead(reduced), all measured per draft step in the runs (t_LMhead = projection + "
            "log-softmax over the active rows, as in Table 4; t_LMhead(reduced) from the run of that vocabulary): "
            "the speed the reduced vocabulary would reach if it kept full-vocabulary acceptance.")
    off = freq_coverage_offline(refs, freq_ranked, sorted(set(sweep_ks) | {m.k for m in methods if m.vocab == "freq"})) \
        if freq_ranked else {}
    heads = sorted({m.head for m in methods if m.head})
    for h in heads:
        full = S[h]["overall"] if h in S else None
        oracle_of = lambda lm: None  # without a full-vocabulary run there is no oracle
        if full and full.get("step_ms"):
            tau, t_full, lm_full = full["mean_accepted_length"], full["step_ms"]["total"], full["step_ms"]["lm_head"]
            oracle_of = lambda lm: tau / (t_full - lm_full + lm) * 1000
            points.append(dict(series="full", head=h, label=h, size=V, coverage=1.0, decode_rate=full["decode_rate"],
                               oracle=full["decode_rate"]))
        for m in methods:
            if m.head != h or m.vocab == "full" or m.ablation:
                continue
            a = S[m.name]["overall"]
            if not a or not a.get("step_ms"):
                continue
            size = m.k if m.vocab == "freq" else a.get("vocab_active_mean", m.k)
            points.append(dict(series=m.vocab, head=h, label=m.name, size=size,
                               coverage=a.get("vocab_coverage") if m.vocab == "nanospec" else off.get(m.k, a.get("vocab_coverage")),
                               decode_rate=a["decode_rate"], oracle=oracle_of(a["step_ms"]["lm_head"]),
                               note=f"W_max {m.k} (GEMM width)" if m.vocab == "nanospec" else ""))
        for k in sorted(off):
            if not any(p["series"] == "freq" and p["size"] == k and p["head"] == h for p in points):
                points.append(dict(series="freq", head=h, label=f"freq-{fmt_k(k)} (not run)", size=k, coverage=off[k]))
    by_task = coverage_by_task(S, methods, tasks_of, refs, freq_ranked) if freq_ranked and tasks_of else None
    if not points and off:
        for k in sorted(off):
            points.append(dict(series="freq", head=None, label=f"freq-{fmt_k(k)} (not run)", size=k, coverage=off[k]))
    return dict(definition=defn, points=points, by_task=by_task) if points else None


def coverage_by_task(S, methods, tasks_of, refs, ranked, ks=(3072, 16384)) -> dict:
    """Per task: coverage of every NanoSpec run (measured during generation) and of freq top-K (offline,
    from the autoregressive outputs of that task's questions). {"columns": [...], "rows": {task: [...]}}."""
    nano = [m for m in methods if m.vocab == "nanospec" and not m.ablation]
    cols = [m.name for m in nano] + [f"freq-{fmt_k(k)} (offline)" for k in ks]
    rows = {}
    for t in dict.fromkeys(tasks_of):
        mine = [r for r, tt in zip(refs, tasks_of) if tt == t]
        off = freq_coverage_offline(mine, ranked, ks)
        rows[t] = [(S[m.name].get(t) or {}).get("vocab_coverage") for m in nano] + [off[k] for k in ks]
    mine = freq_coverage_offline(refs, ranked, ks)
    rows["Overall"] = [S[m.name]["overall"].get("vocab_coverage") for m in nano] + [mine[k] for k in ks]
    return dict(columns=cols, rows=rows)


def check_targets(S, methods):
    rows = []
    for h in sorted({m.head for m in methods if m.head}):
        ns = f"{h}+nanospec"
        if ns not in S or h not in S or not S[ns]["overall"] or not S[h]["overall"]:
            continue
        sp, full = S[ns]["overall"]["tokens_per_s"], S[h]["overall"]["tokens_per_s"]
        rows.append([h, "NanoSpec tok/s >= 1.2x full vocabulary", f"{sp / full:.3f}x", "yes" if sp >= 1.2 * full else "NO"])
        fr = [(S[m.name]["overall"]["tokens_per_s"], m.name) for m in methods
              if m.head == h and m.vocab == "freq" and not m.compiled and S[m.name]["overall"]]
        if fr:
            best, bn = max(fr)
            rows.append([h, f"NanoSpec tok/s >= 1.05x best FR-Spec ({bn})", f"{sp / best:.3f}x",
                         "yes" if sp >= 1.05 * best else "NO"])
        t1, t0 = S[ns]["overall"]["mean_accepted_length"], S[h]["overall"]["mean_accepted_length"]
        rows.append([h, "NanoSpec τ >= 97% of full vocabulary", f"{t1 / t0 * 100:.1f}%", "yes" if t1 >= 0.97 * t0 else "NO"])
    return rows


# ---------------------------------------------------------------- latency mode (GPU; tiny shape on CPU for tests)

def _init_random_(module: torch.nn.Module, std=0.02):
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
    return module


def time_op(fn, device, iters=50, warmup=5, graph=True):
    """(eager ms, CUDA-graph replay ms or None). CPU: perf_counter means."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1000, None
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    eager = s.elapsed_time(e) / iters
    g_ms = None
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            s.record()
            for _ in range(iters):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            g_ms = s.elapsed_time(e) / iters
        except Exception:
            torch.cuda.synchronize()
            g_ms = None
    return eager, g_ms


@torch.no_grad()
def latency_mode(args, log) -> int:
    """Time the pieces of one speculative step for a randomly initialised model of a named shape."""
    dev = torch.device(args.device)
    if dev.type != "cuda" and args.shape != "tiny":
        raise UsageError("--latency needs CUDA (a GPU); on CPU only the smoke-test shape runs: --device cpu --shape tiny")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--latency needs CUDA, but CUDA is not available on this machine")
    a = shape_args(args.shape)
    dtype = getattr(torch, args.dtype) if dev.type == "cuda" or args.dtype != "bfloat16" else torch.float32
    ctx_len, N, k, D = args.latency_context, args.tree_nodes, args.tree_topk, args.tree_depth
    t0 = time.perf_counter()
    with torch.device("meta"):
        m = Transformer(a)
    m = _init_random_(m.to(dtype).to_empty(device=dev))
    if a.tie_word_embeddings:
        m.lm_head.weight = m.embed_tokens.weight
    m.eval()
    S = ctx_len + N + 64
    m.setup_caches(1, S)
    eagle_args = ModelArgs(arch="eagle", dim=a.dim, n_layers=1, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                           head_dim=a.head_dim, intermediate_size=a.intermediate_size, vocab_size=a.vocab_size,
                           norm_eps=a.norm_eps, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
                           max_position_embeddings=a.max_position_embeddings)
    c = dr.EagleConfig(3, eagle_args, 3 * a.dim, False, a.vocab_size, (2, a.n_layers // 2, a.n_layers - 3))
    with torch.device("meta"):
        head = dr.EagleHead(c)
    head = _init_random_(head.to(dtype).to_empty(device=dev)).eval()
    dr.attach(head, m)
    head.setup_caches(S + D * k)
    build_s = time.perf_counter() - t0
    log(f"built random {args.shape} target + full-vocabulary EAGLE-3 head on {dev} in {build_s:.1f} s")
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    kv_bytes = 2 * a.n_layers * a.n_kv_heads * a.head_dim * ctx_len * torch.finfo(dtype).bits // 8
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []

    def add(name, fn, bytes_moved=None, iters=args.latency_iters, graph=True):
        eager, graph = time_op(fn, dev, iters, graph=graph)
        best = graph if graph is not None else eager
        bw = f"{bytes_moved / best / 1e6:.0f} GB/s" if bytes_moved else ""
        rows.append([name, f"{eager:.3f}", "-" if graph is None else f"{graph:.3f}", bw])
        log(f"  {name}: eager {eager:.3f} ms" + ("" if graph is None else f", graph {graph:.3f} ms") + (f", {bw}" if bw else ""))

    # target decode step at position ctx_len
    tok1 = torch.randint(0, a.vocab_size, (1, 1), generator=g).to(dev)
    pos1 = torch.tensor([ctx_len], device=dev)
    add(f"target decode step (context {ctx_len})", lambda: m(tok1, pos1), nbytes + kv_bytes)
    # verify of N tree nodes (a chain mask is as costly as any tree mask)
    toksN = torch.randint(0, a.vocab_size, (1, N), generator=g).to(dev)
    posN = ctx_len + torch.arange(N, device=dev)
    maskN = m.seq_range[None, :] <= posN[:, None]
    add(f"verify {N} nodes", lambda: m(toksN, posN, mask=maskN, cache_pos=posN, return_hidden=True), nbytes + kv_bytes)
    # draft backbone: one tree level (k frontier tokens) through the EAGLE-3 midlayer
    ftok = torch.randint(0, a.vocab_size, (1, k), generator=g).to(dev)
    feats = torch.randn(1, k, a.dim, generator=g).to(dev, dtype)
    fpos = torch.full((k,), ctx_len, device=dev)
    fslots = ctx_len + torch.arange(k, device=dev)
    fmask = head.seq_range[None, :] <= fslots[:, None]
    add(f"draft backbone, one level ({k} tokens)", lambda: head(ftok, feats, fpos, fslots, fmask))
    # LM head at each vocabulary size, k rows (one tree level)
    h = torch.randn(k, a.dim, generator=g).to(dev, dtype)
    W = head.lm_weight()
    W_max = args.w_max if args.w_max < a.vocab_size else a.vocab_size // 4
    vocabs = [("full", FullVocab(W), a.vocab_size)]
    if 32768 < a.vocab_size:
        vocabs.append(("freq 32k", FreqVocab(W, torch.randperm(a.vocab_size, generator=g)[:32768]), 32768))
    ns = make_vocab("nanospec", W, w_max=W_max, k_pre=args.k_pre, k_ver=args.k_ver,
                    max_append=N + (D + 1) * args.k_ver)
    ns.reset(torch.randperm(a.vocab_size, generator=g)[:W_max].to(dev))
    vocabs.append((f"nanospec {W_max}", ns, W_max))
    ns.wait()
    lm_ms = {}
    for name, v, n_rows in vocabs:
        # NanoSpec: the packed GEMM that logits() runs once the copy stream's update has landed
        fn = (lambda: F.linear(h, ns.rows, ns.bias)) if v is ns else (lambda v=v: v.logits(h))
        add(f"LM head {name} ({k} x {n_rows} rows)", fn, n_rows * a.dim * W.element_size())
        lm_ms[name] = rows[-1]
    # NanoSpec: one step's update (N draft tokens + (D+1) x k_ver verified ids, ~10% new)
    new_ids = torch.randint(0, a.vocab_size, (N,), generator=g).to(dev)
    ver = torch.randint(0, a.vocab_size, (D + 1, args.k_ver), generator=g).to(dev)
    valid = torch.ones(N, dtype=torch.bool, device=dev)
    vvalid = torch.ones(D + 1, dtype=torch.bool, device=dev)

    def upd():
        ns.update(new_ids, valid, ver, vvalid)
        ns.wait()
    # eager only: the update forks onto the copy stream, which a graph capture of one call does not model
    add(f"nanospec update ({N}+{(D + 1) * args.k_ver} appended ids, incl. gather)", upd, graph=False)
    rows_buf = torch.zeros(W_max, a.dim, device=dev, dtype=dtype)
    nnew = max(1, (N + (D + 1) * args.k_ver) // 10)
    gt = torch.randint(0, a.vocab_size, (nnew,), generator=g).to(dev)
    gs = torch.randperm(W_max, generator=g)[:nnew].to(dev)
    add(f"gather {nnew} new rows (kernels.gather_rows_)", lambda: kernels.gather_rows_(rows_buf, W, gt, gs),
        2 * nnew * a.dim * W.element_size())
    title = (f"latency: {args.shape} (d={a.dim}, V={a.vocab_size}, {a.n_layers} layers, {nbytes / 1e9:.2f} GB "
             f"{str(dtype).replace('torch.', '')}), {dev}"
             + (f" {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else "") + f", torch {torch.__version__}")
    table = md_table(["operation", "eager ms", "CUDA graph ms", "achieved bandwidth"], rows)
    # one draft step of a depth-D tree: D backbone passes (the first on the accepted tokens) and D LM-head calls
    best = lambda r: float(r[2] if r[2] != "-" else r[1])
    backbone = best(next(r for r in rows if r[0].startswith("draft backbone")))
    upd_ms = best(next(r for r in rows if r[0].startswith("nanospec update")))
    est = [[f"draft step, {name}", f"{D * (backbone + best(r)) + (upd_ms if name.startswith('nanospec') else 0):.3f}"]
           for name, r in lm_ms.items()]
    table += ("\nEstimated draft time per step (depth " + str(D) + ": " + str(D) + " x (backbone + LM head), "
              "+ the update for NanoSpec):\n\n" + md_table(["", "ms"], est))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"latency_{args.shape}.md").write_text(f"# {title}\n\nCommand: `{command_line(args.argv)}`\n\n{table}")
    (out / f"latency_{args.shape}.json").write_text(json.dumps(dict(title=title, rows=rows), indent=1))
    print(f"\n{title}\n{table}", flush=True)
    return 0


# ---------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="NanoSpec engine: Spec-Bench-style side-by-side benchmark")
    p.add_argument("--checkpoint", default=None, help="target HF folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl or any jsonl with a prompt field "
                   "(default: the built-in prompts)")
    p.add_argument("--limit", type=int, default=None, help="questions per task (Spec-Bench task; MT-bench counts as one)")
    p.add_argument("--categories", default=None, help="comma-separated tasks or file categories")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn (default 256)")
    p.add_argument("--methods", default=None, help="comma-separated names: ar, ngram, eagle3 (full vocabulary), "
                   "eagle3+freq-8k (any K), eagle3+nanospec, eagle3+nanospec-ctx|-ext|-noasync, eagle3+nanospec-w1k "
                   "(any window), the same with eagle2; and presets main (ar, ngram, full, --freq-ks, nanospec), "
                   "ablations, sweep (--sweep-ks, --sweep-w), all. Default: all for the built-in prompts, main for "
                   "--questions. ar always runs (reference and baseline)")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 head folder (default: the shipped head of the default "
                   "model when it exists; 'none' to run without)")
    p.add_argument("--eagle2", default=None, help="EAGLE-1/2 head folder")
    p.add_argument("--random-head", action="store_true", help="without --eagle3: use a randomly initialised "
                   "EAGLE-3 head (untrained: acceptance ~1; exercises every code path and times drafting)")
    p.add_argument("--freq", default=None, help="FR-Spec frequency file (default: built from text the target "
                   "generates itself, cached under --cache)")
    p.add_argument("--freq-ks", default="8k", help="FR-Spec sizes of the main comparison (default 8k)")
    p.add_argument("--sweep-ks", default="512,1k,2k,4k,8k,16k,32k", help="FR-Spec sizes of Figure 1 "
                   "(default 512,1k,2k,4k,8k,16k,32k)")
    p.add_argument("--sweep-w", default="1k", help="extra NanoSpec window sizes of Figure 1 (default 1k)")
    p.add_argument("--freq-corpus", default="16x512", help="self-generated corpus for the frequency file: ROWSxTOKENS (default 16x512)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="default: cuda if available")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="default bfloat16")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU bit-exact decode/verify for every method but ar-fast (default: wherever this CPU's check "
                        "passes); --no-exact times the plain path for all")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="torch.compile decode / verify / draft steps (CUDA graphs on CUDA); the steps are fused, so "
                   "Table 4 then splits only verify vs the rest. 'both': every method also runs compiled, as "
                   "NAME@compile, side by side with eager (its outputs are checked against ar@compile)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor; tests use eager)")
    p.add_argument("--max-seq", type=int, default=None, help="with --compile: KV cache slots of every request "
                   "(default: what the longest question needs)")
    p.add_argument("--sync-phases", action="store_true", help="CUDA: synchronise around the timed vocabulary / "
                   "drafter updates (accurate Table 4, slower runs)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted warm-up generations per method (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "results"), help="report folder (default results/)")
    p.add_argument("--tag", default=None, help="report file stem suffix (default: builtin or the questions file's name)")
    p.add_argument("--cache", default=None, help="cache folder (default: OUT/cache)")
    p.add_argument("--shape", default="llama3.1-8b", help=f"named shape for Table 6 and --latency: {', '.join(SHAPES)} (default llama3.1-8b)")
    p.add_argument("--latency", action="store_true", help="GPU latency mode: random weights of --shape, no download")
    p.add_argument("--latency-context", type=int, default=1024, help="KV context length in latency mode (default 1024)")
    p.add_argument("--latency-iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice; 1 is "
                   "far steadier on a machine shared with other jobs)")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("speculative decoding (as generate.py)",
                             "EAGLE-2 tree: CUDA (and --latency) default top-10, depth 5, 60 nodes as in the papers; "
                             "CPU default top-8, depth 5, 16 nodes (on the 2-core dev CPU a 60-node verify costs "
                             "~3-4 decode steps, a 16-node one ~1.5, and the shipped head accepts as much with 16)")
    g.add_argument("--tree-topk", type=int, default=None)
    g.add_argument("--tree-depth", type=int, default=None)
    g.add_argument("--tree-nodes", type=int, default=None)
    g.add_argument("--spec-k", type=int, default=None, help="n-gram chain length (default 10)")
    g.add_argument("--ngram-min", type=int, default=1)
    g.add_argument("--ngram-max", type=int, default=3)
    g.add_argument("--w-max", type=int, default=3072)
    g.add_argument("--k-pre", type=int, default=3)
    g.add_argument("--k-ver", type=int, default=3)
    return p.parse_args(argv)


def command_line(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return "python bench.py " + " ".join(shlex.quote(a) for a in argv)


TREE_GPU, TREE_CPU = generate.TREE_GPU, generate.TREE_CPU


def run(args, log) -> int:
    try:
        torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"unknown device {args.device!r}") from None
    dflt = TREE_CPU if (torch.device(args.device).type == "cpu" and not args.latency) else TREE_GPU
    args.tree_topk = dflt[0] if args.tree_topk is None else args.tree_topk
    args.tree_depth = dflt[1] if args.tree_depth is None else args.tree_depth
    args.tree_nodes = dflt[2] if args.tree_nodes is None else args.tree_nodes
    dr.check_tree_budget(args.tree_topk, args.tree_depth, args.tree_nodes)
    if args.latency:
        return latency_mode(args, log)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    if args.shape not in SHAPES:
        raise UsageError(f"unknown --shape {args.shape!r}; choose from {', '.join(SHAPES)}")
    questions = select_questions(load_questions(args.questions), args.categories, args.limit)
    tag = args.tag or ("builtin" if args.questions is None else
                       (Path(args.questions).parent.name if Path(args.questions).stem == "question"
                        else Path(args.questions).stem))
    out_dir = Path(args.out)
    cache = ensure_cache(Path(args.cache) if args.cache else out_dir / "cache")
    warnings = []
    t_begin = time.perf_counter()
    if hasattr(os, "getloadavg") and dev.type == "cpu":
        load, ncpu = os.getloadavg()[0], os.cpu_count() or 1
        if load >= max(1.0, 0.5 * ncpu):
            warnings.append(f"the machine was busy when the run started (load average {load:.1f} on {ncpu} cores): "
                            "CPU timings are unreliable (other jobs; with several torch threads each, contention "
                            "can slow runs many-fold: --threads 1 is steadier)")

    path = resolve_checkpoint(args.checkpoint)
    model_name = path.name
    tok = Tokenizer(path)
    dtype = getattr(torch, args.dtype)
    model = load_model(path, dtype=dtype, device=dev)
    if not model.args.eos_ids:
        raise UsageError(f"no eos_token_id in {path}")
    cfg = json.loads((path / "config.json").read_text())
    sync = (lambda: torch.cuda.synchronize(dev)) if (dev.type == "cuda" and args.sync_phases) else (lambda: None)

    heads, head_info = {}, {}
    e3 = args.eagle3
    shipped = getattr(generate, "DEFAULT_HEAD", None)  # trained by eagle_train.py for the default model
    if e3 is None and args.checkpoint is None and not args.random_head and shipped and (Path(shipped) / "config.json").is_file():
        e3 = str(shipped)
        head_info["eagle3"] = f"shipped default head ({shipped})"
    if e3 == "none":
        e3 = None
    if e3 is None and args.random_head:
        e3 = str(write_random_eagle3(cache / f"random_eagle3_{model_name}", cfg, seed=args.seed))
        warnings.append("The EAGLE-3 head is RANDOMLY INITIALISED (--random-head): it is untrained, its drafts are "
                        "almost never accepted (τ ≈ 1), so EAGLE speeds here show drafting cost, not the method's speedup.")
        head_info["eagle3"] = "random (untrained)"
    for name, p in (("eagle2", args.eagle2), ("eagle3", e3)):
        if p is None:
            continue
        hp = resolve_checkpoint(p, patterns=["config.json", "*.safetensors", "pytorch_model.bin"])
        head = dr.load_eagle(hp, model, dtype, dev)
        want = 3 if name == "eagle3" else 2
        if head.c.version != want:
            raise UsageError(f"--{name} {p} is an EAGLE-{'3' if head.c.version == 3 else '1/2'} head")
        if head.c.version == 3:
            model.aux_layers = head.c.aux_layers
        heads[name] = head
        head_info.setdefault(name, str(hp))
    if not heads:
        warnings.append("No EAGLE head (none shipped, none given with --eagle3 PATH / --eagle2 PATH / --random-head): "
                        "only autoregressive and n-gram run; the EAGLE, FR-Spec and NanoSpec tables are empty.")

    freq_ks = [parse_k(s) for s in args.freq_ks.split(",") if s.strip()]
    sweep_ks = [parse_k(s) for s in args.sweep_ks.split(",") if s.strip()]
    sweep_w = [parse_k(s) for s in args.sweep_w.split(",") if s.strip()]
    V_draft = min((h.lm_weight().shape[0] for h in heads.values()), default=model.args.vocab_size)
    dropped = sorted({k for k in freq_ks + sweep_ks + sweep_w if k >= V_draft})
    if dropped:
        warnings.append(f"sizes {', '.join(map(str, dropped))} are >= the draft vocabulary ({V_draft}) and were left out")
        freq_ks, sweep_ks, sweep_w = ([k for k in ks if k < V_draft] for ks in (freq_ks, sweep_ks, sweep_w))
    if args.w_max >= V_draft:
        raise UsageError(f"--w-max {args.w_max} must be smaller than the draft vocabulary ({V_draft})")
    spec = args.methods or ("all" if args.questions is None else "main")
    methods = expand_methods(spec, heads, freq_ks, sweep_ks, sweep_w, args.w_max)
    if args.compile == "on":
        for m in methods:
            m.compiled = True
    elif args.compile == "both":  # side by side: every method eager and compiled, interleaved like the rest
        methods = sorted(methods + [replace(m, name=f"{m.name}@compile", compiled=True, groups=set(m.groups), timers={})
                                    for m in methods], key=Method.order)

    freq_path, freq_info, ranked = None, None, None
    if any(m.vocab == "freq" for m in methods):
        if args.freq:
            freq_path = Path(args.freq)
            if not freq_path.is_file():
                raise UsageError(f"frequency file not found: {freq_path}")
            freq_info = dict(source=str(freq_path))
        else:
            try:
                r, n = (int(x) for x in args.freq_corpus.lower().split("x"))
            except ValueError:
                raise UsageError(f"--freq-corpus must be ROWSxTOKENS, e.g. 16x512, got {args.freq_corpus!r}") from None
            freq_path, freq_info = self_freq_file(model, tok, model_name, cache, r, n, args.seed, log)
        ranked = torch.load(freq_path, map_location="cpu", weights_only=True)
        ranked = ranked.tolist() if isinstance(ranked, torch.Tensor) else list(ranked)
        n_ranked = len(dict.fromkeys(ranked))
        short = [k for k in freq_ks if k > n_ranked]
        if short:
            raise UsageError(f"{freq_path} ranks {n_ranked} token ids, fewer than --freq-ks {fmt_k(max(short))}")
        beyond = sorted({m.k for m in methods if m.vocab == "freq" and m.k > n_ranked})
        if beyond:  # Figure 1's sweep stops where the file's ranking ends (FR-Spec files list only seen ids)
            methods = [m for m in methods if not (m.vocab == "freq" and m.k > n_ranked)]
            sweep_ks = [k for k in sweep_ks if k <= n_ranked]
            warnings.append(f"{freq_path} ranks {n_ranked} token ids: sweep sizes {', '.join(map(fmt_k, beyond))} "
                            "were left out")
        if "seen" in freq_info:
            over = [k for k in sorted(set(freq_ks + sweep_ks)) if k > freq_info["seen"]]
            if over:
                warnings.append(f"the self-generated corpus saw {freq_info['seen']} distinct tokens: FR-Spec sizes "
                                f"{', '.join(fmt_k(k) for k in over)} fill the rest of the top-K with unseen ids in "
                                "id order (see the frequency file note)")

    limit = model.args.max_position_embeddings
    fits, longest = [], 0
    for q in questions:
        n = len(tok.encode_chat([{"role": "user", "content": "\n".join(q.turns)}]) if tok.chat_template else
                tok.encode("\n".join(q.turns)))
        need = n + len(q.turns) * (args.max_new_tokens + 16) + args.tree_nodes + 64
        if need > limit:
            warnings.append(f"question {q.qid} left out: its {n} prompt tokens + {len(q.turns)} x {args.max_new_tokens} "
                            f"new tokens may exceed the model's context of {limit}")
        else:
            fits.append(q)
            longest = max(longest, need)
    questions = fits
    if not questions:
        raise UsageError("no question fits the model's context")

    sampling = Sampling()
    torch.manual_seed(args.seed)
    for m in methods:
        build_method(m, model, heads, freq_path, args, sampling, sync)
        if m.compiled:
            # One KV-cache size for every request, so the compiled steps (and CUDA graphs) are built once, in the
            # warm-up, instead of once per cache-size bucket inside timed runs. generate.Engine keys this on
            # `graphs` (fixed buffers); on CPU it only fixes the size.
            m.engine.graphs = True
            m.engine.max_seq = args.max_seq or min(limit, (longest + 63) // 64 * 64)
    tasks = list(dict.fromkeys(q.task for q in questions))
    n_gen = sum(len(q.turns) for q in questions)
    log(f"{len(questions)} questions ({n_gen} generations per method) in {len(tasks)} tasks x {len(methods)} methods: "
        f"{', '.join(m.name for m in methods)}")
    for w in warnings:
        log(f"WARNING: {w}")

    # warm-up: kernel set-up, allocator, first-call costs; not counted
    methods[0].engine.warmup()
    wids = tok.encode_chat([{"role": "user", "content": WARMUP_PROMPT}]) if tok.chat_template else tok.encode(WARMUP_PROMPT)
    for _ in range(args.warmup):
        for m in methods:
            m.engine.generate(wids, min(args.max_new_tokens, 16))

    records, mismatches, refs = run_benchmark(questions, methods, tok, args.max_new_tokens, log,
                                              progress=not args.no_progress, model=model)
    S = summarize(records, methods, tasks)
    fig1 = figure1(S, methods, ranked, refs, sweep_ks, V_draft, [q.task for q in questions]) if heads else None
    d = model.lm_head.weight.shape[1]
    state_tables = {}
    elem = torch.finfo(dtype).bits // 8
    # the run's own model: from the live vocabulary objects where they ran
    live = [["full", V_draft, human_bytes(V_draft * d * elem), human_bytes(FullVocab(torch.empty(V_draft, d, device="meta")).state_bytes())]]
    for m in methods:
        a = S[m.name]["overall"]
        if m.vocab != "full" and a.get("vocab_state_bytes") is not None:
            live.append([m.name, m.k, human_bytes(m.k * d * elem), human_bytes(a["vocab_state_bytes"])])
    state_tables[f"this run ({model_name}, d={d}, V={V_draft}, {args.dtype})"] = live
    a6 = shape_args(args.shape)
    state_tables[f"{args.shape} (d={a6.dim}, V={a6.vocab_size}, fp16)"] = state_table(
        args.shape, a6.vocab_size, a6.dim, args.w_max, [8192, 16384, 32768, 65536])
    settings = {
        "model": f"{model_name} ({path})", "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else
                                                               f" ({machine_id()}, {os.cpu_count()} cores)"),
        "torch threads": torch.get_num_threads(), "dtype": args.dtype, "compile": args.compile, "torch": torch.__version__,
        "workload": f"{args.questions or 'built-in prompts'}: {len(questions)} questions, {n_gen} generations per "
                    f"method, tasks {', '.join(tasks)}" + (f", limit {args.limit} per task" if args.limit else ""),
        "max new tokens": args.max_new_tokens, "decoding": "greedy, chat template",
        "heads": ", ".join(f"{k}: {v}" for k, v in head_info.items()) or "none",
        "tree": f"top-{args.tree_topk}, depth {args.tree_depth}, {args.tree_nodes} nodes",
        "nanospec": f"W_max {args.w_max}, K_pre {args.k_pre}, K_ver {args.k_ver}",
        "frequency file": "-" if freq_info is None else f"{freq_path.name}: " + ", ".join(f"{k} {v}" for k, v in freq_info.items()),
        "methods": ", ".join(m.name for m in methods),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall time": f"{time.perf_counter() - t_begin:.0f} s",
    }
    ctx = dict(command=command_line(args.argv), settings=settings, warnings=warnings, state_tables=state_tables,
               targets=check_targets(S, methods))
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        make_plots(out_dir, tag, fig1, S, methods, tasks, log)
    except Exception as e:  # a plotting problem must not cost the measurements
        log(f"WARNING: plotting failed ({type(e).__name__}: {e}); the Markdown report has the same data")
    write_reports(out_dir, tag, ctx, S, methods, tasks, records, mismatches, fig1, log)
    with open(out_dir / f"bench_{tag}_outputs.jsonl", "w") as f:
        for q, outs in zip(questions, refs):
            f.write(json.dumps(dict(question_id=q.qid, category=q.category,
                                    turns=[tok.decode(o) for o in outs]), ensure_ascii=False) + "\n")
    print_summary(S, methods, tasks, mismatches, warnings, out_dir / f"bench_{tag}.md")
    return 1 if mismatches else 0


def print_summary(S, methods, tasks, mismatches, warnings, md_path):
    cols = tasks + ["overall"]
    print()
    print(md_table(["method"] + [TASK_TITLES.get(t, t) if t != "overall" else "Overall" for t in cols] + ["tok/s"],
                   [[m.name] + [f"{S[m.name][t]['speedup']:.2f}x τ{S[m.name][t]['mean_accepted_length']:.2f}"
                                if S[m.name].get(t) else "-" for t in cols]
                    + [_f(S[m.name]["overall"].get("tokens_per_s"))] for m in methods]))
    for w in warnings:
        print(f"WARNING: {w}")
    if mismatches:
        print(f"\n!!! CORRECTNESS FAILURE: {len(mismatches)} outputs differ from autoregressive decoding:", file=sys.stderr)
        for x in mismatches:
            print(f"!!!   question {x['qid']} turn {x['turn']} method {x['method']} (first difference at token "
                  f"{x['index']})", file=sys.stderr)
    else:
        print("all outputs identical to autoregressive decoding")
    print(f"report: {md_path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    threads = torch.get_num_threads()
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise UsageError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        return run(args, log)
    except (UsageError, ModelError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
