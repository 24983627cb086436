"""GPU checks in one command (a few minutes on an H100/H200); the compact table is printed last.

    python gpu_check.py [--quick] [--out results] [--parts kernel,copy,latency,eager,graphs,batch,quantized,train]

kernel: the CUDA gather kernel == the pure-torch fallback (bf16, fp16; V=128256, d=4096, W_max=3072).
copy, latency: the device-to-device copy bandwidth; the pieces of a step at the Llama-3.1-8B shape with random
   weights (bench.py --latency), and whether the NanoSpec gather hides behind the draft backbone.
eager, graphs: on the default model, every method's greedy tokens against its autoregressive ones (bf16 eager,
   then CUDA graphs, and graphs against eager), fp32 CPU against fp32 CUDA (TF32 off), and tokens/s: autoregressive,
   prompt lookup, EAGLE full vocabulary, FR-Spec, NanoSpec, and the CLI's default (NanoSpec with prompt lookup, the
   budget on: held autoregressive steps and the hybrid's pending ones outlive graph replays).
batch: batch outputs against one prompt at a time (fp32; eager, prompt lookup, and decode steps as CUDA graphs),
   and batch 16's tokens/s (bf16, eager and graphs).
quantized: quantize.py's int8 and int4 g32 through torch's kernels (as gpt-fast): prompt lookup's greedy output
   against the quantized target's own autoregressive output, and autoregressive tokens/s.
train: eagle_train.py on CUDA, briefly (the target's answers to a few prompts, a --time-limit run from the shipped
   head, its export drafting losslessly): seconds a step before a real run is sized.
Equal outputs pass, and so do outputs that part only at a near tie of the target's logits (compare: CUDA's kernels
are not batch invariant). Writes OUT/gpu_check.json and OUT/gpu_check.md after every part.
"""
import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import bench
import draft_config as dc
from batch import BatchEngine
import cuda_gather
from download import resolve_checkpoint
from eagle import load_eagle
from engine import Engine, build_engine, load_target

REPO = Path(__file__).resolve().parent
HEAD = REPO / "heads" / "SmolLM2-135M-Instruct-eagle3-sharegpt"
PROMPTS = ["What is the capital of France?", "Write a Python function that checks whether a number is prime.",
           "Summarize the water cycle in three sentences."]


def check_kernel(rows_out):
    ok_all = True
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        V, d, W, n = 128256, 4096, 3072, 300
        weight = torch.randn(V, d, generator=g).to("cuda", dtype)
        tok = torch.randint(0, V, (n,), generator=g).cuda()
        slots = torch.randperm(W, generator=g)[:n].cuda()
        slots[::7] = -1  # invalid entries are skipped
        a = torch.zeros(W, d, device="cuda", dtype=dtype)
        b = a.clone()
        cuda_gather.gather_rows_(a, weight, tok, slots)  # the custom op: CUDA extension when it builds
        cuda_gather.gather_rows_reference(b, weight, tok, slots)
        torch.cuda.synchronize()
        ok = torch.equal(a, b)
        ok_all &= ok
        rows_out.append(["gather kernel == fallback", str(dtype).replace("torch.", ""),
                         "PASS" if ok else "FAIL", f"extension built: {cuda_gather.cuda_ext_available()}"])
    return ok_all


