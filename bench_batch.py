"""Batched decoding's throughput: the same prompts decoded one at a time by the engine's autoregressive loop (the
batch-1 baseline) and by BatchEngine at several batch sizes, rounds alternating, medians. Prints a Markdown table.

    python bench_batch.py --prompts 16 --max-new-tokens 64 --batches 1,4,8,16 --rounds 3
"""
import argparse
import statistics
import sys
import time

import torch

from batch import BatchEngine
from bench_workload import BUILTIN_QUESTIONS
from generate import Engine, load_target


def run_single(model, prompts, max_new) -> tuple[int, float]:
    eng, n, t0 = Engine(model), 0, time.perf_counter()
    for p in prompts:
        n += len(eng.generate(p, max_new)[0])
    return n, time.perf_counter() - t0


def run_batch(model, prompts, max_new, batch) -> tuple[int, float]:
    S = -(-(max(len(p) for p in prompts) + max_new) // 16) * 16
    eng = BatchEngine(model, batch, S)
    t0 = time.perf_counter()
    outs = eng.generate_batch(prompts, max_new)
    return sum(len(o) for o in outs), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--prompts", type=int, default=16, help="how many prompts (the built-in ones, repeated)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    model, tok, _ = load_target(args.checkpoint)
    texts = [BUILTIN_QUESTIONS[i % len(BUILTIN_QUESTIONS)]["turns"][0] for i in range(args.prompts)]
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    sizes = [int(b) for b in args.batches.split(",")]
    configs = [("engine, one at a time", lambda: run_single(model, prompts, args.max_new_tokens))]
    configs += [(f"BatchEngine, batch {b}", lambda b=b: run_batch(model, prompts, args.max_new_tokens, b))
                for b in sizes]
    configs[1][1]()  # warm-up: kernels, caches
    rates = {name: [] for name, _ in configs}
    for r in range(args.rounds):
        for name, fn in configs if r % 2 == 0 else configs[::-1]:
            n, dt = fn()
            rates[name].append(n / dt)
    base = statistics.median(rates[configs[0][0]])
    print(f"{args.prompts} prompts x {args.max_new_tokens} new tokens (greedy), {torch.get_num_threads()} threads, "
          f"medians of {args.rounds} rounds\n")
    print("| configuration | tok/s | vs one at a time |\n|---|---|---|")
    for name, _ in configs:
        m = statistics.median(rates[name])
        print(f"| {name} | {m:.1f} | {m / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
