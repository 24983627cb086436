"""Train full-vocabulary EAGLE-3 draft heads: the training loop, the CLI (data and its batches: eagle_data; the head,
its training-time-test forward and loss, the target pass: eagle_ttt; checkpoints and export: eagle_ckpt; diagnostics:
eagle_eval).

    # data: self-generated (Magpie-style, the default when no dataset is at hand) ...
    python eagle_train.py data --out data/smol.jsonl --num 1000
    # ... or regenerate the assistant turns of a ShareGPT / UltraChat jsonl with the target
    python eagle_train.py data --dataset sharegpt.jsonl --out data/sg.jsonl --num 5000
    # train (online target pass per batch), then export an EAGLE-3 folder
    python eagle_train.py train --data data/smol.jsonl --out runs/smol --export heads/smol
    torchrun --nproc-per-node 8 eagle_train.py train --checkpoint meta-llama/Llama-3.1-8B-Instruct ...
    python eagle_train.py export --run runs/smol --out heads/smol [--no-lm-head]

Data format (jsonl, one conversation a line): {"ids": [token ids], "spans": [[start, end], ...]}; the
half-open spans mark the assistant tokens the head learns to predict (the loss mask). A sidecar
`<data>.meta.json` records how the file was made, so the same command reuses it instead of regenerating.
"""
import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import eagle_eval as ev
from download import CheckpointError, resolve_checkpoint
from eagle_ckpt import CKPT_FORMAT, CKPT_NAME, atomic_save, export_head, init_from, load_checkpoint, signature
from eagle_data import (TrainError, answer_conversations, check_held_out, collate, dataset_records, log, magpie_data,
                        make_batches, progress, read_conversations, read_records, write_records)
from eagle_ttt import TTTLoss, aux_layer_ids, head_from_config, loss_columns, new_head, target_pass
from errors import one_line_errors
from model import ModelError, load_model
from tokenizer import Tokenizer


# ---------------------------------------------------------------- training loop

def lr_lambda(warmup: int, total: int, min_ratio: float = 0.0):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        prog = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def autocast_ctx(device: torch.device, enabled: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def train(args) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    device = torch.device(args.device)
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend)
        rank = dist.get_rank()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    try:
        res = _train(args, device, rank, world)
        if world > 1:
            # every rank waits here until all are done (rank 0 saves and exports last), so no rank closes
            # its sockets while a peer may still be reading from them: gloo aborts the process on a reset
            dist.barrier()
        return res
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


FIT_STEPS = 10  # --time-limit: steps timed (after the first) before the schedule is fitted