def engines(path, device, dtype, compile, head_path):
    """(name, Engine) for every method on one loaded target (the papers' GPU tree: 10/5/60)."""
    m, tok, _ = load_target(str(path), device, str(dtype).replace("torch.", ""))
    head = load_eagle(head_path, m, dtype, device)
    freq = REPO / "results" / "cache" / f"freq_gpu_check_{m.args.vocab_size}.pt"
    if not freq.is_file():  # any frequency ranking works for an equality check: use the token ids in order
        freq.parent.mkdir(parents=True, exist_ok=True)
        torch.save(list(range(m.args.vocab_size)), freq)
    methods = [("autoregressive", "none", "full"), ("ngram", "ngram", "full"), ("eagle3 full", head_path, "full"),
               ("fr-spec 8k", head_path, f"freq:{freq}:{min(8192, m.args.vocab_size // 2)}"),
               ("nanospec", head_path, "nanospec"), ("default: nanospec + lookup, budget", head_path, "nanospec")]
    out = []
    for name, draft, vocab in methods:
        auto = name.startswith("default")  # the CLI's default: held autoregressive steps, the hybrid's pending ones
        c = dc.DraftConfig(str(draft), vocab, *dc.TREE_GPU, w_max=min(3072, m.args.vocab_size // 2), static=compile,
                           ngram=auto)
        out.append((name, build_engine(m, tok, c, compile=compile, max_seq=1024,
                                       head=head if draft == head_path else None, budget=auto)))
    return out, tok, m


def check_batch(path, device, dtype, n_new, batch=4) -> dict:
    """The batch engine against one prompt at a time (autoregressive) over PROMPTS repeated to 2 x batch sequences:
    the outputs of one at a time ("single"), of the batch ("batch") and of a speculative batch ("spec": prompt lookup
    per sequence, every tree verified), tok/s of the batch ("tps") and of one at a time ("tps1"), the target and
    the prompts' ids; on CUDA also the batch's outputs and tok/s with its decode steps as CUDA graphs ("graphs",
    "tps_graphs": the second run, the first captured)."""
    m, tok, _ = load_target(str(path), device, str(dtype).replace("torch.", ""))
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in (PROMPTS * (2 * batch))[:2 * batch]]
    eng, t0 = Engine(m), time.perf_counter()
    single = [eng.generate(p, n_new)[0] for p in prompts]
    t1 = time.perf_counter()
    outs = BatchEngine(m, batch, max(len(p) for p in prompts) + n_new).generate_batch(prompts, n_new)
    t2 = time.perf_counter()
    n = sum(len(o) for o in outs)
    graphed = None
    if m.lm_head.weight.is_cuda:  # the decode steps as CUDA graphs, one per padded batch size (the first use captures)
        eng = BatchEngine(m, batch, max(len(p) for p in prompts) + n_new, cuda_graphs=True)
        eng.generate_batch(prompts, n_new)
        t3 = time.perf_counter()
        graphed = eng.generate_batch(prompts, n_new)
        tps_g = sum(len(o) for o in graphed) / (time.perf_counter() - t3)
    ds = dc.make_drafters(dc.DraftConfig("ngram"), m, batch)
    spec = BatchEngine(m, batch, max(len(p) for p in prompts) + n_new + ds[0].nodes, drafters=ds,
                       budget=False).generate_batch(prompts, n_new)
    return dict(single=single, batch=outs, spec=spec, graphs=graphed, tps=n / (t2 - t1),
                tps_graphs=tps_g if graphed else None, tps1=sum(len(o) for o in single) / (t1 - t0), model=m,
                prompts=prompts)


@torch.no_grad()
def compare(m, prompts, outs, ref) -> tuple[bool, str]:
    """(ok, detail): ok where every output equals ref's, or parts from it only at a near tie of the target's
    logits for the two tokens. CUDA's GEMMs pick kernels by row count (the engine's exact mode is CPU-only), so a
    token whose two best logits sit within a few bf16 roundings (2^-8 each) of each other may flip between a
    one-row and a tree pass; a flip at a clear margin is a bug."""
    same = sum(o == r for o, r in zip(outs, ref))
    notes, ok = [], True
    for k, (p, o, r) in enumerate(zip(prompts, outs, ref)):
        if o == r:
            continue
        i = next((j for j, (x, y) in enumerate(zip(o, r)) if x != y), None)
        if i is None:  # one is a prefix of the other: one stopped early
            ok = False
            notes.append(f"#{k}: lengths {len(o)} vs {len(r)}")
            continue
        ids = p + r[:i]
        m.setup_caches(1, len(ids) + 8)
        lg = m(torch.tensor([ids], device=m.lm_head.weight.device),
               torch.arange(len(ids), device=m.lm_head.weight.device))[0, -1].float()
        gap, top = (lg[o[i]] - lg[r[i]]).abs().item(), lg.max().abs().item()
        tie = gap <= 0.02 * max(top, 1.0)
        ok &= tie
        notes.append(f"#{k} parts at token {i}: logits {lg[o[i]].item():.3f} vs {lg[r[i]].item():.3f}"
                     f" ({'near tie' if tie else 'CLEAR MARGIN'})")
    return ok, f"{same}/{len(ref)} same" + ("; " + "; ".join(notes) if notes else "")


