"""An EAGLE-3 head's whole EAGLE-2 tree search (EagleDrafter.draft's loop) in one C call on a bf16 CPU, csrc/draft.c.
Why: in eager PyTorch a drafting level costs ~30 small ops around a head layer the C pass runs in ~0.1 ms. The same
search, ties to the lower index, scores equal to float rounding; the target verifies whatever tree comes out."""

import torch
from torch import Tensor

import cbuild
import cpu_forward
import cpu_gemm


def _c(name: str):
    """csrc/draft.c's entry point `name`, or None where cpu_forward's pass cannot be built here."""
    return cpu_gemm.c_function(name) if cpu_forward.kernel() is not None else None


def kernel():
    return _c("eagle_tree_bf16")


def append_kernel():
    return _c("nanospec_append")


def head_args(drafter) -> cbuild.Head:
    """The C view of the drafter's head layer (csrc/nanospec.h's Head)."""
    h = drafter.head
    a = h.c.args
    return cbuild.Head(h.cpu_pass.table.data_ptr(), a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size,
                       h.kv.shape[3], a.norm_eps, h.kv.data_ptr(), h.embed_tokens.weight.data_ptr(),
                       h.rope_cos.data_ptr(), h.rope_sin.data_ptr())


ENV = "NANOSPEC_CPU_DRAFT"  # on (default) | off: the PyTorch loop


def switched_on() -> bool:
    return cbuild.env_choice(ENV, ("on", "off")) == "on"


def topk_rows(x: Tensor, rows: Tensor | None, k: int) -> Tensor:
    """torch.topk(x[rows], k).indices (rows None: every row), in C for bf16 CPU rows (ties to the lower index)."""
    if (torch.compiler.is_compiling() or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2
            or not 1 <= k <= min(64, x.shape[1]) or not x.is_contiguous() or not switched_on()
            or _c("topk_rows_bf16") is None):
        return torch.topk(x if rows is None else x.index_select(0, rows), k, dim=-1).indices
    rows = torch.arange(x.shape[0]) if rows is None else rows.to(torch.int64).contiguous()
    lo, hi = rows.aminmax()  # (the C loop reads rows unchecked)
    if int(lo) < 0 or int(hi) >= x.shape[0]:
        raise IndexError(f"row index out of range [0, {x.shape[0]})")
    out = torch.empty(rows.shape[0], k, dtype=torch.int64)
    _c("topk_rows_bf16")(x.data_ptr(), x.shape[1], rows.data_ptr(), rows.shape[0], k, out.data_ptr(),
                         torch.get_num_threads())
    return out


def append(v, new: Tensor, valid: Tensor) -> bool:
    """NanoSpec's _append in C where it applies (CPU, cpu_gemm's row writer, eager); else False."""
    if torch.compiler.is_compiling() or new.device.type != "cpu" or not switched_on() or append_kernel() is None:
        return False
    rows = v.rows_dst()
    if rows is None:
        return False
    new, valid = new.long().contiguous(), valid.to(torch.bool).contiguous()
    n = new.shape[0]
    cand, slot = torch.empty(2 * n, dtype=torch.int64), torch.empty(2 * n, dtype=torch.int64)
    flags = torch.empty(2 * n, dtype=torch.uint8)
    w = cbuild.Window(v.V, v.W, v.ring.data_ptr(), v.head.data_ptr(), v.count_.data_ptr(), v.slot_of_.data_ptr(),
                      v.token_of_.data_ptr(), v.winner.data_ptr(), v.fill_tok.data_ptr(),
                      v.fill_slot_.data_ptr() if v.has_fill else 0, int(v.has_fill), v.ids.data_ptr(),
                      v.bias.data_ptr(), rows)
    append_kernel()(cbuild.ptr(w), new.data_ptr(), valid.data_ptr(), n, cand.data_ptr(), slot.data_ptr(),
                    flags.data_ptr())
    return True


def metrics(drafter, em: Tensor, ok: Tensor, L: Tensor) -> bool:
    """VocabDrafter.observe's metrics (emitted rows em, ok, accepted length L) in C for a CPU NanoSpec window."""
    v, m = drafter.vocab, drafter.metrics
    if (torch.compiler.is_compiling() or not hasattr(v, "count_") or v.count_.device.type != "cpu"
            or not switched_on() or _c("nanospec_metrics") is None):
        return False
    em, ok = em.to(torch.int64).contiguous(), ok.to(torch.bool).contiguous()
    fs = getattr(v, "fill_slot_", None) if v.has_fill else None
    _c("nanospec_metrics")(em.data_ptr(), ok.data_ptr(), em.shape[0], int(L), v.V, v.W, v.count_.data_ptr(),
                           0 if fs is None else fs.data_ptr(), v.token_of_.data_ptr(), m.data_ptr())
    return True


def usable(drafter) -> bool:
    """The C search applies: a head on cpu_forward's pass, a vocabulary with packed rows (bf16 bias or none), eager."""
    v, h = drafter.vocab, drafter.head
    p, b = getattr(v, "packed", None), getattr(v, "bias", None)
    return (switched_on() and h.cpu_pass is not None and h.kv is not None and p is not None and cpu_gemm.enabled()
            and (b is None or b.dtype == torch.bfloat16) and v.ids.shape[0] >= drafter.topk
            and not torch.compiler.is_compiling() and kernel() is not None)


def update(drafter, a, nxt: Tensor) -> bool:
    """EagleDrafter.update's head pass over the accepted path in one C call (fc, the layer, the KV write) into
    drafter.last_out and last_lm_in; False where it does not apply (aux not contiguous bf16, fc not packed)."""
    h, aux, fc = drafter.head, a.aux, drafter.head.fc
    if (aux is None or aux.dtype != torch.bfloat16 or not aux.is_contiguous() or fc.packed is None
            or (fc.bias is not None and fc.bias.dtype != torch.bfloat16) or _c("eagle_update_bf16") is None):
        return False
    S, R, n, L = h.kv.shape[3], nxt.shape[0], int(a.n), int(a.L)
    path, nxt = a.path.to(torch.int64).contiguous(), nxt.to(torch.int64).contiguous()
    if n + R > S or not 1 <= L <= R or int(path.max()) >= aux.shape[1]:
        raise ValueError(f"accepted path of {R} past the head's cache ({S}) or the step's rows")
    u = cbuild.UpdateArgs(head_args(drafter), fc.packed.data_ptr(), 0 if fc.bias is None else fc.bias.data_ptr(),
                          aux.shape[2], aux.data_ptr(), path.data_ptr(), nxt.data_ptr(), R, n, L,
                          drafter.last_out.data_ptr(), h.norm.weight.data_ptr(), drafter.last_lm_in.data_ptr(),
                          torch.get_num_threads())
    _c("eagle_update_bf16")(cbuild.ptr(u))
    return True


def tree(drafter, root: Tensor, n: Tensor, k: int, depth: int, nodes: int):
    """(tokens [N], parents [N], depth [N], anc [N, N] bool) of EagleDrafter.draft's search, in one C call."""
    h, v = drafter.head, drafter.vocab
    v.wait()
    S, W = h.kv.shape[3], v.ids.shape[0]
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
