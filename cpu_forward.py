"""The CPU target pass in one C call: every decoder layer of a bf16 model (norms, fused GEMMs, RoPE, the KV
write, attention, the MLP, the residuals) for all rows of a pass.

Why: on CPU a pass through PyTorch's eager ops costs far more than its arithmetic. A one-row decode step of
the default 30-layer model issues about 1,500 small ops (measured: 13 of 36 ms outside the GEMMs and the
attention), and SDPA's CPU flash kernel spends most of its time on a masked, static-length cache. Here the
whole layer stack runs in one OpenMP parallel region of one C function (cpu_gemm's GEMM tiles inside), with
q/k/v and gate/up fused into one packed weight each (gpt-fast's wqkv; loaded from the HF checkpoint as it is).

Exact by construction: every step works on each row alone, in an order that does not depend on the pass.
The GEMMs are cpu_gemm's (row-invariant). Attention reads, for each query row, exactly the keys its mask
allows, in increasing slot order, one dot product per key (one FMA chain over the head dimension, a fixed
horizontal sum; in the AVX-512 BF16 build one vdpbf16ps chain over its pairs, 1.1-1.2x faster verification
passes of 11-26 rows at 300-1,000 keys on Zen 4, in the key's own vector lane, from a transposed copy of the
keys kept next to the cache, scoring whole 16-slot blocks and keeping the allowed keys' scores: no horizontal
sum per key, 1.05-1.17x faster passes of 11-26 rows and 1.17x faster 1,000-token prefills on Zen 5; the
AVX-512F build reads the same transposed keys with one fp32 FMA chain over the head dimension per lane), then a
two-pass softmax in that order. Tree nodes come after their ancestors (draft.Tree),
so a node sees the prefix and then its ancestors in the same order and with the same values as the
autoregressive token at its position sees them. A token's bits therefore never depend on how many rows
share its pass or where its keys sit, and exact mode needs neither padding nor model.exact_attention.

Rounding follows the PyTorch bf16 path (model.py): every op's result is rounded to bf16 where that path
rounds (norm, RoPE, residual adds, SiLU, the product with up); attention runs in fp32 over the bf16 cache.
So the two paths agree to bf16 rounding, not bit for bit (sums run in other orders).

Used by model.Transformer.forward for batch-1 passes of bf16 CPU models where cpu_gemm's kernel is on
(`attach`); other passes (batches, explicit [B, 1, T, S] masks) take the PyTorch path.
"""
import os
import time

import torch
from torch import Tensor

import cbuild
import cpu_gemm

TAG = cbuild.source_hash(cpu_gemm.FLAGS)[:8]  # keys the per-machine answers about this pass


def kernel():
    """The pass's C function (csrc/forward.c), or None where cpu_gemm's kernel cannot be built here."""
    if cpu_gemm.kernel() is None:
        return None
    return cpu_gemm.c_function("stack_bf16", phases=_TIMED[0])


# The pass's kinds of work, in phase_times()'s order (the C enum PH_*)
PHASES = ("GEMMs", "attention", "norms", "RoPE + KV writes", "SiLU", "residuals", "set-up")
_TIMED = [False]


def timed(on: bool):
    """Run the fused pass as its phase-timing build (-DNANOSPEC_PHASES) from now on (on) or the plain one (off): the
    same arithmetic."""
    _TIMED[0] = bool(on)


def phase_times() -> dict[str, float]:
    """Milliseconds per kind of work (PHASES) in the timed build's passes since the last call: thread 0's wall time
    between the pass's barriers, each kind's waits for the other threads included; the kinds add up to the passes."""
    out = torch.zeros(len(PHASES), dtype=torch.float64)
    cpu_gemm.c_function("phase_times", phases=True)(out.data_ptr())
    return dict(zip(PHASES, (out * 1e3).tolist()))


