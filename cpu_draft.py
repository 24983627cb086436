"""An EAGLE-3 head's whole EAGLE-2 tree search in one C call on a bf16 CPU (EagleDrafter.draft's loop), csrc/draft.c.

Why: on CPU a drafting level through PyTorch's eager ops costs ~30 small ops (masks, top-k, gathers, one-hot
ancestor rows) around a head layer that the C pass runs in ~0.1 ms; a 16-node draft took ~2.3 ms of a ~7 ms
decode step (BENCHMARKS.md). Here every level (the head layer, its norm, the LM head over the draft
vocabulary's packed rows, log-softmax, top-k, the frontier's choice and its ancestor mask) and the final
rerank run in C, reusing cpu_forward's layer pass and cpu_gemm's GEMM.

The same search as the PyTorch loop, step for step, with one fixed tie order (the lower index first, where
torch.topk leaves ties unordered); sums run in other orders, so scores agree to float rounding. Whatever the
tree, the target verifies it: output is unchanged (the drafter only decides what gets verified).
"""
import os

import torch
from torch import Tensor

import cbuild
import cpu_forward
import cpu_gemm


def _c(name: str):
    """csrc/draft.c's entry point `name`, or None where cpu_forward's pass cannot be built here."""
    return cpu_gemm.c_function(name) if cpu_forward.kernel() is not None else None


def kernel():
    """The tree search's C function, or None where cpu_forward's pass cannot be built here."""
    return _c("eagle_tree_bf16")


def topk_kernel():
    return _c("topk_rows_bf16")


def append_kernel():
    return _c("nanospec_append")


def metrics_kernel():
    return _c("nanospec_metrics")


def update_kernel():
    return _c("eagle_update_bf16")


def head_args(drafter) -> cbuild.Head:
    """The C view of the drafter's head layer (csrc/nanospec.h's Head)."""
    h = drafter.head
    a = h.c.args
    return cbuild.Head(h.cpu_pass.table.data_ptr(), a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size,
                       h.kv.shape[3], a.norm_eps, h.kv.data_ptr(), h.embed_tokens.weight.data_ptr(),
                       h.rope_cos.data_ptr(), h.rope_sin.data_ptr())


ENV = "NANOSPEC_CPU_DRAFT"  # on (default) | off: off drafts with the PyTorch loop (tests and benches compare)


def switched_on() -> bool:
    mode = os.environ.get(ENV, "on")
    if mode not in ("on", "off"):
        raise ValueError(f"{ENV} must be on or off, got {mode!r}")
    return mode == "on"


def topk_rows(x: Tensor, rows: Tensor | None, k: int) -> Tensor:
    """[M, k] indices of the k largest entries of each row x[rows] (x [R, n]; rows None: every row):
    torch.topk(x[rows], k).indices, in C for bf16 CPU rows (ties then go to the lower index; torch leaves them
    unordered)."""
    if (torch.compiler.is_compiling() or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2
            or not 1 <= k <= min(64, x.shape[1]) or not x.is_contiguous() or not switched_on()
            or topk_kernel() is None):
        return torch.topk(x if rows is None else x.index_select(0, rows), k, dim=-1).indices
    rows = torch.arange(x.shape[0]) if rows is None else rows.to(torch.int64).contiguous()
    lo, hi = rows.aminmax()  # (the C loop reads rows unchecked)
    if int(lo) < 0 or int(hi) >= x.shape[0]:
        raise IndexError(f"row index out of range [0, {x.shape[0]})")
    out = torch.empty(rows.shape[0], k, dtype=torch.int64)
    topk_kernel()(x.data_ptr(), x.shape[1], rows.data_ptr(), rows.shape[0], k, out.data_ptr(), torch.get_num_threads())
    return out


def append(v, new: Tensor, valid: Tensor) -> bool:
    """NanoSpec's _append in C where it applies (CPU, cpu_gemm's row writer serves the vocabulary, eager, on);
    False where the caller's PyTorch version must run."""
    if (torch.compiler.is_compiling() or new.device.type != "cpu" or not v.c_rows or v.packed is None
            or not switched_on() or append_kernel() is None):
        return False
    new, valid = new.long().contiguous(), valid.to(torch.bool).contiguous()
    n = new.shape[0]
    cand, slot = torch.empty(2 * n, dtype=torch.int64), torch.empty(2 * n, dtype=torch.int64)
    flags = torch.empty(2 * n, dtype=torch.uint8)
    rows = cbuild.RowsDst(v.rows.data_ptr(), v.packed.data_ptr(), v.weight.data_ptr(), v.V, v.W, v.weight.shape[1],
                          cpu_gemm.PANEL, cpu_gemm.KB, cpu_gemm._SLOT.data_ptr())
    w = cbuild.Window(v.V, v.W, v.ring.data_ptr(), v.head.data_ptr(), v.count_.data_ptr(), v.slot_of_.data_ptr(),
                      v.token_of_.data_ptr(), v.winner.data_ptr(), v.fill_tok.data_ptr(), int(v.has_fill),
                      v.ids.data_ptr(), v.bias.data_ptr(), rows)
    append_kernel()(cbuild.ptr(w), new.data_ptr(), valid.data_ptr(), n, cand.data_ptr(), slot.data_ptr(),
                    flags.data_ptr())
    return True


