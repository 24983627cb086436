"""Batched decoding's throughput per batch size: the same prompts through BatchEngine with drafting off (AR), the
default speculative configuration with its load-aware budget (auto), and with every tree verified every step
(forced), rounds alternating, medians; the one-at-a-time engine as the batch-1 baseline; transformers' batched
generate() and llama.cpp's llama-batched-bench as peers. Prints a Markdown table, writes a PNG of tokens/s against
batch size (the crossover where speculation stops paying) and reports memory per sequence.

    python bench_batch.py --questions ../shared/data/spec_bench/question.jsonl --batches 1,2,4,8,16,32,64 \\
        --max-new-tokens 128 --rounds 3 [--png results/bench_batch.png] [--llama-batched-bench BIN --gguf F.gguf]

Each batch size decodes 2 x batch prompts (at least 4; Spec-Bench's, round-robin over its categories, or the
built-in ones), so waiting prompts join as others finish: the batch stays full, as a server's would.
"""
import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import torch

import draft_config as dc
from batch import BatchEngine
from bench_workload import load_questions, select_questions
from cpu_forward import layers_from
from cpu_gemm import machine_id
from errors import UsageError
from engine import DEFAULT_HEAD, Engine, load_target

CONFIGS = ("AR", "auto", "forced")
STEADY = "AR, full batch"  # run_steady: decode-only tokens/s, every step the whole batch (llama-batched-bench's S_TG)


def prompts_for(tok, questions: str | None, n: int) -> list[list[int]]:
    qs = load_questions(questions)
    qs = [q for q in select_questions(qs, None, None)]  # task by task, round-robin over a task's categories
    tasks = {}
    for q in qs:
        tasks.setdefault(q.task, []).append(q)
    mixed = [t[i] for i in range(max(map(len, tasks.values()))) for t in tasks.values() if i < len(t)]
    return [tok.encode_chat([{"role": "user", "content": mixed[i % len(mixed)].turns[0]}]) for i in range(n)]


