"""Weight-only quantization: int8 and int4 codes with fp16 scales (and offsets) per group of `group` consecutive k,
gpt-fast's int8 / int4 schemes and llama.cpp's Q8_0 / Q4_0 / Q4_1 in one form. A weight is

    bf16(code * scale + offset)      (fp32 products and sums, rounded to bf16 once, as torch's float -> bfloat16)

so a quantized model is the bf16 model whose weights are these values, and the CPU kernels (csrc/gemm*.h) widen
the codes in registers to exactly them: the GEMM stays row-invariant and its bits are the bf16 GEMM's on the
dequantized matrix. int8 is symmetric (no offsets: scale = max |w| / 127); int4 is asymmetric (codes 0..15,
scale = (max - min) / 15, offset = min), as Q4_1; Q4_0's w = d * (q - 8) is scale d, offset -8 d (exact in fp16).

Layouts. In memory and in a checkpoint (quantize.py writes `<linear>.qweight`, `.scales`, `.offsets`): codes int8
[N, K] (bits 8) or uint8 [N, K / 2] (bits 4: k = 2 j in byte j's low nibble, 2 j + 1 in its high one); scales
and offsets fp16 [N, K / group]. For the CPU kernel (pack_codes, pack_groups): codes in panels of cpu_gemm.PANEL
rows, per group of cpu_gemm.KB consecutive k the panel's rows in order (a row's KB codes side by side), int4 two
a byte (code j and j + QC of each run of 2 QC in byte j), scales [panels][K / group][PANEL] (csrc/nanospec.h's
Packed documents the same).
"""
import ctypes
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import cbuild
import cpu_gemm

CONFIG_KEY = "quantization_config"  # config.json's record of the scheme (Hugging Face's key)
METHOD = "nanospec"


class QuantError(ValueError):
    """A user-facing, one-line problem with a quantization request or a quantized checkpoint."""


@dataclass(frozen=True)
class Scheme:
    bits: int  # 8 or 4
    group: int  # k per scale (K: one scale per output row)

    def check(self, name: str, K: int):
        if self.bits not in (8, 4):
            raise QuantError(f"{name}: {self.bits}-bit weights are not supported (8 or 4)")
        if self.group <= 0 or K % self.group or self.group % 2:
            raise QuantError(f"{name}: group size {self.group} does not divide its input width {K} "
                             f"into even groups")


def quantize(w: Tensor, s: Scheme) -> tuple[Tensor, Tensor, Tensor | None]:
    """w [N, K] -> (codes, scales, offsets or None) in the memory layout; each code minimises its own error against
    the fp16 scale and offset it will be read with."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // s.group, s.group)
    if s.bits == 8:
        scale = (g.abs().amax(-1) / 127).half()
        sf = torch.where(scale == 0, 1.0, scale.float())
        codes = torch.round(g / sf[..., None]).clamp(-127, 127).to(torch.int8).reshape(N, K)
        return codes, scale, None
    lo, hi = g.amin(-1), g.amax(-1)
    scale, off = ((hi - lo) / 15).half(), lo.half()
    sf = torch.where(scale == 0, 1.0, scale.float())
    codes = torch.round((g - off.float()[..., None]) / sf[..., None]).clamp(0, 15).to(torch.uint8).reshape(N, K)
    return pack_nibbles(codes), scale, off


def pack_nibbles(codes: Tensor) -> Tensor:
    """[N, K] codes 0..15 -> [N, K / 2] bytes, k = 2 j low and 2 j + 1 high."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(b: Tensor) -> Tensor:
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1)


def codes_of(codes: Tensor, bits: int) -> Tensor:
    """The memory layout's codes as one value per weight [N, K] (int16: room for both ranges)."""
    return (unpack_nibbles(codes) if bits == 4 else codes).to(torch.int16)


def dequantize(codes: Tensor, scales: Tensor, offsets: Tensor | None, bits: int) -> Tensor:
    """The bf16 weights [N, K] the codes stand for: bf16(code * scale + offset), each op in fp32."""
    c = codes_of(codes, bits).float()
    G = c.shape[1] // scales.shape[1]
    w = c * scales.float().repeat_interleave(G, 1)
    if offsets is not None:
        w = w + offsets.float().repeat_interleave(G, 1)
    return w.bfloat16()