def _train(args, device, rank, world) -> dict:
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = Path(args.out)
    ck_path = out / CKPT_NAME
    if args.time_limit is not None and (args.time_limit <= 0 or args.resume or args.stop_after):
        raise TrainError("--time-limit takes seconds > 0 and fits a fresh schedule: not with --resume or --stop-after")
    if not args.resume and ck_path.exists():
        raise TrainError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
    if args.resume and not ck_path.exists():
        raise TrainError(f"nothing to resume: no {CKPT_NAME} in {out}")
    path = resolve_checkpoint(args.checkpoint)
    target = load_model(path, dtype=getattr(torch, args.target_dtype), device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    aux = aux_layer_ids(target, args.aux_layers)
    recs = [r for p in ([args.data] if isinstance(args.data, (str, Path)) else args.data)
            for r in read_records(p, target.args.vocab_size, min(args.max_len, target.args.max_position_embeddings))]
    head = new_head(target, aux, args.rope_theta, seed=args.seed)
    if getattr(args, "init", None) and not args.resume:
        init_from(head, Path(args.init))
    head.lm_head.weight.requires_grad_(not args.freeze_lm_head)
    sig = signature(target, head, args.freeze_lm_head)
    ck = load_checkpoint(ck_path, sig) if args.resume else None
    if ck is not None:
        head.load_state_dict(ck["model"])
    model = TTTLoss(head, args.ttt_steps, args.logits_chunk,
                    torch.bfloat16 if args.bf16 else torch.float32)
    ddp = model
    if world > 1:
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    batches = make_batches(recs, args.batch_tokens)
    sampler = DistributedSampler(batches, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    per_epoch = len(sampler)
    total = per_epoch * args.epochs if args.max_steps is None else min(args.max_steps, per_epoch * args.epochs)
    warmup = max(1, int(args.warmup * total) if args.warmup < 1 else int(args.warmup))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total, args.min_lr_ratio))
    step = 0
    if args.start_step and ck is None:  # a campaign restarted from its exported head: Adam starts afresh
        step = args.start_step
        for _ in range(step):
            sched.step()
    if ck is not None:
        opt.load_state_dict(ck["optim"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
        torch.set_rng_state(ck["rng"])
        if ck.get("cuda_rng") is not None and device.type == "cuda":
            torch.cuda.set_rng_state(ck["cuda_rng"], device)
    pad_id = target.args.eos_ids[0] if target.args.eos_ids else 0
    hist_path = out / "history.json"
    history = json.loads(hist_path.read_text())[:step] if ck is not None and hist_path.is_file() else []
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        n_sup = sum(e - max(s, 2) for r in recs for s, e in r["spans"])
        log(f"{len(recs)} records, {sum(len(r['ids']) for r in recs)} tokens ({n_sup} supervised), "
            f"{len(batches)} batches/epoch, {total} steps, world {world}, ttt steps {args.ttt_steps}")

    def save():
        if rank == 0:
            atomic_save(dict(format=CKPT_FORMAT, signature=sig, model=head.state_dict(), optim=opt.state_dict(),
                             sched=sched.state_dict(), step=step, rng=torch.get_rng_state(),
                             cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                             args={k: v for k, v in vars(args).items() if k != "func"}), ck_path)

    bar = progress(total=total, initial=step, desc="train", unit="step")
    t_start = time.perf_counter()
    ema, n_sup_seen = None, 0
    stop = min(total, args.stop_after) if args.stop_after else total
    step0, t_first, fitted = step, None, args.time_limit is None

    def fit_schedule(now: float) -> int:
        """--time-limit: the schedule's length becomes the steps that fit, at the rate of the steps after the first
        (one-time set-ups), so the learning rate anneals by the deadline; every rank takes rank 0's answer."""
        nonlocal warmup
        per = (now - t_first) / max(1, step - step0 - 1)
        new = torch.tensor([max(step, step + int((args.time_limit - now) / per))], device=device)
        if world > 1:
            dist.broadcast(new, 0)
        new = min(total, int(new))
        warmup = min(warmup, max(1, int(args.warmup * new) if args.warmup < 1 else int(args.warmup)))
        sched.lr_lambdas = [lr_lambda(warmup, new, args.min_lr_ratio)]
        bar.total = new
        if rank == 0:
            log(f"--time-limit {args.time_limit:g} s: {new} steps at {per:.3f} s a step")
        return new
    while step < stop:
        epoch, skip = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        for k, bi in enumerate(sampler):
            if k < skip:
                continue
            tokens, sup = collate(recs, batches[bi], pad_id, device)
            cols, bias = loss_columns(tokens, target.args.vocab_size, args.loss_vocab)
            with autocast_ctx(device, args.bf16):
                aux_states, tgt = target_pass(target, aux, tokens, sup, args.logits_chunk, cols)
                loss, acc, cnt = ddp(aux_states, tokens, sup, tgt, cols, bias)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            sched.step()
            step += 1
            lv = float(loss.detach())
            ema = lv if ema is None else 0.95 * ema + 0.05 * lv
            accs = [round(a, 3) for a in acc.tolist()]  # (one host sync, not one per TTT step)
            history.append(dict(step=step, loss=lv, acc=accs, grad_norm=float(gnorm), lr=sched.get_last_lr()[0]))
            n_sup_seen += int(sup[:, 2:].sum()) * world
            rate = n_sup_seen / (time.perf_counter() - t_start)
            bar.set_postfix_str(f"loss {ema:.3f} acc {' '.join(f'{a:.2f}' for a in accs)} {rate:.0f} supervised tok/s")
            bar.update(1)
            if not fitted:
                now = time.perf_counter() - t_start
                t_first = now if t_first is None else t_first
                if step - step0 > 1 and (step - step0 > FIT_STEPS or now >= 0.1 * args.time_limit):
                    total = stop = fit_schedule(now)
                    fitted = True
            if args.time_limit and world == 1 and time.perf_counter() - t_start >= args.time_limit:
                stop = step  # a slower stretch than the fitted rate: the deadline holds anyway
            if args.save_every and step % args.save_every == 0:
                save()
                if rank == 0:  # with the checkpoint: an invocation stopped between checkpoints keeps its history
                    hist_path.write_text(json.dumps(history))
            if step >= stop:
                break
    bar.close()
    save()
    elapsed = time.perf_counter() - t_start
    res = dict(steps=step, seconds=elapsed, history=history)
    if rank == 0:
        log(f"step {step}: {n_sup_seen} supervised tokens in {elapsed:.0f} s "
            f"({n_sup_seen / max(elapsed, 1e-9):.0f} supervised tok/s)")
        hist_path.write_text(json.dumps(history))
        if args.export and (step >= total or args.time_limit):
            export_head(head, args.export, getattr(torch, args.export_dtype), with_lm_head=not args.no_lm_head)
            log(f"exported {args.export}")
    return res


# ---------------------------------------------------------------- CLI

def data_meta(args, ckpt_path: Path) -> dict:
    cfg = (ckpt_path / "config.json").read_bytes()
    w = ckpt_path / "model.safetensors"
    ident = hashlib.sha256(cfg + (str(w.stat().st_size).encode() if w.is_file() else b"")).hexdigest()[:16]
    keys = ["dataset", "num", "offset", "max_turns", "max_prompt_tokens", "seed", "batch_size", "max_new_tokens",
            "request_tokens", "temperature", "sampled_frac", "min_request_chars"]
    kind = ("as-is" if args.as_is else "regenerated") if args.dataset else "magpie"
    return dict(kind=kind, target=ident,
                **{k: getattr(args, k) for k in keys if hasattr(args, k)})


def cmd_data(args):
    if args.as_is and not args.dataset:
        raise TrainError("--as-is keeps a --dataset's own answers; name the dataset")
    path = resolve_checkpoint(args.checkpoint)
    meta = data_meta(args, path)
    out = Path(args.out)
    meta_path = Path(str(out) + ".meta.json")
    if out.is_file() and meta_path.is_file() and not args.overwrite:
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in meta} == meta:
            log(f"{out} is up to date ({old.get('records')} records); reusing it")
            return 0
        log(f"{out} was made with other settings; regenerating")
    torch.manual_seed(args.seed)
    tok = Tokenizer(path)
    model = load_model(path, dtype=getattr(torch, args.dtype), device=args.device)
    if not model.args.eos_ids:
        raise TrainError(f"no eos_token_id in {path}; cannot tell where generations end")
    t0 = time.perf_counter()
    if args.dataset:
        convs = read_conversations(args.dataset, answers=args.as_is)
        if args.num:
            rng = random.Random(args.seed)
            rng.shuffle(convs)
            convs = convs[args.offset:args.offset + args.num]
        elif args.offset:
            convs = convs[args.offset:]
        if not convs:
            raise TrainError(f"no conversations left in {args.dataset} at --offset {args.offset}")
    if args.as_is:
        recs = dataset_records(tok, convs, model.args.eos_ids, args.max_prompt_tokens, args.max_turns)
        if not recs:
            raise TrainError(f"no conversation in this chunk of {args.dataset} has an assistant turn that fits")
    elif args.dataset:
        recs = answer_conversations(model, tok, convs, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, sampled_frac=1.0 if args.temperature > 0 else 0.0,
                                    seed=args.seed, max_turns=args.max_turns, max_prompt_tokens=args.max_prompt_tokens)
    else:
        recs = magpie_data(model, tok, args.num, batch_size=args.batch_size, request_tokens=args.request_tokens,
                           max_new_tokens=args.max_new_tokens, answer_temperature=args.temperature,
                           sampled_frac=args.sampled_frac, min_request_chars=args.min_request_chars, seed=args.seed)
    dt = time.perf_counter() - t0
    write_records(out, recs, meta)
    n_tok = sum(e - s for r in recs for s, e in r["spans"])
    what = "supervised" if args.as_is else "generated"
    log(f"wrote {len(recs)} records to {out}: {n_tok} {what} tokens in {dt:.0f} s ({n_tok / max(dt, 1e-9):.0f} tok/s)")
    return 0


def cmd_export(args):
    ck = load_checkpoint(Path(args.run) / CKPT_NAME if Path(args.run).is_dir() else Path(args.run))
    path = resolve_checkpoint(args.checkpoint or ck["args"].get("checkpoint"))
    target = load_model(path, dtype=torch.float32)
    head = head_from_config(ck["signature"]["head"], target)
    head.load_state_dict(ck["model"])
    if args.no_lm_head and not torch.equal(head.lm_head.weight, target.lm_head.weight.float()):
        raise TrainError("--no-lm-head needs the head's lm_head to equal the target's (train with --freeze-lm-head)")
    export_head(head, args.out, getattr(torch, args.dtype), with_lm_head=not args.no_lm_head)
    log(f"exported {args.out}")
    return 0


def cmd_eval(args):
    path = resolve_checkpoint(args.checkpoint)
    target = load_model(path, dtype=getattr(torch, args.dtype))
    head_dir = resolve_checkpoint(args.head, patterns=["config.json", "*.safetensors"])
    try:
        head = ev.load_head(head_dir, target)
    except ValueError as e:
        raise TrainError(str(e)) from None
    recs = [r for r in read_records(args.data, target.args.vocab_size, target.args.max_position_embeddings)
            if r["spans"]][:args.limit]
    if not recs:
        raise TrainError(f"{args.data}: no records with an answer span")
    try:
        topk, depth, nodes = (int(x) for x in args.tree.split("/"))
    except ValueError:
        raise TrainError(f"--tree must be top-k/depth/nodes (e.g. 8/5/16), got {args.tree!r}") from None
    t0 = time.perf_counter()
    try:
        res = ev.recall_table(target, head, recs, steps=args.steps, vocab=args.vocab, w_max=args.w_max,
                              k_pre=args.k_pre, k_ver=args.k_ver, ablation=args.vocab_ablation)
        eng = None
        if args.engine_tokens:
            prompts = [r["ids"][:r["spans"][0][0]] for r in recs]
            eng = ev.engine_acceptance(target, head_dir, prompts, args.vocab, args.engine_tokens, topk, depth, nodes,
                                       args.steps, args.w_max, args.k_pre, args.k_ver, args.vocab_ablation)
    except ValueError as e:  # a vocabulary spec or size the engine refuses
        raise TrainError(str(e)) from None
    print(ev.table(res, eng))
    log(f"{len(recs)} records in {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(recall=res, engine=eng, head=str(args.head), data=str(args.data)),
                                              indent=1))
    return 0