def metrics(drafter, em: Tensor, ok: Tensor, L: Tensor) -> bool:
    """VocabDrafter.observe's metrics in C where they apply (a NanoSpec window on the CPU, eager, on): the
    emitted rows em [n] (ok [n]: in the draft vocabulary), the accepted length L (a CPU tensor: a memory
    read, not a sync); False where the caller's PyTorch version must run."""
    v, m = drafter.vocab, drafter.metrics
    if (torch.compiler.is_compiling() or not hasattr(v, "count_") or v.count_.device.type != "cpu"
            or not switched_on() or metrics_kernel() is None):
        return False
    em, ok = em.to(torch.int64).contiguous(), ok.to(torch.bool).contiguous()
    fs = getattr(v, "fill_slot_", None) if v.has_fill else None
    metrics_kernel()(em.data_ptr(), ok.data_ptr(), em.shape[0], int(L), v.V, v.W, v.count_.data_ptr(),
                     0 if fs is None else fs.data_ptr(), v.token_of_.data_ptr(), m.data_ptr())
    return True


def usable(drafter) -> bool:
    """The C search applies: an EAGLE-3 head on cpu_forward's pass, a vocabulary with cpu_gemm's packed rows
    (bf16 bias or none), eager mode, the kernel on, not switched off."""
    v, h = drafter.vocab, drafter.head
    if not switched_on():
        return False
    p, b = getattr(v, "packed", None), getattr(v, "bias", None)
    return (h.cpu_pass is not None and h.kv is not None and p is not None and cpu_gemm.enabled()
            and (b is None or b.dtype == torch.bfloat16) and v.ids.shape[0] >= drafter.topk
            and not torch.compiler.is_compiling() and kernel() is not None)


def update(drafter, a, nxt: Tensor) -> bool:
    """EagleDrafter.update's head pass over the accepted path in one C call (fc, the layer, the KV write), its
    output at the last accepted position into drafter.last_out and that output's final norm into
    drafter.last_lm_in; False where the caller's PyTorch pass must run
    (EAGLE-3 aux states not contiguous bf16, fc not packed). Reads n and L on the host (CPU tensors)."""
    h, aux = drafter.head, a.aux
    fc = h.fc
    if (aux is None or aux.dtype != torch.bfloat16 or not aux.is_contiguous() or fc.packed is None
            or (fc.bias is not None and fc.bias.dtype != torch.bfloat16) or update_kernel() is None):
        return False
    S, R, n, L = h.kv.shape[3], nxt.shape[0], int(a.n), int(a.L)
    path, nxt = a.path.to(torch.int64).contiguous(), nxt.to(torch.int64).contiguous()
    if n + R > S or not 1 <= L <= R or int(path.max()) >= aux.shape[1]:
        raise ValueError(f"accepted path of {R} past the head's cache ({S}) or the step's rows")
    u = cbuild.UpdateArgs(head_args(drafter), fc.packed.data_ptr(), 0 if fc.bias is None else fc.bias.data_ptr(),
                          aux.shape[2], aux.data_ptr(), path.data_ptr(), nxt.data_ptr(), R, n, L,
                          drafter.last_out.data_ptr(), h.norm.weight.data_ptr(), drafter.last_lm_in.data_ptr(),
                          torch.get_num_threads())
    update_kernel()(cbuild.ptr(u))
    return True


def tree(drafter, root: Tensor, n: Tensor, k: int, depth: int, nodes: int):
    """(tokens [N], parents [N], depth [N], anc [N, N] bool) of EagleDrafter.draft's search, in one C call.
    Reads n and root on the host: CPU tensors, so a memory read, not a device sync."""
    h, v = drafter.head, drafter.vocab
    v.wait()
    S = h.kv.shape[3]
    W = v.ids.shape[0]
    if int(n) + depth * k > S or k > W:
        raise ValueError(f"draft tree of {depth} x {k} slots past the head's cache ({S}) or window ({W})")
    tokens = torch.empty(nodes, dtype=torch.int64)
    parents, dep = torch.empty_like(tokens), torch.empty_like(tokens)
    anc = torch.empty(nodes, nodes, dtype=torch.bool)
    lm_s = torch.zeros(1, dtype=torch.float64)
    r2t = drafter.row_to_tok
    ids = v.ids if v.ids.dtype == torch.int64 else v.ids.long()
    b = getattr(v, "bias", None)
    t = cbuild.TreeArgs(head_args(drafter), h.norm.weight.data_ptr(), drafter.last_out.data_ptr(),
                        drafter.last_lm_in.data_ptr(), int(n), v.packed.data_ptr(), 0 if b is None else b.data_ptr(),
                        ids.data_ptr(), W, 0 if r2t is None else r2t.data_ptr(), k, depth, nodes, int(root),
                        tokens.data_ptr(), parents.data_ptr(), dep.data_ptr(), anc.data_ptr(), lm_s.data_ptr(),
                        torch.get_num_threads())
    kernel()(cbuild.ptr(t))
    drafter.lm_head_s += float(lm_s)
    return tokens, parents, dep, anc
