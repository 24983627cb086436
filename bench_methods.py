"""bench.py's methods: names and presets, each method's Engine, the interleaved run and its correctness guard."""
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import draft_config as dc
from engine import Engine, build_engine
from errors import UsageError
from model import Transformer


# ---------------------------------------------------------------- methods

def parse_k(s: str) -> int:
    m = re.fullmatch(r"(\d+)(k?)", s.strip().lower())
    if not m:
        raise UsageError(f"bad size {s!r} (use e.g. 512, 8k, 32768)")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


def fmt_k(k: int) -> str:
    return f"{k // 1024}k" if k % 1024 == 0 else str(k)


@dataclass
class Method:
    name: str
    kind: str  # ar | ngram | eagle
    head: str | None = None  # eagle2 | eagle3
    vocab: str = "full"  # full | freq | nanospec
    k: int | None = None  # freq K or nanospec window
    ablation: str | None = None
    compiled: bool = False  # torch.compile'd steps (--compile; --compile both adds a compiled twin "NAME@compile")
    fast: bool = False  # ar-fast: autoregressive decoding without exact mode (the speed baseline)
    budget: bool = False  # the fitted speculative budget (--budget auto; --budget both adds a twin "NAME@auto")
    hybrid: bool = False  # "+ngram": a prompt-lookup chain merged into the EAGLE tree (draft.HybridDrafter)
    groups: set = field(default_factory=set)
    engine: Engine | None = None
    timers: dict = field(default_factory=dict)

    def order(self):
        """Report order: ar, ngram, then per head: full, freq by K, NanoSpec, other windows, ablations."""
        if self.kind != "eagle":
            return (0 if self.kind == "ar" else 1, self.fast, self.compiled, self.budget)
        if self.ablation:
            v = (4, ABLATION_ORDER.index(self.ablation))
        elif self.vocab == "nanospec":
            v = (2, 0) if self.name.endswith("+nanospec") else (3, self.k)
        else:
            v = (0 if self.vocab == "full" else 1, self.k or 0)
        return (2, self.head, self.hybrid, *v, self.compiled, self.budget)


ABLATION_ORDER = ("ctx", "ext", "noasync", "nofill")


def method_from_name(name: str, heads: dict, w_max: int) -> Method:
    if name == "ar":
        return Method("ar", "ar")
    if name == "ar-fast":
        return Method("ar-fast", "ar", fast=True)
    if name == "ngram":
        return Method("ngram", "ngram")
    if re.fullmatch(r"eagle[23].*\+ngram", name):  # the EAGLE method with a prompt-lookup chain merged in
        return replace(method_from_name(name[:-len("+ngram")], heads, w_max), name=name, hybrid=True)
    m = re.fullmatch(r"(eagle[23])(?:\+(.+))?", name)
    if not m:
        raise UsageError(f"unknown method {name!r}")
    head, rest = m.group(1), m.group(2)
    if head not in heads:
        raise UsageError(f"method {name} needs an {head.upper()} head: pass --{head} PATH"
                         + (" or --random-head" if head == "eagle3" else ""))
    if rest is None or rest == "full":
        return Method(head, "eagle", head)
    if rest.startswith("freq-"):
        return Method(name, "eagle", head, "freq", parse_k(rest[5:]))
    if rest == "nanospec":
        return Method(name, "eagle", head, "nanospec", w_max)
    mm = re.fullmatch(r"nanospec-(ctx|ext|noasync|nofill|w(\d+k?))", rest)
    if mm:
        if mm.group(2):
            return Method(name, "eagle", head, "nanospec", parse_k(mm.group(2)))
        return Method(name, "eagle", head, "nanospec", w_max, mm.group(1))
    raise UsageError(f"unknown method {name!r}")


def expand_methods(spec: str, heads: dict, freq_ks, sweep_ks, sweep_w, w_max) -> list[Method]:
    """Presets and names -> Method list (ar first, duplicates merged, group tags kept)."""
    preset = {"main": lambda h: [h] + [f"{h}+freq-{fmt_k(k)}" for k in freq_ks] + [f"{h}+nanospec"],
              "ablations": lambda h: [f"{h}+nanospec", f"{h}+nanospec-ctx", f"{h}+nanospec-ext",
                                      f"{h}+nanospec-noasync", f"{h}+nanospec-nofill"],
              "sweep": lambda h: [h] + [f"{h}+freq-{fmt_k(k)}" for k in sweep_ks] + [f"{h}+nanospec"]
              + [f"{h}+nanospec-w{fmt_k(w)}" for w in sweep_w if w != w_max]}
    names: dict[str, set] = {"ar": {"main"}, "ar-fast": {"main"}}  # the reference and the speed baseline
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        groups = ["main", "ablations", "sweep"] if item == "all" else [item] if item in preset else None
        if groups is None:
            names.setdefault(item, set()).add("custom")
            continue
        for g in groups:
            if g == "main":
                names.setdefault("ar", set()).add("main")
                names.setdefault("ngram", set()).add("main")
            for h in heads:
                for n in preset[g](h):
                    names.setdefault(n, set()).add(g)
    out = []
    for n, g in names.items():
        m = method_from_name(n, heads, w_max)
        m.groups = g
        out.append(m)
    return sorted(out, key=Method.order)


