"""EAGLE-3 head diagnostics on held-out text (`python eagle_train.py eval`): how often the target's next token
is among the head's top-k at each unrolled depth, over the full vocabulary and over the draft vocabulary in
use, next to the acceptance the engine realises on the same prompts. Users training their own heads read it
to tell a narrow head (low recall everywhere) from a vocabulary that loses what the head knows (full-vocabulary
recall above the draft vocabulary's) from a tree that loses what both know (recall above acceptance).

Teacher forcing: each depth's input tokens are the text's own (as training-time test feeds them), so depth i's
recall is conditioned on the earlier tokens being right, which is what acceptance at depth i needs too.
The draft vocabulary's window follows the text as the engine's does: reset from the prompt (and the target's
top-k_pre at each prompt position), then per answer position the target's top-k_ver there and the head's
first-level candidates (its top-`tree_k` at the previous position, the tree's first level)."""
import json
import re
from pathlib import Path

import torch

import vocab as vc
from draft_config import DraftConfig
from eagle import load_eagle
from eagle_data import TrainError
from eagle_ttt import rope_cache, ttt_forward
from engine import build_engine
from model import Plan, Transformer

KS = (1, 4, 8, 10)


@torch.no_grad()
def recall_table(target: Transformer, head, recs: list[dict], steps: int = 4, vocab: str = "nanospec",
                 ks=KS, tree_k: int = 8, w_max: int = 3072, k_pre: int = 3, k_ver: int = 3,
                 ablation: str | None = None) -> dict:
    """recs: eagle_data records; each one's first span (its first answer) is scored after its prompt.
    Returns {"full": [[R@k per k] per depth], "vocab": the same over the draft vocabulary, "rows": rows
    scored per depth, "window": mean active rows of the draft vocabulary}."""
    dev = target.lm_head.weight.device
    K = max(ks)
    a = head.c.args
    W = head.lm_weight()
    W32 = W.float()
    hits = {w: [[0] * len(ks) for _ in range(steps)] for w in ("full", "vocab")}
    rows, window, n_win = [0] * steps, 0, 0
    plan = Plan(head.c.aux_layers)
    for r in recs:
        s0, e0 = r["spans"][0]
        ids = torch.tensor(r["ids"][:e0], device=dev)
        T = ids.shape[0]
        if s0 < 1 or e0 - s0 < 2:
            continue
        target.setup_caches(1, T)
        logits, _, aux = target(ids[None], torch.arange(T, device=dev), return_hidden=True, plan=plan)
        logits = logits[0].float()  # [T, V]: row j predicts token j + 1
        nxt = logits.argmax(-1)  # [T] the target's next token
        ver = logits.topk(max(k_pre, k_ver), dim=-1).indices  # [T, k]
        cos, sin = rope_cache(T + steps, a.head_dim, a.rope_theta, a.rope_scaling)
        outs = ttt_forward(head, aux, ids[None], steps, cos.to(dev), sin.to(dev))  # [1, T, d] per depth
        # the full vocabulary's top-K of every row at once, in fp32: one GEMM per depth (row by row in bf16
        # it would take most of the time on a CPU without bf16 hardware)
        fulls = [torch.cat([(o[0, a:a + 256].float() @ W32.T).topk(K, dim=-1).indices
                            for a in range(0, T, 256)]) for o in outs]  # [T, K] per depth
        voc = vc.make_vocab(vocab, W, w_max=w_max, k_pre=k_pre, k_ver=k_ver, eos_ids=target.args.eos_ids,
                            ablation=ablation, fill=getattr(head, "fill_path", None) if vocab == "nanospec" else None)
        voc.reset(ids[:s0], ver[:s0, :k_pre])
        lvl1 = None  # the head's first-level candidates at the previous row
        # row t of depth i predicts token t + i + 2 (its label: the target's argmax at row t + i + 1); the
        # first answer token (s0) is the target's own bonus, so rows start where they predict s0 + 1
        for t in range(s0 - 1, e0 - 2):
            draft = lvl1 if lvl1 is not None else ver[t, :0]
            voc.update(draft.clamp(min=0), draft >= 0, ver[t:t + 1, :k_ver],
                       torch.ones(1, dtype=torch.bool, device=dev))
            window, n_win = window + int(voc.active_size()), n_win + 1
            for i in range(steps):
                if t + i + 1 >= e0 - 1:
                    break
                h = outs[i][0, t]  # [d]
                label = nxt[t + i + 1]
                full = fulls[i][t]  # [K]
                z, vids = voc.logits(h[None])
                z = z[0].float()
                top = z.topk(min(K, z.shape[0]))
                vtop = torch.where(top.values > float("-inf"), vids[top.indices], -1)
                for j, k in enumerate(ks):
                    hits["full"][i][j] += int((full[:k] == label).any())
                    hits["vocab"][i][j] += int((vtop[:k] == label).any())
                rows[i] += 1
                if i == 0:
                    lvl1 = vtop[:tree_k]  # (-1: a pick the vocabulary could not fill, not appended)
    rate = lambda w: [[round(h / max(rows[i], 1), 4) for h in hits[w][i]] for i in range(steps)]
    return dict(full=rate("full"), vocab=rate("vocab"), rows=rows, window=round(window / max(n_win, 1), 1),
                ks=list(ks), vocab_spec=vocab)