def check_quantized(path, n_new, device="cuda", cache=REPO / "results" / "cache") -> list[list[str]]:
    """Rows for the int8 and int4 targets on CUDA: lossless prompt lookup against their own AR, and AR tok/s."""
    import quantize
    rows = []
    for mode in ("int8", "int4"):
        q = Path(cache) / f"gpu_check_{mode}"
        try:
            if not (q / "config.json").is_file():
                quantize.quantize_folder(path, q, mode, None)
            m, tok, _ = load_target(str(q), device, "bfloat16")
            ar, ng = Engine(m), build_engine(m, tok, dc.DraftConfig("ngram"), budget=False)
            prompts, refs, outs, speeds = [], [], [], []
            for p in PROMPTS:
                ids = tok.encode_chat([{"role": "user", "content": p}])
                ar.generate(ids, 8)
                o, st = ar.generate(ids, n_new)
                prompts.append(ids)
                refs.append(o)
                outs.append(ng.generate(ids, n_new)[0])
                speeds.append(st.new_tokens / st.total_s)
            same, detail = compare(m, prompts, outs, refs)
            rows.append([f"quantized target: {mode}", "torch's kernels, eager", "PASS" if same else "FAIL",
                         f"prompt lookup vs its AR: {detail}; AR {statistics.median(speeds):.1f} tok/s"])
        except Exception as e:  # a kernel torch lacks here is a finding, not the end of the run
            traceback.print_exc()
            rows.append([f"quantized target: {mode}", "torch's kernels, eager", "FAIL", error_line(e)])
    return rows


def run_all(path, device, dtype, compile, head_path, n_new, repeats=1):
    """{method: (outputs, median tok/s), or the error it raised as a line}, the target, the prompts' ids."""
    es, tok, m = engines(path, device, dtype, compile, head_path)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    res = {}
    for name, e in es:
        try:
            outs, speeds = [], []
            for r in range(repeats + (1 if compile else 0)):  # with graphs, the first pass captures
                for ids in prompts:
                    o, st = e.generate(ids, n_new)
                    if r == repeats - 1 + (1 if compile else 0):
                        outs.append(o)
                        speeds.append(st.new_tokens / st.total_s)
            res[name] = (outs, statistics.median(speeds))
        except Exception as ex:  # one method's failure is a finding, not the end of the others
            traceback.print_exc()
            res[name] = error_line(ex)
    return res, m, prompts


