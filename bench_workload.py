"""bench.py's workload: questions and task selection, named model shapes, random EAGLE-3 heads, frequency files."""
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from errors import UsageError
from tokenizer import Tokenizer
from model import ModelArgs, Transformer
from sampling import Sampling, logits_to_probs, sample_from
from vocab_freq import build_freq


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

_BUILTIN = [  # (category, turns), written for this project: a few per Spec-Bench task, plus code completion
    ("mt_bench", [
        "Write a short blog post about a weekend trip to a mountain village, mentioning the food and the people "
        "you met.",
        "Rewrite your post as a poem of at most eight lines."]),
    ("mt_bench", [
        "A farmer has 17 sheep and all but 9 run away. How many sheep are left? Explain your reasoning.",
        "Now make up a similar trick question of your own and give its answer."]),
    ("translation", [
        "Translate the following German sentence into English: \"Der Zug nach Berlin hat wegen eines Sturms "
        "zwei Stunden Verspätung, deshalb warten viele Reisende im Bahnhofscafé.\""]),
    ("translation", [
        "Translate into English: \"La bibliothèque municipale ouvrira une nouvelle salle d'étude le mois "
        "prochain, avec des ordinateurs gratuits pour les étudiants.\""]),
    ("summarization", [_SUMMARY_1 + "\n\nSummarize the text above in two sentences."]),
    ("summarization", [_SUMMARY_2 + "\n\nSummarize the report above for a manager."]),
    ("qa", ["Why does the sky look blue during the day but red at sunset?"]),
    ("qa", ["What is the difference between a virus and a bacterium?"]),
    ("math_reasoning", [
        "A shop sells pencils at 3 for $1.20. Tom buys 12 pencils and pays with a $10 bill. How much change "
        "does he get? Think step by step."]),
    ("math_reasoning", [
        "A train travels 150 km in 2 hours and then 90 km in 1.5 hours. What is its average speed for the "
        "whole trip? Show your work."]),
    ("rag", [_RAG_1 + "\n\nUsing the passages above, answer: when was the lamp electrified, and who was the last "
             "resident keeper?"]),
    ("rag", [_RAG_2 + "\n\nUsing the passages above, answer: why was the Carrow Dam built and what else does it do?"]),
    ("code", [
        "Write a Python function is_palindrome(s) that ignores case and punctuation, and add a few tests."]),
    ("code", [
        "Complete this function:\n```python\ndef running_max(xs):\n    \"\"\"Return a list whose element i is "
        "the maximum of xs[:i+1].\"\"\"\n```"]),
]
BUILTIN_QUESTIONS = [dict(question_id=f"b{i}", category=c, turns=t) for i, (c, t) in enumerate(_BUILTIN, 1)]
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
                        vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                        tie_word_embeddings=True,
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
                   num_attention_heads=H, num_key_value_heads=Hkv, head_dim=hd,
                   rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
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