def cmd_curve(args):
    print(ev.curve([ev.read_point(p, tokens=True) for p in args.points], args.png,
                   ev.read_point(args.ref) if args.ref else None))
    return 0


def cmd_train(args):
    if args.no_lm_head and not args.freeze_lm_head:
        raise TrainError("--no-lm-head needs --freeze-lm-head (the exported head then shares the target's lm_head)")
    if args.ttt_steps < 1:
        raise TrainError(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    if args.start_step and (not args.init or args.resume):
        raise TrainError("--start-step continues a schedule from an exported head: it needs --init and no --resume")
    if args.held_out:
        check_held_out(args.held_out, args.data)
    # CUDA: each batch's shapes differ (the target's cache is set up per batch); growable segments, not fragments
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    train(args)
    return 0


DTYPES = ["bfloat16", "float16", "float32"]


def target_args(p, cpu: bool, dtype_flag: str = "--dtype"):
    """The flags every command that runs the target shares."""
    p.add_argument("--checkpoint", default=None, help="target HF folder or hub id (default: embedded SmolLM2)")
    p.add_argument(dtype_flag, default="bfloat16", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if not cpu else "cpu")


def parse_args(argv=None):
    cpu = not torch.cuda.is_available()
    p = argparse.ArgumentParser(description="Train full-vocabulary EAGLE-3 draft heads (training-time test)")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("data", help="generate training data with the target (cached jsonl)")
    target_args(d, cpu)
    d.add_argument("--out", required=True, help="output jsonl (a .meta.json sidecar records how it was made)")
    d.add_argument("--dataset", default=None,
                   help="ShareGPT/UltraChat jsonl, or ShareGPT's JSON array (a copy cut off mid-record "
                        "gives its complete records), whose assistant turns are regenerated; "
                        "omitted: self-generated (Magpie-style) instructions")
    d.add_argument("--num", type=int, default=1000,
                   help="conversations (self-generated) or at most this many from --dataset")
    d.add_argument("--offset", type=int, default=0,
                   help="--dataset: skip this many of the shuffled conversations first (disjoint chunks: --offset 0, "
                        "--offset N, ... with the same --num N and --seed)")
    d.add_argument("--as-is", action="store_true",
                   help="--dataset: keep its own assistant turns (no generation; the target's logits label them)")
    d.add_argument("--max-turns", type=int, default=None, help="--dataset: answer at most this many user turns each")
    d.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="--dataset: end a conversation before a turn whose prompt (--as-is: the whole turn) is longer")
    d.add_argument("--max-new-tokens", type=int, default=256, help="assistant tokens per turn")
    d.add_argument("--request-tokens", type=int, default=64,
                   help="self-generated request budget (unfinished ones are dropped)")
    d.add_argument("--min-request-chars", type=int, default=12, help="self-generated: drop shorter requests")
    d.add_argument("--temperature", type=float, default=0.0, help="answer temperature (0 = greedy)")
    d.add_argument("--sampled-frac", type=float, default=0.0,
                   help="self-generated: fraction of answers sampled at --temperature")
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--overwrite", action="store_true", help="regenerate even if the cached file matches")
    d.set_defaults(func=cmd_data)

    t = sub.add_parser("train", help="train an EAGLE-3 head with training-time test")
    target_args(t, cpu, "--target-dtype")
    t.add_argument("--data", required=True, nargs="+", help="jsonl file(s) from `eagle_train.py data`")
    t.add_argument("--out", required=True, help="run folder (checkpoint.pt, history.json)")
    t.add_argument("--export", default=None, help="write the EAGLE-3 folder here at the end")
    t.add_argument("--held-out", default=None,
                   help="held-out records (eval's --data): an error if a --data file shares conversations with them")
    t.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    t.add_argument("--init", default=None,
                   help="start from this exported EAGLE-3 head folder (continued training on new data)")
    t.add_argument("--start-step", type=int, default=0,
                   help="with --init: continue a schedule from this step (the data order and learning rate resume; "
                        "Adam starts afresh)")
    t.add_argument("--ttt-steps", type=int, default=3 if cpu else 7, help="unrolled training-time-test steps")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--max-steps", type=int, default=None, help="schedule length: at most this many optimizer steps")
    t.add_argument("--stop-after", type=int, default=None,
                   help="end this invocation after step N (checkpointed; continue with --resume), schedule unchanged")
    t.add_argument("--time-limit", type=float, default=None,
                   help="train for this many seconds: the schedule's length becomes the steps that fit (timed over "
                        "the first steps), the learning rate anneals by then, and the run saves and exports at it")
    t.add_argument("--batch-tokens", type=int, default=2048 if cpu else 16384,
                   help="padded tokens per batch (per rank)")
    t.add_argument("--max-len", type=int, default=2048, help="truncate records to this many tokens")
    t.add_argument("--lr", type=float, default=5e-4 if cpu else 1e-4)
    t.add_argument("--min-lr-ratio", type=float, default=0.0)
    t.add_argument("--warmup", type=float, default=0.03, help="warmup steps (< 1: fraction of all steps)")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--freeze-lm-head", action=argparse.BooleanOptionalAction, default=cpu,
                   help="keep lm_head = the target's LM head (default on CPU)")
    t.add_argument("--aux-layers", default=None, help="three target layer ids, e.g. 2,15,27 (default 2,L//2,L-3)")
    t.add_argument("--rope-theta", type=float, default=None, help="the head's RoPE base (default: the target's)")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    t.add_argument("--logits-chunk", type=int, default=512, help="rows per LM-head chunk in the loss")
    t.add_argument("--loss-vocab", type=int, default=0,
                   help="0: exact soft CE over the full vocabulary; N: sampled softmax over N columns (the batch's "
                        "tokens + uniform negatives, log-corrected), much cheaper on CPU")
    t.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (0: only at the end)")
    t.add_argument("--export-dtype", default="bfloat16", choices=DTYPES)
    t.add_argument("--no-lm-head", action="store_true", help="export without lm_head.weight (frozen head only)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("export", help="export a run's checkpoint as an EAGLE-3 folder")
    e.add_argument("--run", required=True, help="run folder or checkpoint.pt")
    e.add_argument("--out", required=True)
    e.add_argument("--checkpoint", default=None, help="target (default: the one the run used)")
    e.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    e.add_argument("--no-lm-head", action="store_true", help="omit lm_head.weight (it must equal the target's)")
    e.set_defaults(func=cmd_export)

    v = sub.add_parser("eval", help="a head's recall@k per depth (full and draft vocabulary) and the engine's "
                                    "acceptance, on held-out records")
    v.add_argument("--head", required=True, help="an EAGLE-3 head folder (over the target's whole vocabulary)")
    v.add_argument("--data", required=True, help="held-out records from `eagle_train.py data` (first answer each)")
    v.add_argument("--checkpoint", default=None, help="target HF folder or hub id (default: embedded SmolLM2)")
    v.add_argument("--vocab", default="nanospec", help="the draft vocabulary: full, nanospec or freq:PATH[:K]")
    v.add_argument("--w-max", type=int, default=3072, help="NanoSpec window slots")
    v.add_argument("--k-pre", type=int, default=3, help="NanoSpec: target top-K per prompt position")
    v.add_argument("--k-ver", type=int, default=3, help="NanoSpec: target top-K per answer position")
    v.add_argument("--vocab-ablation", default=None, choices=["ctx", "ext", "noasync", "nofill"],
                   help="NanoSpec ablation (as generate.py's)")
    v.add_argument("--steps", type=int, default=4, help="unrolled depths")
    v.add_argument("--limit", type=int, default=None, help="at most this many records")
    v.add_argument("--engine-tokens", type=int, default=128,
                   help="new tokens per prompt for the engine's realised acceptance (0: skip it)")
    v.add_argument("--tree", default="8/5/16", help="the engine's tree: top-k/depth/nodes")
    v.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    v.add_argument("--json", default=None, help="also write the figures here")
    v.set_defaults(func=cmd_eval)

    c = sub.add_parser("curve", help="the data-size curve: a table (and a PNG) of `eval --json` results by "
                                     "supervised tokens")
    c.add_argument("points", nargs="+", help="TOKENS=FILE.json, e.g. 2.21M=results/head_eval/a.json")
    c.add_argument("--ref", default=None, help="LABEL=FILE.json: a head drawn as a line (e.g. the shipped one)")
    c.add_argument("--png", default=None)
    c.set_defaults(func=cmd_curve)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return one_line_errors(args.func, args, (TrainError, ModelError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
