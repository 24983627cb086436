"""FR-Spec frequency files (`torch.save` of a list of token ids, most frequent first): vocab.FreqVocab takes the top
K, vocab.NanoSpecVocab fills its free slots from one. CLI: python vocab.py build-freq --tokenizer T --corpus F --out O
"""
import argparse
import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer


def load_freq_file(path, vocab_size, k=None, eos_ids=()):
    """The file's top k ids (None: all, capped at vocab_size), repeats keeping their first rank. Exactly k come back:
    eos ids missing from the top k replace the least frequent ones, so the GEMM width stays k."""
    if not Path(path).is_file():
        raise ValueError(f"frequency file not found: {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and weights-only errors come in several types
        raise ValueError(f"{path} is not a readable frequency file (torch.save of a list of token ids): "
                         f"{str(e).splitlines()[0][:120]}") from None
    if isinstance(data, torch.Tensor):
        if data.dim() != 1 or data.is_floating_point() or data.is_complex():
            raise ValueError(f"{path}: expected a 1-D integer tensor of ids, got {data.dtype} {tuple(data.shape)}")
        data = data.tolist()
    if not isinstance(data, (list, tuple)) or not all(isinstance(x, int) for x in data):
        raise ValueError(f"{path}: expected a list of int token ids (FR-Spec freq_*.pt format)")
    if not data:
        raise ValueError(f"{path}: the frequency file is empty")
    bad = [x for x in data if not 0 <= x < vocab_size]
    if bad:
        raise ValueError(f"{path}: {len(bad)} token id(s) outside [0, {vocab_size}) "
                         f"(e.g. {bad[0]}); was it built for a different tokenizer/vocabulary?")
    bad = [e for e in eos_ids if not 0 <= e < vocab_size]
    if bad:
        raise ValueError(f"eos id(s) {bad} outside [0, {vocab_size})")
    ranked = list(dict.fromkeys(data))                               # dedupe, keep first rank
    if k is None:
        k = min(len(ranked), vocab_size)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > len(ranked):
        raise ValueError(f"{path}: asked for the top {k} ids but the file ranks only {len(ranked)}")
    eos = list(dict.fromkeys(eos_ids))
    if len(eos) > k:
        raise ValueError(f"k ({k}) is smaller than the number of eos ids ({len(eos)})")
    top = ranked[:k]
    in_top = set(top)
    missing = [e for e in eos if e not in in_top]
    if missing:  # they replace the least frequent non-eos ids
        others = [t for t in top if t not in eos]
        drop = set(others[len(others) - len(missing):])
        top = [t for t in top if t not in drop] + missing
    return torch.tensor(top, dtype=torch.long)


def build_freq(token_ids, vocab_size):
    """Ids that occur in `token_ids` by descending count, ties by id; unseen ids left out, as in FR-Spec's files."""
    t = torch.as_tensor(token_ids if isinstance(token_ids, torch.Tensor) else list(token_ids),
                        dtype=torch.long).flatten().cpu()
    return _rank(build_freq_counts(t, vocab_size))


def build_freq_counts(t, vocab_size):
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}) (range {int(t.min())}..{int(t.max())})")
    return torch.bincount(t, minlength=vocab_size)


def _rank(counts):
    # stable sort on -count keeps id order among ties; never-seen ids are dropped
    order = torch.sort(-counts, stable=True).indices
    return order[counts[order] > 0].tolist()


_TEXT_KEYS = {"text", "prompt", "turns", "conversations", "messages", "content", "value",
              "response", "completion", "output", "instruction", "input", "question", "answer"}


def _json_texts(obj, is_text=False):
    # strings only under text-like keys (not ids, categories, roles); lists inherit their key, dicts re-decide
    if isinstance(obj, str):
        if is_text:
            yield obj
    elif isinstance(obj, list):
        for x in obj:
            yield from _json_texts(x, is_text)
    elif isinstance(obj, dict):
        for key, v in obj.items():
            yield from _json_texts(v, key in _TEXT_KEYS)


