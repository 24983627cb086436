"""Tensor parallelism over torch.distributed, applied to a loaded Transformer from outside (gpt-fast's tp.py):

    torchrun --nproc_per_node 2 generate.py --prompt "..."      # rank 0 prints; gloo on CPU, NCCL on CUDA

Every linear layer of the decoder is split by its output rows: each rank computes its slice of the outputs from the
whole input, and the slices are gathered (all_gather) before the next operation, which every rank then runs on the
whole tensor (norms, RoPE, attention, the residual adds, the LM head: replicated). Why every layer column-parallel:
an output element is one rank's whole dot product, summed in the order one process sums it, so a TP run
gives one process's logits bit for bit. Megatron's layout (o_proj and down_proj split by input rows, their partial
sums all-reduced) sums each output across ranks in another order.

--no-exact (shard(exact=False)) on the PyTorch layers takes that layout where a block allows it (summed()): q, k, v
and gate, up split by output rows, each rank its heads (its key/value heads' cache) and its columns of the MLP, and
o_proj, down_proj by input columns, their partial products summed (all_reduce, fp32): 2 collectives a layer
instead of 4 (TP 2 on a 2-core Zen 4 over gloo: 1.11x the exact layout's AR tok/s on those layers, 1.29x with the
default drafter). A block with quantized weights, or heads its ranks do not divide, keeps the gathers.

Where one process runs the fused CPU pass (every layer in one C call, cpu_forward.py), so do the ranks, in the exact
layout with or without --no-exact: the pass's four GEMMs a layer read this rank's rows (q | k | v and gate | up fused
from its slices), and its thread 0 calls back into Python between them for the all_gather (FusedGather), so a TP run
gives one process's output whichever pass that process takes (and the fused pass's gathers beat the all-reduce
layout on the layers: 11.5 against 7.5 tok/s AR, 13.5 against 11.9 with the default drafter, same machine).
Drafters are replicated: every rank drafts the same tree from the same inputs with no communication, and the budget's
choice of size and source (timed on each rank) is rank 0's, broadcast every step (sync_budget), at batch 1 and in
the batch engine. serve.py under a launcher: rank 0 serves HTTP and shares each turn of its engine loop; the other
ranks follow it (serve_loop.follow).
"""
import atexit
import ctypes
import datetime
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor, nn

import cbuild
import cpu_forward
import cpu_gemm
import qlinear
from budget import Budgets
from budget_batch import BatchBudget
from errors import UsageError
from model import Linear, Transformer

# the decoder's linear layers, grouped by the input they read: a group's slices travel in one all_gather
GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


# the all-reduce layout (--no-exact): per block, the linears split by output rows, then the one split by input columns
SUMMED = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def device() -> str:
    """Where collectives' own tensors live: NCCL moves CUDA tensors only."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world() > 1 else 0


def launched() -> bool:
    """Started by torchrun (or another launcher that sets WORLD_SIZE) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(device: str = "cpu") -> int:
    """Join the launcher's process group (gloo on CPU, NCCL on CUDA, each rank its local GPU); other ranks than 0
    print nothing. -> the world size."""
    if not launched():
        return 1
    if not dist.is_initialized():
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(close)
    if rank() != 0:
        sys.stdout = sys.stderr = open(os.devnull, "w")
    return world()


def close():
    """Leave the group at exit: every rank at a barrier first, then each closes its connections. Why: a rank that
    closed while the other still read its last message made both abort at exit ("terminate called without an
    active exception", 3 of 8 two-rank runs of generate.py); a rank that failed alone lets the barrier time out."""
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30)) if device() == "cpu" else dist.barrier()
    except RuntimeError:
        pass
    finally:
        dist.destroy_process_group()


