"""bench.py's PNG figures (matplotlib, optional): coverage and speed by vocabulary size (the paper's Figure 1), the
budget's tokens/s by tree size, and drafting time by task. The Markdown report has the same data as tables."""
from pathlib import Path

from bench_workload import TASK_TITLES


def make_plots(out_dir: Path, tag: str, fig1, S, methods, tasks, log):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG plots (the Markdown report has the same data as tables)")
        return
    if fig1:
        for what, fname, ylabel in (("coverage", "fig1a_coverage", "coverage of emitted tokens"),
                                    ("decode_rate", "fig1b_speed", "decode tokens/s")):
            fig, ax = plt.subplots(figsize=(6, 4))
            heads = sorted({p["head"] for p in fig1["points"]}, key=str)
            for h in heads:
                pre = f"{h} " if len(heads) > 1 else ""
                for series, style in (("freq", "o-"), ("nanospec", "s-"), ("full", "D")):
                    pts = sorted([p for p in fig1["points"] if p["head"] == h and p["series"] == series
                                  and p.get(what) is not None], key=lambda p: p["size"])
                    if pts:
                        ax.plot([p["size"] for p in pts], [p[what] for p in pts], style, label=pre + series)
                if what == "decode_rate":
                    pts = [p for p in fig1["points"] if p["head"] == h and p.get("oracle") is not None
                           and p["series"] != "full"]
                    if pts:
                        ax.plot([p["size"] for p in pts], [p["oracle"] for p in pts], "kx", ms=8,
                                label=pre + "oracle (Eq. 1)")
            if not ax.lines:  # no vocabulary of the run measured this (a head that never drafted): no empty figure
                plt.close(fig)
                log(f"figure {fname}: no data points in this run, not drawn")
                continue
            ax.set_xscale("log", base=2)
            ax.set_xlabel("draft vocabulary size (rows)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(out_dir / f"bench_{tag}_{fname}.png", dpi=120)
            plt.close(fig)
    fitted = [m.name for m in methods if S[m.name]["overall"].get("budget_curve")]
    if fitted:  # tokens/s and tokens per step against the verified tree size, per task (the budget's view)
        fig, axes = plt.subplots(len(fitted), 2, figsize=(10, 3.2 * len(fitted)), squeeze=False)
        for row, n in zip(axes, fitted):
            for t in tasks + ["overall"]:
                c = (S[n].get(t) or {}).get("budget_curve")
                if c:
                    sz = sorted(c)
                    style = "k-o" if t == "overall" else "-."
                    row[0].plot(sz, [c[b]["tokens_per_s"] for b in sz], style, label=TASK_TITLES.get(t, t), ms=4)
                    row[1].plot(sz, [c[b]["tokens"] for b in sz], style, label=TASK_TITLES.get(t, t), ms=4)
            for ax, yl in zip(row, ("expected tokens/s", "expected tokens per step")):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("verified tree size (nodes, 1 = autoregressive)")
                ax.set_ylabel(yl)
                ax.set_title(n, fontsize=9)
                ax.grid(alpha=0.3)
            row[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"bench_{tag}_tree_size.png", dpi=120)
        plt.close(fig)
    eag = [m.name for m in methods if m.kind == "eagle" and m.groups & {"main", "custom"}
           and S[m.name]["overall"].get("draft_ms")]
    if eag:
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(tasks)), 4))
        wdt = 0.8 / len(eag)
        for i, n in enumerate(eag):
            ax.bar([j + i * wdt for j in range(len(tasks))], [(S[n].get(t) or {}).get("draft_ms", 0) for t in tasks],
                   wdt, label=n)
        ax.set_xticks([j + 0.4 - wdt / 2 for j in range(len(tasks))], [TASK_TITLES.get(t, t) for t in tasks])
        ax.set_ylabel("drafting ms per step")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / f"bench_{tag}_fig4_draft_time.png", dpi=120)
        plt.close(fig)
