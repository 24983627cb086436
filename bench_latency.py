"""bench.py's GPU latency mode: the pieces of one speculative step timed on random weights of a named shape."""
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import draft_config as dc
import cuda_gather
from bench_report import command_line, md_table
from eagle import EagleConfig, EagleHead, attach
from bench_workload import shape_args
from errors import UsageError
from model import ModelArgs, Transformer
from vocab import FreqVocab, FullVocab, make_vocab


# ---------------------------------------------------------------- latency mode (GPU; tiny shape on CPU for tests)

def _init_random_(module: torch.nn.Module, std=0.02):
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
    return module


def time_op(fn, device, iters=50, warmup=5, graph=True):
    """(eager ms, CUDA-graph replay ms or None). CPU: perf_counter means."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1000, None
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    eager = s.elapsed_time(e) / iters
    g_ms = None
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            s.record()
            for _ in range(iters):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            g_ms = s.elapsed_time(e) / iters
        except Exception:
            torch.cuda.synchronize()
            g_ms = None
    return eager, g_ms


@torch.no_grad()
def latency_mode(args, log) -> int:
    """Time the pieces of one speculative step for a randomly initialised model of a named shape."""
    dev = torch.device(args.device)
    if dev.type != "cuda" and args.shape != "tiny":
        raise UsageError("--latency needs CUDA (a GPU); on CPU only the smoke-test shape runs: "
                         "--device cpu --shape tiny")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--latency needs CUDA, but CUDA is not available on this machine")
    a = shape_args(args.shape)
    dtype = getattr(torch, args.dtype) if dev.type == "cuda" or args.dtype != "bfloat16" else torch.float32
    ctx_len, N, k, D = args.latency_context, args.tree_nodes, args.tree_topk, args.tree_depth
    t0 = time.perf_counter()
    with torch.device("meta"):
        m = Transformer(a)
    m = _init_random_(m.to(dtype).to_empty(device=dev))
    if a.tie_word_embeddings:
        m.lm_head.weight = m.embed_tokens.weight
    m.eval()
    S = ctx_len + N + 64
    m.setup_caches(1, S)
    eagle_args = ModelArgs(arch="eagle", dim=a.dim, n_layers=1, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                           head_dim=a.head_dim, intermediate_size=a.intermediate_size, vocab_size=a.vocab_size,
                           norm_eps=a.norm_eps, rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
                           max_position_embeddings=a.max_position_embeddings)
    c = EagleConfig(3, eagle_args, 3 * a.dim, False, a.vocab_size, (2, a.n_layers // 2, a.n_layers - 3))
    with torch.device("meta"):
        head = EagleHead(c)
    head = _init_random_(head.to(dtype).to_empty(device=dev)).eval()
    attach(head, m)
    head.setup_caches(S + D * k)
    build_s = time.perf_counter() - t0
    log(f"built random {args.shape} target + full-vocabulary EAGLE-3 head on {dev} in {build_s:.1f} s")
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    kv_bytes = 2 * a.n_layers * a.n_kv_heads * a.head_dim * ctx_len * torch.finfo(dtype).bits // 8
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []

    def add(name, fn, bytes_moved=None, iters=args.latency_iters, graph=True):
        eager, graph = time_op(fn, dev, iters, graph=graph)
        best = graph if graph is not None else eager
        bw = f"{bytes_moved / best / 1e6:.0f} GB/s" if bytes_moved else ""
        rows.append([name, f"{eager:.3f}", "-" if graph is None else f"{graph:.3f}", bw])
        log(f"  {name}: eager {eager:.3f} ms" + ("" if graph is None else f", graph {graph:.3f} ms")
            + (f", {bw}" if bw else ""))

    # target decode step at position ctx_len
    tok1 = torch.randint(0, a.vocab_size, (1, 1), generator=g).to(dev)
    pos1 = torch.tensor([ctx_len], device=dev)
    add(f"target decode step (context {ctx_len})", lambda: m(tok1, pos1), nbytes + kv_bytes)
    # verify of N tree nodes (a chain mask is as costly as any tree mask)
    toksN = torch.randint(0, a.vocab_size, (1, N), generator=g).to(dev)
    posN = ctx_len + torch.arange(N, device=dev)
    maskN = m.seq_range[None, :] <= posN[:, None]
    add(f"verify {N} nodes", lambda: m(toksN, posN, mask=maskN, cache_pos=posN, return_hidden=True), nbytes + kv_bytes)
    # draft backbone: one tree level (k frontier tokens) through the EAGLE-3 midlayer
    ftok = torch.randint(0, a.vocab_size, (1, k), generator=g).to(dev)
    feats = torch.randn(1, k, a.dim, generator=g).to(dev, dtype)
    fpos = torch.full((k,), ctx_len, device=dev)
    fslots = ctx_len + torch.arange(k, device=dev)
    fmask = head.seq_range[None, :] <= fslots[:, None]
    add(f"draft backbone, one level ({k} tokens)", lambda: head(ftok, feats, fpos, fslots, fmask))
    # LM head at each vocabulary size, k rows (one tree level)
    h = torch.randn(k, a.dim, generator=g).to(dev, dtype)
    W = head.lm_weight()
    W_max = args.w_max if args.w_max < a.vocab_size else a.vocab_size // 4
    vocabs = [("full", FullVocab(W), a.vocab_size)]
    if 32768 < a.vocab_size:
        vocabs.append(("freq 32k", FreqVocab(W, torch.randperm(a.vocab_size, generator=g)[:32768]), 32768))
    ns = make_vocab("nanospec", W, w_max=W_max, k_pre=args.k_pre, k_ver=args.k_ver,
                    max_append=dc.append_width(N, D, args.k_ver))
    ns.reset(torch.randperm(a.vocab_size, generator=g)[:W_max].to(dev))
    vocabs.append((f"nanospec {W_max}", ns, W_max))
    ns.wait()
    lm_ms = {}
    for name, v, n_rows in vocabs:
        # NanoSpec: the packed GEMM that logits() runs once the copy stream's update has landed
        fn = (lambda: F.linear(h, ns.rows, ns.bias)) if v is ns else (lambda v=v: v.logits(h))
        add(f"LM head {name} ({k} x {n_rows} rows)", fn, n_rows * a.dim * W.element_size())
        lm_ms[name] = rows[-1]
    # NanoSpec: one step's update (N draft tokens + (D+1) x k_ver verified ids, ~10% new)
    new_ids = torch.randint(0, a.vocab_size, (N,), generator=g).to(dev)
    ver = torch.randint(0, a.vocab_size, (D + 1, args.k_ver), generator=g).to(dev)
    valid = torch.ones(N, dtype=torch.bool, device=dev)
    vvalid = torch.ones(D + 1, dtype=torch.bool, device=dev)

    def upd():
        ns.update(new_ids, valid, ver, vvalid)
        ns.wait()
    # eager only: the update forks onto the copy stream, which a graph capture of one call does not model
    add(f"nanospec update ({N}+{(D + 1) * args.k_ver} appended ids, incl. gather)", upd, graph=False)
    rows_buf = torch.zeros(W_max, a.dim, device=dev, dtype=dtype)
    nnew = max(1, (N + (D + 1) * args.k_ver) // 10)
    gt = torch.randint(0, a.vocab_size, (nnew,), generator=g).to(dev)
    gs = torch.randperm(W_max, generator=g)[:nnew].to(dev)
    add(f"gather {nnew} new rows (cuda_gather.gather_rows_)", lambda: cuda_gather.gather_rows_(rows_buf, W, gt, gs),
        2 * nnew * a.dim * W.element_size())
    title = (f"latency: {args.shape} (d={a.dim}, V={a.vocab_size}, {a.n_layers} layers, {nbytes / 1e9:.2f} GB "
             f"{str(dtype).replace('torch.', '')}), {dev}"
             + (f" {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else "") + f", torch {torch.__version__}")
    table = md_table(["operation", "eager ms", "CUDA graph ms", "achieved bandwidth"], rows)
    # one draft step of a depth-D tree: D backbone passes (the first on the accepted tokens) and D LM-head calls
    best = lambda r: float(r[2] if r[2] != "-" else r[1])
    backbone = best(next(r for r in rows if r[0].startswith("draft backbone")))
    upd_ms = best(next(r for r in rows if r[0].startswith("nanospec update")))
    est = [[f"draft step, {name}", f"{D * (backbone + best(r)) + (upd_ms if name.startswith('nanospec') else 0):.3f}"]
           for name, r in lm_ms.items()]
    table += ("\nEstimated draft time per step (depth " + str(D) + ": " + str(D) + " x (backbone + LM head), "
              "+ the update for NanoSpec):\n\n" + md_table(["", "ms"], est))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"latency_{args.shape}.md").write_text(f"# {title}\n\nCommand: `{command_line(args.argv)}`\n\n{table}")
    (out / f"latency_{args.shape}.json").write_text(json.dumps(dict(title=title, rows=rows), indent=1))
    print(f"\n{title}\n{table}", flush=True)
    return 0