def _timed(obj, attr: str, acc: dict, key: str, sync):
    """Accumulate the wall time of obj.attr(...) into acc[key] (an instance attribute shadows the method).
    Transparent under torch.compile (--compile fuses the steps: no per-call times there)."""
    fn = getattr(obj, attr)

    def wrapper(*a, **k):
        if torch.compiler.is_compiling():
            return fn(*a, **k)
        t0 = time.perf_counter()
        r = fn(*a, **k)
        sync()
        acc[key] += time.perf_counter() - t0
        return r
    setattr(obj, attr, wrapper)


def build_method(m: Method, model: Transformer, heads: dict, freq_path: Path | None, args, sampling, sync):
    """Attach an Engine to m (EAGLE methods share the loaded head; each has its own vocabulary state)."""
    kw = dict(compile=m.compiled, backend=args.compile_backend, exact=False if m.fast else args.exact, budget=m.budget)
    c = dc.DraftConfig(m.kind if m.kind in ("ar", "ngram") else m.head, tree_topk=args.tree_topk,
                       tree_depth=args.tree_depth, tree_nodes=args.tree_nodes, spec_k=args.spec_k,
                       ngram_min=args.ngram_min, ngram_max=args.ngram_max, k_pre=args.k_pre, k_ver=args.k_ver,
                       ablation=m.ablation, static=m.compiled, ngram=m.hybrid,
                       ngram_occurrences=args.ngram_occurrences)
    if m.kind in ("ar", "ngram"):
        m.engine = build_engine(model, None, replace(c, draft="none" if m.kind == "ar" else "ngram"), sampling, **kw)
        return
    head = heads[m.head]
    rows = head.lm_weight().shape[0]
    if m.vocab == "freq":
        if freq_path is None:
            raise UsageError(f"{m.name} needs a frequency file (--freq PATH, or let bench build one)")
        c.vocab = f"freq:{freq_path}:{m.k}"
    else:
        c.vocab = m.vocab
    c.w_max = m.k if m.vocab == "nanospec" else args.w_max
    if m.vocab in ("freq", "nanospec") and m.k >= rows:
        raise UsageError(f"{m.name}: size {m.k} >= the draft vocabulary ({rows}); choose a smaller size")
    m.engine = build_engine(model, None, c, sampling, head=head, **kw)
    d = m.engine.drafter
    # drafter_update includes its vocabulary's update (the drafter calls it); bench_report subtracts it
    m.timers = dict(drafter_update=0.0, vocab_update=0.0)
    _timed(d, "update", m.timers, "drafter_update", sync)
    _timed(d.vocab, "update", m.timers, "vocab_update", sync)
    m.timers["drafter_logp"] = 0.0  # projection + log-softmax over the active rows
    _timed(getattr(d, "tree", d), "_logp", m.timers, "drafter_logp", sync)  # (a hybrid's LM head is its tree's)


# ---------------------------------------------------------------- running