def accept_hist(target: Transformer, prompts: list[list[int]], c: DraftConfig, max_new_tokens: int) -> dict:
    """Greedy speculative decoding with c's head through engine.Engine, the whole tree verified every step:
    {tokens a step emitted (bonus included): steps}, over every prompt."""
    eng = build_engine(target, None, c, budget=False)
    hist = {}
    for p in prompts:
        _, st = eng.generate(list(p), max_new_tokens)
        for k, v in st.accept_hist.items():
            hist[k] = hist.get(k, 0) + v
    return hist


def engine_acceptance(target: Transformer, head_dir, prompts: list[list[int]], vocab: str, max_new_tokens: int,
                      topk: int, depth: int, nodes: int, steps: int, w_max: int = 3072, k_pre: int = 3,
                      k_ver: int = 3, ablation: str | None = None) -> dict:
    """With the head and the vocabulary: per depth d, the share of steps that accepted at least d drafted
    tokens, and τ (tokens per step)."""
    c = DraftConfig(str(head_dir), vocab, topk, depth, nodes, w_max=w_max, k_pre=k_pre, k_ver=k_ver, ablation=ablation)
    hist = accept_hist(target, prompts, c, max_new_tokens)
    n = max(sum(hist.values()), 1)
    acc = [round(sum(v for k, v in hist.items() if k - 1 >= d) / n, 4) for d in range(1, steps + 1)]
    return dict(accept=acc, tau=round(sum(k * v for k, v in hist.items()) / n, 3), steps=n)


@torch.no_grad()
def mean_accepted_length(target: Transformer, head_dir, prompts: list[list[int]], max_new_tokens: int = 64,
                         topk: int = 10, depth: int = 5, nodes: int = 60) -> float:
    """Tokens emitted per target forward with the head over the full vocabulary (Spec-Bench / vLLM convention)."""
    hist = accept_hist(target, prompts, DraftConfig(str(head_dir), "full", topk, depth, nodes), max_new_tokens)
    return sum(k * v for k, v in hist.items()) / max(sum(hist.values()), 1)


def load_head(path, target: Transformer):
    """The EAGLE-3 head to diagnose; one over the target's whole vocabulary (a pruned, d2t head's rows are not
    token ids, and NanoSpec's window needs them to be)."""
    w = target.lm_head.weight
    head = load_eagle(path, target, w.dtype, w.device)
    if head.c.version != 3 or head.lm_weight().shape[0] != target.args.vocab_size:
        raise ValueError(f"{path}: eval needs an EAGLE-3 head over the target's whole vocabulary")
    return head


