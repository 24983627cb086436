"""Autoregressive speed: this engine's configurations against HF transformers `generate()` on the same checkpoint.

    python bench_ar.py [--checkpoint PATH] [--max-new-tokens 128] [--rounds 3] [--compile]

Rows: the engine with plain arithmetic (the fastest eager configuration), the engine in exact mode (`--exact`:
what makes speculative output bit-identical; its cost is the ratio of the two), `--compile` when asked, and
transformers. Methods alternate prompt by prompt (machines here are shared and noisy); the table reports the
median tokens/s of each, its ratio to transformers and to the fastest engine configuration. All run greedy in
the same dtype with the same prompt tokens, and the generated tokens are compared with transformers'.
"""
import argparse
import statistics
import time

import torch

from download import resolve_checkpoint
from exact import machine_id
from generate import Engine, Tokenizer
from model import load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works, with an example in Python.",
    "List five ideas for a rainy weekend.",
    "Summarize the causes of the French Revolution in a paragraph.",
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true", help="also time our engine with --compile")
    args = p.parse_args()
    import transformers as tf

    path = resolve_checkpoint(args.checkpoint)
    dtype = getattr(torch, args.dtype)
    tok = Tokenizer(path)
    model = load_model(path, dtype=dtype)
    ours = Engine(model, exact=False)
    methods = {"engine": ours, "engine --exact": Engine(model, exact=True)}
    if args.compile:
        methods["engine --compile"] = Engine(load_model(path, dtype=dtype), compile=True, exact=False)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    eos = ours.model.args.eos_ids
    n = args.max_new_tokens

    def run_hf(ids):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        dt = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), dt

    def run_ours(eng, ids):
        t0 = time.perf_counter()
        out, _ = eng.generate(ids, n)
        return out, time.perf_counter() - t0

    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS]
    for e in methods.values():  # warm-up (compilation, oneDNN kernel set-up), not timed
        run_ours(e, prompts[0])
        run_ours(e, prompts[0])
    run_hf(prompts[0])
    speeds = {k: [] for k in ["transformers", *methods]}
    same = True
    for r in range(args.rounds):
        for ids in prompts:
            ref, dt = run_hf(ids)
            speeds["transformers"].append(len(ref) / dt)
            for name, e in methods.items():
                out, dt = run_ours(e, ids)
                speeds[name].append(len(out) / dt)
                same &= out[:len(ref)] == ref[:len(out)]
    med = {k: statistics.median(v) for k, v in speeds.items()}
    base = med["transformers"]
    fastest = max((k for k in med if k.startswith("engine")), key=med.get)
    print(f"\ncheckpoint {path.name}, {args.dtype}, greedy, {n} new tokens max, {len(prompts)} prompts x {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads, {machine_id()}")
    print(f"| method | median tok/s | vs transformers | vs fastest engine ({fastest}) |\n|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {v / base:.2f}x | {v / med[fastest]:.3f}x |")
    print(f"tokens identical to transformers (prefix compared): {same}")


if __name__ == "__main__":
    main()
