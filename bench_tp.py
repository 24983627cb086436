"""Tensor parallelism against one process, on this machine: generate.py on one prompt as one process with the fused
pass, as one process on the PyTorch layers in exact mode (what each rank runs), and under torchrun with N ranks,
exact (every linear gathered) and --no-exact (the all-reduce layout), in turn, --rounds times; decode tokens/s,
the mean accepted length, and whether each text is the one-process layers' text (exact TP's must be: the exit
status is 1 where it is not).

    python bench_tp.py --ranks 2 --rounds 2 --max-new-tokens 128 [--checkpoint DIR] [--draft none] [--prompt TEXT]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPT = "Write a short story about a robot who learns to paint."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--draft", default=None, help="generate.py's --draft (default: its default drafter)")
    a = p.parse_args(argv)
    if a.ranks < 2 or a.rounds < 1:
        p.error("--ranks must be >= 2 and --rounds >= 1")
    return a


def commands(a) -> dict[str, tuple[list[str], dict]]:
    """{configuration: (argv, environment)}; the ranks share this machine's threads."""
    gen = ["generate.py", "--prompt", a.prompt, "--max-new-tokens", str(a.max_new_tokens), "--json"]
    gen += (["--checkpoint", a.checkpoint] if a.checkpoint else []) + (["--draft", a.draft] if a.draft else [])
    env, threads = dict(os.environ), torch.get_num_threads()
    return {"one process, fused pass": ([sys.executable, *gen], env),
            "one process, PyTorch layers, exact": ([sys.executable, *gen, "--exact"],
                                                   env | {"NANOSPEC_CPU_FORWARD": "off"}),
            f"{a.ranks} ranks (TP {a.ranks})": ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                 str(a.ranks), *gen],
                                                env | {"OMP_NUM_THREADS": str(max(1, threads // a.ranks))}),
            f"{a.ranks} ranks, --no-exact (all-reduce)": ([sys.executable, "-m", "torch.distributed.run",
                                                          "--nproc_per_node", str(a.ranks), *gen, "--no-exact"],
                                                         env | {"OMP_NUM_THREADS": str(max(1, threads // a.ranks))})}


def run_one(argv: list[str], env: dict) -> dict:
    r = subprocess.run(argv, capture_output=True, text=True, cwd=HERE, env=env, timeout=3600)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or [""])[-1]
        raise SystemExit(f"error: {' '.join(argv[:4])} ... failed (rc {r.returncode}): {tail}")
    return json.loads(lines[-1])


def run(a) -> int:
    cmds, got = commands(a), {}
    for _ in range(a.rounds):
        for name, (argv, env) in cmds.items():
            got.setdefault(name, []).append(run_one(argv, env))
    ref = got["one process, PyTorch layers, exact"][0]["text"]
    print(f"{a.max_new_tokens} new tokens, greedy, {torch.get_num_threads()} threads, {a.rounds} rounds in turn\n")
    print("| configuration | decode tok/s | median | vs one process's layers | τ | text = layers' |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(x["decode_tokens_per_s"] for x in got["one process, PyTorch layers, exact"])
    same_tp = True
    for name, rs in got.items():
        speeds = [x["decode_tokens_per_s"] for x in rs]
        taus = [x.get("mean_accepted_length") for x in rs]
        same = all(x["text"] == ref for x in rs)
        same_tp &= same or not name.endswith(")")
        tau = "-" if taus[0] is None else ", ".join(f"{t:.2f}" for t in taus)
        print(f"| {name} | {', '.join(f'{s:.2f}' for s in speeds)} | {statistics.median(speeds):.2f} | "
              f"{statistics.median(speeds) / base:.2f}x | {tau} | {'yes' if same else 'no'} |")
    return 0 if same_tp else 1


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