def table(res: dict, eng: dict | None = None) -> str:
    """recall_table's result (and engine_acceptance's) as a markdown table."""
    ks = res["ks"]
    hdr = (["depth"] + [f"full R@{k}" for k in ks] + [f"{res['vocab_spec']} R@{k}" for k in ks]
           + (["engine accepted"] if eng else []) + ["rows"])
    out = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for i, (f, v) in enumerate(zip(res["full"], res["vocab"])):
        cells = [str(i + 1)] + [f"{x:.3f}" for x in f] + [f"{x:.3f}" for x in v]
        if eng:
            cells.append(f"{eng['accept'][i]:.3f}" if i < len(eng["accept"]) else "")
        out.append("| " + " | ".join(cells + [str(res["rows"][i])]) + " |")
    tail = f"mean slots the window's own tokens hold: {res['window']}"
    if eng:
        tail += f"; engine τ {eng['tau']} over {eng['steps']} steps"
    return "\n".join(out) + "\n\n" + tail


def read_point(spec: str, tokens: bool = False) -> tuple:
    """`curve`'s LABEL=FILE.json (an `eval --json` result) -> (label, result); tokens: the label read as a token
    count (410k, 2.21M)."""
    label, sep, f = spec.partition("=")
    if not sep or not Path(f).is_file():
        raise TrainError(f"{spec!r}: expected LABEL=FILE.json with an existing file")
    try:
        res = json.loads(Path(f).read_text())
    except json.JSONDecodeError as e:
        raise TrainError(f"{f} is not JSON ({e.msg})") from None
    if not tokens:
        return label, res
    if not (m := re.fullmatch(r"([\d.]+)([kKmM]?)", label)):
        raise TrainError(f"{label!r} is not a token count (e.g. 410k, 2.21M)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[m.group(2).lower()], res


def curve(points: list[tuple[float, dict]], png: str | None = None, ref: tuple[str, dict] | None = None) -> str:
    """The data-size curve: (supervised tokens, `eval --json` result) per head, as a markdown table (depth-1 and
    depth-4 recall, engine τ) and, with png, a figure of depth-1 R@8 and τ against tokens; ref: a head drawn as a
    line (its label, its result)."""
    pts = sorted(points, key=lambda p: p[0])
    row = lambda r: [r["recall"]["full"][0][0], r["recall"]["full"][0][2], r["recall"]["full"][-1][2],
                     (r.get("engine") or {}).get("tau")]
    out = ["| supervised tokens | depth-1 R@1 | depth-1 R@8 | depth-4 R@8 | engine τ |", "|---|---|---|---|---|"]
    for n, r in pts:
        a, b, c, t = row(r)
        out.append(f"| {n / 1e6:.2f}M | {a:.3f} | {b:.3f} | {c:.3f} | {'-' if t is None else f'{t:.3f}'} |")
    if ref:
        a, b, c, t = row(ref[1])
        out.append(f"| {ref[0]} | {a:.3f} | {b:.3f} | {c:.3f} | {'-' if t is None else f'{t:.3f}'} |")
    if png:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        xs = [n / 1e6 for n, _ in pts]
        for ax, j, name in ((axes[0], 1, "depth-1 recall@8"), (axes[1], 3, "engine τ (16-node tree)")):
            ax.plot(xs, [row(r)[j] or float("nan") for _, r in pts], "o-", label="campaign")
            if ref and row(ref[1])[j] is not None:
                ax.axhline(row(ref[1])[j], color="gray", ls="--", label=ref[0])
            ax.set_xscale("log")
            ax.set_xticks(xs, [f"{x:.2f}" for x in xs])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("supervised tokens (M)")
            ax.set_title(name)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
    return "\n".join(out)

