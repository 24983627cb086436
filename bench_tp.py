"""Tensor parallelism against one process, on this machine: generate.py on one prompt as one process with the fused
pass and on the PyTorch layers in exact mode, and under torchrun with N ranks on each of the same two passes (exact:
every linear gathered) and on the layers with --no-exact (the all-reduce layout), in turn, --rounds times; decode
tokens/s, the mean accepted length, and whether each text is one process's on the same pass (exact TP's must be: the
exit status is 1 where it is not).

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


FUSED, LAYERS = "one process, fused pass", "one process, PyTorch layers, exact"


def commands(a) -> dict[str, tuple[list[str], dict, str | None]]:
    """{configuration: (argv, environment, the one-process configuration whose text it must give)}; the ranks share
    this machine's threads."""
    gen = ["generate.py", "--prompt", a.prompt, "--max-new-tokens", str(a.max_new_tokens), "--json"]
    gen += (["--checkpoint", a.checkpoint] if a.checkpoint else []) + (["--draft", a.draft] if a.draft else [])
    env, threads = dict(os.environ), torch.get_num_threads()
    layers = {"NANOSPEC_CPU_FORWARD": "off"}
    tp = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.ranks), *gen]
    ranks = env | {"OMP_NUM_THREADS": str(max(1, threads // a.ranks))}
    return {FUSED: ([sys.executable, *gen], env, FUSED),
            LAYERS: ([sys.executable, *gen, "--exact"], env | layers, LAYERS),
            f"{a.ranks} ranks (TP {a.ranks}), fused pass": (tp, ranks, FUSED),
            f"{a.ranks} ranks (TP {a.ranks}), PyTorch layers": (tp + ["--exact"], ranks | layers, LAYERS),
            f"{a.ranks} ranks, PyTorch layers, --no-exact (all-reduce)": (tp + ["--no-exact"], ranks | layers, None)}


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
        for name, (argv, env, _) in cmds.items():
            got.setdefault(name, []).append(run_one(argv, env))
    print(f"{a.max_new_tokens} new tokens, greedy, {torch.get_num_threads()} threads, {a.rounds} rounds in turn\n")
    print("| configuration | decode tok/s | median | vs one process's fused pass | τ | text = one process's |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(x["decode_tokens_per_s"] for x in got[FUSED])
    same_tp = True
    for name, rs in got.items():
        speeds = [x["decode_tokens_per_s"] for x in rs]
        taus = [x.get("mean_accepted_length") for x in rs]
        ref = cmds[name][2]
        same = ref is not None and all(x["text"] == got[ref][0]["text"] for x in rs)
        same_tp &= same or ref is None
        tau = "-" if taus[0] is None else ", ".join(f"{t:.2f}" for t in taus)
        said = "-" if ref is None else f"{'yes' if same else 'no'} ({'fused' if ref == FUSED else 'layers'})"
        print(f"| {name} | {', '.join(f'{s:.2f}' for s in speeds)} | {statistics.median(speeds):.2f} | "
              f"{statistics.median(speeds) / base:.2f}x | {tau} | {said} |")
    return 0 if same_tp else 1


def main(argv=None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