def compact(kv: Tensor, kt: Tensor, src: list[int], dst: list[int]) -> bool:
    """model.compact_kv's moves in one C call (eager CPU): KV slot src[i] -> dst[i] in every layer, and in the
    transposed keys; False where the C code is not built here (the caller moves them with torch). Why: the
    index_select / index_copy pair and the transposed keys' advanced indexing cost about 0.15 ms a tree step."""
    fn = cpu_gemm.c_function("compact_bf16") if cpu_gemm.kernel() is not None else None
    if fn is None:
        return False
    L, _, Hkv, S, hd = kv.shape
    assert kv.is_contiguous() and kv.dtype == torch.bfloat16 and (kt.numel() == 0 or kt.is_contiguous())
    sd = torch.tensor([src, dst], dtype=torch.int64)  # [2, n]: the sources, then the destinations
    has_kt = kt.numel() > 0
    c = cbuild.KVCache(kv.data_ptr(), kt.data_ptr() if has_kt else 0, L, Hkv, S, hd, kt.shape[2] if has_kt else 0)
    fn(cbuild.ptr(c), sd[0].data_ptr(), sd[1].data_ptr(), len(src))
    return True


def transposed_keys(kv: Tensor) -> Tensor:
    """kv [L, 2, Hkv, S, hd] bf16 -> its keys as stack_bf16's kt [L, Hkv, ceil(S / 16), hd / 2, 16] (int32 pairs of
    bf16), or an empty tensor where the pass does not read them (the AVX2 build; hd % 32 != 0). Why: attention's
    scores with the keys in the vector lanes need no horizontal sum per key (lanes512); kept next to the cache
    and written with each key (transposing per pass cost 2 ms at 1,200 keys, BENCHMARKS.md)."""
    L, _, Hkv, S, hd = kv.shape
    if cpu_gemm.ISA not in ("avx512bf16", "avx512") or hd % 32 or kv.dtype != torch.bfloat16:
        return kv.new_empty(0, dtype=torch.int32)
    nb = -(-S // 16)
    k = torch.zeros(L, Hkv, nb * 16, hd, dtype=kv.dtype, device=kv.device)
    k[:, :, :S] = kv[:, 0]
    return k.view(torch.int32).view(L, Hkv, nb, 16, hd // 2).transpose(3, 4).contiguous()


ENV = "NANOSPEC_CPU_FORWARD"  # on (default) | off: off keeps the PyTorch layers (with cpu_gemm's GEMMs)


def switched_on() -> bool:
    mode = os.environ.get(ENV, "on")
    if mode not in ("on", "off"):
        raise ValueError(f"{ENV} must be on or off, got {mode!r}")
    return mode == "on"


def fits_args(a) -> bool:
    """Model dims the C pass handles: no Qwen3 q/k norms, head_dim a multiple of 8 up to 256."""
    return (not a.qk_norm and a.head_dim % 8 == 0 and a.head_dim <= 256 and a.dim % 8 == 0
            and a.intermediate_size % 8 == 0 and a.n_heads % a.n_kv_heads == 0)


def fits(a, layers) -> bool:
    """Decoder layers the C pass can run now: fits_args, bf16 on the CPU, with cpu_gemm's packed linears (the
    process took the kernel), the C pass built here."""
    w = layers[0].mlp.down_proj
    return (fits_args(a) and w.weight.device.type == "cpu" and w.weight.dtype == torch.bfloat16
            and w.packed is not None and kernel() is not None)


# What a pass of so many rows is worth, in tokens, when the check below weighs a decode step against a tree
# verification: about the default drafter's mean accepted length at that budget on CPU (BENCHMARKS.md, Spec-Bench)
ROWS_WORTH = {1: 1.0, 4: 1.8, 16: 2.5}


def shape_key(a) -> str:
    """What a model's per-machine timings depend on besides the machine (cached answers are keyed by it), the
    C pass's source included."""
    return f"pass {TAG} L{a.n_layers} d{a.dim} h{a.n_heads}/{a.n_kv_heads}x{a.head_dim} i{a.intermediate_size} v{a.vocab_size}"


def attach(model):
    """Give a bf16 CPU model, whose GEMM cpu_gemm.choose has picked, its fastest pass on this machine, and pack
    its linears where the process takes cpu_gemm's kernel. The fused pass (its GEMMs are the kernel's) runs
    where it fits and either NANOSPEC_CPU_GEMM=kernel forces the kernel or, in auto mode, it beats the PyTorch
    layers with the GEMM their check chose: both timed on the model's own weights (fused_wins), once per
    machine and model shape. So a CPU whose torch GEMM wins at 16 rows (AMX) still gets the fused pass when
    its per-op savings weigh more."""
    gemm, layers_kernel = cpu_gemm.mode(), cpu_gemm.enabled()
    if not (switched_on() and gemm != "torch" and fits_args(model.args) and kernel() is not None):
        if layers_kernel:
            cpu_gemm.pack_linears(model)
        return
    cpu_gemm.switch(True)  # the fused pass's products are the kernel's: the process takes it (draft head too)
    cpu_gemm.pack_linears(model)
    packs = {m: m.packed for m in model.modules() if "packed" in m._buffers}
    stack = Stack(model.args, model.layers)
    key = (f"{cpu_gemm.machine_id()} fused pass {shape_key(model.args)} vs layers with "
           f"{'kernel' if layers_kernel else 'torch'} GEMM, worth {ROWS_WORTH}")
    if gemm == "auto" and not cpu_gemm.cached(key, lambda: fused_wins(model, stack, packs, layers_kernel)):
        cpu_gemm.switch(layers_kernel)  # the PyTorch layers, with the GEMM cpu_gemm's check chose
        for m, p in packs.items():
            m.packed = p if layers_kernel else None
        return
    model.cpu_pass = stack


@torch.no_grad()
def fused_wins(model, stack: "Stack", packs: dict, layers_kernel: bool, reps: int = 3) -> bool:
    """Time the model's whole pass here at every ROWS_WORTH size (pass_seconds), fused and as PyTorch layers,
    alternating, medians of reps; True iff the fused pass's best worth per second beats the layers'. Leaves the
    model without caches or a fused pass."""
    ts = {f: {r: [] for r in ROWS_WORTH} for f in (True, False)}
    for _ in range(reps + 1):  # the first round warms up
        for fused in (True, False):
            cpu_gemm.switch(fused or layers_kernel)
            for m, p in packs.items():  # (the fused copies replaced some; the layers need them all)
                m.packed = p
            model.cpu_pass = stack if fused else None
            for r, t in pass_seconds(model, list(ROWS_WORTH), reps=1).items():
                ts[fused][r].append(t)
    model.cpu_pass = None
    worth = {f: max(w / sorted(ts[f][r][1:])[reps // 2] for r, w in ROWS_WORTH.items()) for f in ts}
    return worth[True] > worth[False]


@torch.no_grad()
def pass_seconds(model, rows: list[int], reps: int = 3, ctx: int = 256) -> dict[int, float]:
    """{rows: median seconds} of the model's pass as it runs now (fused or PyTorch layers, its GEMM), at each
    row count, over a context of ctx keys, rows interleaved, medians of reps (one warm-up round first when
    reps > 1). Leaves the model without caches (its next setup_caches allocates them afresh)."""
    ctx = max(1, min(ctx, model.args.max_position_embeddings - max(rows)))
    tok = torch.randint(0, model.args.vocab_size, (1, max(rows)), generator=torch.Generator().manual_seed(0))
    model.max_batch = -1
    model.setup_caches(1, ctx + max(rows))
    ts = {r: [] for r in rows}
    for _ in range(reps + (reps > 1)):
        for r in rows:
            t0 = time.perf_counter()
            model(tok[:, :r], ctx + torch.arange(r))
            ts[r].append(time.perf_counter() - t0)
    model.kv, model.kt, model.max_batch, model.max_seq = None, None, -1, -1
    return {r: sorted(t[-reps:])[reps // 2] for r, t in ts.items()}


class Stack:
    """The packed, fused weights of decoder layers (a target's, or an EAGLE-3 head's one layer) and the
    pointer table the C pass reads. Holds the tensors it points at, so they live as long as the table."""

    def __init__(self, a, layers):
        self.args, self.L = a, len(layers)
        self.keep, rows = [], []
        for layer in layers:
            at, mlp = layer.self_attn, layer.mlp
            hid = getattr(layer, "hidden_norm", None)  # EAGLE-3: q/k/v read [norm(embedding); norm(hidden)]
            qkv = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]).detach()
            bias = torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]).detach() if a.qkv_bias else None
            gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            ts = [layer.input_layernorm.weight.detach(), cpu_gemm.pack(qkv), bias, pack_of(at.o_proj),
                  layer.post_attention_layernorm.weight.detach(), cpu_gemm.pack(gu), pack_of(mlp.down_proj),
                  None if hid is None else hid.weight.detach()]
            self.keep += [t for t in ts if t is not None]
            rows.append([0 if t is None else t.data_ptr() for t in ts])
            for lin in (at.q_proj, at.k_proj, at.v_proj, mlp.gate_proj, mlp.up_proj):
                lin.packed = None  # their products now come from the fused copies (the torch path uses F.linear)
        self.table = torch.tensor(rows, dtype=torch.int64)
        self.aux_of = {}  # aux layers -> [n_aux] the layer whose input each aux slot gets (built once per tuple)
        self.no_kt = torch.empty(0, dtype=torch.int32)  # no transposed keys: the scores read K

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache_pos: Tensor, kv: Tensor,
                 aux_layers: tuple[int, ...] = (), emb: Tensor | None = None, kt: Tensor | None = None,
                 norm: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [T, D] bf16 (the embeddings; an EAGLE-3 head: its input features); cos, sin [T, hd] bf16; mask
        [T, S] bool; cache_pos [T] int64; kv [L, 2, Hkv, S, hd] bf16, written at cache_pos; aux_layers:
        layers whose inputs to return (repeats allowed); emb [T, D]: an EAGLE-3 head's token embeddings; kt:
        the cache's transposed keys (transposed_keys), written and read with kv, or None; norm [D]: the final
        RMSNorm's weight, applied to the output (as model.RMSNorm, in the pass's own arithmetic), or None
        -> (x after the layers (and the norm) [T, D], aux [T, len(aux_layers)*D])."""
        a, key = self.args, tuple(aux_layers)
        if key not in self.aux_of:
            self.aux_of[key] = torch.tensor(list(key) or [-1], dtype=torch.int64)
        if kt is None:
            kt = self.no_kt
        args = (x, emb, cos, sin, mask, cache_pos, kv, kt, self.table, self.aux_of[key], len(key), a.n_heads,
                a.intermediate_size, a.norm_eps, norm)
        return torch.ops.nanospec.cpu_stack(*args) if torch.compiler.is_compiling() else run(*args)


def pack_of(lin) -> Tensor:
    return lin.packed if lin.packed is not None else cpu_gemm.pack(lin.weight.detach())


def run(x: Tensor, emb: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor, cache_pos: Tensor, kv: Tensor,
        kt: Tensor, table: Tensor, aux_of: Tensor, n_aux: int, n_heads: int, inter: int, eps: float,
        norm: Tensor | None = None) -> tuple[Tensor, Tensor]:
    T, D = x.shape
    L, _, Hkv, S, hd = kv.shape
    assert kv.is_contiguous() and mask.shape == (T, S) and hd % 8 == 0 and hd <= 256 and table.shape[0] == L
    assert kt.numel() == 0 or (kt.is_contiguous() and kt.shape == (L, Hkv, -(-S // 16), hd // 2, 16))
    x = x.contiguous().clone()  # the kernel works in place
    aux = x.new_empty(T, max(n_aux, 1) * D)
    # contiguous copies bound to names: they must outlive the call
    m = mask.contiguous().view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
    cos, sin, pos = cos.contiguous(), sin.contiguous(), cache_pos.to(torch.int64).contiguous()
    e = None if emb is None else emb.contiguous()
    a = cbuild.StackArgs(table.data_ptr(), L, D, n_heads, Hkv, hd, inter, eps, T, S, x.data_ptr(),
                         0 if e is None else e.data_ptr(), cos.data_ptr(), sin.data_ptr(), m.data_ptr(), pos.data_ptr(),
                         kv.data_ptr(), kt.data_ptr() if kt.numel() else 0, aux_of.data_ptr(), n_aux, aux.data_ptr(),
                         0 if norm is None else norm.data_ptr(), torch.get_num_threads())
    kernel()(cbuild.ptr(a))
    return x, aux


@torch.library.custom_op("nanospec::cpu_stack", mutates_args=("kv", "kt"))
def cpu_stack_op(x: Tensor, emb: Tensor | None, cos: Tensor, sin: Tensor, mask: Tensor, cache_pos: Tensor, kv: Tensor,
                 kt: Tensor, table: Tensor, aux_of: Tensor, n_aux: int, n_heads: int, inter: int, eps: float,
                 norm: Tensor | None) -> tuple[Tensor, Tensor]:
    return run(x, emb, cos, sin, mask, cache_pos, kv, kt, table, aux_of, n_aux, n_heads, inter, eps, norm)


@cpu_stack_op.register_fake
def _(x, emb, cos, sin, mask, cache_pos, kv, kt, table, aux_of, n_aux, n_heads, inter, eps, norm):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], max(n_aux, 1) * x.shape[1])
