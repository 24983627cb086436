"""Weight-only quantization: gpt-fast's int8 / int4 schemes and llama.cpp's GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1 and the K-quants Q4_K, Q5_K, Q6_K) in one form, `QWeight`. A weight is

    bf16((q - zero) * scale + offset)      (fp32 arithmetic, rounded to bf16 once, as torch's float -> bfloat16)

with q an unsigned 4-, 5-, 6- or signed 8-bit code, and per group of k either one fp16 scale (and offset) or, for
the K-quants, two levels: scale = d * sc and offset = -(dmin * m), d and dmin fp16 per super-block of 256 k, sc and m
small integers per group. Every product in that formula is exact in fp32 (at most 24 significant bits), so the only
rounding is the final add's (then bf16's): these are gguf's `dequantize` values exactly. A quantized model is the
bf16 model whose weights are these values, and the CPU kernels (csrc/gemm*.h) widen the codes in registers to
exactly them: the GEMM stays row-invariant and its bits are the bf16 GEMM's on the dequantized matrix.

Layouts. In memory and in a checkpoint (`<linear>.qweight`, `.qhigh`, `.scales`, `.offsets`, `.subscales`,
`.submins`, `.qzero`): codes int8 [N, K] (8 bits) or uint8 [N, K / 2] (k = 2 j in byte j's low nibble, 2 j + 1 in
its high one), 5- and 6-bit codes' high bits uint8 [N, K (bits - 4) / 8] (a row's as one little-endian bit string);
scales and offsets fp16 [N, K / group] (two levels: [N, K / 256], subscales and submins int8 [N, K / group]). For the
CPU kernel (qlinear.KernelWeight): panels of cpu_gemm.PANEL rows, per group of cpu_gemm.KB consecutive k the panel's
rows in order (a row's KB codes side by side), the low nibbles two a byte (code j and j + QC of each run of 2 QC in
byte j), the high bits as one bit string per k group, scales and the rest [panels][groups][PANEL] (csrc/nanospec.h's
Packed).
"""
from dataclasses import dataclass

import torch
from torch import Tensor

import cpu_gemm

CONFIG_KEY = "quantization_config"  # config.json's record of the scheme (Hugging Face's key)
METHOD = "nanospec"
SUPER = 256  # the K-quants' super-block


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