def qc() -> int:
    """Codes one widening fills in the CPU kernel (int4's nibble runs): 16 lanes with AVX-512, 8 with AVX2."""
    return 8 if cpu_gemm.ISA == "avx2" else 16


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Memory-layout codes [N, K] (or [N, K / 2]) -> the kernel's bytes [panels, K / KB, PANEL * KB * bits / 8]."""
    c = codes_of(codes, bits)
    N, K = c.shape
    P, PN, KB = -(-N // cpu_gemm.PANEL), cpu_gemm.PANEL, cpu_gemm.KB
    c = torch.cat([c, c.new_zeros(P * PN - N, K)]) if P * PN > N else c
    c = c.reshape(P, PN, K // KB, KB).permute(0, 2, 1, 3).reshape(P, K // KB, PN * KB)
    if bits == 8:
        return c.to(torch.int8).contiguous()
    q = qc()
    runs = c.to(torch.uint8).reshape(P, K // KB, PN * KB // (2 * q), 2, q)
    return (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(P, K // KB, PN * KB // 2).contiguous()


def unpack_codes(packed: Tensor, N: int, bits: int) -> Tensor:
    """pack_codes' inverse: the checkpoint layout's codes of the N rows a packed copy holds."""
    P, G, B = packed.shape
    PN, KB = cpu_gemm.PANEL, cpu_gemm.KB
    if bits == 4:
        q = qc()
        b = packed.reshape(P, G, PN * KB // (2 * q), q)
        c = torch.stack([b & 15, b >> 4], dim=3).reshape(P, G, PN * KB)
    else:
        c = packed
    c = c.reshape(P, G, PN, KB).permute(0, 2, 1, 3).reshape(P * PN, G * KB)[:N]
    return pack_nibbles(c) if bits == 4 else c.contiguous()


def unpack_groups(t: Tensor, N: int) -> Tensor:
    P, NG, PN = t.shape
    return t.transpose(1, 2).reshape(P * PN, NG)[:N].contiguous()


def pack_groups(t: Tensor) -> Tensor:
    """Scales or offsets [N, K / group] fp16 -> [panels, K / group, PANEL], zero rows padding the last panel."""
    N, NG = t.shape
    P = -(-N // cpu_gemm.PANEL)
    t = torch.cat([t, t.new_zeros(P * cpu_gemm.PANEL - N, NG)]) if P * cpu_gemm.PANEL > N else t
    return t.reshape(P, cpu_gemm.PANEL, NG).transpose(1, 2).contiguous()


class KernelWeight:
    """A matrix as the C GEMM reads it: the packed tensors and the Packed struct pointing at them (csrc/nanospec.h).
    bf16: KernelWeight(cpu_gemm.pack(W)); quantized: KernelWeight(pack_codes(..), pack_groups(s), pack_groups(m))."""

    def __init__(self, w: Tensor, s: Tensor | None = None, m: Tensor | None = None, bits: int = 16, group: int = 0):
        self.tensors = (w, s, m)  # the struct points into them: kept alive here
        self.bits, self.group = bits, group
        self.c = cbuild.Packed(w.data_ptr(), 0 if s is None else s.data_ptr(), 0 if m is None else m.data_ptr(),
                               bits, group)

    def address(self) -> int:
        return ctypes.addressof(self.c)


def kernel_weight(codes: Tensor, scales: Tensor, offsets: Tensor | None, bits: int) -> KernelWeight:
    group = codes.shape[1] * 8 // bits // scales.shape[1]
    return KernelWeight(pack_codes(codes, bits), pack_groups(scales),
                        None if offsets is None else pack_groups(offsets), bits, group)


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
            codes, s, m = quantize(torch.randn(N, K, generator=g), Scheme(bits, group))
            kw, tq = kernel_weight(codes, s, m, bits), to_torch_kernel(codes, s, m, bits)
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
    """(bits, group, offsets, N, K) of every quantized matrix in a checkpoint's tensors."""
    out = []
    for k, codes in sd.items():
        if k.endswith(".qweight"):
            base = k.removesuffix(".qweight")
            bits = 8 if codes.dtype == torch.int8 else 4
            K = codes.shape[1] * (2 if bits == 4 else 1)
            scales = sd.get(base + ".scales")
            if scales is not None and scales.dim() == 2 and scales.shape[1] and K % scales.shape[1] == 0:
                out.append((bits, K // scales.shape[1], base + ".offsets" in sd, codes.shape[0], K))
    return out


class QLinear(nn.Module):
    """A linear layer with quantized weights, held once: on a CPU with the C kernels in the kernel's layout (packed
    at load; its products row-invariant, the bf16 GEMM's bits on the dequantized weights), elsewhere (CUDA, no C
    compiler) in the checkpoint's, multiplied through the dequantized weights."""

    def __init__(self, codes: Tensor, scales: Tensor, offsets: Tensor | None, bits: int, bias: Tensor | None = None):
        super().__init__()
        self.bits = bits
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * (2 if bits == 4 else 1)
        self.group = self.in_features // scales.shape[1]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.kw: KernelWeight | None = None  # the C GEMM's view of the buffers, in the kernel's layout
        self.tq: tuple | None = None  # torch's packed weights and scales for its kernels, where it has one
        if (codes.device.type == "cpu" and _C[0] and cpu_gemm.mode() != "torch"
                and cpu_gemm.c_function("linear_packed") is not None):
            codes, scales = pack_codes(codes, bits), pack_groups(scales)
            offsets = None if offsets is None else pack_groups(offsets)
        elif torch_kernel_fits(bits, self.group, offsets is not None, self.out_features, self.in_features):
            self.tq = to_torch_kernel(codes, scales, offsets, bits)
            codes, scales, offsets = self.tq[0], self.tq[1], None  # (held once: the buffers are torch's tensors)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)
        if codes.dim() == 3:
            self.point()

    def point(self):
        """(Re)point the kernel at the buffers (after they were replaced by views of a fused copy)."""
        self.kw = KernelWeight(self.codes, self.scales, self.offsets, self.bits, self.group)

    def rows(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """(codes, scales, offsets) in the checkpoint's layout (not for torch's kernels' layouts)."""
        if self.kw is None:
            return self.codes, self.scales, self.offsets
        N = self.out_features
        return (unpack_codes(self.codes, N, self.bits), unpack_groups(self.scales, N),
                None if self.offsets is None else unpack_groups(self.offsets, N))

    @property
    def weight(self) -> Tensor:
        """The dequantized bf16 weights (a new [N, K] tensor each call: for checks, not for the forward); with torch's
        kernels, theirs: its product with the identity, one term per output."""
        if self.tq is not None:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.codes.device)
            return torch_kernel_linear(eye, self.tq, self.bits, self.group).T.contiguous()
        return dequantize(*self.rows(), self.bits)

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
        return f"{self.in_features}, {self.out_features}, int{self.bits}, group {self.group}"


def torch_kernel_fits(bits: int, group: int, offsets: bool, N: int, K: int) -> bool:
    """Whether torch has a kernel for this scheme (gpt-fast's): int8 per output channel, int4 in groups of 32-256
    with offsets (tinygemm; its CUDA layout wants K in 32s and N in 8s)."""
    if bits == 8:
        return group == K and not offsets
    return offsets and group in (32, 64, 128, 256) and K % group == 0 and K % 32 == 0 and N % 8 == 0


def to_torch_kernel(codes: Tensor, scales: Tensor, offsets: Tensor | None, bits: int) -> tuple:
    """(weights, scales) in torch's layouts: int8 codes [N, K] and bf16 scales [N]; int4, tinygemm's packed
    codes and scales_and_zeros [K / group, N, 2] bf16, whose weight is (q - 8) scale + zero: zero = offset + 8 scale
    (rounded to bf16: torch's path is its own arithmetic, not the C kernel's bits)."""
    if bits == 8:  # (a fresh, aligned copy: torch's int8 kernel crashed on a safetensors buffer at offset 40 of 64)
        return codes.clone(), scales.view(-1).bfloat16()
    q = codes_of(codes, 4)
    sz = torch.stack([scales.float().T, (offsets.float() + 8 * scales.float()).T], dim=-1).bfloat16().contiguous()
    if codes.device.type == "cuda":  # gpt-fast's call: even k in the high nibble; inner k tiles as K allows
        tiles = next(t for t in (8, 4, 2) if q.shape[1] % (t * 16) == 0)
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
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
    every one fills whole panels, the panels are concatenated and each linear's buffers become views of them (one
    copy in memory); else the rows are packed again into a copy of their own."""
    if len({(m.bits, m.group, m.offsets is None) for m in layers}) != 1:
        raise QuantError("fused linears must share one quantization scheme: " + ", ".join(map(repr, layers)))
    m0 = layers[0]
    if any(m.tq is not None for m in layers):
        raise QuantError("the fused CPU pass reads the C kernel's layouts, not torch's")
    if all(m.kw is not None and m.out_features % cpu_gemm.PANEL == 0 for m in layers):
        c, s = torch.cat([m.codes for m in layers]), torch.cat([m.scales for m in layers])
        o = None if m0.offsets is None else torch.cat([m.offsets for m in layers])
        p = 0
        for m in layers:
            n = m.codes.shape[0]
            m.codes, m.scales = c[p:p + n], s[p:p + n]
            m.offsets = None if o is None else o[p:p + n]
            m.point()
            p += n
        return KernelWeight(c, s, o, m0.bits, m0.group)
    rows = [m.rows() for m in layers]
    return kernel_weight(torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows]),
                         None if m0.offsets is None else torch.cat([r[2] for r in rows]), m0.bits)


GGUF_TYPES = {"Q8_0": (34, 8), "Q4_0": (18, 4), "Q4_1": (20, 4)}  # bytes per block of 32 weights, bits


def from_gguf_blocks(raw, kind: str, K: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """A GGUF tensor's blocks as they are (raw [N, K / 32 * block bytes] uint8) -> (codes, scales, offsets) in the
    memory layout, group 32. Q8_0: fp16 d, 32 int8 q (w = d q). Q4_0: fp16 d, 16 bytes (w = d (q - 8), q of weight
    j and j + 16 in byte j's low and high nibble): scale d, offset -8 d (exact). Q4_1: fp16 d, fp16 m, 16 bytes
    (w = d q + m). The fp32 values are llama.cpp's and gguf's dequantization's exactly; dequantize() rounds them
    to bf16 once."""
    nbytes, bits = GGUF_TYPES[kind]
    b = torch.from_numpy(raw.copy()).view(torch.uint8)
    N = b.shape[0]
    b = b.reshape(N, K // 32, nbytes)
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if kind == "Q8_0":
        return b[..., 2:].contiguous().view(torch.int8).reshape(N, K), d.contiguous(), None
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0] if kind == "Q4_1" else (d.float() * -8).half()
    qs = b[..., nbytes - 16:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(N, K)  # weight j low, j + 16 high, per block
    return pack_nibbles(codes), d.contiguous(), m.contiguous()


def config_record(mode: str, bits: int, group: int, lm_head: dict) -> dict:
    return {"quant_method": METHOD, "mode": mode, "bits": bits, "group_size": group, "lm_head": lm_head}


def read_record(cfg: dict) -> dict | None:
    """config.json's quantization record, or None for a bf16 checkpoint; other methods are refused."""
    r = cfg.get(CONFIG_KEY)
    if r is None:
        return None
    if r.get("quant_method") != METHOD:
        raise QuantError(f"quantization method {r.get('quant_method')!r} is not supported (quantize.py writes "
                         f"{METHOD!r})")
    return r


def swap_linears(model: nn.Module, sd: dict, where: str) -> int:
    """Replace each Linear whose `<name>.qweight` is in sd by a QLinear of sd's tensors (popped); how many."""
    n = 0
    for name, mod in list(model.named_modules()):
        if f"{name}.qweight" not in sd:
            continue
        codes, scales = sd.pop(f"{name}.qweight"), sd.pop(f"{name}.scales", None)
        offsets = sd.pop(f"{name}.offsets", None)
        if scales is None:
            raise QuantError(f"{where}: {name} has quantized weights but no {name}.scales")
        bits = 8 if codes.dtype == torch.int8 else 4
        N, K = mod.out_features, mod.in_features
        if bits == 4 and offsets is None:
            raise QuantError(f"{where}: {name} has int4 weights but no {name}.offsets")
        if codes.shape != (N, K if bits == 8 else K // 2) or scales.dim() != 2 or scales.shape[0] != N \
                or K % scales.shape[1] or (offsets is not None and offsets.shape != scales.shape):
            raise QuantError(f"{where}: {name}'s quantized tensors have shapes {tuple(codes.shape)}, "
                             f"{tuple(scales.shape)}, not those of a [{N}, {K}] weight")
        bias = sd.pop(f"{name}.bias", None)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], QLinear(codes, scales.half(), None if offsets is None else
                                                         offsets.half(), bits, bias))
        n += 1
    return n


def weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights (parameters and quantized buffers; storage shared by ties and views
    counted once)."""
    seen, n = set(), 0
    for t in list(model.parameters()) + [b for m in model.modules() if isinstance(m, QLinear)
                                          for b in (m.codes, m.scales, m.offsets) if b is not None]:
        st = t.untyped_storage()
        if t.device.type != "meta" and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n
