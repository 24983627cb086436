"""Autoregressive speed: this engine's configurations against HF transformers `generate()` on the same checkpoint.

    python bench_ar.py [--checkpoint PATH] [--max-new-tokens 128] [--rounds 3] [--compile]
                       [--llama-cpp PATH/llama-completion --gguf MODEL.gguf] [--quant int8,int4,gguf]
    python bench_ar.py --profile [--context 300]      # where one target pass spends its time

Rows: the engine as the CLI runs it (the fused CPU pass where this machine has it, cpu_forward.py: exact by
construction), the PyTorch layers with plain arithmetic and in exact mode (`--exact`: what makes speculative
output bit-identical there), both again with torch's GEMM where this machine chose cpu_gemm's kernel,
`--compile` when asked, quantized targets when asked (`--quant`: int8 and int4 copies made by quantize.py, and
`gguf`: the checkpoint folder's GGUF files run as they are), transformers, and llama.cpp when given a binary and
GGUFs (its Q8_0 and Q4_1 files are the quantized rows' peers)
(`llama-completion`, greedy, this process's thread count; its tokens/s is generated tokens over its own
prompt-eval + eval time, as ours is over prefill + decode). Methods alternate prompt by prompt (machines here
are shared and noisy); the table reports the median tokens/s of each, its ratio to transformers and to the
fastest engine configuration. All run greedy in the same dtype with the same prompt, and the generated tokens
are compared with transformers'.
"""
import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import cpu_forward
import cpu_gemm
from download import resolve_checkpoint
from exact import machine_id
from engine import Engine
from tokenizer import Tokenizer
from model import load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works, with an example in Python.",
    "List five ideas for a rainy weekend.",
    "Summarize the causes of the French Revolution in a paragraph.",
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true", help="also time our engine with --compile")
    p.add_argument("--profile", action="store_true", help="per target pass: GEMMs, attention and the rest, "
                   "against the floor of reading the weights once")
    p.add_argument("--context", type=int, default=300, help="--profile: tokens already in the KV cache")
    p.add_argument("--rows", default="1,16,60", help="--profile: pass sizes (decode = 1, tree verifies)")
    p.add_argument("--llama-cpp", default=None, help="a llama.cpp llama-completion binary: time it as a peer")
    p.add_argument("--gguf", action="append", default=None, help="with --llama-cpp: a GGUF of the same weights (e.g. "
                   "convert_hf_to_gguf.py --outtype bf16 of the checkpoint folder); repeat for several")
    p.add_argument("--quant", default="", help="quantized targets to time too: int8, int4 (quantize.py's defaults) "
                   "and gguf (the checkpoint folder's GGUF files, as they are)")
    args = p.parse_args()
    quant_modes = [q for q in args.quant.split(",") if q]
    if bad := [q for q in quant_modes if q not in ("int8", "int4", "gguf")]:
        p.error(f"--quant takes int8, int4 and gguf, not {bad[0]}")
    if bool(args.llama_cpp) != bool(args.gguf):
        p.error("--llama-cpp and --gguf go together")
    for f in [args.llama_cpp, *(args.gguf or [])] if args.llama_cpp else []:
        if not os.path.isfile(f):
            p.error(f"not a file: {f}")
    path = resolve_checkpoint(args.checkpoint)
    dtype = getattr(torch, args.dtype)
    tok = Tokenizer(path)
    model = load_model(path, dtype=dtype)
    if args.profile:
        return profile(model, path.name, args.dtype, args.context, [int(r) for r in args.rows.split(",")])
    import transformers as tf  # a peer, not a dependency of the engine

    ours = Engine(model, exact=None)  # as the CLI: exact where that is free (the fused pass)
    methods = {}
    if model.cpu_pass is not None:  # the fused pass, and the PyTorch layers it replaces in a model of their own
        methods["engine (fused CPU pass)"] = ours
        os.environ[cpu_forward.ENV] = "off"
        layers = load_model(path, dtype=dtype)
        del os.environ[cpu_forward.ENV]
    else:
        layers = model
    methods |= {"engine, PyTorch layers": Engine(layers, exact=False),
                "engine --exact, PyTorch layers": Engine(layers, exact=True)}
    kernel = cpu_gemm.enabled()  # this machine chose cpu_gemm's kernel: torch's GEMM gets rows of its own
    if kernel:
        methods |= {"engine, PyTorch layers, torch GEMM": Engine(layers, exact=False),
                    "engine --exact, PyTorch layers, torch GEMM": Engine(layers, exact=True)}
    if args.compile:
        methods["engine --compile"] = Engine(load_model(path, dtype=dtype), compile=True, exact=False)
    quantized = quantized_engines(path, quant_modes, dtype, tempfile.mkdtemp(prefix="bench_ar_quant-"))
    methods |= quantized
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    eos = ours.model.args.eos_ids
    n = args.max_new_tokens

    def run_hf(ids):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos[0])
        dt = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), dt

    def run_ours(eng, ids):
        cpu_gemm.switch(kernel and not any(e is eng for k, e in methods.items() if k.endswith("torch GEMM")))
        t0 = time.perf_counter()
        out, _ = eng.generate(ids, n)
        dt = time.perf_counter() - t0
        cpu_gemm.switch(kernel)
        return out, dt

    texts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in PROMPTS]  # special tokens spelled out
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]  # = tok.encode_chat
    text_of = {tuple(ids): t for ids, t in zip(prompts, texts)}
    for e in methods.values():  # warm-up (compilation, oneDNN kernel set-up), not timed
        run_ours(e, prompts[0])
        run_ours(e, prompts[0])
    run_hf(prompts[0])
    peers = {}
    for gguf in args.gguf or []:
        peers["llama.cpp " + os.path.basename(gguf)] = lambda ids, f=gguf: run_llama_cpp(args.llama_cpp, f,
                                                                                         text_of[tuple(ids)], n)
        for fn in peers.values():
            fn(prompts[0])
    speeds = {k: [] for k in ["transformers", *methods, *peers]}
    same = dict.fromkeys(methods, True)  # greedy tokens equal to transformers' (prefix compared)
    for r in range(args.rounds):
        for ids in prompts:
            ref, dt = run_hf(ids)
            speeds["transformers"].append(len(ref) / dt)
            for name, e in methods.items():
                out, dt = run_ours(e, ids)
                speeds[name].append(len(out) / dt)
                same[name] &= out[:len(ref)] == ref[:len(out)]
            for name, fn in peers.items():
                speeds[name].append(fn(ids))
    med = {k: statistics.median(v) for k, v in speeds.items()}
    base = med["transformers"]
    fastest = max((k for k in med if k.startswith("engine") and k not in quantized), key=med.get)
    print(f"\ncheckpoint {path.name}, {args.dtype}, greedy, {n} new tokens max, {len(prompts)} prompts x "
          f"{args.rounds} rounds, {torch.get_num_threads()} threads, {machine_id()}")
    print(f"| method | median tok/s | vs transformers | vs fastest engine ({fastest}) | tokens = transformers' |\n"
          "|---|---|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {v / base:.2f}x | {v / med[fastest]:.3f}x | "
              f"{'-' if k in quantized else same.get(k, '-')} |")
    print("tokens = transformers': every greedy answer equals transformers' (prefix compared); bf16 GEMMs that sum "
          "in another order (cpu_gemm's kernel) flip near-ties, so False there is expected, not a fault")