@dataclass
class QWeight:
    """A quantized matrix [N, K] in the memory layout (module docstring)."""
    codes: Tensor
    scales: Tensor
    offsets: Tensor | None = None
    bits: int = 4
    high: Tensor | None = None  # 5 and 6 bits: the codes' high bits
    subscales: Tensor | None = None  # two levels (K-quants): int8 per group
    submins: Tensor | None = None
    zero: int = 0

    @property
    def N(self) -> int:
        return self.codes.shape[0]

    @property
    def K(self) -> int:
        return self.codes.shape[1] * (1 if self.bits == 8 else 2)

    @property
    def group(self) -> int:
        return self.K // (self.scales if self.subscales is None else self.subscales).shape[1]

    @property
    def sup(self) -> int:
        """k per super-block (two levels), 0 for one level."""
        return 0 if self.subscales is None else self.K // self.scales.shape[1]

    def values(self) -> Tensor:
        """The codes q [N, K] (before the zero point): int8 (8 bits) or uint8."""
        if self.bits == 8:
            return self.codes
        q = unpack_nibbles(self.codes)
        return q if self.high is None else q | (unpack_bits(self.high, self.bits - 4) << 4)

    def scale_offset(self) -> tuple[Tensor, Tensor | None]:
        """Per-weight fp32 scale and offset [N, K] (exact: fp16 times a small integer)."""
        rep = lambda t, n: t.float().repeat_interleave(n, 1)
        if self.subscales is None:
            return rep(self.scales, self.group), None if self.offsets is None else rep(self.offsets, self.group)
        s = rep(self.scales, self.sup) * rep(self.subscales, self.group)
        o = None if self.offsets is None else -(rep(self.offsets, self.sup) * rep(self.submins, self.group))
        return s, o

    def dequantize(self) -> Tensor:
        """The bf16 weights [N, K] the codes stand for."""
        s, o = self.scale_offset()
        w = (self.values().float() - self.zero) * s
        return (w if o is None else w + o).bfloat16()

    def take(self, rows: Tensor) -> "QWeight":
        """The rows' QWeight (an embedding's lookups)."""
        pick = lambda t: None if t is None else t.index_select(0, rows)
        return QWeight(pick(self.codes), pick(self.scales), pick(self.offsets), self.bits, pick(self.high),
                       pick(self.subscales), pick(self.submins), self.zero)

    def tensors(self, base: str) -> dict:
        """The checkpoint's tensors of this matrix, named after `base`."""
        out = {".qweight": self.codes, ".scales": self.scales, ".offsets": self.offsets, ".qhigh": self.high,
               ".subscales": self.subscales, ".submins": self.submins,
               ".qzero": torch.tensor([self.zero], dtype=torch.int16) if self.zero else None}
        return {base + k: v.contiguous() for k, v in out.items() if v is not None}

    @classmethod
    def pop(cls, sd: dict, base: str, where: str, N: int, K: int) -> "QWeight":
        """The matrix `base` of checkpoint tensors sd (popped), checked against its module's [N, K]."""
        t = {k: sd.pop(base + k, None) for k in (".qweight", ".scales", ".offsets", ".qhigh", ".subscales",
                                                  ".submins", ".qzero")}
        codes, scales, high = t[".qweight"], t[".scales"], t[".qhigh"]
        if scales is None:
            raise QuantError(f"{where}: {base} has quantized weights but no {base}.scales")
        bits = 8 if codes.dtype == torch.int8 else 4 + (0 if high is None else high.shape[1] * 8 // max(K, 1))
        zero = 0 if t[".qzero"] is None else int(t[".qzero"].reshape(-1)[0])
        qw = cls(codes, scales.half(), None if t[".offsets"] is None else t[".offsets"].half(), bits, high,
                 t[".subscales"], t[".submins"], zero)
        qw.check(where, base, N, K)
        return qw

    def check(self, where: str, base: str, N: int, K: int):
        sub, G = self.subscales, self.scales.shape[1] if self.scales.dim() == 2 else 0
        ok = (self.codes.shape == (N, K if self.bits == 8 else K // 2) and self.scales.dim() == 2
              and self.scales.shape[0] == N and G and K % G == 0 and self.bits in (4, 5, 6, 8)
              and (self.offsets is None or self.offsets.shape == self.scales.shape)
              and (self.high is None or self.high.shape == (N, K * (self.bits - 4) // 8))
              and (sub is None or (sub.dim() == 2 and sub.shape[0] == N and sub.shape[1] % G == 0
                                   and K % sub.shape[1] == 0 and (self.offsets is None) == (self.submins is None)
                                   and (self.submins is None or self.submins.shape == sub.shape))))
        if not ok:
            raise QuantError(f"{where}: {base}'s quantized tensors have shapes "
                             f"{[tuple(x.shape) for x in (self.codes, self.scales) if x is not None]}, "
                             f"not those of a [{N}, {K}] weight")
        if self.bits == 4 and self.offsets is None and not self.zero and self.subscales is None:
            raise QuantError(f"{where}: {base} has int4 weights but no {base}.offsets")

    def torch_fits(self) -> bool:
        """Whether torch has a kernel for this scheme (gpt-fast's): int8 per output channel, int4 in groups of 32-256
        with offsets (tinygemm; its CUDA layout wants K in 32s and N in 8s)."""
        if self.subscales is not None or self.zero or self.high is not None:
            return False
        return torch_kernel_fits(self.bits, self.group, self.offsets is not None, self.N, self.K)


def quantize(w: Tensor, s: Scheme) -> QWeight:
    """w [N, K] -> its QWeight under gpt-fast's scheme s; each code minimises its own error against the fp16 scale
    and offset it will be read with. int8 is symmetric (scale = max |w| / 127); int4 asymmetric (codes 0..15, scale =
    (max - min) / 15, offset = min), as Q4_1."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // s.group, s.group)
    if s.bits == 8:
        scale = (g.abs().amax(-1) / 127).half()
        sf = torch.where(scale == 0, 1.0, scale.float())
        return QWeight(torch.round(g / sf[..., None]).clamp(-127, 127).to(torch.int8).reshape(N, K), scale, bits=8)
    lo, hi = g.amin(-1), g.amax(-1)
    scale, off = ((hi - lo) / 15).half(), lo.half()
    sf = torch.where(scale == 0, 1.0, scale.float())
    codes = torch.round((g - off.float()[..., None]) / sf[..., None]).clamp(0, 15).to(torch.uint8).reshape(N, K)
    return QWeight(pack_nibbles(codes), scale, off, 4)


def pack_nibbles(codes: Tensor) -> Tensor:
    """[N, K] codes 0..15 -> [N, K / 2] bytes, k = 2 j low and 2 j + 1 high."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(b: Tensor) -> Tensor:
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[0], -1)


def pack_bits(v: Tensor, b: int) -> Tensor:
    """[..., E] values below 2^b -> [..., E b / 8] bytes: one little-endian bit string, value j at bits b j."""
    per = 8 // b
    v = v.to(torch.uint8).reshape(*v.shape[:-1], -1, per)
    out = v[..., 0].clone()
    for j in range(1, per):
        out |= v[..., j] << (b * j)
    return out


def unpack_bits(p: Tensor, b: int) -> Tensor:
    mask = (1 << b) - 1
    return torch.stack([(p >> (b * j)) & mask for j in range(8 // b)], -1).reshape(*p.shape[:-1], -1)


# ---------------------------------------------------------------- GGUF blocks as they are

# where each block type keeps its fp16 scales (the rest of a block: codes, or packed integer scales)
GGUF_F16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,)}


def random_blocks(kind: str, N: int, K: int, rng):
    """Random blocks of a GGUF type [N, K / block * block bytes] uint8 (numpy): random codes and integer scales,
    fp16 scales of a trained model's size (tests, kernel benchmarks: the gguf package quantizes only some types)."""
    import gguf
    import numpy as np
    per, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(N, K // per, nbytes), dtype=np.uint8)
    for at in GGUF_F16_AT[kind]:
        d = rng.uniform(2e-3, 2e-2, size=(N, K // per)).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(N, K // per, 2)
    return raw.reshape(N, -1)


# bytes per block, weights per block
GGUF_TYPES = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
              "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def _f16(b: Tensor) -> Tensor:
    return b.contiguous().view(torch.float16)[..., 0]


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (sc, m) [..., 8] (llama.cpp's get_scale_min_k4)."""
    d, m, md = s[..., 0:4].int(), s[..., 4:8].int(), s[..., 8:12].int()
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], -1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], -1)
    return sc.to(torch.int8), mn.to(torch.int8)


def from_gguf(raw, kind: str, K: int) -> QWeight:
    """A GGUF tensor's blocks as they are (raw [N, K / block * block bytes] uint8) -> its QWeight (groups of 32, or
    the K-quants' 16 / 32 under super-blocks of 256). Q8_0: w = d q; Q4_0: d (q - 8); Q4_1: d q + m; Q5_0: d (q -
    16); Q5_1: d q + m, a fifth bit per weight in 4 bytes; Q4_K: d sc q - dmin m per 32, scales and mins 6 bits in 12
    bytes; Q5_K: the same with a fifth bit plane; Q6_K: d sc (q - 32) per 16, low 4 and high 2 bits in two planes."""
    nbytes, per = GGUF_TYPES[kind]
    b = torch.from_numpy(raw.copy()).view(torch.uint8)
    N, nb = b.shape[0], K // per
    b = b.reshape(N, nb, nbytes)
    flat = lambda t: t.reshape(N, -1)
    if kind == "Q8_0":
        return QWeight(flat(b[..., 2:].contiguous().view(torch.int8)), flat(_f16(b[..., 0:2])), bits=8)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4]) if kind.endswith("_1") else None
        qs, qh = b[..., nbytes - 16:], b[..., nbytes - 20:nbytes - 16] if kind.startswith("Q5") else None
        low = torch.cat([qs & 15, qs >> 4], -1)  # weight j low, j + 16 high, per block
        high = None if qh is None else pack_bits(flat(unpack_bits(qh, 1)), 1)  # bit j of the 32-bit qh: weight j
        zero = {"Q4_0": 8, "Q5_0": 16}.get(kind, 0)
        return QWeight(pack_nibbles(flat(low)), flat(d), None if m is None else flat(m), 4 + (qh is not None), high,
                       zero=zero)
    d = _f16(b[..., 0:2]) if kind != "Q6_K" else _f16(b[..., 208:210])
    if kind == "Q6_K":  # ql 128, qh 64, scales 16 (int8), d; weight 128 h + 32 i + j of half h: ql's nibble, qh bits
        ql, qh, sc = b[..., 0:128].reshape(N, nb, 2, 64), b[..., 128:192].reshape(N, nb, 2, 32), b[..., 192:208]
        low = torch.cat([ql & 15, ql >> 4], -1)  # [N, nb, 2, 128]: j < 64 low nibbles, 64.. high ones
        hi = torch.stack([(qh >> (2 * i)) & 3 for i in range(4)], 3).reshape(N, nb, 2, 128)
        return QWeight(pack_nibbles(flat(low)), flat(d), None, 6, pack_bits(flat(hi), 2),
                       flat(sc.contiguous().view(torch.int8)), None, 32)
    dmin, (sc, mn) = _f16(b[..., 2:4]), _k_scales(b[..., 4:16])
    qs = b[..., nbytes - 128:].reshape(N, nb, 4, 32)  # 4 chunks of 64 weights: 32 low nibbles, then 32 high ones
    low = torch.stack([qs & 15, qs >> 4], 3).reshape(N, nb, 256)
    high = None
    if kind == "Q5_K":  # qh 32 bytes: weight 32 s + j's fifth bit is bit s of byte j
        qh = b[..., 16:48]
        high = pack_bits(flat(torch.stack([(qh >> s) & 1 for s in range(8)], 2)), 1)
    return QWeight(pack_nibbles(flat(low)), flat(d), flat(dmin), 4 + (kind == "Q5_K"), high, flat(sc), flat(mn))


# ---------------------------------------------------------------- the CPU kernel's layout


def qc() -> int:
    """Codes one widening fills in the CPU kernel (int4's nibble runs): 16 lanes with AVX-512, 8 with AVX2."""
    return 8 if cpu_gemm.ISA == "avx2" else 16


def _panels(c: Tensor) -> Tensor:
    """[N, K] -> [panels, K / KB, PANEL KB]: per group of KB k, the panel's rows in order, zero rows padding."""
    N, K = c.shape
    P, PN, KB = -(-N // cpu_gemm.PANEL), cpu_gemm.PANEL, cpu_gemm.KB
    c = torch.cat([c, c.new_zeros(P * PN - N, K)]) if P * PN > N else c
    return c.reshape(P, PN, K // KB, KB).permute(0, 2, 1, 3).reshape(P, K // KB, PN * KB)


def _unpanels(e: Tensor, N: int) -> Tensor:
    P, G, E = e.shape
    PN, KB = cpu_gemm.PANEL, cpu_gemm.KB
    return e.reshape(P, G, PN, KB).permute(0, 2, 1, 3).reshape(P * PN, G * KB)[:N]


def pack_planes(q: Tensor, bits: int, k: bool = False) -> tuple[Tensor, Tensor | None]:
    """Codes [N, K] -> the kernel's code bytes [panels, K / KB, PANEL KB bits / 8] (8 bits; else the low nibbles)
    and, for 5 and 6 bits, the high bits' bytes [panels, K / KB, PANEL KB (bits - 4) / 8]. k (klayout): the
    factorized K-quant tiles' layout, per k pair's 4 vectors of 32 values: 32 bytes a vector pair (vector 2 h's
    value j in byte j's low nibble, 2 h + 1's in its high one) and 32 bytes of 2-bit high fields (5 and 6 bits:
    vector v's value j at bits 2 v of byte j)."""
    e = _panels(q)
    if bits == 8:
        return e.to(torch.int8).contiguous(), None
    P, G, E = e.shape
    run = 32 if k else qc()
    runs = (e & 15).to(torch.uint8).reshape(P, G, E // (2 * run), 2, run)
    low = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(P, G, E // 2).contiguous()
    if bits == 4:
        return low, None
    if k:
        h = (e >> 4).to(torch.uint8).reshape(P, G, E // 32, 32)
        return low, sum(h[:, :, v] << (2 * v) for v in range(E // 32)).to(torch.uint8).contiguous()
    return low, pack_bits(e >> 4, bits - 4).contiguous()


def unpack_planes(low: Tensor, high: Tensor | None, N: int, bits: int, k: bool = False) -> Tensor:
    """pack_planes' inverse: the codes [N, K]."""
    if bits == 8:
        return _unpanels(low, N)
    P, G, B = low.shape
    run = 32 if k else qc()
    b = low.reshape(P, G, B // run, run)
    e = torch.stack([b & 15, b >> 4], dim=3).reshape(P, G, 2 * B)
    if high is not None:
        if k:
            h = torch.stack([(high >> (2 * v)) & 3 for v in range(2 * B // 32)], 2).reshape(P, G, 2 * B)
        else:
            h = unpack_bits(high, bits - 4)
        e = e | (h << 4)
    return _unpanels(e, N)


def factorized(qw: QWeight) -> bool:
    """Whether qw is a K-quant the C kernels multiply factorized, codes unwidened (csrc/gemm_kquant.h, gemm_kfma.h)."""
    return qw.subscales is not None and qw.bits in (4, 5, 6)


def klayout(qw: QWeight) -> bool:
    """Whether qw (a K-quant) takes the factorized tiles' own layout: the AVX-512 BF16 kernel's (gemm_kquant.h)."""
    return cpu_gemm.ISA == "avx512bf16" and factorized(qw)


def pack_groups(t: Tensor) -> Tensor:
    """Per-group values [N, groups] -> [panels, groups, PANEL], zero rows padding the last panel."""
    N, NG = t.shape
    P = -(-N // cpu_gemm.PANEL)
    t = torch.cat([t, t.new_zeros(P * cpu_gemm.PANEL - N, NG)]) if P * cpu_gemm.PANEL > N else t
    return t.reshape(P, cpu_gemm.PANEL, NG).transpose(1, 2).contiguous()


def unpack_groups(t: Tensor, N: int) -> Tensor:
    P, NG, PN = t.shape
    return t.transpose(1, 2).reshape(P * PN, NG)[:N].contiguous()


def to_kernel(qw: QWeight) -> QWeight:
    """qw's tensors in the kernel's layout (a QWeight of packed tensors: codes, high, and per-group ones)."""
    low, high = pack_planes(qw.values(), qw.bits, klayout(qw))
    g = lambda t: None if t is None else pack_groups(t)
    return QWeight(low, g(qw.scales), g(qw.offsets), qw.bits, high, g(qw.subscales), g(qw.submins), qw.zero)


def from_kernel(kq: QWeight, N: int) -> QWeight:
    """to_kernel's inverse (the checkpoint layout of a kernel-layout QWeight's N rows)."""
    q = unpack_planes(kq.codes, kq.high, N, kq.bits, klayout(kq))
    g = lambda t: None if t is None else unpack_groups(t, N)
    if kq.bits == 8:
        codes, high = q.contiguous(), None
    else:
        codes, high = pack_nibbles(q & 15), None if kq.bits == 4 else pack_bits(q >> 4, kq.bits - 4)
    return QWeight(codes, g(kq.scales), g(kq.offsets), kq.bits, high, g(kq.subscales), g(kq.submins), kq.zero)


def fast_layout(qw: QWeight) -> QWeight | None:
    """A 4-bit matrix in groups of 32 in csrc/gemm_fast.h's layout (the draft models' integer GEMM: not the bf16
    GEMM's bits), scale and offset per block rounded to fp16; None where it does not apply (other widths, groups,
    CPUs without AVX-512 VNNI)."""
    if not (cpu_gemm.VNNI and qw.bits == 4 and qw.group == 32 and cpu_gemm.PANEL == 64):
        return None
    N, K = qw.N, qw.K
    s, o = qw.scale_offset()
    s = s[:, ::32]
    o = (torch.zeros_like(s) if o is None else o[:, ::32]) - qw.zero * s
    P = -(-N // 64)
    q = qw.values()
    q = torch.cat([q, q.new_zeros(P * 64 - N, K)]) if P * 64 > N else q
    q = q.reshape(P, 4, 16, K // 4, 4).permute(0, 3, 1, 2, 4).reshape(P, K // 4, 4, 64)
    codes = torch.cat([q[:, :, 0] | (q[:, :, 1] << 4), q[:, :, 2] | (q[:, :, 3] << 4)], -1).contiguous()
    return QWeight(codes, pack_groups(s.half()), pack_groups(o.half()), 4)


def from_fast(fq: QWeight, N: int) -> QWeight:
    """fast_layout's matrix back in the checkpoint layout (groups of 32, its fp16 scales and offsets)."""
    P, Q, _ = fq.codes.shape
    c = fq.codes.reshape(P, Q, 2, 64)
    q = torch.stack([c[:, :, 0] & 15, c[:, :, 0] >> 4, c[:, :, 1] & 15, c[:, :, 1] >> 4], 2)  # [P, Q, 4, 64]
    q = q.reshape(P, Q, 4, 16, 4).permute(0, 2, 3, 1, 4).reshape(P * 64, Q * 4)[:N]
    return QWeight(pack_nibbles(q), unpack_groups(fq.scales, N), unpack_groups(fq.offsets, N), 4)


def torch_kernel_fits(bits: int, group: int, offsets: bool, N: int, K: int) -> bool:
    if bits == 8:
        return group == K and not offsets
    return bits == 4 and offsets and group in (32, 64, 128, 256) and K % group == 0 and K % 32 == 0 and N % 8 == 0


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