def error_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def check_training(path, head, seconds: float, device="cuda", dtype="bfloat16",
                   work=REPO / "results" / "cache" / "gpu_train") -> tuple[bool, str]:
    """The trainer on this device, briefly: the target's answers to PROMPTS (the batch engine), `seconds` of TTT
    steps from `head` (--time-limit), an export without lm_head -> (ok: it trained and its head drafts losslessly,
    a detail: steps, seconds a step, the loss first and last, the drafting check)."""
    import shutil

    import eagle_data
    import eagle_train
    work = Path(work)
    shutil.rmtree(work, ignore_errors=True)
    m, tok, _ = load_target(str(path), device, dtype)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS * 8]
    eagle_data.write_records(work / "data.jsonl", eagle_data.answer_conversations(
        m, tok, convs, batch_size=len(convs), max_new_tokens=96, desc="answers (gpu_check)"), {})
    rc = eagle_train.main(["train", "--checkpoint", str(path), "--device", device, "--target-dtype", dtype,
                           "--data", str(work / "data.jsonl"), "--out", str(work / "run"), "--init", str(head),
                           "--freeze-lm-head", "--no-lm-head", "--export", str(work / "head"), "--time-limit",
                           str(seconds), "--epochs", "1000", "--batch-tokens", "2048", "--lr", "1e-4",
                           "--save-every", "0"])
    if rc:
        return False, f"eagle_train.py train exited with {rc}"
    hist = json.loads((work / "run" / "history.json").read_text())
    per = seconds / max(1, len(hist))
    eng = build_engine(m, tok, dc.DraftConfig(str(work / "head"), "nanospec", *dc.TREE_GPU,
                                              w_max=min(3072, m.args.vocab_size // 2)), budget=False)
    prompts = [tok.encode_chat(c) for c in convs[:len(PROMPTS)]]
    ar = Engine(m)
    same, detail = compare(m, prompts, [eng.generate(p, 48)[0] for p in prompts],
                           [ar.generate(p, 48)[0] for p in prompts])
    return same, (f"{len(hist)} steps in {seconds:g} s (~{per:.2f} s a step), loss {hist[0]['loss']:.3f} -> "
                  f"{hist[-1]['loss']:.3f}; the exported head drafts: {detail}")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read and written (the roofline for a decode step)."""
    x = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t0) / 1e9


def latency_rows(out: Path, quick: bool) -> list[list[str]]:
    """The Llama-3.1-8B-shape latency table (bench.py --latency) as rows, and whether the gather hides."""
    argv = ["--latency", "--shape", "llama3.1-8b", "--device", "cuda", "--out", str(out),
            "--latency-iters", "20" if quick else "50"]
    if rc := bench.main(argv):
        raise RuntimeError(f"bench.py {' '.join(argv)} exited with {rc}")
    lat = json.loads((out / "latency_llama3.1-8b.json").read_text())
    return ([[f"8B: {r[0]}", f"eager {r[1]} ms", f"graph {r[2]} ms", r[3]] for r in lat["rows"]]
            + [["NanoSpec gather hidden behind backbone", "", gather_overlap(lat), ""]])


PARTS = ("kernel", "copy", "latency", "eager", "graphs", "batch", "quantized", "train")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens and iterations")
    ap.add_argument("--out", default=str(REPO / "results"))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (default all)")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if unknown := [p for p in parts if p not in PARTS]:
        print(f"error: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: gpu_check.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    rows, ok, eager16 = [], True, {}
    dev_name = torch.cuda.get_device_name(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    print(f"GPU: {dev_name}, torch {torch.__version__}", flush=True)
    n_new = 48 if args.quick else 96

    @functools.cache
    def model_and_head():  # the default model (and the shipped head) only for the parts that run it
        path = resolve_checkpoint(None)
        head = HEAD
        if not (head / "config.json").is_file():  # no trained head in this checkout: a random one checks equality
            head = bench.write_random_eagle3(REPO / "results" / "cache" / "random_eagle3",
                                             json.loads((path / "config.json").read_text()))
        return path, head

    def kernel():
        return check_kernel(rows)

    def copy():
        rows.append(["device-to-device copy bandwidth", "read + write", f"{copy_bandwidth():.0f} GB/s", ""])
        return True

    def latency():
        rows.extend(latency_rows(out, args.quick))
        return True

    def eager():  # every method == AR in bf16 on CUDA; fp32 CPU against fp32 CUDA (TF32 off)
        path, head = model_and_head()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        cpu32, _, _ = run_all(path, "cpu", torch.float32, False, head, n_new)
        gpu32, m32, prompts = run_all(path, "cuda", torch.float32, False, head, n_new)
        gpu16, m16, _ = run_all(path, "cuda", torch.bfloat16, False, head, n_new, repeats=2)
        eager16.update(gpu16)
        good, ar = True, gpu16["autoregressive"]
        for name in gpu16:
            if isinstance(gpu16[name], str) or isinstance(ar, str):
                good = False
                rows.append([f"greedy, eager: {name}", "bf16 CUDA", "FAIL",
                             gpu16[name] if isinstance(gpu16[name], str) else ar])
                continue
            same, detail = compare(m16, prompts, gpu16[name][0], ar[0])
            good &= same
            dev = ("fp32 CPU vs CUDA: " + compare(m32, prompts, gpu32[name][0], cpu32[name][0])[1]
                   if not isinstance(gpu32[name], str) and not isinstance(cpu32[name], str) else "fp32: raised")
            rows.append([f"greedy, eager: {name}", "bf16 CUDA vs its AR", "PASS" if same else "FAIL",
                         f"{detail}; {gpu16[name][1]:.1f} tok/s; {dev}"])
        return good

    def graphs():  # CUDA graphs: == AR (graphs) and == eager, tok/s against AR
        path, head = model_and_head()
        graph16, m16, prompts = run_all(path, "cuda", torch.bfloat16, True, head, n_new, repeats=2)
        good, ar = True, graph16["autoregressive"]
        for name, r in graph16.items():
            if isinstance(r, str) or isinstance(ar, str):
                good = False
                rows.append([f"CUDA graphs: {name}", "bf16", "FAIL", r if isinstance(r, str) else ar])
                continue
            same, detail = compare(m16, prompts, r[0], ar[0])
            e = eager16.get(name)
            vs_eager = (compare(m16, prompts, r[0], e[0])[1] + f", eager {e[1]:.1f} tok/s"
                        if isinstance(e, tuple) else "no eager run")
            good &= same
            rows.append([f"CUDA graphs: {name}", "bf16, vs its AR", "PASS" if same else "FAIL",
                         f"{detail}; {r[1]:.1f} tok/s, x{r[1] / ar[1]:.2f} vs AR; vs eager: {vs_eager}"])
        return good

    def batch():
        path, _ = model_and_head()
        r32 = check_batch(path, "cuda", torch.float32, n_new)
        same, d1 = compare(r32["model"], r32["prompts"], r32["batch"], r32["single"])
        spec, d2 = compare(r32["model"], r32["prompts"], r32["spec"], r32["single"])
        graphed, d3 = compare(r32["model"], r32["prompts"], r32["graphs"], r32["single"])
        r16 = check_batch(path, "cuda", torch.bfloat16, n_new, batch=16)
        rows.append(["batched decoding (batch.py)", "fp32, batch 4 vs one at a time: AR; prompt lookup; AR, graphs",
                     "PASS" if same and spec and graphed else "FAIL",
                     f"AR {d1}; lookup {d2}; graphs {d3}; bf16 batch 16: {r16['tps']:.1f} tok/s eager, "
                     f"{r16['tps_graphs']:.1f} graphs, one at a time {r16['tps1']:.1f}"])
        return same and spec and graphed

    def quantized():
        qrows = check_quantized(model_and_head()[0], n_new)
        rows.extend(qrows)
        return all(r[2] == "PASS" for r in qrows)

    def train():  # the trainer on CUDA: a few of the target's answers, a short --time-limit run, its head drafting
        path, head = model_and_head()
        ok, detail = check_training(path, head, 30 if args.quick else 90)
        rows.append(["EAGLE-3 training (eagle_train.py)", "bf16, from the shipped head", "PASS" if ok else "FAIL",
                     detail])
        return ok

    def write(final=False):
        md = ("| check | setting | result | detail |\n|---|---|---|---|\n"
              + "\n".join("| " + " | ".join(r) + " |" for r in rows))
        (out / "gpu_check.md").write_text(f"# GPU check, {stamp}, {dev_name}, torch {torch.__version__}\n\n"
                                          f"Command: `python gpu_check.py {' '.join(sys.argv[1:])}`\n\n{md}\n")
        (out / "gpu_check.json").write_text(json.dumps(dict(date=stamp, gpu=dev_name, torch=torch.__version__,
                                                             parts=parts, rows=rows, ok=ok, done=final), indent=1))
        return md

    fns = dict(kernel=kernel, copy=copy, latency=latency, eager=eager, graphs=graphs, batch=batch, quantized=quantized,
               train=train)
    for name in parts:  # each part's failure is a row of its own: one broken part must not lose the others' figures
        t0 = time.perf_counter()
        try:
            ok &= bool(fns[name]())
        except Exception as e:
            traceback.print_exc()
            ok = False
            rows.append([name, "raised", "FAIL", error_line(e)])
        torch.cuda.empty_cache()
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
        write()
    md = write(final=True)
    print(f"\n# GPU check, {stamp}, {dev_name}, {time.perf_counter() - t_start:.0f} s\n{md}")
    print("ALL PASS" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


@torch.no_grad()
def gather_overlap(lat) -> str:
    """Time the draft backbone alone and with one step's gather issued on the copy stream in parallel."""
    d, V, W, n = 4096, 128256, 3072, 60
    weight = torch.randn(V, d, device="cuda", dtype=torch.bfloat16)
    rows = torch.zeros(W, d, device="cuda", dtype=torch.bfloat16)
    tok = torch.randint(0, V, (n,), device="cuda")
    slots = torch.randperm(W, device="cuda")[:n]
    # a stand-in backbone of the 8B draft layer's size: 5 GEMMs of [10, 4096] x [4096, 4096]
    h = torch.randn(10, d, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(d, d, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    stream, ev = cuda_gather.copy_stream(torch.device("cuda")), torch.cuda.Event()

    def backbone():
        x = h
        for w in ws:
            x = x @ w
        return x

    def both():
        with cuda_gather.on_copy_stream(stream, ev, tok, slots):
            cuda_gather.gather_rows_(rows, weight, tok, slots)
        x = backbone()
        cuda_gather.wait_event(ev)
        return x

    def t(fn, iters=200):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1000
    a, b = t(backbone), t(both)
    return f"backbone {a:.3f} ms, backbone + gather {b:.3f} ms ({'hidden' if b <= a * 1.05 else 'NOT hidden'})"


if __name__ == "__main__":
    sys.exit(main())
