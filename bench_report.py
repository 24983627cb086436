"""bench.py's reports: aggregation per method and task, the paper's tables and figures (Markdown, JSON, PNG)."""
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch

from bench_methods import fmt_k
from bench_workload import TASK_TITLES
from vocab import FreqVocab, FullVocab, nanospec_state_bytes


# ---------------------------------------------------------------- aggregation

def aggregate(recs: list[dict]) -> dict:
    """Spec-Bench conventions: speed = mean over generations of tokens / wall time (prefill included);
    mean accepted length = tokens per target forward over all speculative steps (bonus included)."""
    if not recs:
        return {}
    hist: dict[int, int] = {}
    for r in recs:
        for k, v in r.get("accept_hist", {}).items():
            hist[int(k)] = hist.get(int(k), 0) + v
    steps = sum(hist.values())
    acc = sum(k * v for k, v in hist.items())
    ph = {}
    for r in recs:
        for k, v in r.get("phase_s", {}).items():
            ph[k] = ph.get(k, 0.0) + v
        for k, v in r.get("timers", {}).items():
            ph[k] = ph.get(k, 0.0) + v
    out = dict(generations=len(recs), new_tokens=sum(r["new_tokens"] for r in recs),
               tokens_per_s=statistics.fmean(r["tokens_per_s"] for r in recs),
               wall_s=sum(r["prefill_s"] + r["decode_s"] for r in recs),
               decode_s=sum(r["decode_s"] for r in recs),
               mean_accepted_length=acc / steps if steps else 1.0, steps=steps, step_tokens=acc)
    if steps:
        per = lambda k: ph.get(k, 0.0) / steps * 1000
        # LM head = projection + log-softmax over the active rows when the drafter's _logp was timed (the
        # vocabulary-dependent part of drafting); engine.py's own lm_head phase otherwise (the PyTorch loop:
        # the projection only; the C search, which calls no _logp, times projection, log-softmax and top-k)
        lm = per("drafter_logp") or per("lm_head")
        out["step_ms"] = dict(
            # the drafter's update contains its vocabulary's (drafter_update includes vocab_update)
            draft_backbone=per("draft") + per("lm_head") - lm + per("drafter_update") - per("vocab_update"),
            lm_head=lm, gather_update=per("vocab_update"),
            verify=per("verify"),
            bookkeeping=per("sync") + per("update") - per("drafter_update"))
        out["step_ms"]["total"] = out["decode_s"] / steps * 1000
        out["draft_ms"] = out["step_ms"]["draft_backbone"] + out["step_ms"]["lm_head"] + out["step_ms"]["gather_update"]
        out["decode_rate"] = acc / max(out["decode_s"], 1e-9)  # tokens from speculative steps per decode second
    curves = [r["budget_curve"] for r in recs if r.get("budget_curve")]
    if curves:  # the fitted budget's measurements: per verified-tree size, step time and tokens per step
        sizes = sorted({int(b) for c in curves for b in c})
        out["budget_curve"] = {b: dict(step_ms=statistics.fmean(c[str(b)][0] for c in curves if str(b) in c),
                                       tokens=statistics.fmean(c[str(b)][1] for c in curves if str(b) in c))
                               for b in sizes}
        for p in out["budget_curve"].values():
            p["tokens_per_s"] = p["tokens"] / p["step_ms"] * 1000
        share = [(r["speculated_share"], r["target_forwards"]) for r in recs if "speculated_share" in r]
        out["speculated_share"] = sum(s * n for s, n in share) / max(sum(n for _, n in share), 1)
    # the hybrid's accepted draft tokens by who proposed them, weighted by each request's accepted draft tokens
    src = [(r["accepted_from"], sum((int(k) - 1) * v for k, v in r.get("accept_hist", {}).items()))
           for r in recs if "accepted_from" in r]
    if src:
        w = sum(n for _, n in src) or 1
        out["accepted_from"] = {k: sum(a.get(k, 0.0) * n for a, n in src) / w for k in ("ngram", "eagle", "both")}
    started = [bool(r["head_started"]) for r in recs if "head_started" in r]
    if started:
        out["head_started"] = sum(started) / len(started)
    cov = [(r["vocab_coverage"], r["new_tokens"]) for r in recs if "vocab_coverage" in r]
    if cov:
        w = sum(n for _, n in cov) or 1
        out["vocab_coverage"] = sum(c * n for c, n in cov) / w
        act = [(r["vocab_active_mean"], r["target_forwards"]) for r in recs if "vocab_active_mean" in r]
        out["vocab_active_mean"] = sum(a * n for a, n in act) / max(sum(n for _, n in act), 1)
        out["vocab_active_max"] = max(r["vocab_active_max"] for r in recs if "vocab_active_max" in r)
        out["vocab_state_bytes"] = max(r["vocab_state_bytes"] for r in recs if "vocab_state_bytes" in r)
    return out