def quantized_engines(path, modes: list[str], dtype, work: str) -> dict:
    """{row name: Engine} of the quantized targets asked for (their weights differ from bf16's: no token check)."""
    import quantize
    out = {}
    for mode in modes:
        if mode == "gguf":
            for f in sorted(path.glob("*.gguf")):
                m = load_model(resolve_checkpoint(str(f)), dtype=dtype)
                out[f"engine {f.name} as it is"
                    f"{' (fused CPU pass)' if m.cpu_pass is not None else ''}"] = Engine(m, exact=None)
            continue
        quantize.quantize_folder(path, Path(work) / mode, mode, None)
        m = load_model(Path(work) / mode, dtype=dtype)
        out[f"engine {mode}{' (fused CPU pass)' if m.cpu_pass is not None else ''}"] = Engine(m, exact=None)
    return out


def run_llama_cpp(binary: str, gguf: str, text: str, n: int) -> float:
    """Greedy llama-completion on the chat-formatted prompt text -> its generated tokens per second over its own
    prompt-eval + eval time (model loading left out, as our engines are loaded once)."""
    cmd = [binary, "-m", gguf, "-p", text, "-n", str(n), "-t", str(torch.get_num_threads()), "--temp", "0",
           "-c", "2048", "-no-cnv", "--no-warmup", "-s", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    times = {k: (float(ms), int(cnt)) for k, ms, cnt in
             re.findall(r"(prompt eval|\beval) time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)", log)}
    if r.returncode != 0 or "eval" not in times or "prompt eval" not in times:
        raise SystemExit(f"llama.cpp failed (rc {r.returncode}): {log.strip().splitlines()[-1] if log.strip() else ''}")
    gen = times["eval"][1] + 1  # the first generated token comes out of the prompt eval
    return gen / ((times["eval"][0] + times["prompt eval"][0]) / 1000)


def median_ms(fn, iters: int = 15) -> float:
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1000


def fmt_ms(ms: float) -> str:
    """A table cell of milliseconds: one decimal, or three significant digits below 10 ms, so a short but measured
    time never prints as 0.0 (a tiny model's attention on a fast CPU)."""
    return f"{ms:.1f}" if abs(ms) >= 10 else f"{ms:.3g}"


def read_bandwidth_gbs() -> float:
    """This machine's memory read bandwidth: summing a 1 GiB tensor (far larger than any CPU cache)."""
    x = torch.ones(256 * 1024 * 1024)
    return x.nbytes / median_ms(lambda: x.sum(), 5) / 1e6


@torch.no_grad()
def profile(model, name: str, dtype: str, ctx: int, rows_list: list[int]):
    """One target pass after a ctx-token prefill (plain arithmetic, the fastest eager path), split into its
    GEMMs and its attention (the fused CPU pass: its own phases, timed inside it by its phase-timing build, plus
    the LM head alone, pass sizes alternating; the PyTorch layers: the same GEMMs alone, back to back, and the same
    SDPA calls over the same cache), and the rest (norms, RoPE, cache writes, residuals, dispatch), against two floors
    measured here: reading every weight once at this machine's bandwidth, and the pass's GEMM multiply-adds at this
    machine's peak with cpu_gemm's instruction (cpu_gemm.peak_gflops). A T-row pass costs at least the larger;
    its ratio to the measured one-row pass is the best a T-node verification can cost against today's decode
    step on this CPU, whatever the code."""
    a, dev = model.args, model.lm_head.weight.device
    rows_list = sorted(set(rows_list) | {1})  # the one-row pass (decode) is what the others compare with
    S = (ctx + max(rows_list) + 64 + 63) // 64 * 64  # what Engine.plan allocates for such a request
    model.setup_caches(1, S)
    model(torch.randint(0, a.vocab_size, (1, ctx)), torch.arange(ctx))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(w.numel() * w.element_size() for w in {m.weight.data_ptr(): m.weight for m in linears}.values())
    bw = read_bandwidth_gbs()
    floor = weight_bytes / bw / 1e6
    flops_row = 2 * sum(m.in_features * m.out_features for m in linears)  # every linear layer once per row
    peak = cpu_gemm.peak_gflops() if dev.type == "cpu" else None
    kv, fused = model.layers[0].self_attn.kv_cache, model.cpu_pass
    print(f"\n{name}, {dtype}, {torch.get_num_threads()} threads, {machine_id()}; "
          f"{'fused CPU pass (cpu_forward.py)' if fused is not None else 'PyTorch layers'}; "
          f"context {ctx} tokens, KV cache "
          f"{S} slots ({str(kv.k.dtype)[6:]}); weights {weight_bytes / 1e6:.0f} MB; read bandwidth {bw:.1f} GB/s, "
          f"so reading the weights once takes {floor:.1f} ms")
    if peak:
        print(f"GEMM multiply-adds {flops_row / 1e9:.3f} GFLOP per row; this CPU's peak with cpu_gemm's instruction "
              f"({cpu_gemm.ISA}) {peak:.0f} GFLOP/s over {torch.get_num_threads()} threads, so at least "
              f"{flops_row / peak / 1e6:.2f} ms of arithmetic per row")
    parts = "GEMMs ms (in the pass + LM head) | attention ms (in the pass)" if fused is not None else \
        "GEMMs alone ms | attention alone ms"
    print(f"| rows | whole pass ms | {parts} | the rest ms | whole / weight floor "
          "| floor ms (weights, arithmetic) | floor / 1-row pass |\n|---|---|---|---|---|---|---|---|")
    one = []  # the measured one-row pass (the first size)

    def floors(T, whole):
        one.append(whole)
        f = max(floor, T * flops_row / peak / 1e6) if peak else floor
        return f"| {fmt_ms(f)} | {f / one[0]:.2f}x |"
    g = torch.Generator().manual_seed(0)
    toks = {T: (torch.randint(0, a.vocab_size, (1, T), generator=g).to(dev), ctx + torch.arange(T, device=dev))
            for T in rows_list}
    if fused is not None:  # the fused pass's phases, timed inside it (its phase-timing build), and the LM head alone
        heads = {T: torch.randn(1, T, a.dim, generator=g).bfloat16() for T in rows_list}
        cpu_forward.timed(True)
        try:
            whole, phases, head = alternate({T: lambda T=T: model(*toks[T]) for T in rows_list},
                                            cpu_forward.phase_times,
                                            {T: lambda T=T: model.lm_head(heads[T]) for T in rows_list})
        finally:
            cpu_forward.timed(False)
        for T in rows_list:
            ph = {k: statistics.median(p[k] for p in phases[T]) for k in cpu_forward.PHASES}
            gemms, attn = ph["GEMMs"] + head[T], ph["attention"]
            print(f"| {T} | {fmt_ms(whole[T])} | {fmt_ms(gemms)} | {fmt_ms(attn)} | "
                  f"{fmt_ms(whole[T] - gemms - attn)} | {whole[T] / floor:.1f}x " + floors(T, whole[T]))
        print("(the fused pass's GEMMs and attention are its own phases, timed inside it, the LM head's alone; "
              "pass sizes alternate, medians of 15 rounds)")
        return
    for T in rows_list:
        tok, pos = toks[T]
        whole = median_ms(lambda: model(tok, pos))
        xs = {m: torch.randn(1, T, m.in_features, generator=g).to(dev, m.weight.dtype) for m in linears}
        gemms = median_ms(lambda: [m(x) for m, x in xs.items()])
        q = torch.randn(1, a.n_heads, T, a.head_dim, generator=g).to(dev, kv.k.dtype)
        mask = model.causal_mask(pos)
        attn = median_ms(lambda: [torch.nn.functional.scaled_dot_product_attention(
            q, kv.k, kv.v, attn_mask=mask, enable_gqa=a.n_kv_heads != a.n_heads) for _ in model.layers])
        print(f"| {T} | {fmt_ms(whole)} | {fmt_ms(gemms)} | {fmt_ms(attn)} | {fmt_ms(whole - gemms - attn)} | "
              f"{whole / floor:.1f}x " + floors(T, whole))


def alternate(passes: dict, phase_times, heads: dict, rounds: int = 15):
    """Each pass size once per round, in turn (so a machine's slow minute lands on every size alike): the whole
    pass's median ms, its phases per round (phase_times() after each pass), and the LM head's median ms."""
    whole, phases, head = {T: [] for T in passes}, {T: [] for T in passes}, {T: [] for T in passes}
    for T in passes:  # warm-up
        passes[T](), heads[T]()
    phase_times()
    for _ in range(rounds):
        for T, fn in passes.items():
            t0 = time.perf_counter()
            fn()
            whole[T].append(time.perf_counter() - t0)
            phases[T].append(phase_times())
            t0 = time.perf_counter()
            heads[T]()
            head[T].append(time.perf_counter() - t0)
    med = lambda d: {T: statistics.median(v) * 1000 for T, v in d.items()}  # noqa: E731
    return med(whole), phases, med(head)

if __name__ == "__main__":
    main()