def first_diff(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_generation(m: Method, ids: list[int], max_new: int) -> tuple[list[int], dict]:
    for k in m.timers:
        m.timers[k] = 0.0
    out, st = m.engine.generate(ids, max_new)
    d = st.as_dict()
    d["timers"] = {k: round(v, 5) for k, v in m.timers.items()}
    return out, d


@torch.no_grad()
def diagnose(model: Transformer, ids: list[int], prefix: list[int], ta: int, tb: int) -> dict:
    """At a divergence: the target's logits for the two tokens after prompt + common prefix (one prefill
    in the run's dtype). A gap within a few roundings of the dtype means a near tie that the 1-token decode
    and the multi-token verify kernels resolved differently (numerics, not a logic error)."""
    seq = ids + prefix
    dev, dt = model.lm_head.weight.device, model.lm_head.weight.dtype
    if not (model.max_batch == 1 and model.max_seq >= len(seq)):  # keep the cache (captured graphs use it)
        model.setup_caches(1, min((len(seq) + 63) // 64 * 64, model.args.max_position_embeddings))
    logits = model(torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev))[0, -1].float()
    la, lb = float(logits[ta]), float(logits[tb])
    tol = 2 * torch.finfo(dt).eps * max(abs(la), abs(lb), 1.0)
    return dict(logit_expected=round(la, 4), logit_got=round(lb, 4), gap=round(la - lb, 4),
                near_tie=abs(la - lb) <= tol, prefill_argmax=int(logits.argmax()))


def run_benchmark(questions, methods, tok, max_new, log, progress=True, model=None, guard=True):
    """Every question: every method back to back (order rotated), each turn after its own previous answer.
    Returns (records, mismatches, reference outputs)."""
    records, mismatches, refs = [], [], []
    total = sum(len(q.turns) for q in questions) * len(methods)
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="gen", desc="bench", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            pass
    done, t_start = 0, time.perf_counter()
    for qi, q in enumerate(questions):
        r = qi % len(methods)
        order = methods[r:] + methods[:r]
        outs, prompts = {}, {}
        for m in order:
            msgs, outs[m.name], prompts[m.name] = [], [], []
            for ti, turn in enumerate(q.turns):
                msgs.append({"role": "user", "content": turn})
                ids = tok.encode_chat(msgs) if tok.chat_template else tok.encode("\n".join(x["content"] for x in msgs))
                out, st = run_generation(m, ids, max_new)
                outs[m.name].append(out)
                prompts[m.name].append(ids)
                msgs.append({"role": "assistant", "content": tok.decode(out)})
                records.append(dict(qid=q.qid, category=q.category, task=q.task, turn=ti + 1, method=m.name,
                                    prompt_tokens=len(ids), **st))
                done += 1
                if bar is not None:
                    bar.set_postfix_str(f"{q.task} {q.qid} {m.name}", refresh=False)
                    bar.update(1)
                elif progress and done % max(1, total // 20) == 0:
                    el = time.perf_counter() - t_start
                    log(f"  {done}/{total} generations, {el:.0f} s, ETA {el / done * (total - done):.0f} s")
        refs.append(outs["ar"])
        for m in methods:
            # compiled kernels round differently from eager ones: a compiled method answers to compiled AR
            rn = "ar@compile" if m.compiled and "ar@compile" in outs else "ar"
            if m.fast or not guard:  # the speed baseline is not exact (near-ties); sampled outputs differ by design
                continue
            ref = outs[rn]
            for ti, (a, b) in enumerate(zip(ref, outs[m.name])):
                if a != b:
                    i = first_diff(a, b)
                    exp = f"{a[i]} {tok.decode([a[i]])!r}" if i < len(a) else "<end>"
                    got = f"{b[i]} {tok.decode([b[i]])!r}" if i < len(b) else "<end>"
                    mm = dict(qid=q.qid, turn=ti + 1, method=m.name, index=i, expected=exp, got=got,
                              len_expected=len(a), len_got=len(b))
                    msg = (f"!!! OUTPUT MISMATCH: question {q.qid} turn {ti + 1}, method {m.name}: first difference "
                           f"at token {i} (autoregressive {exp}, got {got}; lengths {len(a)} vs {len(b)})")
                    if prompts[m.name][ti] != prompts[rn][ti]:
                        mm["diagnosis"] = "follows an earlier turn's difference (different prompt)"
                    elif model is not None and i < len(a) and i < len(b):
                        dg = diagnose(model, prompts[rn][ti], a[:i], a[i], b[i])
                        mm.update(dg)
                        mm["diagnosis"] = (f"near tie: logit gap {dg['gap']:+.4f} is within "
                                           f"{str(model.lm_head.weight.dtype)[6:]} "
                                           "rounding (1-token decode and multi-token verify kernels round differently)"
                                           if dg["near_tie"] else f"logit gap {dg['gap']:+.4f}: not a near tie, "
                                           "likely a logic error")
                    if "diagnosis" in mm:
                        msg += f"; {mm['diagnosis']}"
                    mismatches.append(mm)
                    (bar.write(msg, file=sys.stderr) if bar is not None else print(msg, file=sys.stderr))
                    for rec in records:
                        if rec["qid"] == q.qid and rec["turn"] == ti + 1 and rec["method"] == m.name:
                            rec["mismatch"] = True
    if bar is not None:
        bar.close()
    return records, mismatches, refs
