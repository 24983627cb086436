"""Quantized layers on the CPU kernels (qlinear.py): each format's GEMM equal to the bf16 kernel's on the
dequantized weights for every ISA this CPU runs (tails, group edges, K-quants' super-blocks, chained formats),
torch's kernels where the C kernel is off, and the draft models' integer GEMM (near the exact product, row-invariant,
loaded and requantized once)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import cpu_gemm
import model as M
import qlinear
import quant
from conftest import advised_huge, gguf_blocks
from test_quant import GGUF_KINDS, SHAPES

needs_kernel = pytest.mark.skipif(cpu_gemm.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")


@needs_kernel
@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_is_the_bf16_kernel_on_dequantized_weights(bits):
    """For each shape, group size and row count (register tiles of 1-6 rows, blocks of 48, a padded last panel):
    the quantized GEMM's bits are the bf16 GEMM's on dequantize()'s matrix, and near fp32's product."""
    g = torch.Generator().manual_seed(bits)
    for N, K, group in SHAPES:
        w = torch.randn(N, K, generator=g) * 0.05
        qw = quant.quantize(w, quant.Scheme(bits, group))
        dq = qw.dequantize()
        kw, ref_p = qlinear.KernelWeight.of(quant.to_kernel(qw), K), cpu_gemm.pack(dq)
        b = torch.randn(N, generator=g).bfloat16()
        x = torch.randn(61, K, generator=g).bfloat16()
        for r in (1, 2, 5, 7, 13, 61):
            y = qlinear.kernel_linear(x[:r], kw, N, b)
            assert torch.equal(y, cpu_gemm.kernel_linear(x[:r], ref_p, N, b)), (N, K, group, r)
            ref = x[:r].float() @ dq.float().T + b.float()
            assert torch.allclose(y.float(), ref, atol=0.02, rtol=0.02)
        assert torch.equal(qlinear.kernel_linear(x[:5], kw, N)[2], qlinear.kernel_linear(x[2:3], kw, N)[0])  # rows


@pytest.mark.parametrize("bits,group,torch_kernel", [(8, 192, True), (4, 32, True), (4, 64, True), (8, 32, False)])
def test_torch_kernels_where_the_c_kernel_is_off(monkeypatch, bits, group, torch_kernel):
    """NANOSPEC_CPU_GEMM=torch (and CUDA): torch's kernels for the schemes it has (gpt-fast's int8 per channel, int4
    in groups with offsets), else the dequantized weights; each near the dequantized product."""
    monkeypatch.setenv(cpu_gemm.ENV, "torch")
    g = torch.Generator().manual_seed(bits + group)
    w = torch.randn(96, 192, generator=g) * 0.05
    qw = quant.quantize(w, quant.Scheme(bits, group))
    lin = qlinear.QLinear(qw, bias=torch.randn(96, generator=g).bfloat16())
    assert lin.kw is None and (lin.tq is not None) == torch_kernel
    dq = qw.dequantize().float()
    x = torch.randn(5, 192, generator=g).bfloat16()
    assert torch.allclose(lin(x).float(), x.float() @ dq.T + lin.bias.float(), atol=0.02, rtol=0.02)
    assert torch.allclose(lin.weight.float(), dq, atol=2e-3)


@needs_kernel
def test_block_types_kernel_is_the_bf16_kernel_on_dequantized_weights():
    """Every GGUF type (and a chain of three types in one matrix, as a Q4_K_M file's q | k | v) gives the bf16
    GEMM's bits on its dequantized matrix, for register tiles of 1-6 rows, widened panels, tails and padded panels;
    but the K-quants, which every kernel multiplies with their codes unwidened (test_kquant_products...): there a
    chain gives each part's own products."""
    rng = np.random.default_rng(7)
    P = cpu_gemm.PANEL
    for kind in GGUF_KINDS:
        for N, K in [(P + 9, 256), (2 * P, 512)]:
            qw = quant.from_gguf(gguf_blocks(kind, N, K, rng), kind, K)
            if not quant.factorized(qw):
                _same_as_bf16(qlinear.KernelWeight.of(quant.to_kernel(qw), K), qw.dequantize(), (kind, N, K))
    parts = [quant.from_gguf(gguf_blocks(k, n, 256, rng), k, 256) for k, n in (("Q4_K", 2 * P), ("Q5_0", P),
                                                                               ("Q6_K", P + 5))]
    kws = [qlinear.KernelWeight.of(quant.to_kernel(q), 256) for q in parts]
    kw = qlinear.KernelWeight.stack(kws, [q.N for q in parts])
    if not any(quant.factorized(q) for q in parts):
        _same_as_bf16(kw, torch.cat([q.dequantize() for q in parts]), "chain")
    else:
        g = torch.Generator().manual_seed(5)
        rows = [q.N for q in parts]
        x, b = torch.randn(13, 256, generator=g).bfloat16(), torch.randn(sum(rows), generator=g).bfloat16()
        bs = b.split(rows)
        for r in (1, 2, 5, 7, 13):
            alone = torch.cat([qlinear.kernel_linear(x[:r], k, q.N, bb) for k, q, bb in zip(kws, parts, bs)], 1)
            assert torch.equal(qlinear.kernel_linear(x[:r], kw, b.shape[0], b), alone), r


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_products_are_the_dequantized_matrix_times_x(kind):
    """A K-quant's codes multiplied unwidened, sub-block by sub-block (csrc/gemm_kquant.h on AVX-512 BF16,
    gemm_kfma.h on the FMA kernels): every product is the
    gguf package's dequantized values (unrounded) times x, to fp32 sums, rounded to bf16 once; the same bits for
    every row count (register tiles of 1-6 rows, widened panels, tails and padded panels), thread count and bias;
    and the kernel layout round-trips."""
    import gguf
    rng = np.random.default_rng(11 + ["Q4_K", "Q5_K", "Q6_K"].index(kind))
    P = cpu_gemm.PANEL
    for N, K in [(P + 9, 256), (2 * P, 512), (3 * P, 768)]:
        raw = gguf_blocks(kind, N, K, rng)
        ref = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
        ref = torch.from_numpy(ref.reshape(N, K)).double()
        qw = quant.from_gguf(raw, kind, K)
        kq = quant.to_kernel(qw)
        assert quant.factorized(qw) and torch.equal(quant.from_kernel(kq, N).dequantize(), qw.dequantize())
        kw = qlinear.KernelWeight.of(kq, K)
        g = torch.Generator().manual_seed(N)
        x, b = torch.randn(13, K, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
        full = qlinear.kernel_linear(x, kw, N, b)
        for r in (1, 2, 3, 5, 7, 13):
            assert torch.equal(qlinear.kernel_linear(x[:r], kw, N, b), full[:r]), (kind, N, K, r)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(qlinear.kernel_linear(x, kw, N, b), full)
        finally:
            torch.set_num_threads(threads)
        exact = x.double() @ ref.T + b.double()
        # one bf16 rounding (half a unit in the last place: up to 2^-8 relative) and the fp32 sums' (sub-block chains of
        # x times 128 + q, then s and c = m - 128 s; on the FMA kernels x times q, then s and m, whose terms |s| q +
        # |m| are below |w| + 126 |s|: 2^-16 of those terms is 2^8 of fp32's unit roundoff); a wrong code or scale
        # would be off by about |x| s
        s_abs = qw.scale_offset()[0].double().abs()
        tol = exact.abs() * 2.0 ** -8 + (x.double().abs() @ (ref.abs() + 128 * s_abs).T) * 2.0 ** -16
        assert ((full.double() - exact).abs() <= tol).all(), (kind, N, K)


def _same_as_bf16(kw, dq, what):
    N, K = dq.shape
    g = torch.Generator().manual_seed(N)
    x, b, ref = torch.randn(13, K, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16(), cpu_gemm.pack(dq)
    for r in (1, 2, 5, 7, 13):
        assert torch.equal(qlinear.kernel_linear(x[:r], kw, N, b), cpu_gemm.kernel_linear(x[:r], ref, N, b)), (what, r)


SMALLER = [isa for isa in ("avx512", "avx2") if isa != cpu_gemm.ISA and cpu_gemm.ISA != "avx2"
           and (isa == "avx2" or "avx512f" in cpu_gemm.cpu_flags())]


@pytest.fixture(scope="module")
def isa_cache(tmp_path_factory):
    """One kernel cache per ISA for this module's subprocesses: each smaller kernel is built once (15-45 s)."""
    return lambda isa: str(tmp_path_factory.getbasetemp() / f"kernels-{isa}")


@needs_kernel
@pytest.mark.parametrize("isa", SMALLER or [
    pytest.param("avx2", marks=pytest.mark.skip("this process tests the AVX2 kernel"))])
def test_the_smaller_kernels_too(isa_cache, isa):
    """The kernels smaller CPUs run (AVX2; AVX-512 without bf16) pass the kernel test too, each in its own process."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, cpu_gemm.ISA_ENV: isa, "NANOSPEC_CACHE": isa_cache(isa)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                        "kernel_is_the_bf16 or kquant_products", "test_qlinear.py"], cwd=here, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "6 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


_KQUANT_BITS = """
import hashlib, numpy as np, torch, qlinear, quant
from conftest import gguf_blocks
rng, out = np.random.default_rng(3), []
for kind in ("Q4_K", "Q5_K", "Q6_K"):
    qw = quant.from_gguf(gguf_blocks(kind, 80, 512, rng), kind, 512)
    kw = qlinear.KernelWeight.of(quant.to_kernel(qw), 512)
    x = torch.from_numpy(rng.standard_normal((13, 512), dtype=np.float32)).bfloat16()
    out += [qlinear.kernel_linear(x[:r], kw, 80).view(torch.int16).numpy().tobytes() for r in (1, 4, 13)]
print(hashlib.sha256(b"".join(out)).hexdigest())
"""


@needs_kernel
@pytest.mark.skipif("avx512f" not in cpu_gemm.cpu_flags(), reason="needs AVX-512F to run both FMA kernels")
def test_the_fma_kernels_give_the_same_kquant_bits(isa_cache):
    """AVX2 and AVX-512F multiply a K-quant with the same operations lane for lane (csrc/gemm_kfma.h): the same bits
    for one row, a tile and several tiles over a widened panel."""
    here = os.path.dirname(os.path.abspath(__file__))
    digests = []
    for isa in ("avx2", "avx512"):
        env = {**os.environ, cpu_gemm.ISA_ENV: isa, "NANOSPEC_CACHE": isa_cache(isa)}
        r = subprocess.run([sys.executable, "-c", _KQUANT_BITS], cwd=here, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        digests.append(r.stdout.split()[-1])
    assert digests[0] == digests[1]


@pytest.mark.skipif(not cpu_gemm.VNNI or cpu_gemm.kernel() is None, reason="needs AVX-512 VNNI and a C compiler")
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "int4"])
def test_the_draft_models_integer_gemm(kind, monkeypatch):
    """4-bit matrices in groups of 32 on the draft models' integer GEMM (int8 activations per block, csrc/gemm_fast.h):
    within 2% of the dequantized product, each row's output the same whatever the rows beside it, a chain of parts
    too, and back to its codes (the scales rounded to fp16); other widths stay on the exact kernel."""
    monkeypatch.setattr(qlinear, "_C", [True])  # (an earlier test's model may have left torch's kernels chosen)
    rng, P = np.random.default_rng(3), cpu_gemm.PANEL
    mk = lambda n, k: (quant.quantize(torch.randn(n, k) * 0.05, quant.Scheme(4, 32)) if kind == "int4"
                       else quant.from_gguf(gguf_blocks(kind, n, k, rng), kind, k))
    for N, K in [(P + 9, 256), (2 * P, 512)]:
        qw = mk(N, K)
        lin = qlinear.QLinear(qw)
        assert lin.make_fast() and lin.kw.c.fast == 1
        x = torch.randn(7, K).bfloat16()
        y, ref = lin(x).float(), x.float() @ qw.dequantize().float().T
        assert (y - ref).norm() / ref.norm() < 0.02
        assert all(torch.equal(lin(x[i:i + 1]).float()[0], y[i]) for i in range(7))
        dq = qw.dequantize().float()  # (scale and offset rounded to fp16: a relative error of 2^-11 each)
        assert (lin.rows().dequantize().float() - dq).abs().max() < 4e-3 * dq.abs().max()
    a, b = qlinear.QLinear(mk(P, 256)), qlinear.QLinear(mk(P + 5, 256))
    assert a.make_fast() and b.make_fast()
    x = torch.randn(3, 256).bfloat16()
    assert torch.equal(qlinear.kernel_linear(x, qlinear.fuse([a, b]), 2 * P + 5), torch.cat([a(x), b(x)], -1))
    assert not qlinear.QLinear(quant.from_gguf(gguf_blocks("Q6_K", P, 256, rng), "Q6_K", 256)).make_fast()


@needs_kernel
def test_a_draft_model_without_the_integer_gemm_loads_again_as_it_was(tmp_path, monkeypatch):
    """load_model(fast=True) where the integer GEMM does not apply (a CPU without AVX-512 VNNI): the matrices stay in
    the kernel's own layout, and a second load from the saved layout keeps them there, with the same logits (it
    once took every saved matrix for the integer GEMM's layout, and NanoSpec's window failed on the Q8_0 head)."""
    import download
    from conftest import write_tiny_gguf
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_gemm, "VNNI", False)
    types = {f"blk.0.{n}.weight": "Q5_0" for n in ["attn_q", "attn_k", "attn_v", "attn_output"]}
    write_tiny_gguf(tmp_path / "d.gguf", arch="qwen2", types=types | {"output.weight": "Q8_0"}, dim=256, ffn=512,
                    heads=4, kv_heads=2, head_dim=64, tied=False)
    path = download.resolve_checkpoint(str(tmp_path / "d.gguf"))
    first = M.load_model(path, fast=True)
    assert (path / f"kernel-{cpu_gemm.ISA}-fast.safetensors").is_file()
    again = M.load_model(path, fast=True)
    for m in (first, again):
        lins = [q for q in m.modules() if isinstance(q, qlinear.QLinear)]
        assert len(lins) == 5 and not any(q.fast for q in lins) and m.lm_head.bits == 8
    p = torch.tensor([[5, 9, 100, 3, 7, 7, 200, 261, 12]])
    for m in (first, again):
        m.setup_caches(1, 64)
    assert torch.equal(first(p, torch.arange(9)), again(p, torch.arange(9)))


@pytest.mark.skipif(not cpu_gemm.VNNI or cpu_gemm.kernel() is None, reason="needs AVX-512 VNNI and a C compiler")
def test_a_draft_model_loads_on_the_integer_gemm(tmp_path, monkeypatch):
    """load_model(fast=True): every quantized matrix on the integer GEMM, other formats (Q5_0, Q6_K, Q8_0) quantized
    again to 4 bits in groups of 32 once and saved beside the checkpoint; the model's logits near the exact ones."""
    import download
    from conftest import write_tiny_gguf
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    layer = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    types = {f"blk.{i}.{n}.weight": k for i, k in ((0, "Q5_0"), (1, "Q6_K")) for n in layer}
    write_tiny_gguf(tmp_path / "d.gguf", arch="qwen2", types=types | {"output.weight": "Q8_0"}, dim=256, ffn=512,
                    heads=4, kv_heads=2, head_dim=64, tied=False)
    path = download.resolve_checkpoint(str(tmp_path / "d.gguf"))
    exact, fast = M.load_model(path), M.load_model(path, fast=True)
    lins = [m for m in fast.modules() if isinstance(m, qlinear.QLinear)]
    assert len(lins) == 15 and all(m.fast for m in lins) and fast.cpu_pass is not None
    assert (path / f"kernel-{cpu_gemm.ISA}-fast.safetensors").is_file()
    calls = []
    monkeypatch.setattr(qlinear.QLinear, "make_fast", lambda self, requantize=False: calls.append(1))
    again = M.load_model(path, fast=True)
    assert not calls and all(m.fast for m in again.modules() if isinstance(m, qlinear.QLinear))
    p = torch.tensor([[5, 9, 100, 3, 7, 7, 200, 261, 12]])
    for m in (exact, fast, again):
        m.setup_caches(1, 64)
    assert torch.equal(fast(p, torch.arange(9)), again(p, torch.arange(9)))
    x = torch.randn(4, 256).bfloat16()
    for (n, e), f in zip(((n, m) for n, m in exact.named_modules() if isinstance(m, qlinear.QLinear)), lins):
        if e.in_features == 256:  # (requantized to 4 bits from 5, 6 and 8: a draft's products, roughly the same)
            y, z = e(x).float(), f(x).float()
            assert (z - y).norm() / y.norm() < 0.15, n


def test_a_kernel_layout_file_is_read_onto_huge_pages(tmp_path):
    """read_on_huge_pages gives the file's tensors (each dtype, empty and large ones) and metadata as safetensors
    reads them, in a private buffer advised for 2 MiB pages (smaps' "hg" flag, on Linux); a file cut short raises,
    so a stale or broken kernel layout is packed again at load."""
    from safetensors.torch import load_file, save_file
    t = {"w": torch.randint(0, 255, (3 << 20,), dtype=torch.uint8), "s": torch.randn(5, 7).to(torch.float16),
         "b": torch.randn(3, 4).to(torch.bfloat16), "i": torch.arange(9, dtype=torch.int32),
         "e": torch.zeros(0, 4, dtype=torch.int8), "f": torch.randn(2, 3)}
    f = tmp_path / "kernel.safetensors"
    save_file(t, str(f), metadata={"key": "k", "fast": "a b"})
    out, meta = qlinear.read_on_huge_pages(f)
    ref = load_file(str(f))
    assert meta == {"key": "k", "fast": "a b"} and out.keys() == ref.keys()
    for k in ref:
        assert out[k].dtype == ref[k].dtype and torch.equal(out[k], ref[k])
    assert advised_huge(out["w"].data_ptr()) in (True, None)
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError):
        qlinear.read_on_huge_pages(f)
