"""Quantized layers on the CPU kernels: `KernelWeight` (a matrix as the C GEMM reads it), `QLinear` and
`QEmbedding` (a checkpoint's quantized matrices held once, in the kernel's layout where the C kernel serves, else in
torch's), the machine's choice between the C kernel and torch's, fusing linears for the fused pass, and the kernel
layout's cache beside a checkpoint. The formats and layouts themselves are quant.py's."""
import ctypes
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import cbuild
import cpu_gemm
from quant import (QuantError, QWeight, Scheme, fast_layout, from_fast, from_kernel, qc, quantize, to_kernel,
                   torch_kernel_fits, unpack_nibbles)

class KernelWeight:
    """A matrix as the C GEMM reads it: the packed tensors and the Packed struct pointing at them (csrc/nanospec.h).
    bf16: KernelWeight(cpu_gemm.pack(W)); quantized: KernelWeight.of(to_kernel(qw), K); several matrices' rows
    stacked: KernelWeight.stack(parts), each part's rows whole panels (q | k | v of different formats)."""

    def __init__(self, w: Tensor, s: Tensor | None = None, m: Tensor | None = None, bits: int = 16, group: int = 0,
                 *, high: Tensor | None = None, sc: Tensor | None = None, mn: Tensor | None = None, sup: int = 0,
                 zero: int = 0, fast: bool = False, keep: tuple = ()):
        self.tensors = (w, s, m, high, sc, mn, *keep)  # the struct points into them: kept alive here
        self.bits, self.group = bits, group
        ad = lambda t: 0 if t is None else t.data_ptr()
        self.c = cbuild.Packed(ad(w), ad(s), ad(m), bits, group, ad(high), ad(sc), ad(mn), sup, zero, 0, None,
                               int(fast))

    @classmethod
    def of(cls, kq: QWeight, K: int) -> "KernelWeight":
        """kq: to_kernel()'s layout of a [N, K] matrix."""
        group = K // (kq.scales if kq.subscales is None else kq.subscales).shape[1]
        sup = 0 if kq.subscales is None else K // kq.scales.shape[1]
        return cls(kq.codes, kq.scales, kq.offsets, kq.bits, group, high=kq.high, sc=kq.subscales, mn=kq.submins,
                   sup=sup, zero=kq.zero)

    @classmethod
    def stack(cls, parts: list["KernelWeight"], rows: list[int]) -> "KernelWeight":
        """One matrix of the parts' rows in order (rows[i]: part i's, whole panels but the last part's): copies of
        their structs chained (Packed.next), each with its first panel (p0)."""
        out = cls.__new__(cls)
        out.tensors, out.bits, out.group = tuple(parts), parts[0].bits, parts[0].group
        structs, p0 = [], 0
        for kw, n in zip(parts, rows):
            structs.append(cbuild.Packed.from_buffer_copy(kw.c))
            structs[-1].p0 = p0
            p0 += n // cpu_gemm.PANEL
        for a, b in zip(structs, structs[1:]):
            a.next = ctypes.pointer(b)
        out.chain, out.c = structs, structs[0]
        return out

    def address(self) -> int:
        return ctypes.addressof(self.c)


def kernel_linear(x: Tensor, kw: KernelWeight, N: int, b: Tensor | None = None) -> Tensor:
    """x [..., K] bf16 @ W.T (+ b) -> [..., N] bf16 through the C GEMM, W as kw holds it."""
    return _linear_at(x, kw.address(), N, b)