def fastest_ar(S, methods) -> str:
    """The speed baseline: the autoregressive configuration with the highest overall speed in this run."""
    return max((m.name for m in methods if m.kind == "ar"), key=lambda n: S[n]["overall"].get("tokens_per_s") or 0)


def summarize(records, methods, tasks):
    S = {}
    for m in methods:
        mine = [r for r in records if r["method"] == m.name]
        S[m.name] = {"overall": aggregate(mine), **{t: aggregate([r for r in mine if r["task"] == t]) for t in tasks}}
    base_name = fastest_ar(S, methods)
    for m in methods:
        for t, a in S[m.name].items():
            base = S[base_name][t].get("tokens_per_s")
            if a and base:
                a["speedup"] = a["tokens_per_s"] / base
    return S


def freq_coverage_offline(refs: list, ranked: list[int], ks) -> dict:
    """Fraction of the autoregressive output tokens inside the top-K of the frequency ranking (what the
    freq vocabulary's coverage metric measures, computed for every K without running it)."""
    toks = torch.tensor([t for outs in refs for o in outs for t in o] or [0])
    # a --freq file may rank only the ids its corpus saw (any subset of the vocabulary)
    rank = torch.full((max(max(ranked, default=0), int(toks.max())) + 1,), 1 << 30, dtype=torch.long)
    rank[torch.tensor(ranked)] = torch.arange(len(ranked))
    r = rank[toks]
    return {k: float((r < k).float().mean()) for k in ks}


# ---------------------------------------------------------------- reports