def range_len(prompts, max_new, drafters=None) -> int:
    """Slots a sequence's range needs: the longest prompt, its new tokens and a tree, in 16s (attention blocks)."""
    return -(-(max(len(p) for p in prompts) + max_new + (drafters[0].nodes if drafters else 0)) // 16) * 16


def run_batch(model, prompts, max_new, batch, drafters=None, budget=True, exact=True) -> tuple[int, float, dict]:
    eng = BatchEngine(model, batch, range_len(prompts, max_new, drafters), drafters=drafters, budget=budget,
                      exact=exact)
    t0 = time.perf_counter()
    outs = eng.generate_batch(prompts, max_new)
    dt = time.perf_counter() - t0
    info = eng.budget.stats() if drafters and budget else {}
    return sum(len(o) for o in outs), dt, dict(info, outs=outs)


def run_steady(model, prompts, max_new, batch, exact=True) -> tuple[int, float, dict]:
    """llama-batched-bench's shape: `batch` prompts at once, each decoding max_new tokens (no EOS), so every decode
    step carries the whole batch -> (decode steps' tokens, their seconds): the batch's steady decode rate."""
    eng = BatchEngine(model, batch, range_len(prompts, max_new), ignore_eos=True, exact=exact)
    eng.generate_batch(prompts[:batch], max_new)
    return eng.decode_tokens, eng.decode_s, dict(outs=None)


def profile(model, prompts, max_new, sizes):
    """--profile: where a full batch's decode step goes (run_steady's shape), per batch size: the fused pass's own
    phases (its phase-timing build, the same arithmetic), the rest of the step's forward (embedding, LM head), of
    the median decode step; the layers' GEMM rate against this CPU's peak (cpu_gemm.peak_gflops)."""
    import cpu_forward
    import cpu_gemm
    if model.cpu_pass is None:
        raise UsageError("--profile times the fused CPU pass's phases: this model runs without it here")
    a = model.args
    flop = 2 * a.n_layers * a.dim * (a.n_heads * a.head_dim + 2 * a.n_kv_heads * a.head_dim + 3 * a.intermediate_size) \
        + 2 * a.n_layers * a.n_heads * a.head_dim * a.dim  # a row's multiply-adds in the layers' GEMMs, x2
    peak = cpu_gemm.peak_gflops()
    cpu_forward.timed(True)
    try:
        print(f"| batch | decode step ms | tok/s | GEMMs ms | attention ms | rest of the pass ms | outside the pass ms "
              f"| GEMM GFLOP/s{f' (peak {peak:.0f})' if peak else ''} |\n|---|---|---|---|---|---|---|---|")
        for b in sizes:
            eng, steps, phases = BatchEngine(model, b, range_len(prompts[:b], max_new), ignore_eos=True), [], []

            def step(*x, f=eng.decode_fn):
                cpu_forward.phase_times()  # (clears what earlier passes left)
                t0 = time.perf_counter()
                out = f(*x)
                steps.append((time.perf_counter() - t0) * 1e3)
                phases.append(cpu_forward.phase_times())
                return out

            eng.decode_fn = step
            eng.generate_batch(prompts[:b], max_new)
            # the median step, whole: its parts add up to it (medians taken column by column had not, by 0.08 ms
            # of a 0.5 ms step)
            i = sorted(range(len(steps)), key=steps.__getitem__)[(len(steps) - 1) // 2]
            ms, p = steps[i], phases[i]
            g, at, inner = p["GEMMs"], p["attention"], sum(p.values())
            rest = inner - g - at
            print(f"| {b} | {ms:.2f} | {b / ms * 1e3:.1f} | {g:.2f} | {at:.2f} | {rest:.2f} | {ms - inner:.2f} "
                  f"| {b * flop / g / 1e6:.0f} |")
    finally:
        cpu_forward.timed(False)
    print(f"\n({max_new} tokens per sequence, EOS ignored; prompts of {statistics.mean(map(len, prompts)):.0f} "
          "tokens on average; outside the pass: the embedding, the LM head and the call's host work)")


def run_single(model, prompts, max_new, exact=True) -> tuple[int, float, dict]:
    eng, n, t0 = Engine(model, exact=None if exact else False), 0, time.perf_counter()
    outs = [eng.generate(p, max_new)[0] for p in prompts]
    return sum(len(o) for o in outs), time.perf_counter() - t0, dict(outs=outs)


def run_hf(path, prompts, max_new, batch, eos) -> float:
    """transformers' batched greedy generate() (left padding), batch prompts at a time -> tokens/s."""
    import transformers as tf
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    n, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        T = max(map(len, chunk))
        ids = torch.tensor([[eos[0]] * (T - len(p)) + p for p in chunk])
        att = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=att, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0])
        for row in out[:, T:].tolist():  # up to and including the first eos, as the engine counts
            n += next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
    return n / (time.perf_counter() - t0)


def run_llama_batched(binary: str, gguf: str, prompt_len: int, max_new: int, batch: int) -> float:
    """llama-batched-bench's generation tokens/s (S_TG) for `batch` parallel sequences, this process's threads."""
    cmd = [binary, "-m", gguf, "-c", str(batch * (prompt_len + max_new) + 64), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_len), "-ntg", str(max_new), "-npl", str(batch), "-t", str(torch.get_num_threads())]
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = [l for l in r.stdout.splitlines() if re.match(r"\|\s*\d+\s*\|", l)]
    if r.returncode or not rows:
        raise SystemExit(f"llama-batched-bench failed (rc {r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}")
    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    return float(cells[-3])  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |


def memory_per_sequence(model, drafter, max_seq: int) -> dict:
    """Bytes a sequence holds: its range of the target's KV cache, and its drafter's state (head cache, window)."""
    a = model.args
    kv = a.n_layers * 2 * a.n_kv_heads * max_seq * a.head_dim * model.lm_head.weight.element_size()
    d = {"KV cache": kv}
    if drafter is not None:
        eagle = getattr(drafter, "tree", drafter)
        head = getattr(eagle, "head", None)
        if head is not None and head.kv is not None:
            d["draft head cache"] = head.kv.numel() * head.kv.element_size()
        vocab = getattr(eagle, "vocab", None)
        if vocab is not None and hasattr(vocab, "state_bytes"):
            d["NanoSpec window"] = vocab.state_bytes()
    return d


