"""Spec-Bench-style side-by-side benchmark: speed, mean accepted length and the NanoSpec paper's tables.

    python bench.py                                             # built-in prompts, every method
    python bench.py --questions ../shared/data/spec_bench/question.jsonl --limit 10 --max-new-tokens 256
    python bench.py --eagle3 PATH/TO/HEAD --methods main,ablations --categories qa,rag --limit 2
    python bench.py --latency --shape llama3.1-8b               # GPU latency table (random weights)
    python bench.py --compile both --methods ar,ngram,eagle3+nanospec   # torch.compile vs eager, side by side
    python bench.py --questions Q --limit 3 --llama-cpp BIN/llama-completion --gguf F.gguf  # llama.cpp as a peer

Methods run interleaved question by question (every method back to back on one question, the order
rotated from question to question) so that drift of a shared machine hits all of them alike. Every
method's greedy output is compared with autoregressive decoding, token for token; any difference is
printed with the question id and makes the exit code 1. Reports (Markdown, JSON, PNG plots when
matplotlib is installed) go to --out (default results/).

Method names: `ar`, `ar-fast`, `ngram`, `<head>` (full vocabulary), `<head>+freq-<K>` (FR-Spec top-K, K like 512,
8k, 32k), `<head>+nanospec`, `<head>+nanospec-ctx|-ext|-noasync|-nofill` (ablations), `<head>+nanospec-w<W>`
(another window size), with <head> = eagle3 or eagle2. Presets: `main`, `ablations`, `sweep`, `all`.
`--compile both` adds a compiled twin `NAME@compile` of every method (its output must equal `ar@compile`:
compiled kernels round differently from eager ones) and a compiled / eager table.

Task = Spec-Bench task: the eight MT-bench categories count as one (`mt_bench`), and `--limit` applies per
task, round-robin over its categories. On CPU the EAGLE-2 tree defaults to top-8 / depth 5 / 16 nodes (a
60-node verify costs 3-4 decode steps there); on CUDA to the papers' top-10 / depth 5 / 60 nodes.

Speed baseline: `ar-fast`, the engine's fastest autoregressive configuration (plain arithmetic, no exact
mode; `ar-fast@compile` too under --compile both): every speedup is a ratio to the fastest AR row of the
run. `ar` is exact-mode AR, the correctness reference; the ratio of the two is exact mode's cost.

On CPU the benchmark runs every method in exact mode (where this machine's check passes, exact.py), which
makes verify and decode do identical arithmetic, so every method must match autoregressive output bit for
bit, bf16 included. With --no-exact or on CUDA the
multi-token verify pass and the 1-token decode step round differently and a near tie of the target's
top two logits can flip: the guard reports every difference and, for the first one of a turn, the
target's logit gap there (a gap within the dtype's rounding = numerics; in exact mode, a bug).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from eagle import load_eagle
from pathlib import Path

import torch

import bench_plots
import draft_config as dc
from bench_latency import latency_mode
from bench_methods import Method, build_method, expand_methods, fmt_k, parse_k, run_benchmark
from bench_report import (_f, check_targets, command_line, figure1, human_bytes, md_table, state_table,
                          summarize, write_reports)
from bench_workload import (SHAPES, TASK_TITLES, WARMUP_PROMPT, ensure_cache, load_questions, select_questions,
                            self_freq_file, shape_args, write_random_eagle3)
from download import CheckpointError, resolve_checkpoint
from exact import machine_id
from engine import DEFAULT_HEAD, load_target
from errors import UsageError
from model import ModelError
from sampling import Sampling
from vocab import FullVocab

REPO = Path(__file__).resolve().parent


# ---------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="NanoSpec engine: Spec-Bench-style side-by-side benchmark")
    p.add_argument("--checkpoint", default=None, help="target HF folder or hub id "
                   "(default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl or any jsonl with a prompt field "
                   "(default: the built-in prompts)")
    p.add_argument("--limit", type=int, default=None, help="questions per task "
                   "(Spec-Bench task; MT-bench counts as one)")
    p.add_argument("--categories", default=None, help="comma-separated tasks or file categories")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per turn (default 256)")
    p.add_argument("--methods", default=None, help="comma-separated names: ar, ngram, eagle3 (full vocabulary), "
                   "eagle3+freq-8k (any K), eagle3+nanospec, eagle3+nanospec-ctx|-ext|-noasync|-nofill, "
                   "eagle3+nanospec-w1k "
                   "(any window), the same with eagle2, any of these + '+ngram' (a prompt-lookup chain merged into the "
                   "tree, e.g. eagle3+nanospec+ngram); and presets main (ar, ngram, full, --freq-ks, nanospec), "
                   "ablations, sweep (--sweep-ks, --sweep-w), all. Default: all for the built-in prompts, main for "
                   "--questions. ar always runs (reference and baseline)")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 head folder (default: the shipped head of the default "
                   "model when it exists; 'none' to run without)")
    p.add_argument("--eagle2", default=None, help="EAGLE-1/2 head folder")
    p.add_argument("--random-head", action="store_true", help="without --eagle3: use a randomly initialised "
                   "EAGLE-3 head (untrained: acceptance ~1; exercises every code path and times drafting)")
    p.add_argument("--freq", default=None, help="FR-Spec frequency file (default: built from text the target "
                   "generates itself, cached under --cache)")
    p.add_argument("--freq-ks", default="8k", help="FR-Spec sizes of the main comparison (default 8k)")
    p.add_argument("--sweep-ks", default="512,1k,2k,4k,8k,16k,32k", help="FR-Spec sizes of Figure 1 "
                   "(default 512,1k,2k,4k,8k,16k,32k)")
    p.add_argument("--sweep-w", default="1k", help="extra NanoSpec window sizes of Figure 1 (default 1k)")
    p.add_argument("--freq-corpus", default="16x512", help="self-generated corpus for the frequency file: "
                   "ROWSxTOKENS (default 16x512)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="default: cuda if available")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="default bfloat16")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU bit-exact decode/verify for every method but ar-fast (default: wherever this CPU's check "
                        "passes); --no-exact times the plain path for all")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=["off", "on", "both"],
                   help="torch.compile decode / verify / draft steps (CUDA graphs on CUDA); the steps are fused, so "
                   "Table 4 then splits only verify vs the rest. 'both': every method also runs compiled, as "
                   "NAME@compile, side by side with eager (its outputs are checked against ar@compile)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend "
                   "(default inductor; tests use eager)")
    p.add_argument("--max-seq", type=int, default=None, help="with --compile: KV cache slots of every request "
                   "(default: what the longest question needs)")
    p.add_argument("--sync-phases", action="store_true", help="CUDA: synchronise around the timed vocabulary / "
                   "drafter updates (accurate Table 4, slower runs)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted warm-up generations per method (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0, greedy); above 0 outputs differ run to run, so the "
                        "guard that compares every method's tokens with autoregressive decoding is off")
    p.add_argument("--out", default=str(REPO / "results"), help="report folder (default results/)")
    p.add_argument("--tag", default=None, help="report file stem suffix (default: builtin or the questions "
                   "file's name); name what the run varies, e.g. specbench_l10_greedy_icelake")
    p.add_argument("--cache", default=None, help="cache folder (default: OUT/cache)")
    p.add_argument("--shape", default="llama3.1-8b",
                   help=f"named shape for Table 6 and --latency: {', '.join(SHAPES)} (default llama3.1-8b)")
    p.add_argument("--latency", action="store_true", help="GPU latency mode: random weights of --shape, no download")
    p.add_argument("--latency-context", type=int, default=1024, help="KV context length in latency mode (default 1024)")
    p.add_argument("--latency-iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice; 1 is "
                   "far steadier on a machine shared with other jobs)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--llama-cpp", default=None, help="a llama.cpp llama-completion binary: time its autoregressive "
                   "decoding of the questions' first turns as a peer (with --gguf)")
    p.add_argument("--gguf", default=None, help="with --llama-cpp: the GGUF it runs (e.g. the target's Q4_1 file)")
    g = p.add_argument_group("speculative decoding (as generate.py)",
                             "EAGLE-2 tree: CUDA (and --latency) default top-10, depth 5, 60 nodes as in the papers; "
                             "CPU default top-8, depth 5, 16 nodes (on the 2-core dev CPU a 60-node verify costs "
                             "~3-4 decode steps, a 16-node one ~1.5, and the shipped head accepts as much with 16)")
    g.add_argument("--tree-topk", type=int, default=None)
    g.add_argument("--tree-depth", type=int, default=None)
    g.add_argument("--tree-nodes", type=int, default=None)
    g.add_argument("--budget", default="fixed", choices=["fixed", "auto", "both"],
                   help="fixed (default): every method verifies its whole tree, as in the papers; auto: each step "
                        "verifies as many nodes as pays on this machine, or none (generate.py's default, budget.py); "
                        "both: every speculative method also runs with the fitted budget, as NAME@auto")
    g.add_argument("--spec-k", type=int, default=None, help="n-gram chain length (default 10)")
    g.add_argument("--ngram-min", type=int, default=1)
    g.add_argument("--ngram-max", type=int, default=3)
    g.add_argument("--ngram-occurrences", type=int, default=8, help="prompt lookup: merge the continuations of "
                   "this many earlier occurrences of the matched suffix into one tree (1: the most recent one's chain)")
    g.add_argument("--w-max", type=int, default=3072)
    g.add_argument("--k-pre", type=int, default=3)
    g.add_argument("--k-ver", type=int, default=3)
    return p.parse_args(argv)


def run(args, log) -> int:
    try:
        torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"unknown device {args.device!r}") from None
    dflt = dc.TREE_CPU if (torch.device(args.device).type == "cpu" and not args.latency) else dc.TREE_GPU
    args.tree_topk = dflt[0] if args.tree_topk is None else args.tree_topk
    args.tree_depth = dflt[1] if args.tree_depth is None else args.tree_depth
    args.tree_nodes = dflt[2] if args.tree_nodes is None else args.tree_nodes
    dc.check_tree_budget(args.tree_topk, args.tree_depth, args.tree_nodes)
    if args.latency:
        return latency_mode(args, log)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if bool(args.llama_cpp) != bool(args.gguf):
        raise UsageError("--llama-cpp and --gguf go together")
    for f in (args.llama_cpp, args.gguf) if args.llama_cpp else ():
        if not Path(f).is_file():
            raise UsageError(f"not a file: {f}")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    if args.shape not in SHAPES:
        raise UsageError(f"unknown --shape {args.shape!r}; choose from {', '.join(SHAPES)}")
    questions = select_questions(load_questions(args.questions), args.categories, args.limit)
    tag = args.tag or ("builtin" if args.questions is None else
                       (Path(args.questions).parent.name if Path(args.questions).stem == "question"
                        else Path(args.questions).stem))
    out_dir = Path(args.out)
    cache = ensure_cache(Path(args.cache) if args.cache else out_dir / "cache")
    warnings = []
    t_begin = time.perf_counter()
    if hasattr(os, "getloadavg") and dev.type == "cpu":
        load, ncpu = os.getloadavg()[0], os.cpu_count() or 1
        if load >= max(1.0, 0.5 * ncpu):
            warnings.append(f"the machine was busy when the run started (load average {load:.1f} on {ncpu} cores): "
                            "CPU timings are unreliable (other jobs; with several torch threads each, contention "
                            "can slow runs many-fold: --threads 1 is steadier)")

    model, tok, path = load_target(args.checkpoint, args.device, args.dtype)
    model_name, dtype = path.name, model.lm_head.weight.dtype
    cfg = json.loads((path / "config.json").read_text())
    sync = (lambda: torch.cuda.synchronize(dev)) if (dev.type == "cuda" and args.sync_phases) else (lambda: None)

    heads, head_info = {}, {}
    e3 = args.eagle3
    shipped = DEFAULT_HEAD  # trained by eagle_train.py for the default model
    if (e3 is None and args.checkpoint is None and not args.random_head and shipped
            and (Path(shipped) / "config.json").is_file()):
        e3 = str(shipped)
        head_info["eagle3"] = f"shipped default head ({shipped})"
    if e3 == "none":
        e3 = None
    if e3 is None and args.random_head:
        e3 = str(write_random_eagle3(cache / f"random_eagle3_{model_name}", cfg, seed=args.seed))
        warnings.append("The EAGLE-3 head is RANDOMLY INITIALISED (--random-head): it is untrained, its drafts are "
                        "almost never accepted (τ ≈ 1), so EAGLE speeds here show drafting cost, "
                        "not the method's speedup.")
        head_info["eagle3"] = "random (untrained)"
    for name, p in (("eagle2", args.eagle2), ("eagle3", e3)):
        if p is None:
            continue
        hp = resolve_checkpoint(p, patterns=["config.json", "*.safetensors", "pytorch_model.bin"])
        head = load_eagle(hp, model, dtype, dev)
        want = 3 if name == "eagle3" else 1
        if head.c.version != want:
            raise UsageError(f"--{name} {p} is an EAGLE-{'3' if head.c.version == 3 else '1/2'} head")
        heads[name] = head
        head_info.setdefault(name, str(hp))
    if not heads:
        warnings.append("No EAGLE head (none shipped, none given with --eagle3 PATH / --eagle2 PATH / --random-head): "
                        "only autoregressive and n-gram run; the EAGLE, FR-Spec and NanoSpec tables are empty.")

    freq_ks = [parse_k(s) for s in args.freq_ks.split(",") if s.strip()]
    sweep_ks = [parse_k(s) for s in args.sweep_ks.split(",") if s.strip()]
    sweep_w = [parse_k(s) for s in args.sweep_w.split(",") if s.strip()]
    V_draft = min((h.lm_weight().shape[0] for h in heads.values()), default=model.args.vocab_size)
    dropped = sorted({k for k in freq_ks + sweep_ks + sweep_w if k >= V_draft})
    if dropped:
        warnings.append(f"sizes {', '.join(map(str, dropped))} are >= the draft vocabulary ({V_draft}) "
                        "and were left out")
        freq_ks, sweep_ks, sweep_w = ([k for k in ks if k < V_draft] for ks in (freq_ks, sweep_ks, sweep_w))
    if args.w_max >= V_draft:
        raise UsageError(f"--w-max {args.w_max} must be smaller than the draft vocabulary ({V_draft})")
    spec = args.methods or ("all" if args.questions is None else "main")
    methods = expand_methods(spec, heads, freq_ks, sweep_ks, sweep_w, args.w_max)
    if args.compile == "on":
        for m in methods:
            m.compiled = True
    elif args.compile == "both":  # side by side: every method eager and compiled, interleaved like the rest
        methods = sorted(methods + [replace(m, name=f"{m.name}@compile", compiled=True, groups=set(m.groups), timers={})
                                    for m in methods], key=Method.order)
    spec_methods = [m for m in methods if m.kind != "ar"]
    if args.budget == "auto":
        for m in spec_methods:
            m.budget = True
    elif args.budget == "both":  # every speculative method also with the fitted budget, as NAME@auto
        methods = sorted(methods + [replace(m, name=f"{m.name}@auto", budget=True, groups=set(m.groups), timers={})
                                    for m in spec_methods], key=Method.order)

    freq_path, freq_info, ranked = None, None, None
    if any(m.vocab == "freq" for m in methods):
        if args.freq:
            freq_path = Path(args.freq)
            if not freq_path.is_file():
                raise UsageError(f"frequency file not found: {freq_path}")
            freq_info = dict(source=str(freq_path))
        else:
            try:
                r, n = (int(x) for x in args.freq_corpus.lower().split("x"))
            except ValueError:
                raise UsageError(f"--freq-corpus must be ROWSxTOKENS, e.g. 16x512, got {args.freq_corpus!r}") from None
            freq_path, freq_info = self_freq_file(model, tok, model_name, cache, r, n, args.seed, log)
        ranked = torch.load(freq_path, map_location="cpu", weights_only=True)
        ranked = ranked.tolist() if isinstance(ranked, torch.Tensor) else list(ranked)
        n_ranked = len(dict.fromkeys(ranked))
        short = [k for k in freq_ks if k > n_ranked]
        if short:
            raise UsageError(f"{freq_path} ranks {n_ranked} token ids, fewer than --freq-ks {fmt_k(max(short))}")
        beyond = sorted({m.k for m in methods if m.vocab == "freq" and m.k > n_ranked})
        if beyond:  # Figure 1's sweep stops where the file's ranking ends (FR-Spec files list only seen ids)
            methods = [m for m in methods if not (m.vocab == "freq" and m.k > n_ranked)]
            sweep_ks = [k for k in sweep_ks if k <= n_ranked]
            warnings.append(f"{freq_path} ranks {n_ranked} token ids: sweep sizes {', '.join(map(fmt_k, beyond))} "
                            "were left out")
        if "seen" in freq_info:
            over = [k for k in sorted(set(freq_ks + sweep_ks)) if k > freq_info["seen"]]
            if over:
                warnings.append(f"the self-generated corpus saw {freq_info['seen']} distinct tokens: FR-Spec sizes "
                                f"{', '.join(fmt_k(k) for k in over)} fill the rest of the top-K with unseen ids in "
                                "id order (see the frequency file note)")

    limit = model.args.max_position_embeddings
    fits, longest = [], 0
    for q in questions:
        n = len(tok.encode_chat([{"role": "user", "content": "\n".join(q.turns)}]) if tok.chat_template else
                tok.encode("\n".join(q.turns)))
        need = n + len(q.turns) * (args.max_new_tokens + 16) + args.tree_nodes + 64
        if need > limit:
            warnings.append(f"question {q.qid} left out: its {n} prompt tokens + {len(q.turns)} x "
                            f"{args.max_new_tokens} new tokens may exceed the model's context of {limit}")
        else:
            fits.append(q)
            longest = max(longest, need)
    questions = fits
    if not questions:
        raise UsageError("no question fits the model's context")

    sampling = Sampling(args.temperature)
    sampling.validate(model.args.vocab_size)
    torch.manual_seed(args.seed)
    for m in methods:
        build_method(m, model, heads, freq_path, args, sampling, sync)
        if m.compiled:
            # One KV-cache size for every request, so the compiled steps (and CUDA graphs) are built once, in the
            # warm-up, instead of once per cache-size bucket inside timed runs (planner.Planner's `fixed`, as for
            # CUDA graphs' fixed buffers); on CPU it only fixes the size.
            m.engine.planner.fixed = args.max_seq or min(limit, (longest + 63) // 64 * 64)
    tasks = list(dict.fromkeys(q.task for q in questions))
    n_gen = sum(len(q.turns) for q in questions)
    log(f"{len(questions)} questions ({n_gen} generations per method) in {len(tasks)} tasks x {len(methods)} methods: "
        f"{', '.join(m.name for m in methods)}")
    for w in warnings:
        log(f"WARNING: {w}")

    # warm-up: kernel set-up, allocator, first-call costs; not counted
    methods[0].engine.warmup()
    wids = (tok.encode_chat([{"role": "user", "content": WARMUP_PROMPT}]) if tok.chat_template
            else tok.encode(WARMUP_PROMPT))
    for _ in range(args.warmup):
        for m in methods:
            m.engine.generate(wids, min(args.max_new_tokens, 16))

    records, mismatches, refs = run_benchmark(questions, methods, tok, args.max_new_tokens, log, guard=sampling.greedy,
                                              progress=not args.no_progress, model=model)
    peer = llama_cpp_peer(args, questions, tok, methods, records, log) if args.llama_cpp else None
    S = summarize(records, methods, tasks)
    fig1 = figure1(S, methods, ranked, refs, sweep_ks, V_draft, [q.task for q in questions]) if heads else None
    d = model.lm_head.weight.shape[1]
    state_tables = {}
    elem = torch.finfo(dtype).bits // 8
    # the run's own model: from the live vocabulary objects where they ran
    live = [["full", V_draft, human_bytes(V_draft * d * elem),
             human_bytes(FullVocab(torch.empty(V_draft, d, device="meta")).state_bytes())]]
    for m in methods:
        a = S[m.name]["overall"]
        if m.vocab != "full" and a.get("vocab_state_bytes") is not None:
            live.append([m.name, m.k, human_bytes(m.k * d * elem), human_bytes(a["vocab_state_bytes"])])
    state_tables[f"this run ({model_name}, d={d}, V={V_draft}, {args.dtype})"] = live
    a6 = shape_args(args.shape)
    state_tables[f"{args.shape} (d={a6.dim}, V={a6.vocab_size}, fp16)"] = state_table(
        args.shape, a6.vocab_size, a6.dim, args.w_max, [8192, 16384, 32768, 65536])
    settings = {
        "model": f"{model_name} ({path})",
        "device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else
                              f" ({machine_id()}, {os.cpu_count()} cores)"),
        "torch threads": torch.get_num_threads(), "dtype": args.dtype, "compile": args.compile,
        "torch": torch.__version__,
        "budget": args.budget, "temperature": args.temperature,
        "workload": f"{args.questions or 'built-in prompts'}: {len(questions)} questions, {n_gen} generations per "
                    f"method, tasks {', '.join(tasks)}" + (f", limit {args.limit} per task" if args.limit else ""),
        "max new tokens": args.max_new_tokens, "decoding": "greedy, chat template",
        "heads": ", ".join(f"{k}: {v}" for k, v in head_info.items()) or "none",
        "tree": f"top-{args.tree_topk}, depth {args.tree_depth}, {args.tree_nodes} nodes",
        "nanospec": f"W_max {args.w_max}, K_pre {args.k_pre}, K_ver {args.k_ver}",
        "frequency file": "-" if freq_info is None else
                          f"{freq_path.name}: " + ", ".join(f"{k} {v}" for k, v in freq_info.items()),
        "methods": ", ".join(m.name for m in methods),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall time": f"{time.perf_counter() - t_begin:.0f} s",
    }
    ctx = dict(command=command_line(args.argv), settings=settings, warnings=warnings, state_tables=state_tables,
               targets=check_targets(S, methods), peer=peer)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        bench_plots.make_plots(out_dir, tag, fig1, S, methods, tasks, log)
    except Exception as e:  # a plotting problem must not cost the measurements
        log(f"WARNING: plotting failed ({type(e).__name__}: {e}); the Markdown report has the same data")
    write_reports(out_dir, tag, ctx, S, methods, tasks, records, mismatches, fig1, log)
    with open(out_dir / f"bench_{tag}_outputs.jsonl", "w") as f:
        for q, outs in zip(questions, refs):
            f.write(json.dumps(dict(question_id=q.qid, category=q.category,
                                    turns=[tok.decode(o) for o in outs]), ensure_ascii=False) + "\n")
    print_summary(S, methods, tasks, mismatches, warnings, out_dir / f"bench_{tag}.md", guarded=sampling.greedy)
    if peer:
        print(f"{peer['name']} (first turns, autoregressive): {peer['tokens_per_s']:.2f} tok/s; "
              + ", ".join(f"{n} {v / peer['tokens_per_s']:.2f}x" for n, v in peer["methods"].items()))
    return 1 if mismatches else 0


def llama_cpp_peer(args, questions, tok, methods, records, log) -> dict:
    """llama.cpp's autoregressive decoding (llama-completion, greedy) of every question's first turn, after the
    methods ran: its mean tokens/s (bench_ar.run_llama_cpp: prompt eval included, as ours is) against each
    method's mean over its own first turns (later turns follow each method's own answers, which llama.cpp's
    would not)."""
    from bench_ar import run_llama_cpp
    log(f"llama.cpp peer: {Path(args.gguf).name}, {len(questions)} first turns")
    texts = [tok.apply_chat_template([{"role": "user", "content": q.turns[0]}]) for q in questions]
    rate = statistics.fmean(run_llama_cpp(args.llama_cpp, args.gguf, t, args.max_new_tokens) for t in texts)
    ours = {m.name: statistics.fmean(r["tokens_per_s"] for r in records if r["method"] == m.name and r["turn"] == 1)
            for m in methods}
    return dict(name=f"llama.cpp {Path(args.gguf).name}", tokens_per_s=rate, first_turns=len(texts), methods=ours)


def print_summary(S, methods, tasks, mismatches, warnings, md_path, guarded=True):
    cols = tasks + ["overall"]
    print()
    print(md_table(["method"] + [TASK_TITLES.get(t, t) if t != "overall" else "Overall" for t in cols] + ["tok/s"],
                   [[m.name] + [f"{S[m.name][t]['speedup']:.2f}x τ{S[m.name][t]['mean_accepted_length']:.2f}"
                                if S[m.name].get(t) else "-" for t in cols]
                    + [_f(S[m.name]["overall"].get("tokens_per_s"))] for m in methods]))
    for w in warnings:
        print(f"WARNING: {w}")
    if mismatches:
        print(f"\n!!! CORRECTNESS FAILURE: {len(mismatches)} outputs differ from autoregressive decoding:",
              file=sys.stderr)
        for x in mismatches:
            print(f"!!!   question {x['qid']} turn {x['turn']} method {x['method']} (first difference at token "
                  f"{x['index']})", file=sys.stderr)
    elif guarded:
        print("all outputs identical to autoregressive decoding")
    else:
        print("sampled outputs (--temperature > 0): not compared with autoregressive decoding")
    print(f"report: {md_path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)
    threads = torch.get_num_threads()
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise UsageError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        return run(args, log)
    except (UsageError, ModelError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