def _f(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def md_table(header, rows):
    s = "| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|\n"
    return s + "".join("| " + " | ".join(str(c) for c in r) + " |\n" for r in rows)


def human_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def state_table(shape_name: str, V: int, d: int, w_max: int, ks, elem=2):
    """Table 6 rows for an LM head of V x d (fp16/bf16 rows): from the real constructors on the meta device."""
    dt = torch.float16 if elem == 2 else torch.float32
    W = torch.empty(V, d, dtype=dt, device="meta")
    rows = []
    full = FullVocab(W)
    rows.append(["full", V, human_bytes(V * d * elem), human_bytes(full.state_bytes())])
    for k in ks:
        if k >= V:
            continue
        try:
            b = FreqVocab(W, torch.arange(k)).state_bytes()
        except Exception:  # meta tensors unsupported by some op: same formula by hand
            b = k * d * elem + k * 8 + V
        rows.append([f"freq top-{fmt_k(k)}", k, human_bytes(k * d * elem), human_bytes(b)])
    if w_max < V:
        rows.append([f"nanospec W={w_max}", w_max, human_bytes(w_max * d * elem),
                     human_bytes(nanospec_state_bytes(V, d, w_max, dtype=dt))])
    return rows


def write_reports(out_dir: Path, tag: str, ctx: dict, S: dict, methods, tasks, records, mismatches, fig1, log) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [m.name for m in methods]
    heads = sorted({m.head for m in methods if m.head})
    L = []
    L.append(f"# NanoSpec engine benchmark: {tag}\n")
    L.append(f"Command: `{ctx['command']}`\n")
    L.append(md_table(["setting", "value"], [[k, v] for k, v in ctx["settings"].items()]))
    for w in ctx["warnings"]:
        L.append(f"\n> **WARNING:** {w}\n")
    L.append("\n## Correctness\n")
    # the references (ar@compile is what compiled methods are compared with) and the speed baselines
    ref_names = {"ar", "ar@compile", "ar-fast", "ar-fast@compile"}
    n_cmp = sum(1 for r in records if r["method"] not in ref_names)
    if mismatches:
        L.append(f"**FAILED: {len(mismatches)} of {n_cmp} outputs differ from autoregressive decoding.**\n")
        ties = sum(1 for x in mismatches if x.get("near_tie"))
        if ties:
            L.append(f"{ties} of them start at a near tie of the target's logits (within {ctx['settings']['dtype']} "
                     "rounding): the 1-token decode and the multi-token verify pass round differently there; "
                     "in float32 such ties practically never flip.\n\n")
        L.append(md_table(["question", "turn", "method", "first different token", "autoregressive", "got", "diagnosis"],
                          [[x["qid"], x["turn"], x["method"], x["index"], x["expected"], x["got"],
                            x.get("diagnosis", "")] for x in mismatches]))
    else:
        L.append(f"All {n_cmp} outputs of {len(set(names) - ref_names)} methods are identical to autoregressive "
                 "decoding, token for token (greedy).\n")

    cols = tasks + ["overall"]
    title = lambda t: "Overall" if t == "overall" else TASK_TITLES.get(t, t)
    L.append("\n## Table 2/3 analogue: speed and mean accepted length per task\n")
    base = fastest_ar(S, methods)
    L.append("Speed = mean over generations of new tokens / wall time (prefill included); speedup = ratio of "
             f"mean speeds to the fastest autoregressive configuration of this run, `{base}` (Spec-Bench's "
             "convention, with the fastest AR as the baseline); τ = mean accepted length, tokens per "
             "target forward, bonus included. Each cell: speedup ×, τ.\n\n")
    rows = []
    for n in names:
        row = [n]
        for t in cols:
            a = S[n].get(t) or {}
            row.append(f"{a['speedup']:.2f}×, {a['mean_accepted_length']:.2f}" if a else "-")
        rows.append(row)
    L.append(md_table(["method"] + [title(t) for t in cols], rows))
    L.append("\nTokens/s (mean speed):\n\n")
    L.append(md_table(["method"] + [title(t) for t in cols],
                      [[n] + [_f((S[n].get(t) or {}).get("tokens_per_s")) for t in cols] for n in names]))
    if ctx.get("peer"):
        pr = ctx["peer"]
        L.append(f"\nA peer, {pr['name']}: autoregressive, greedy, the {pr['first_turns']} questions' first turns, "
                 f"{_f(pr['tokens_per_s'])} tok/s mean (prompt eval included). Each method's mean over its own first "
                 "turns against it:\n\n")
        L.append(md_table(["method", "tok/s, first turns", f"vs {pr['name']}"],
                          [[n, _f(v), f"{v / pr['tokens_per_s']:.2f}x"] for n, v in pr["methods"].items()]))
    exact_cost = [(n, f) for n, f in (("ar", "ar-fast"), ("ar@compile", "ar-fast@compile"))
                  if n in S and f in S and S[n]["overall"] and S[f]["overall"]]
    if exact_cost:
        L.append("\n## Exact mode's cost (same run, interleaved)\n\n")
        L.append("`ar` decodes in exact mode (with the PyTorch layers: every pass padded to sizes this CPU keeps "
                 "row-invariant, exact attention; with the fused CPU pass, cpu_forward.py: the same arithmetic, "
                 "row-invariant by construction, so the two differ by noise); `ar-fast` uses plain arithmetic. "
                 "Exact mode is what makes every speculative output identical to `ar`.\n\n")
        L.append(md_table(["exact", "plain", "exact tok/s", "plain tok/s", "exact / plain"],
                          [[n, f, _f(S[n]["overall"]["tokens_per_s"]), _f(S[f]["overall"]["tokens_per_s"]),
                            f"{S[n]['overall']['tokens_per_s'] / S[f]['overall']['tokens_per_s']:.3f}x"]
                           for n, f in exact_cost]))
    twins = [(n, f"{n}@compile") for n in names
             if f"{n}@compile" in S and S[n]["overall"] and S[f"{n}@compile"]["overall"]]
    if twins:
        L.append("\n## torch.compile vs eager (same run, interleaved)\n\n")
        L.append("Compiled outputs are checked against compiled autoregressive decoding (ar@compile): compiled "
                 "kernels round differently from eager ones. Tokens/s include prefill (eager in both).\n\n")
        L.append(md_table(["method", "eager tok/s", "compiled tok/s", "compiled / eager", "τ eager", "τ compiled"],
                          [[n, _f(S[n]["overall"]["tokens_per_s"]), _f(S[c]["overall"]["tokens_per_s"]),
                            f"{S[c]['overall']['tokens_per_s'] / S[n]['overall']['tokens_per_s']:.3f}x",
                            _f(S[n]["overall"]["mean_accepted_length"]), _f(S[c]["overall"]["mean_accepted_length"])]
                           for n, c in twins]))

    spec = [n for n in names if (S[n]["overall"] or {}).get("step_ms")]
    if spec:
        L.append("\n## Table 4 analogue: time per draft step (ms, means over all speculative steps)\n")
        L.append("draft backbone = head forwards of the tree expansion and of the accepted tokens, and the tree's "
                 "top-k / rerank; LM head = draft-vocabulary projection + log-softmax over the active rows; "
                 "gather/update = NanoSpec window update incl. the row gather; verify = target pass over the tree, "
                 "acceptance and KV compaction; bookkeeping = the step's host sync and the coverage metrics. On CUDA "
                 "these are host wall times (see the latency mode for device times); with --compile the update and "
                 "the draft run fused and count as draft backbone.\n\n")
        rows = []
        for n in spec:
            p = S[n]["overall"]["step_ms"]
            rows.append([n, _f(p["draft_backbone"]), _f(p["lm_head"]), _f(p["gather_update"]), _f(p["verify"]),
                         _f(p["bookkeeping"]), _f(p["total"]), _f(S[n]["overall"]["mean_accepted_length"])])
        L.append(md_table(["method", "draft backbone", "LM head", "gather/update", "verify", "bookkeeping",
                           "total", "τ"], rows))

    abl = [m.name for m in methods if m.ablation or "ablations" in m.groups]
    if abl:
        L.append("\n## Table 5 analogue: NanoSpec ablations\n")
        L.append("ctx = context only (no per-step append), ext = extension only (no prompt initialisation), "
                 "noasync = indexed GEMM over non-contiguous rows instead of the packed buffer, "
                 "nofill = free slots left empty (no frequent tokens from the head folder's freq.pt).\n\n")
        rows = []
        for h in heads:
            base = (S.get(h) or {}).get("overall", {}).get("tokens_per_s")
            for n in ([h] if base else []) + [x for x in abl if x.startswith(h + "+")]:
                a = S[n]["overall"]
                if not a:
                    continue
                rows.append([n, _f(a["tokens_per_s"]), f"{a['tokens_per_s'] / base:.3f}×" if base else "-",
                             _f(a["mean_accepted_length"]), _f(a.get("vocab_coverage"), 3),
                             _f(a.get("vocab_active_mean"), 0), _f(a.get("draft_ms"))])
        L.append(md_table(["method", "tok/s", "vs full vocab", "τ", "coverage", "mean active rows",
                           "draft ms/step"], rows))

    L.append("\n## Table 6 analogue: draft-vocabulary state\n")
    L.append("Bytes of LM-head rows the draft reads per projection, and the device state each strategy keeps "
             "(from the vocab.py constructors; fp16/bf16 rows). 'full' keeps only an id table: its rows are the "
             "model's own LM head.\n")
    for sname, rows in ctx["state_tables"].items():
        L.append(f"\n{sname}:\n\n")
        L.append(md_table(["strategy", "rows", "LM-head rows read per call", "state bytes"], rows))

    if fig1:
        L.append("\n## Figure 1a/1b analogue: coverage and speed versus draft-vocabulary size\n")
        L.append(fig1["definition"] + "\n\n")
        rows = [[p["label"], _f(p["size"], 0), _f(p.get("coverage"), 4), _f(p.get("decode_rate")),
                 _f(p.get("oracle")), p.get("note", "")] for p in fig1["points"]]
        L.append(md_table(["vocabulary", "rows", "coverage", "decode tok/s", "oracle tok/s (Eq. 1)", "note"], rows))
        for img in ("fig1a_coverage", "fig1b_speed"):
            if (out_dir / f"bench_{tag}_{img}.png").is_file():
                L.append(f"\n![{img}](bench_{tag}_{img}.png)\n")
        bt = fig1.get("by_task")
        if bt:
            L.append("\n### Coverage per task\n\nNanoSpec: measured during its runs; freq top-K: the frequency "
                     "ranking of this run (text the target generated, never Spec-Bench) applied to the autoregressive "
                     "outputs of each task.\n\n")
            L.append(md_table(["task"] + bt["columns"], [[t] + [_f(c, 3) for c in r] for t, r in bt["rows"].items()]))

    draft_rows = []
    for n in spec:
        if not any(m.name == n and m.kind == "eagle" for m in methods):
            continue
        draft_rows.append([n] + [_f((S[n].get(t) or {}).get("draft_ms")) for t in cols])
    if draft_rows:
        L.append("\n## Figure 4 analogue: drafting time per task (ms per draft step: backbone + LM head + gather)\n\n")
        L.append(md_table(["method"] + [title(t) for t in cols], draft_rows))
        if (out_dir / f"bench_{tag}_fig4_draft_time.png").is_file():
            L.append(f"\n![fig4](bench_{tag}_fig4_draft_time.png)\n")

    fitted = [n for n in spec if S[n]["overall"].get("budget_curve")]
    if fitted:
        L.append("\n## The fitted budget: tokens/s against the verified tree size\n\n"
                 "From budget.py's own measurements at each request's end (mean over requests): per size, the step "
                 "time (ms; interpolated where the size was not timed twice) and the expected tokens per step "
                 "(1 + the acceptance rates of node ranks below the size). Size 1 is autoregressive decoding.\n\n")
        for n in fitted:
            c = S[n]["overall"]["budget_curve"]
            L.append(f"\n{n} (speculated on {S[n]['overall']['speculated_share']:.0%} of steps):\n\n")
            L.append(md_table(["size"] + [str(b) for b in sorted(c)],
                              [[k] + [_f(c[b][k]) for b in sorted(c)] for k in ("step_ms", "tokens", "tokens_per_s")]))
        if (out_dir / f"bench_{tag}_tree_size.png").is_file():
            L.append(f"\n![tree size](bench_{tag}_tree_size.png)\n")

    hybrid = [n for n in spec if S[n]["overall"].get("accepted_from")]
    for n in hybrid:
        L.append(f"\n## Hybrid drafting per task: {n}\n\nτ = mean accepted length; n-gram / EAGLE / both = the "
                 "share of accepted draft tokens that prompt lookup, the EAGLE tree or both proposed; speculated = "
                 "the share of steps that verified a draft (the rest decoded autoregressively); head started = the "
                 "share of requests whose EAGLE head ran at all (it starts late, and only where the budget expects "
                 "it to pay: draft.HybridDrafter, budget.py).\n\n")
        rows = []
        for t in cols:
            x = S[n].get(t) or {}
            a = x.get("accepted_from") or {}
            rows.append([title(t), _f(x.get("mean_accepted_length"))] + [f"{a[k]:.0%}" if k in a else "-" for k in
                        ("ngram", "eagle", "both")] + [f"{x[k]:.0%}" if k in x else "-" for k in
                        ("speculated_share", "head_started")])
        L.append(md_table(["task", "τ", "n-gram", "EAGLE", "both", "speculated", "head started"], rows))

    targets = ctx.get("targets") or []
    if targets:
        L.append("\n## Targets of issue 6\n\n")
        L.append(md_table(["head", "target", "value", "met"], targets))
    L.append(f"\nPer-generation records: `bench_{tag}.json` (key `runs`); autoregressive outputs: "
             f"`bench_{tag}_outputs.jsonl`.\n")
    md = "".join(L)
    (out_dir / f"bench_{tag}.md").write_text(md)
    js = dict(settings=ctx["settings"], command=ctx["command"], warnings=ctx["warnings"], summary=S,
              mismatches=mismatches, state_tables=ctx["state_tables"], figure1=fig1, targets=targets,
              peer=ctx.get("peer"),
              methods={m.name: dict(kind=m.kind, head=m.head, vocab=m.vocab, size=m.k, ablation=m.ablation,
                                    groups=sorted(m.groups)) for m in methods}, runs=records)
    (out_dir / f"bench_{tag}.json").write_text(json.dumps(js, indent=1, default=str))
    return js


def figure1(S, methods, freq_ranked, refs, sweep_ks, V, tasks_of=None):
    """Coverage/speed points per vocabulary size and the oracle of Eq. 1 for each head."""
    points = []
    defn = ("Coverage = fraction of emitted tokens that were in the draft's active vocabulary at that step "
            "(freq: computed from the autoregressive outputs for every K, also for sizes not run). Speed = decode "
            "tokens/s over speculative steps (prefill excluded). Oracle (Eq. 1) for a vocabulary of the same size: "
            "the full-vocabulary run's tokens per step τ_full divided by a step time of t_step(full) - "
            "t_LMhead(full) + t_LMhead(reduced), all measured per draft step in the runs (t_LMhead = projection + "
            "log-softmax over the active rows, as in Table 4; t_LMhead(reduced) from the run of that vocabulary): "
            "the speed the reduced vocabulary would reach if it kept full-vocabulary acceptance.")
    off = freq_coverage_offline(refs, freq_ranked,
                                sorted(set(sweep_ks) | {m.k for m in methods if m.vocab == "freq"})) \
        if freq_ranked else {}
    heads = sorted({m.head for m in methods if m.head})
    for h in heads:
        full = S[h]["overall"] if h in S else None
        oracle_of = lambda lm: None  # without a full-vocabulary run there is no oracle
        if full and full.get("step_ms"):
            tau, t_full, lm_full = full["mean_accepted_length"], full["step_ms"]["total"], full["step_ms"]["lm_head"]
            oracle_of = lambda lm: tau / (t_full - lm_full + lm) * 1000
            points.append(dict(series="full", head=h, label=h, size=V, coverage=1.0, decode_rate=full["decode_rate"],
                               oracle=full["decode_rate"]))
        for m in methods:
            if m.head != h or m.vocab == "full" or m.ablation:
                continue
            a = S[m.name]["overall"]
            if not a or not a.get("step_ms"):
                continue
            size = m.k if m.vocab == "freq" else a.get("vocab_active_mean", m.k)
            points.append(dict(series=m.vocab, head=h, label=m.name, size=size,
                               coverage=(a.get("vocab_coverage") if m.vocab == "nanospec"
                                         else off.get(m.k, a.get("vocab_coverage"))),
                               decode_rate=a["decode_rate"], oracle=oracle_of(a["step_ms"]["lm_head"]),
                               note=f"W_max {m.k} (GEMM width)" if m.vocab == "nanospec" else ""))
        for k in sorted(off):
            if not any(p["series"] == "freq" and p["size"] == k and p["head"] == h for p in points):
                points.append(dict(series="freq", head=h, label=f"freq-{fmt_k(k)} (not run)", size=k, coverage=off[k]))
    by_task = coverage_by_task(S, methods, tasks_of, refs, freq_ranked) if freq_ranked and tasks_of else None
    if not points and off:
        for k in sorted(off):
            points.append(dict(series="freq", head=None, label=f"freq-{fmt_k(k)} (not run)", size=k, coverage=off[k]))
    return dict(definition=defn, points=points, by_task=by_task) if points else None


def coverage_by_task(S, methods, tasks_of, refs, ranked, ks=(3072, 16384)) -> dict:
    """Per task: coverage of every NanoSpec run (measured during generation) and of freq top-K (offline,
    from the autoregressive outputs of that task's questions). {"columns": [...], "rows": {task: [...]}}."""
    nano = [m for m in methods if m.vocab == "nanospec" and not m.ablation]
    cols = [m.name for m in nano] + [f"freq-{fmt_k(k)} (offline)" for k in ks]
    rows = {}
    for t in dict.fromkeys(tasks_of):
        mine = [r for r, tt in zip(refs, tasks_of) if tt == t]
        off = freq_coverage_offline(mine, ranked, ks)
        rows[t] = [(S[m.name].get(t) or {}).get("vocab_coverage") for m in nano] + [off[k] for k in ks]
    mine = freq_coverage_offline(refs, ranked, ks)
    rows["Overall"] = [S[m.name]["overall"].get("vocab_coverage") for m in nano] + [mine[k] for k in ks]
    return dict(columns=cols, rows=rows)


def check_targets(S, methods):
    rows = []
    for h in sorted({m.head for m in methods if m.head}):
        ns = f"{h}+nanospec"
        if ns not in S or h not in S or not S[ns]["overall"] or not S[h]["overall"]:
            continue
        sp, full = S[ns]["overall"]["tokens_per_s"], S[h]["overall"]["tokens_per_s"]
        rows.append([h, "NanoSpec tok/s >= 1.2x full vocabulary", f"{sp / full:.3f}x",
                     "yes" if sp >= 1.2 * full else "NO"])
        fr = [(S[m.name]["overall"]["tokens_per_s"], m.name) for m in methods
              if m.head == h and m.vocab == "freq" and not m.compiled and S[m.name]["overall"]]
        if fr:
            best, bn = max(fr)
            rows.append([h, f"NanoSpec tok/s >= 1.05x best FR-Spec ({bn})", f"{sp / best:.3f}x",
                         "yes" if sp >= 1.05 * best else "NO"])
        t1, t0 = S[ns]["overall"]["mean_accepted_length"], S[h]["overall"]["mean_accepted_length"]
        rows.append([h, "NanoSpec τ >= 97% of full vocabulary", f"{t1 / t0 * 100:.1f}%",
                     "yes" if t1 >= 0.97 * t0 else "NO"])
    return rows


def command_line(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return "python bench.py " + " ".join(shlex.quote(a) for a in argv)