def plot(png: str, sizes, med: dict, peers: dict):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, style in (("AR", "o-"), ("auto", "s-"), ("forced", "^--"), (STEADY, "d-.")):
        xs = [b for b in sizes if (name, b) in med]
        ax.plot(xs, [med[name, b] for b in xs], style, label={
            "AR": "speculation off (AR)", "auto": "auto (budget)", "forced": "forced (every tree)",
            STEADY: "AR, whole batch every step (decode only)"}[name])
    for name, vals in peers.items():
        xs = sorted(vals)
        ax.plot(xs, [vals[b] for b in xs], ":", marker=".", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (sequences per target pass)")
    ax.set_ylabel("tokens/s, whole batch")
    ax.set_title("Batched decoding: when speculation pays")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: the built-in prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="AR, auto, forced")
    ap.add_argument("--forced-max", type=int, default=16, help="largest batch timed with every tree verified")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hf", default="1,8", help="batch sizes transformers' generate() is timed at ('' for none)")
    ap.add_argument("--png", default=None, help="write the figure here")
    ap.add_argument("--llama-batched-bench", default=None, help="llama.cpp's llama-batched-bench binary (a peer)")
    ap.add_argument("--gguf", default=None, help="with --llama-batched-bench: a GGUF of the same weights")
    ap.add_argument("--json", default=None, help="write every measurement here")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-exact: passes from the size the machine's check picks run the PyTorch layers with "
                         "torch's GEMMs (AMX where the CPU has it); a sequence may then differ from its batch-1 output")
    ap.add_argument("--profile", action="store_true", help="only profile a full batch's decode step per batch size "
                    "(the fused pass's phases)")
    ap.add_argument("--steady", action=argparse.BooleanOptionalAction, default=True,
                    help="also time AR with the whole batch every step (batch prompts, no EOS: decode-only tok/s, the "
                         "shape of llama-batched-bench's S_TG)")
    args = ap.parse_args(argv)
    if bool(args.llama_batched_bench) != bool(args.gguf):
        ap.error("--llama-batched-bench and --gguf go together")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if bad := [c for c in configs if c not in CONFIGS]:
        ap.error(f"unknown config {bad[0]} (known: {', '.join(CONFIGS)})")
    sizes = sorted({int(b) for b in args.batches.split(",")})
    model, tok, path = load_target(args.checkpoint)
    draft = dc.DraftConfig(str(DEFAULT_HEAD), "nanospec", ngram=None) if args.checkpoint is None else \
        dc.DraftConfig("ngram")
    n_max = max(4, 2 * max(sizes))
    prompts = prompts_for(tok, args.questions, n_max)
    if args.profile:
        return profile(model, prompts, args.max_new_tokens, sizes) or 0
    drafters = dc.make_drafters(draft, model, max(sizes)) if {"auto", "forced"} & set(configs) else []
    jobs = [("one at a time", 1)] + [(c, b) for b in sizes for c in configs if c != "forced" or b <= args.forced_max]
    jobs += [(STEADY, b) for b in sizes if "AR" in configs and args.steady]

    def run(job):
        c, b = job
        ps = prompts[:max(4, 2 * b)]
        if c == "one at a time":
            return run_single(model, ps, args.max_new_tokens, args.exact)
        if c == STEADY:
            return run_steady(model, prompts[:b], args.max_new_tokens, b, args.exact)
        return run_batch(model, ps, args.max_new_tokens, b, None if c == "AR" else drafters[:b], c == "auto",
                         args.exact)

    run(("AR", sizes[0]))  # warm-up: kernels, caches
    rates, shares, outs = {j: [] for j in jobs}, {j: [] for j in jobs}, {}
    for r in range(args.rounds):
        for j in jobs if r % 2 == 0 else jobs[::-1]:
            n, dt, info = run(j)
            rates[j].append(n / dt)
            shares[j].append(info.get("speculated_share", 1.0 if j[0] == "forced" else 0.0))
            if info["outs"] is not None:
                outs[j] = info["outs"]
    med = {j: statistics.median(v) for j, v in rates.items()}
    peers = {}
    eos = model.args.eos_ids
    for b in [int(x) for x in args.hf.split(",") if x.strip()]:
        peers.setdefault("transformers generate()", {})[b] = run_hf(path, prompts[:max(4, 2 * b)],
                                                                   args.max_new_tokens, b, eos)
    if args.llama_batched_bench:
        plen = round(statistics.mean(len(p) for p in prompts))
        peers["llama.cpp llama-batched-bench"] = {b: run_llama_batched(args.llama_batched_bench, args.gguf, plen,
                                                                       args.max_new_tokens, b) for b in sizes}
    base = med["one at a time", 1]
    print(f"{path.name}, bf16, greedy, {args.max_new_tokens} new tokens max, 2 x batch prompts (at least 4) "
          f"from {args.questions or 'the built-in prompts'}, {torch.get_num_threads()} threads, medians of "
          f"{args.rounds} rounds, {machine_id()}, "
          + ("exact" if args.exact else f"not exact: the PyTorch layers from {layers_from(model)} rows") + "\n")
    steady = {b: med[STEADY, b] for b in sizes if (STEADY, b) in med}
    print("| batch | " + " | ".join(f"{c} tok/s" for c in configs) + " | auto / AR | auto: speculated share "
          "| AR vs one at a time | " + " | ".join(peers) + (" | AR, full batch: decode tok/s | vs its batch 1 |"
                                                             if steady else " |"))
    print("|---" * (len(configs) + 4 + len(peers) + 2 * bool(steady)) + "|")
    print(f"| one at a time (engine, batch 1) | {base:.1f} |"
          + " |" * (len(configs) + 3 + len(peers) + 2 * bool(steady)))
    for b in sizes:
        cells = [f"{med[c, b]:.1f}" if (c, b) in med else "-" for c in configs]
        ratio = f"{med['auto', b] / med['AR', b]:.2f}x" if ("auto", b) in med and ("AR", b) in med else "-"
        share = f"{statistics.median(shares['auto', b]):.0%}" if ("auto", b) in shares else "-"
        vs = f"{med['AR', b] / base:.2f}x" if ("AR", b) in med else "-"
        print(f"| {b} | " + " | ".join(cells) + f" | {ratio} | {share} | {vs} | "
              + " | ".join(f"{v[b]:.1f}" if b in v else "-" for v in peers.values())
              + (f" | {steady[b]:.1f} | {steady[b] / steady[sizes[0]]:.2f}x |" if steady else " |"))
    if steady:
        print(f"\n(AR, full batch: batch prompts at once, each decoding {args.max_new_tokens} tokens with EOS ignored, "
              f"decode steps only, as llama-batched-bench's S_TG; 'vs its batch 1': against the same at batch "
              f"{sizes[0]})")
    same = all(outs[c, b] == outs["AR", b] for c, b in outs if c != "one at a time" and ("AR", b) in outs)
    print(f"\nevery configuration's tokens equal AR's at the same batch size: {same}")
    S = range_len(prompts, args.max_new_tokens, drafters)
    mem = memory_per_sequence(model, drafters[0] if drafters else None, S)
    print(f"memory per sequence at {S} positions: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem.items()))
    if args.png:
        plot(args.png, sizes, {k: v for k, v in med.items() if k[0] in CONFIGS + (STEADY,)}, peers)
        print(f"figure: {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rates={f"{c} {b}": v for (c, b), v in rates.items()}, peers=peers,
                           shares={f"{c} {b}": v for (c, b), v in shares.items()}, memory=mem, same=same,
                           machine=machine_id()), f, indent=1)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