class Gathered(nn.Module):
    """A linear layer's slice of output rows on this rank; forward returns every rank's slice, in rank order. The
    linears of a group read one input (q | k | v, gate | up): the first one called computes the group's slices and
    gathers them in one all_gather (4 a layer instead of 7), the others take theirs."""

    def __init__(self, part: nn.Module, n: int, group: "Group"):
        super().__init__()
        self.part, self.out_features, self.group, self.index = part, n, group, len(group.members)
        group.members.append(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.group.output(self.index, x)


class Summed(nn.Module):
    """A linear layer's slice of input columns on this rank (a row-parallel layer): forward sums every rank's
    partial products of its slice of the input, in fp32, then adds the bias."""

    def __init__(self, part: nn.Module, n: int, bias: Tensor | None):
        super().__init__()
        self.part, self.out_features, self.bias = part, n, bias

    def forward(self, x: Tensor) -> Tensor:
        y = self.part(x).float()
        dist.all_reduce(y)
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


class Group:
    """A layer's Gathered linears that read one input, and what they gathered for it until each took its part."""

    def __init__(self):
        self.members, self.x, self.out = [], None, []

    def output(self, i: int, x: Tensor) -> Tensor:
        if self.x is not x or self.out[i] is None:  # a new input: every member's slice, gathered together
            ys = [m.part(x).contiguous() for m in self.members]
            row = torch.cat([y.view(torch.uint8) for y in ys], -1)  # the bits as bytes: any dtype (gloo: no int16)
            every = [torch.empty_like(row) for _ in range(world())]
            dist.all_gather(every, row)
            widths = [y.view(torch.uint8).shape[-1] for y in ys]
            ends = [sum(widths[:j + 1]) for j in range(len(ys))]
            self.out = [torch.cat([e[..., end - w:end] for e in every], -1).view(y.dtype)
                        for y, w, end in zip(ys, widths, ends)]
            self.x = x
        out, self.out[i] = self.out[i], None  # (each member's output taken once: nothing kept past the layer)
        if all(o is None for o in self.out):
            self.x = None
        return out


class FusedGather:
    """The fused CPU pass's gathers (cpu_forward.Stack's gather): its GEMMs a layer (0 q | k | v, 1 o, 2 gate | up,
    3 down) each compute this rank's slices of their linears' rows, and the pass's thread 0 calls back here to
    all_gather every rank's into one process's column order. A callback's error is raised when the pass returns."""

    def __init__(self, a):
        w = world()
        Q, KV, D, I = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.dim, a.intermediate_size
        self.order = []  # per GEMM: one process's columns as places in the gathered row (rank-major, then member)
        for widths in ((Q, KV, KV), (D,), (I, I), (D,)):
            n = [x // w for x in widths]
            self.order.append(torch.tensor([r * sum(n) + sum(n[:j]) + i for j in range(len(n))
                                            for r in range(w) for i in range(n[j])]))
        self.fn, self.error = cbuild.GATHER(self.gather), None

    def gather(self, g: int, T: int, part: int, full: int):
        try:
            order = self.order[g]
            mine = floats(part, T * (len(order) // world())).view(T, -1)
            every = [torch.empty_like(mine) for _ in range(world())]
            dist.all_gather(every, mine)
            floats(full, T * len(order)).view(T, -1).copy_(torch.cat(every, -1)[:, order])
        except BaseException as e:  # (called from C: nothing can be raised through it)
            self.error = self.error or e

    def run(self, fused_pass, *args):
        self.error = None
        out = fused_pass(*args, gather=self.fn, tp=world())
        if self.error is not None:
            raise self.error
        return out


def floats(address: int, n: int) -> Tensor:
    """The n fp32 values at address as a tensor (no copy)."""
    return torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32)


def parts(layer: nn.Module) -> SimpleNamespace:
    """A decoder layer as cpu_forward.Stack reads it, its linears this rank's slices (Gathered's parts)."""
    ns, at, mlp = SimpleNamespace, layer.self_attn, layer.mlp
    return ns(self_attn=ns(**{k: getattr(at, k).part for k in ("q_proj", "k_proj", "v_proj", "o_proj")}),
              mlp=ns(**{k: getattr(mlp, k).part for k in ("gate_proj", "up_proj", "down_proj")}),
              input_layernorm=layer.input_layernorm, post_attention_layernorm=layer.post_attention_layernorm)


def split(m: nn.Module, name: str, r: int, w: int) -> nn.Module:
    """Rank r's rows of the linear layer m (one of w equal slices)."""
    q = isinstance(m, qlinear.QLinear)
    N, K = (m.out_features, m.in_features) if q else m.weight.shape
    if N % w:
        raise UsageError(f"tensor parallelism: {name} has {N} outputs, which {w} ranks do not divide")
    rows = slice(r * N // w, (r + 1) * N // w)
    bias = None if m.bias is None else m.bias.detach()[rows].clone()
    if q:  # its rows in the checkpoint's layout (codes with their scales and offsets), laid out for the kernel again
        if m.fast:
            raise UsageError(f"tensor parallelism: {name} is on the draft models' integer GEMM, not a target's")
        return qlinear.QLinear(m.rows().take(torch.arange(rows.start, rows.stop)), bias)
    part = Linear(K, N // w, bias=bias is not None, device="meta")
    part.weight = nn.Parameter(m.weight.detach()[rows].clone(), requires_grad=False)
    if bias is not None:
        part.bias = nn.Parameter(bias, requires_grad=False)
    return part


def split_in(m: nn.Module, name: str, r: int, w: int) -> nn.Module:
    """Rank r's input columns of the bf16 linear layer m, without its bias (Summed adds it once)."""
    N, K = m.weight.shape
    if K % w:
        raise UsageError(f"tensor parallelism: {name} has {K} inputs, which {w} ranks do not divide")
    part = Linear(K // w, N, bias=False, device="meta")
    part.weight = nn.Parameter(m.weight.detach()[:, r * K // w:(r + 1) * K // w].clone(), requires_grad=False)
    return part


def summed(block: nn.Module, w: int) -> bool:
    """Whether a block (attention, MLP) takes the all-reduce layout: bf16 linears, and heads its ranks divide."""
    if any(isinstance(m, qlinear.QLinear) for m in block.modules()):
        return False
    return not hasattr(block, "n_heads") or (block.n_heads % w == 0 and block.n_kv_heads % w == 0)


def shard(model: Transformer, exact: bool = True) -> Transformer:
    """Split every decoder linear layer of model across the process group's ranks (in place); the fused CPU pass
    where rank 0 has it, on the ranks' slices, in the exact layout (else the PyTorch layers). exact=False, on the
    PyTorch layers: the all-reduce layout where a block allows it (where the fused pass runs, its gathers are
    faster: bench_tp.py on a 2-core Zen 4, 11.5 against 7.5 tok/s AR). World size 1: model unchanged."""
    w, r = world(), rank()
    if w == 1:
        return model
    fused = broadcast_ints([int(model.cpu_pass is not None)])[0] == 1  # (each rank timed its own choice)
    exact = exact or fused
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        local = {name for name, block in (("self_attn", attn), ("mlp", mlp)) if not exact and summed(block, w)}
        if "self_attn" in local:  # this rank's heads: its query heads and the key/value heads they read
            attn.n_heads, attn.n_kv_heads = attn.n_heads // w, attn.n_kv_heads // w
        for owner in local:
            block, (*cols, row) = getattr(layer, owner), SUMMED[owner]
            for attr in cols:
                setattr(block, attr, split(getattr(block, attr), f"layers.{i}.{owner}.{attr}", r, w))
            m = getattr(block, row)
            bias = None if m.bias is None else m.bias.detach().clone()
            setattr(block, row, Summed(split_in(m, f"layers.{i}.{owner}.{row}", r, w), m.out_features, bias))
        for paths in (g for g in GROUPS if g[0].split(".")[0] not in local):
            group = Group()
            for path in paths:
                owner, attr = path.split(".")
                parent = getattr(layer, owner)
                m = getattr(parent, attr)
                setattr(parent, attr, Gathered(split(m, f"layers.{i}.{path}", r, w), m.out_features, group))
    model.cpu_pass, model.max_batch = None, -1  # (caches set up again: a rank's heads' keys and values only)
    if fused:
        cpu_gemm.switch(True)  # (as cpu_forward.attach: the process takes the kernel's products)
    cpu_gemm.pack_linears(model)  # every linear on the kernel, as one process's PyTorch layers run them
    if fused:  # (its fused copies of q | k | v and gate | up then serve those slices, as in one process)
        layers = [parts(layer) for layer in model.layers]
        model.cpu_pass = cpu_forward.Stack(model.args, layers, FusedGather(model.args))
    check_same(model)
    return model


def check_same(model: Transformer):
    """Every rank loaded the same model: a one-line error on every rank otherwise (a rank with other weights would
    gather slices of another function)."""
    a = model.args
    sig = torch.tensor([a.n_layers, a.dim, a.vocab_size, a.n_heads, a.n_kv_heads,
                        float(model.norm.weight.detach().float().sum())], dtype=torch.float64, device=device())
    every = [torch.empty_like(sig) for _ in range(world())]
    dist.all_gather(every, sig)
    if any(not torch.equal(x, every[0]) for x in every):
        raise UsageError("tensor parallelism: the ranks loaded different models")


def share(obj=None):
    """Rank 0's obj on every rank (pickled: serve_loop's engine events)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=torch.device(device()))
    return box[0]


def broadcast_ints(values: list[int]) -> list[int]:
    t = torch.tensor(values, dtype=torch.long, device=device())
    dist.broadcast(t, 0)
    return t.tolist()


def sync_budget():
    """The budgets return rank 0's sizes and sources on every rank: each rank times its own steps, and ranks that
    drafted different trees would gather slices of different passes. Budgets.pick (one sequence) and
    BatchBudget.choose (a batch's), each after its own choice, take rank 0's."""
    if world() == 1 or getattr(Budgets.pick, "tp_synced", False):
        return
    pick, choose = Budgets.pick, BatchBudget.choose

    def synced_pick(self, keys, left: float = float("inf")) -> int:
        b = pick(self, keys, left)
        keys = [keys] if isinstance(keys, str) else list(keys)
        b, k, chosen = broadcast_ints([b, keys.index(self.key), int(self.chosen is not None)])
        self.key = keys[k]
        self.budget(self.key)  # (rank 0's source, its Budget made here where this rank had not drafted it)
        self.chosen = self.key if chosen else None
        return b

    def synced_choose(self, seqs: list, key_of) -> list[int]:
        sizes = choose(self, seqs, key_of)
        offered = [[k] if isinstance(k, str) else list(k) for k in map(key_of, seqs)]
        mine = [x for s, keys in zip(seqs, offered) for x in (keys.index(s.key), int(s.chosen is not None))]
        got = broadcast_ints(sizes + mine)
        for i, (s, keys) in enumerate(zip(seqs, offered)):
            k, chosen = got[len(seqs) + 2 * i: len(seqs) + 2 * i + 2]
            s.key = keys[k]
            s.chosen = s.key if chosen else None
        return got[:len(seqs)]

    synced_pick.tp_synced = True
    Budgets.pick, BatchBudget.choose = synced_pick, synced_choose
