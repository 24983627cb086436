"""CLI: generate text from a prompt, a chat or a file of prompts (the engine itself is engine.py).

    python generate.py                                   # embedded SmolLM2-135M-Instruct, "capital of France"
    python generate.py --checkpoint meta-llama/Llama-3.1-8B-Instruct --prompt "Hi" --device cuda --compile
"""
import argparse
import json
import sys
from pathlib import Path

import torch

import batch_prompts
import draft_config as dc
import tp
from download import models_table
from engine import DEFAULT_HEAD, Engine, build_engine, load_target
from errors import UsageError, one_line_errors
from model import Transformer
from sampling import Sampling
from stats import Stats
from tokenizer import Streamer, Tokenizer

DEFAULT_PROMPT = "What is the capital of France?"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="NanoSpec engine: generate text with speculative decoding")
    p.add_argument("--checkpoint", default=None, help="HF folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--list-models", action="store_true", help="print the named models (--checkpoint NAME) and exit")
    p.add_argument("--prompt", default=None, help="prompt text, or @file to read it from a file")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--compile", action="store_true",
                   help="torch.compile decode/verify/draft steps (inductor on CPU; CUDA graphs on CUDA); with "
                        "--prompts (CUDA only): the batch's decode steps as CUDA graphs, one per padded batch size")
    p.add_argument("--max-seq", type=int, default=4096, help="KV cache slots when CUDA graphs are captured")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: greedy output bit-identical to autoregressive decoding (an error where this CPU's "
                        "check fails). Default: on where free (the fused CPU pass), else the fastest arithmetic")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text + stats")
    p.add_argument("--prompts", default=None, help="a file of prompts, one a line (JSON {\"prompt\", ...} or text): "
                   "decoded --batch at a time, one JSON line each as it finishes")
    p.add_argument("--batch", type=int, default=None, help="--prompts: sequences per target pass (default 8)")
    p.add_argument("--ordered", action="store_true", help="--prompts: print results in input order")
    g = dc.add_flags(p)
    g.add_argument("--budget", default="auto", choices=["auto", "fixed"],
                   help="auto: verify as many drafted nodes as pays on this machine for this request (measured "
                        "as it generates; none: autoregressive); fixed: the whole tree")
    args = p.parse_args(argv)
    args.given = dc.given_flags(p, argv)
    return args


def read_prompt(arg: str | None) -> str:
    if arg is None:
        return DEFAULT_PROMPT
    if arg.startswith("@"):
        f = Path(arg[1:])
        if not f.is_file():
            raise UsageError(f"prompt file not found: {f}")
        return f.read_text()
    return arg


def stats_line(st: Stats, model: Transformer) -> str:
    d = st.as_dict()
    s = (f"[{d['new_tokens']} new tokens, {d['tokens_per_s']:.2f} tok/s (decode {d['decode_tokens_per_s']:.2f} "
         f"tok/s), prefill {st.prefill_s * 1000:.0f} ms")
    if "mean_accepted_length" in d:
        s += f", {st.target_forwards} target forwards, mean accepted length {d['mean_accepted_length']:.2f}"
    if "accepted_from" in d:
        s += ", accepted draft tokens from " + ", ".join(f"{k} {v:.0%}" for k, v in d["accepted_from"].items())
    if "speculated_share" in d:
        s += f", speculated on {d['speculated_share']:.0%} of steps (verified nodes: {d['budget_hist']})"
    if "exact" in d:
        s += ", exact" if d["exact"] else ", not exact"
    if model.norm.weight.is_cuda:
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        s += (f", {nbytes * st.target_forwards / max(st.decode_s, 1e-9) / 1e9:.1f} GB/s, "
              f"peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    return s + "]"


def run(args) -> int:
    if args.list_models:
        print(models_table())
        return 0
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.prompts is None and (args.batch is not None or args.ordered):
        raise UsageError("--batch and --ordered go with --prompts FILE")
    if args.prompts is not None and (args.chat or args.prompt is not None):
        raise UsageError("--prompts decodes its own prompts: drop --chat and --prompt")
    if args.prompts is not None and args.compile and torch.device(args.device).type != "cuda":
        raise UsageError("--compile with --prompts replays the batch's decode steps as CUDA graphs: "
                         "it needs --device cuda")
    if tp.launched() and (args.chat or args.compile):
        raise UsageError("tensor parallelism runs eager, without --chat: drop --chat and --compile")
    # the request as the library takes it, before a model loads (a flag's or a prompt file's error comes first)
    draft, sampling = dc.from_flags(args, DEFAULT_HEAD), Sampling(args.temperature, args.top_k, args.top_p)
    text = read_prompt(args.prompt) if args.prompts is None and not args.chat else None
    ranks = tp.setup(args.device)  # torchrun --nproc_per_node N: tensor parallel (tp.py)
    model, tok, _ = load_target(args.checkpoint, args.device, args.dtype)
    tp.shard(model, exact=args.exact is not False)  # --no-exact: the all-reduce layout
    tp.sync_budget()
    if args.prompts is not None:
        return batch_prompts.run_prompts(
            model, tok, args.prompts, sampling, draft,
            batch=8 if args.batch is None else args.batch, max_new_tokens=args.max_new_tokens, raw=args.raw,
            budget=args.budget == "auto", exact=args.exact, cuda_graphs=args.compile, seed=args.seed,
            ordered=args.ordered, as_json=args.json)
    # exact by default where it costs nothing (the fused pass) and under TP (each rank's layers, as one process's)
    exact = args.exact if args.exact is not None else (None if model.cpu_pass is not None else ranks > 1)
    engine = build_engine(model, tok, draft, sampling, compile=args.compile,
                          max_seq=args.max_seq, exact=exact, budget=args.budget == "auto", budget_cache=True)
    torch.manual_seed(args.seed)
    engine.warmup()
    if args.chat:
        return chat_loop(engine, tok, args)
    chat = not args.raw and tok.chat_template is not None
    ids = tok.encode_chat([{"role": "user", "content": text}]) if chat else tok.encode(text)
    out, st = engine.generate(ids, args.max_new_tokens, on_tokens=None if args.json else Streamer(tok))
    if args.json:
        print(json.dumps(dict(text=tok.decode(out), **st.as_dict())))
    else:
        print()
        print(stats_line(st, engine.model), file=sys.stderr)
    return 0


def chat_loop(engine: Engine, tok: Tokenizer, args) -> int:
    messages = []
    print("chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        out, st = engine.generate(tok.encode_chat(messages), args.max_new_tokens, on_tokens=Streamer(tok))
        print()
        print(stats_line(st, engine.model), file=sys.stderr)
        messages.append({"role": "assistant", "content": tok.decode(out)})
    return 0


def main(argv=None) -> int:
    return one_line_errors(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