def corpus_texts(path, id_lists=None):
    """Texts of a .txt (one per non-empty line), .jsonl or .json corpus (a JSON array of ShareGPT or OpenAI
    conversations: only the assistant turns, what the model writes). Token-id records ({"ids": [...]}) go to id_lists
    when given, only their "spans" (the target's answers: FR-Spec ranks what the model writes) where they have any."""
    if str(path).endswith(".json"):  # one JSON array of conversations (ShareGPT's release): the assistant turns
        from eagle_data import ROLE_MAP, json_objects
        for _, rec in json_objects(Path(path))[0]:
            turns = (rec.get("conversations") or rec.get("messages") or []) if isinstance(rec, dict) else []
            for m in turns if isinstance(turns, list) else []:
                m = m if isinstance(m, dict) else {}
                text = m.get("value", m.get("content"))
                if ROLE_MAP.get(str(m.get("from", m.get("role"))).lower()) == "assistant" and isinstance(text, str):
                    yield text
        return
    is_jsonl = str(path).endswith(".jsonl")
    with open(path, encoding="utf-8") as f:
        for line in f:
            if is_jsonl:
                if line.strip():
                    obj = json.loads(line)
                    ids = obj.get("ids") if isinstance(obj, dict) else None
                    if id_lists is not None and isinstance(ids, list) and all(isinstance(x, int) for x in ids):
                        spans = obj.get("spans")
                        id_lists.append(ids if not spans else [x for a, b in spans for x in ids[a:b]])
                    else:
                        yield from _json_texts(obj)
            elif line.strip():
                yield line.rstrip("\n")


def build_freq_file(tokenizer_path, corpus_paths, out_path, vocab_size=None, batch=256, top=None):
    """Rank token ids by count over one or more corpora (text, or token-id records of the same tokenizer); the
    tokenizer: a tokenizer.json, or a checkpoint's (folder, GGUF file or named model); top: keep the first top."""
    if not str(tokenizer_path).endswith(".json"):
        from download import resolve_checkpoint
        tokenizer_path = resolve_checkpoint(str(tokenizer_path)) / "tokenizer.json"
    tok = Tokenizer.from_file(str(tokenizer_path))
    V = vocab_size or tok.get_vocab_size(with_added_tokens=True)
    counts = torch.zeros(V, dtype=torch.long)
    texts, id_lists = [], []
    for p in [corpus_paths] if isinstance(corpus_paths, (str, os.PathLike)) else corpus_paths:
        texts += corpus_texts(p, id_lists)
    if id_lists:
        counts += build_freq_counts(torch.tensor([x for ids in id_lists for x in ids], dtype=torch.long), V)
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i:i + batch], add_special_tokens=False):
            if enc.ids:
                ids = torch.tensor(enc.ids, dtype=torch.long)
                if int(ids.max()) >= V:
                    raise ValueError(f"tokenizer produced id {int(ids.max())} >= --vocab-size {V}")
                counts += torch.bincount(ids, minlength=V)
    ranked = _rank(counts)[:top]
    torch.save(torch.tensor(ranked, dtype=torch.int32) if top else ranked, out_path)
    return ranked


def main(argv=None):
    p = argparse.ArgumentParser(description="NanoSpec vocabulary tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build-freq", help="rank token ids by frequency in a corpus (FR-Spec file)")
    b.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a checkpoint (folder, .gguf, named model)")
    b.add_argument("--corpus", required=True, nargs="+",
                   help=".txt (one text per line), .jsonl (texts, or token-id records {\"ids\": [...]}) or .json (a "
                        "JSON array of ShareGPT or OpenAI conversations: their assistant turns)")
    b.add_argument("--top", type=int, help="keep the top K ids (an int32 tensor; default: every id seen, a list)")
    b.add_argument("--out", required=True, help="output .pt (list of ids, most frequent first)")
    b.add_argument("--vocab-size", type=int, help="model vocabulary size (default: the tokenizer's, added tokens too)")
    a = p.parse_args(argv)
    if a.top is not None and a.top < 1:
        p.error(f"--top must be >= 1, got {a.top}")
    ranked = build_freq_file(a.tokenizer, a.corpus, a.out, a.vocab_size, top=a.top)
    print(f"wrote {len(ranked)} ranked token ids to {a.out}")
