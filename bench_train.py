"""Where a step of `eagle_train.py train` goes: the loss columns, the target's teacher-forced pass, the head's TTT
forward with its fused loss, the backward, the optimizer; and the supervised tokens per second. Runs the trainer's
own parts on the first batches of its epoch-0 order (the same batching, sampler and seed), a fresh head or --init
one. Prints a Markdown table.

    python bench_train.py --data data/sg_asis_a.jsonl [--steps 12] [--batch-tokens 2048] [--ttt-steps 4] \\
        [--loss-vocab 8192] [--init HEAD] [--json out.json]
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

from cpu_gemm import machine_id
from download import CheckpointError, resolve_checkpoint
from eagle_ckpt import init_from
from eagle_data import TrainError, read_records
from eagle_data import collate, make_batches
from eagle_train import DTYPES, autocast_ctx
from eagle_ttt import TTTLoss, aux_layer_ids, loss_columns, new_head, target_pass
from errors import one_line_errors
from model import ModelError, load_model

PARTS = ("loss columns", "target pass", "head forward + loss", "backward", "optimizer")


def run(a) -> int:
    if a.steps < 1 or a.warmup < 0:
        raise TrainError("--steps must be >= 1 and --warmup >= 0")
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    target = load_model(resolve_checkpoint(a.checkpoint), dtype=getattr(torch, a.target_dtype), device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    aux_layers = aux_layer_ids(target, None)
    recs = [r for p in a.data for r in read_records(p, target.args.vocab_size,
                                                     min(a.max_len, target.args.max_position_embeddings))]
    head = new_head(target, aux_layers, seed=a.seed)
    if a.init:
        init_from(head, Path(a.init))
    head.lm_head.weight.requires_grad_(False)
    model = TTTLoss(head, a.ttt_steps, a.logits_chunk, torch.bfloat16 if a.bf16 else torch.float32)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95))
    batches = make_batches(recs, a.batch_tokens)
    order = list(DistributedSampler(batches, num_replicas=1, rank=0, shuffle=True, seed=a.seed))
    pad_id = target.args.eos_ids[0] if target.args.eos_ids else 0
    rows = []
    for k in range(a.warmup + a.steps):
        tokens, sup = collate(recs, batches[order[k % len(order)]], pad_id, device)
        t = [time.perf_counter()]
        cols, bias = loss_columns(tokens, target.args.vocab_size, a.loss_vocab)
        sync(), t.append(time.perf_counter())
        with autocast_ctx(device, a.bf16):
            aux, tgt = target_pass(target, aux_layers, tokens, sup, a.logits_chunk, cols)
            sync(), t.append(time.perf_counter())
            loss, _, _ = model(aux, tokens, sup, tgt, cols, bias)
            sync(), t.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync(), t.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sync(), t.append(time.perf_counter())
        if k >= a.warmup:
            rows.append(dict(shape=list(tokens.shape), supervised=int(sup[:, 2:].sum()),
                             seconds=[t[i + 1] - t[i] for i in range(len(PARTS))]))
    per_part = [[r["seconds"][i] for r in rows] for i in range(len(PARTS))]
    total = sum(sum(r["seconds"]) for r in rows)
    n_sup = sum(r["supervised"] for r in rows)
    print(f"{machine_id()}, torch {torch.__version__}, {torch.get_num_threads()} threads, {a.target_dtype} target"
          f"{', bf16 autocast' if a.bf16 else ''}; {len(rows)} steps of {a.batch_tokens}-token batches (after "
          f"{a.warmup} warm-up), {a.ttt_steps} TTT steps, loss columns {a.loss_vocab or 'all'}\n")
    print("| part | median ms a step | share of the time |\n|---|---|---|")
    for name, xs in zip(PARTS, per_part):
        print(f"| {name} | {1e3 * statistics.median(xs):.0f} | {100 * sum(xs) / total:.0f}% |")
    print(f"| **step** | **{1e3 * statistics.median(sum(r['seconds']) for r in rows):.0f}** | 100% |")
    print(f"\n{n_sup} supervised tokens in {total:.1f} s: **{n_sup / total:.0f} supervised tok/s**"
          f" ({n_sup / len(rows):.0f} a step)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine=machine_id(), cpu=platform.processor(), torch=torch.__version__,
                           threads=torch.get_num_threads(), args={k: v for k, v in vars(a).items() if k != "func"},
                           parts=list(PARTS), steps=rows, supervised_tok_s=n_sup / total), f, indent=1)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, nargs="+", help="jsonl file(s) from `eagle_train.py data`")
    p.add_argument("--checkpoint", default=None, help="target HF folder or hub id (default: embedded SmolLM2)")
    p.add_argument("--target-dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="an exported EAGLE-3 head folder to start from (default: fresh)")
    p.add_argument("--steps", type=int, default=12, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--loss-vocab", type=int, default=8192)
    p.add_argument("--logits-chunk", type=int, default=512)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    return one_line_errors(run, parse_args(argv), (TrainError, ModelError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
