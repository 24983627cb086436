"""GPU checks in one command (a few minutes on an H100/H200); the compact table is printed last.

    python gpu_check.py [--quick] [--out results]

1. CUDA gather kernel == pure-torch fallback (bf16, fp16; V=128256, d=4096, W_max=3072).
2. Default model, every method: greedy tokens identical between CUDA eager and CUDA graphs (bf16), and
   between CPU eager and CUDA eager (fp32, TF32 off).
3. Latency at the Llama-3.1-8B shape with random weights (bench.py --latency), plus the measured
   device-to-device copy bandwidth, and whether the NanoSpec gather hides behind the draft backbone.
4. End-to-end tokens/s on the default model: autoregressive, EAGLE full vocabulary, FR-Spec, NanoSpec.
5. Batched decoding: batch outputs == one prompt at a time (fp32), and batch 16's tokens/s (bf16).
6. Quantized targets (quantize.py int8 and int4 g32 through torch's kernels, as gpt-fast): prompt lookup's greedy
   output == the quantized target's own autoregressive output, and autoregressive tokens/s against bf16's.
Writes OUT/gpu_check.json and OUT/gpu_check.md.
"""
import argparse
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
from generate import Engine, build_engine, load_target

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
               ("nanospec", head_path, "nanospec")]
    out = []
    for name, draft, vocab in methods:
        c = dc.DraftConfig(str(draft), vocab, *dc.TREE_GPU, w_max=min(3072, m.args.vocab_size // 2), static=compile)
        out.append((name, build_engine(m, tok, c, compile=compile, max_seq=1024, head=head if draft == head_path else None,
                                        budget=False)))
    return out, tok


def check_batch(path, device, dtype, n_new, batch=4):
    """The batch engine against one prompt at a time (autoregressive): (same outputs, batch tok/s, one-at-a-time
    tok/s, a speculative batch's outputs the same: prompt lookup per sequence, every tree verified) over PROMPTS
    repeated to 2 x batch sequences."""
    m, tok, _ = load_target(str(path), device, str(dtype).replace("torch.", ""))
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in (PROMPTS * (2 * batch))[:2 * batch]]
    eng, t0 = Engine(m), time.perf_counter()
    single = [eng.generate(p, n_new)[0] for p in prompts]
    t1 = time.perf_counter()
    outs = BatchEngine(m, batch, max(len(p) for p in prompts) + n_new).generate_batch(prompts, n_new)
    t2 = time.perf_counter()
    n = sum(len(o) for o in outs)
    ds = dc.make_drafters(dc.DraftConfig("ngram"), m, batch)
    spec = BatchEngine(m, batch, max(len(p) for p in prompts) + n_new + ds[0].nodes, drafters=ds,
                       budget=False).generate_batch(prompts, n_new)
    return outs == single, n / (t2 - t1), sum(len(o) for o in single) / (t1 - t0), spec == single


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
            same, speeds = True, []
            for p in PROMPTS:
                ids = tok.encode_chat([{"role": "user", "content": p}])
                ar.generate(ids, 8)
                o, st = ar.generate(ids, n_new)
                same &= ng.generate(ids, n_new)[0] == o
                speeds.append(st.new_tokens / st.total_s)
            rows.append([f"quantized target: {mode}", "torch's kernels, eager", "PASS" if same else "FAIL",
                         f"prompt lookup == its AR; AR {statistics.median(speeds):.1f} tok/s"])
        except Exception as e:  # a kernel torch lacks here is a finding, not the end of the run
            rows.append([f"quantized target: {mode}", "torch's kernels, eager", "FAIL",
                         f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"])
    return rows


def run_all(path, device, dtype, compile, head_path, n_new, repeats=1):
    es, tok = engines(path, device, dtype, compile, head_path)
    res = {}
    for name, e in es:
        outs, speeds = [], []
        for r in range(repeats + (1 if compile else 0)):  # with graphs, the first pass captures
            for p in PROMPTS:
                ids = tok.encode_chat([{"role": "user", "content": p}])
                o, st = e.generate(ids, n_new)
                if r == repeats - 1 + (1 if compile else 0):
                    outs.append(o)
                    speeds.append(st.new_tokens / st.total_s)
        res[name] = (outs, statistics.median(speeds))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer tokens and iterations")
    ap.add_argument("--out", default=str(REPO / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: gpu_check.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    path = resolve_checkpoint(None)
    head = HEAD
    if not (head / "config.json").is_file():  # no trained head in this checkout: a random one checks equality
        head = bench.write_random_eagle3(REPO / "results" / "cache" / "random_eagle3",
                                         json.loads((path / "config.json").read_text()))
    rows, ok = [], True
    dev_name = torch.cuda.get_device_name(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    print(f"GPU: {dev_name}, torch {torch.__version__}", flush=True)
    n_new = 48 if args.quick else 96

    def kernel():
        return check_kernel(rows)

    def greedy_and_speed():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        cpu32 = run_all(path, "cpu", torch.float32, False, head, n_new)
        gpu32 = run_all(path, "cuda", torch.float32, False, head, n_new)
        gpu16 = run_all(path, "cuda", torch.bfloat16, False, head, n_new, repeats=2)
        graph16 = run_all(path, "cuda", torch.bfloat16, True, head, n_new, repeats=2)
        good = True
        for name in cpu32:
            same_graph = gpu16[name][0] == graph16[name][0]
            same_dev = cpu32[name][0] == gpu32[name][0]
            same_ar = graph16[name][0] == graph16["autoregressive"][0]
            good &= same_graph and same_ar
            rows.append([f"greedy equality: {name}", "bf16 eager vs graphs / == AR",
                         "PASS" if same_graph and same_ar else "FAIL",
                         f"fp32 CPU vs CUDA: {'same' if same_dev else 'differs (fp32 rounding)'}"])
        for name in graph16:
            rows.append([f"tok/s default model: {name}", "bf16 CUDA graphs", f"{graph16[name][1]:.1f}",
                         f"eager {gpu16[name][1]:.1f}, x{graph16[name][1] / graph16['autoregressive'][1]:.2f} vs AR"])
        return good

    def batch():
        same32, _, _, spec32 = check_batch(path, "cuda", torch.float32, n_new)
        _, tps, tps1, _ = check_batch(path, "cuda", torch.bfloat16, n_new, batch=16)
        rows.append(["batched decoding (batch.py)", "fp32: batch 4 == one at a time, AR and prompt lookup",
                     "PASS" if same32 and spec32 else "FAIL",
                     f"bf16 batch 16: {tps:.1f} tok/s, x{tps / tps1:.2f} vs one at a time"])
        return same32 and spec32

    def quantized():
        qrows = check_quantized(path, n_new)
        rows.extend(qrows)
        return all(r[2] == "PASS" for r in qrows)

    def copy_bandwidth():  # device-to-device copy bandwidth (the roofline for a decode step)
        x = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            y.copy_(x)
        torch.cuda.synchronize()
        copy_bw = 2 * x.numel() * 10 / (time.perf_counter() - t0) / 1e9
        rows.append(["device-to-device copy bandwidth", "read + write", f"{copy_bw:.0f} GB/s", ""])
        return True

    def latency():
        argv = ["--latency", "--shape", "llama3.1-8b", "--device", "cuda", "--out", str(out),
                "--latency-iters", "20" if args.quick else "50"]
        bench.latency_mode(bench.parse_args(argv), lambda s: print(s, flush=True))
        lat = json.loads((out / "latency_llama3.1-8b.json").read_text())
        for r in lat["rows"]:
            rows.append([f"8B: {r[0]}", f"eager {r[1]} ms", f"graph {r[2]} ms", r[3]])
        rows.append(["NanoSpec gather hidden behind backbone", "", gather_overlap(lat), ""])
        return True

    def write(final=False):
        md = "| check | setting | result | detail |\n|---|---|---|---|\n" + "\n".join("| " + " | ".join(r) + " |" for r in rows)
        (out / "gpu_check.md").write_text(f"# GPU check, {stamp}, {dev_name}, torch {torch.__version__}\n\n{md}\n")
        (out / "gpu_check.json").write_text(json.dumps(dict(date=stamp, gpu=dev_name, torch=torch.__version__,
                                                             rows=rows, ok=ok, done=final), indent=1))
        return md

    # each part's failure is a row of its own: one broken part must not lose the others' figures
    for part in (kernel, greedy_and_speed, batch, quantized, copy_bandwidth, latency):
        t0 = time.perf_counter()
        try:
            ok &= bool(part())
        except Exception as e:
            traceback.print_exc()
            ok = False
            rows.append([f"{part.__name__}", "raised", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"])
        torch.cuda.empty_cache()
        print(f"[{part.__name__}: {time.perf_counter() - t0:.0f} s]", flush=True)
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