def _linear_at(x: Tensor, address: int, N: int, b: Tensor | None = None) -> Tensor:
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.bfloat16)
    xf = torch.empty(x2.shape[0], K) if cpu_gemm.KB == 1 else None  # the FMA kernels widen x into it
    cpu_gemm.c_function("linear_packed")(x2.data_ptr(), 0 if xf is None else xf.data_ptr(), x2.shape[0], K,
                                         address, 0 if b is None else b.data_ptr(), N, y.data_ptr(),
                                         torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


linear_packed_op = torch.library.custom_op("nanospec::linear_packed", _linear_at, mutates_args=())


@linear_packed_op.register_fake
def _(x, address, N, b=None):
    return x.new_empty(*x.shape[:-1], N)


_C = [True]  # whether the C kernel serves quantized products on this CPU (choose(); a list: tests switch it)


def choose(schemes: list[tuple[int, int, bool, int, int]], rows=(1, 16), reps: int = 5) -> bool:
    """Whether the C kernel serves quantized products here, for a model of these (bits, group, offsets, N, K):
    NANOSPEC_CPU_GEMM=kernel or torch decides, else it must beat torch's kernels (gpt-fast's, where torch has one
    for the scheme) on a pass through the shapes at every row count, timed once per machine (cached). Only the C
    kernel's products are row-invariant, and only its layout feeds the fused pass."""
    mode = cpu_gemm.mode()
    if cpu_gemm.c_function("linear_packed") is None or mode == "torch":
        on = False
    elif mode == "kernel":
        on = True
    else:
        fits = sorted(s for s in set(schemes) if torch_kernel_fits(s[0], s[1], s[2], s[3], s[4]))
        counts = {s: schemes.count(s) for s in fits}
        on = not fits or cpu_gemm.cached(f"{cpu_gemm.machine_id()} quantized {counts} rows {list(rows)}",
                                         lambda: _c_faster(counts, rows, reps))
    _C[0] = on
    return on


def _c_faster(counts: dict, rows, reps: int) -> bool:
    g = torch.Generator().manual_seed(0)
    for r in rows:
        total = {"c": 0.0, "torch": 0.0}
        for (bits, group, _, N, K), c in counts.items():
            qw = quantize(torch.randn(N, K, generator=g), Scheme(bits, group))
            kw, tq = KernelWeight.of(to_kernel(qw), K), to_torch_kernel(qw)
            x = torch.randn(r, K, generator=g).bfloat16()
            fns = {"c": lambda: kernel_linear(x, kw, N), "torch": lambda: torch_kernel_linear(x, tq, bits, group)}
            ts = {k: [] for k in fns}
            for _ in range(reps + 1):  # alternating; the first round warms up
                for k, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    ts[k].append(time.perf_counter() - t0)
            for k in total:
                total[k] += c * sorted(ts[k][1:])[reps // 2]
        if total["c"] >= total["torch"]:
            return False
    return True


def schemes_of(sd: dict) -> list[tuple[int, int, bool, int, int]]:
    """(bits, group, offsets, N, K) of every quantized matrix in a checkpoint's tensors that torch has a kernel for
    (the others take the C kernel whatever choose() finds)."""
    out = []
    for k, codes in sd.items():
        if k.endswith(".qweight"):
            base = k.removesuffix(".qweight")
            if any(base + s in sd for s in (".qhigh", ".subscales", ".qzero")):
                continue
            bits = 8 if codes.dtype == torch.int8 else 4
            K = codes.shape[1] * (2 if bits == 4 else 1)
            scales = sd.get(base + ".scales")
            if scales is not None and scales.dim() == 2 and scales.shape[1] and K % scales.shape[1] == 0:
                out.append((bits, K // scales.shape[1], base + ".offsets" in sd, codes.shape[0], K))
    return out


class QLinear(nn.Module):
    """A linear layer with quantized weights, held once: on a CPU with the C kernels in the kernel's layout (packed
    at load; its products row-invariant, the bf16 GEMM's bits on the dequantized weights), elsewhere (CUDA, no C
    compiler) in the checkpoint's, multiplied through torch's kernel for the scheme or the dequantized weights."""

    def __init__(self, qw: QWeight, bias: Tensor | None = None, kernel: QWeight | None = None, fast: bool = False):
        """kernel: qw already in the kernel's layout (read_kernel_cache), used as it is where the C kernel serves;
        fast: kernel is fast_layout's (the draft models' integer GEMM)."""
        super().__init__()
        self.bits, self.zero = qw.bits, qw.zero
        self.out_features, self.in_features, self.group = qw.N, qw.K, qw.group
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kw: KernelWeight | None = None  # the C GEMM's view of the buffers, in the kernel's layout
        self.tq: tuple | None = None  # torch's packed weights and scales for its kernels, where it has one
        self.wide: Tensor | None = None  # the dequantized weights, where neither kernel serves (CUDA K-quants)
        self.fast = False  # csrc/gemm_fast.h's layout (make_fast: draft models)
        if (qw.codes.device.type == "cpu" and _C[0] and cpu_gemm.mode() != "torch"
                and cpu_gemm.c_function("linear_packed") is not None):
            qw = to_kernel(qw) if kernel is None else kernel
        elif qw.torch_fits():
            self.tq = to_torch_kernel(qw)
            qw = QWeight(self.tq[0], self.tq[1], bits=qw.bits)  # (held once: the buffers are torch's tensors)
        else:
            self.wide = qw.dequantize()
        for name in ("codes", "scales", "offsets", "high", "subscales", "submins"):
            self.register_buffer(name, getattr(qw, name))
        if fast and kernel is not None and self.tq is None and self.wide is None:
            self.set_fast(kernel)
        elif self.codes.dim() == 3:
            self.point()

    def qweight(self) -> QWeight:
        """The buffers as a QWeight (the kernel's layout where packed)."""
        return QWeight(self.codes, self.scales, self.offsets, self.bits, self.high, self.subscales, self.submins,
                       self.zero)

    def point(self):
        """(Re)point the kernel at the buffers (after they were replaced by views of a fused copy)."""
        self.kw = KernelWeight.of(self.qweight(), self.in_features)
        if self.fast:
            self.kw = KernelWeight(self.codes, self.scales, self.offsets, 4, 32, fast=True)

    def make_fast(self, requantize: bool = False) -> bool:
        """Switch to the draft models' integer GEMM where it applies (fast_layout); requantize: other formats (a
        GGUF's Q5_0, Q6_K, Q8_0) quantized again to 4 bits in groups of 32 first. Whether it did."""
        if self.kw is None or self.fast:
            return self.fast
        qw = self.rows()
        fl = fast_layout(qw)
        if fl is None and requantize and cpu_gemm.VNNI and self.in_features % 32 == 0:
            fl = fast_layout(quantize(qw.dequantize().float(), Scheme(4, 32)))
        if fl is None:
            return False
        self.set_fast(fl)
        return True

    def set_fast(self, fl: QWeight):
        """Take fast_layout's tensors as the buffers."""
        self.fast, self.bits, self.zero, self.group = True, 4, 0, 32
        for name in ("codes", "scales", "offsets", "high", "subscales", "submins"):
            setattr(self, name, getattr(fl, name))
        self.point()

    def rows(self) -> QWeight:
        """The matrix in the checkpoint's layout (not for torch's kernels' layouts)."""
        if self.fast:
            return from_fast(self.qweight(), self.out_features)
        return self.qweight() if self.kw is None else from_kernel(self.qweight(), self.out_features)

    @property
    def weight(self) -> Tensor:
        """The dequantized bf16 weights (a new [N, K] tensor each call: for checks, not for the forward); with torch's
        kernels, theirs: its product with the identity, one term per output."""
        if self.wide is not None:
            return self.wide
        if self.tq is not None:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.codes.device)
            return torch_kernel_linear(eye, self.tq, self.bits, self.group).T.contiguous()
        return self.rows().dequantize()

    def forward(self, x: Tensor) -> Tensor:
        if self.kw is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16:
            b = None if self.bias is None else self.bias.to(torch.bfloat16)
            if torch.compiler.is_compiling():
                return torch.ops.nanospec.linear_packed(x, self.kw.address(), self.out_features, b)
            return kernel_linear(x, self.kw, self.out_features, b)
        if self.tq is not None:
            y = torch_kernel_linear(x, self.tq, self.bits, self.group)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return F.linear(x, self.weight.to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        levels = f", super-blocks of {self.in_features // self.scales.shape[-2 if self.kw else 1]}" \
            if self.subscales is not None else ""
        return f"{self.in_features}, {self.out_features}, {self.bits} bits, group {self.group}{levels}"


class QEmbedding(nn.Module):
    """An embedding whose rows stay quantized (a GGUF's token_embd as it is): a lookup dequantizes the rows it
    reads, the same values as the widened matrix's (a 151,936 x 1,536 Q4_K table: 131 MB, against 467 MB in bf16)."""

    def __init__(self, qw: QWeight, dtype=torch.bfloat16):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype, self.bits, self.zero = qw.N, qw.K, dtype, qw.bits, qw.zero
        for name in ("codes", "scales", "offsets", "high", "subscales", "submins"):
            self.register_buffer(name, getattr(qw, name))

    def qweight(self) -> QWeight:
        return QWeight(self.codes, self.scales, self.offsets, self.bits, self.high, self.subscales, self.submins,
                       self.zero)

    @property
    def weight(self) -> Tensor:
        """The whole dequantized table (a new tensor each call: for checks and rare whole-table readers)."""
        return self.qweight().dequantize().to(self.dtype)

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self.qweight().take(tokens.reshape(-1)).dequantize().to(self.dtype)
        return rows.view(*tokens.shape, self.embedding_dim)


def to_torch_kernel(qw: QWeight) -> tuple:
    """(weights, scales) in torch's layouts: int8 codes [N, K] and bf16 scales [N]; int4, tinygemm's packed
    codes and scales_and_zeros [K / group, N, 2] bf16, whose weight is (q - 8) scale + zero: zero = offset + 8 scale
    (rounded to bf16: torch's path is its own arithmetic, not the C kernel's bits)."""
    if qw.bits == 8:  # (a fresh, aligned copy: torch's int8 kernel crashed on a safetensors buffer at offset 40 of 64)
        return qw.codes.clone(), qw.scales.view(-1).bfloat16()
    q, s, o = unpack_nibbles(qw.codes).to(torch.int32), qw.scales.float(), qw.offsets.float()
    sz = torch.stack([s.T, (o + 8 * s).T], dim=-1).bfloat16().contiguous()
    if qw.codes.device.type == "cuda":  # gpt-fast's call: even k in the high nibble; inner k tiles as K allows
        tiles = next(t for t in (8, 4, 2) if q.shape[1] % (t * 16) == 0)
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return packed, sz


def torch_kernel_linear(x: Tensor, tq: tuple, bits: int, group: int) -> Tensor:
    w, s = tq[0], tq[1]
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    if bits == 8:
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x2, w, s)
        else:  # gpt-fast's int8 on CUDA: the codes widened in the GEMM, the scales after
            y = F.linear(x2, w.to(x2.dtype)) * s
    elif x.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w, group, s)
    else:
        y = torch.ops.aten._weight_int4pack_mm(x2, w, group, s)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def fuse(layers: list[QLinear]) -> KernelWeight:
    """One kernel matrix of several quantized linears' rows stacked (the fused pass's q | k | v, gate | up). Where
    every one but the last fills whole panels, their structs are chained (no copy; the formats may differ, as a
    Q4_K_M file's Q4_K q and k with a Q6_K v); else, in one scheme, the rows are packed again into a copy."""
    if any(m.kw is None for m in layers):
        raise QuantError("the fused CPU pass reads the C kernel's layouts, not torch's")
    if all(m.out_features % cpu_gemm.PANEL == 0 for m in layers[:-1]):
        return KernelWeight.stack([m.kw for m in layers], [m.out_features for m in layers])
    m0 = layers[0]
    if len({(m.bits, m.group, m.zero, m.offsets is None, m.subscales is None) for m in layers}) != 1:
        raise QuantError("fused linears whose rows fill no whole panels must share one quantization scheme: "
                         + ", ".join(map(repr, layers)))
    rows = [m.rows() for m in layers]
    cat = lambda name: None if getattr(rows[0], name) is None else torch.cat([getattr(r, name) for r in rows])
    qw = QWeight(cat("codes"), cat("scales"), cat("offsets"), m0.bits, cat("high"), cat("subscales"), cat("submins"),
                 m0.zero)
    return KernelWeight.of(to_kernel(qw), m0.in_features)


def swap_linears(model: nn.Module, sd: dict, where: str, packed: dict | None = None, fast: frozenset = frozenset()
                 ) -> int:
    """Replace each Linear whose `<name>.qweight` is in sd by a QLinear of sd's tensors (popped), and an embedding
    with quantized rows by a QEmbedding; how many. packed: read_kernel_cache()'s tensors, the kernel's layout of the
    same matrices (no packing at load); fast: the names of those in fast_layout's."""
    n = 0
    for name, mod in list(model.named_modules()):
        if f"{name}.qweight" not in sd:
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if isinstance(mod, nn.Embedding):
            new = QEmbedding(QWeight.pop(sd, name, where, mod.num_embeddings, mod.embedding_dim))
        else:
            qw = QWeight.pop(sd, name, where, mod.out_features, mod.in_features)
            kq = None
            if packed is not None and f"{name}.codes" in packed:
                get = lambda b: packed.get(f"{name}.{b}")
                kq = QWeight(get("codes"), get("scales"), get("offsets"), qw.bits, get("high"), get("subscales"),
                             get("submins"), qw.zero)
            new = QLinear(qw, sd.pop(f"{name}.bias", None), kq, name in fast and kq is not None)
        setattr(parent, name.rpartition(".")[2], new)
        n += 1
    return n


# the kernel's layout of a quantized checkpoint, saved beside it once per ISA: later loads map it as it is
# (the 1.5B Q4_K_M GGUF: 1 s and 1.1 GB resident, against 5 s and a 3.8 GB peak packing it at each load)
KERNEL_LAYOUT = "3"  # bump when pack_planes / pack_groups or what the file records change


def _kernel_cache(folder, files, fast: bool) -> tuple:
    from pathlib import Path
    key = " ".join([KERNEL_LAYOUT, cpu_gemm.ISA, str(cpu_gemm.PANEL), str(cpu_gemm.KB), str(qc()), str(fast)]
                   + [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files])
    return Path(folder) / f"kernel-{cpu_gemm.ISA}{'-fast' if fast else ''}.safetensors", key


def read_kernel_cache(folder, files, fast: bool = False) -> tuple[dict, frozenset] | None:
    """The kernel-layout tensors saved for these checkpoint files on this ISA, and the names of the linears among
    them in the draft models' layout (fast: a draft model's file, QLinear.make_fast, which some matrices or CPUs
    do not take), or None (none, or stale)."""
    f, key = _kernel_cache(folder, files, fast)
    try:
        tensors, meta = read_on_huge_pages(f)
    except Exception:  # absent, unreadable or cut short: pack at load as without it
        return None
    if meta.get("key") != key:
        return None
    return tensors, frozenset(meta.get("fast", "").split())


ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
             "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}


def huge_buffer(nbytes: int) -> Tensor:
    """A uint8 tensor over a new private anonymous buffer advised for 2 MiB pages where the OS gives them (before
    its first touch: its pages are made huge as they fault in). Why: a token's pass streams every weight, and
    weights on 4 KiB pages miss the TLB every 4 KiB: the 1.5B Q4_K_M pass ran 2.6% faster (29.91 -> 29.17 ms, Zen 4,
    8 alternations). (A shared mapping, mmap's default, gets no huge pages.)"""
    import mmap
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8)


def on_huge_pages(ts: list[Tensor]) -> list[Tensor]:
    """Copies of CPU tensors ts in one huge_buffer, each at a 64-byte boundary (weights that a pass streams)."""
    ends = [0]
    for t in ts:
        ends.append(ends[-1] + (t.numel() * t.element_size() + 63) // 64 * 64)
    buf = huge_buffer(ends[-1])
    out = []
    for t, a in zip(ts, ends):
        v = buf[a:a + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append(v.copy_(t))
    return out


def keep_kernel_layout(model: nn.Module, folder, files, fast: bool = False):
    """A first load's kernel layout: saved beside the checkpoint for later loads, and moved onto 2 MiB pages as they
    read it."""
    write_kernel_cache(model, folder, files, fast)
    to_huge_pages(model)


def to_huge_pages(model: nn.Module):
    """The quantized linears' kernel-layout buffers moved into one huge_buffer, as read_kernel_cache reads them at
    later loads (a first load packs them into ordinary allocations, on 4 KiB pages)."""
    mods = [m for m in model.modules() if isinstance(m, QLinear) and m.kw is not None]
    names = [(m, b) for m in mods for b, v in m.named_buffers(recurse=False) if v is not None and b != "bias"]
    for (m, b), v in zip(names, on_huge_pages([getattr(m, b) for m, b in names])):
        setattr(m, b, v)
    for m in mods:
        m.point()


def read_on_huge_pages(path) -> tuple[dict, dict]:
    """A safetensors file's tensors, read into one huge_buffer (not mapped from the file on 4 KiB pages), and its
    metadata."""
    import json
    import os
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        size = os.fstat(fh.fileno()).st_size - 8 - n
        data = huge_buffer(size)
        if fh.readinto(memoryview(data.numpy())[:size]) != size:
            raise ValueError(f"{path} is cut short")
    meta, out = header.pop("__metadata__", None) or {}, {}
    for k, v in header.items():
        a, b = v["data_offsets"]
        if not 0 <= a <= b <= size:
            raise ValueError(f"{path}: tensor {k} lies outside the file")
        out[k] = data[a:b].view(ST_DTYPES[v["dtype"]]).view(v["shape"])
    return out, meta


def write_kernel_cache(model: nn.Module, folder, files, fast: bool = False):
    """Save the model's quantized linears' kernel-layout buffers beside its checkpoint (atomic; skipped where the
    folder is read-only)."""
    import os
    import tempfile

    from safetensors.torch import save_file
    f, key = _kernel_cache(folder, files, fast)
    t = {f"{n}.{b}": v.contiguous() for n, m in model.named_modules() if isinstance(m, QLinear) and m.kw is not None
         for b, v in m.named_buffers(recurse=False) if v is not None and b != "bias"}
    if not t:
        return
    fast_names = " ".join(n for n, m in model.named_modules() if isinstance(m, QLinear) and m.kw is not None and m.fast)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kernel-", dir=f.parent)
        os.close(fd)
        save_file(t, tmp, metadata={"key": key, "fast": fast_names})
        os.chmod(tmp, 0o644)
        os.replace(tmp, f)
    except OSError:
        try:
            os.unlink(tmp)
        except (OSError, UnboundLocalError):
            pass


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights (parameters and quantized buffers; storage shared by ties and views
    counted once)."""
    seen, n = set(), 0
    qt = [b for m in model.modules() if isinstance(m, (QLinear, QEmbedding)) for b in m.buffers(recurse=False)]
    for t in list(model.parameters()) + qt:
        st = t.untyped_storage()
        if t.device.type != "meta" and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n
