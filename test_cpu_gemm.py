"""The CPU bf16 linear kernel: right products, row-invariant bits, torch's rounding, compile, the machine's choice."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import cpu_gemm
from model import Linear

pytestmark = pytest.mark.skipif(cpu_gemm.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("N,K,bias", [(48, 64, False), (50, 64, True), (49, 136, False), (3, 8, True), (1, 16, False),
                                      (130, 64, True)])
def test_products_match_fp32_to_one_rounding(N, K, bias):
    """Every output is the fp32 product of the bf16 inputs, rounded once: within one bf16 step of it (the
    sum order differs from a plain fp32 matmul's). N not a multiple of the panel (16 or 64 rows) exercises the
    padded last panel."""
    w, b = rand(N, K), rand(N, seed=1) if bias else None
    for M in (1, 2, 3, 4, 5, 9, 13):
        x = rand(M, K, seed=M)
        y = cpu_gemm.kernel_linear(x, cpu_gemm.pack(w), N, b)
        ref = x.float() @ w.float().T + (b.float() if bias else 0)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all(), (M, (y.float() - ref).abs().max())


def test_rows_are_invariant_by_construction():
    """A row's bits do not depend on how many rows share the pass or where it sits (register tiles of 1-6
    rows, balanced heights, row blocks of at most 48 of nearly equal height): the property exact mode needs."""
    w = rand(96, 576)
    p = cpu_gemm.pack(w)
    x = rand(101, 576, seed=3)
    full = cpu_gemm.kernel_linear(x, p, 96)
    for r in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 23, 49, 60, 96):
        for o in (0, 1, 5):
            assert torch.equal(cpu_gemm.kernel_linear(x[o:o + r], p, 96), full[o:o + r]), (r, o)
    x3 = x[:12].view(2, 6, 576)  # leading dims are flattened rows
    assert torch.equal(cpu_gemm.kernel_linear(x3, p, 96), full[:12].view(2, 6, 96))


def test_any_thread_count_gives_the_same_bits():
    """Work is dealt to the threads in half panels where the kernel has half-panel tiles (AVX-512F: one thread
    may take half of a panel, as in the default model's 9-panel products over 2 threads); one thread takes whole
    panels only. Every thread count gives the bits of one thread, at any row count, padded panel included."""
    before = torch.get_num_threads()
    try:
        for N in (130, 576, 49):
            w = rand(N, 576, seed=N)
            p, x = cpu_gemm.pack(w), rand(16, 576, seed=7)
            torch.set_num_threads(1)
            ref = {r: cpu_gemm.kernel_linear(x[:r], p, N) for r in (1, 5, 16)}
            for threads in (2, 3, 4):
                torch.set_num_threads(threads)
                for r, y in ref.items():
                    assert torch.equal(cpu_gemm.kernel_linear(x[:r], p, N), y), (N, threads, r)
    finally:
        torch.set_num_threads(before)


def test_pack_layout_round_trips():
    """unpack(pack(w)) is w, the padded panel included, and pack_rows_ replaces exactly the rows it is given."""
    P, KB = cpu_gemm.PANEL, cpu_gemm.KB
    N = P + P // 2 + 2  # two panels, the second padded
    w = rand(N, 24)
    p = cpu_gemm.pack(w)
    assert p.shape == (2, 24 // KB, P * KB) and torch.equal(cpu_gemm.unpack(p, N), w)
    assert not cpu_gemm.unpack(p, 2 * P)[N:].any()  # the zero rows padding the last panel
    new, slots = rand(3, 24, seed=1), torch.tensor([0, P + 5, N - 1])
    cpu_gemm.pack_rows_(p, new, slots)
    w[slots] = new
    assert torch.equal(cpu_gemm.unpack(p, N), w)
    assert torch.equal(cpu_gemm.kernel_linear(rand(2, 24, seed=2), p, N),
                       cpu_gemm.kernel_linear(rand(2, 24, seed=2), cpu_gemm.pack(w), N))


def test_write_rows_is_a_gather_and_pack_rows():
    """write_rows_ (NanoSpec's row writes, one C call) leaves the rows buffer and its packed copy as the torch
    gather and pack_rows_ do: entries whose slot is out of range (-1, the sink W) or whose token is not a row
    of the weight are skipped; it runs traced too."""
    P = cpu_gemm.PANEL
    W, V = P + 3, 40  # the packed copy has the sink row W, in a second panel
    weight = rand(V, 24, seed=3)
    for step, compiled in enumerate((False, True)):
        rows = rand(W, 24, seed=4)
        packed = cpu_gemm.pack(torch.cat([rows, rows.new_zeros(1, 24)]))
        tok = torch.tensor([5, 7, 39, V, 2, 11, -1])
        slots = torch.tensor([0, P + 2, W - 1, 4, -1, W, 3])
        if not cpu_gemm.writes_rows(rows, packed, weight):
            pytest.skip("the C code is not built here")
        write = (torch.compile(cpu_gemm.write_rows_, fullgraph=True, backend="eager") if compiled
                 else cpu_gemm.write_rows_)
        write(rows, packed, weight, tok, slots)
        want = rand(W, 24, seed=4)
        want[[0, P + 2, W - 1]] = weight[[5, 7, 39]]
        assert torch.equal(rows, want), step
        assert torch.equal(cpu_gemm.unpack(packed, W), want) and not cpu_gemm.unpack(packed, W + 1)[W].any(), step


def test_rounds_to_nearest_even_like_torch():
    """y = a + b for bf16 a, b (weights 1, 1, 0, ...): the kernel's float -> bf16 matches torch's, ties,
    overflow to inf and NaN included."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(4000, generator=g) * torch.logspace(-3, 3, 4000)).bfloat16()
    b = (a.float() * torch.rand(4000, generator=g) * 2 ** -7).bfloat16()  # sums between bf16 neighbours
    a = torch.cat([a, torch.tensor([3.0e38, float("inf"), float("nan"), 1.0]).bfloat16()])
    b = torch.cat([b, torch.tensor([3.0e38, 1.0, 1.0, 2 ** -8]).bfloat16()])  # overflow, inf, nan, an exact tie
    x = torch.zeros(len(a), 8, dtype=torch.bfloat16)
    x[:, 0], x[:, 1] = a, b
    w = torch.zeros(3, 8, dtype=torch.bfloat16)
    w[0, :2] = 1
    y = cpu_gemm.kernel_linear(x, cpu_gemm.pack(w), 3)[:, 0]
    ref = (a.float() + b.float()).bfloat16()
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y[~ref.isnan()], ref[~ref.isnan()])
    # whole registers of 16 outputs (the vector epilogue) and a tail of 3, with a bias added before the rounding
    w = torch.zeros(35, 8, dtype=torch.bfloat16)
    w[:, :2] = 1
    bias = (torch.randn(35, generator=g) * 10).bfloat16()
    y = cpu_gemm.kernel_linear(x, cpu_gemm.pack(w), 35, bias)
    ref = ((a.float() + b.float())[:, None] + bias.float()).bfloat16()
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y[~ref.isnan()], ref[~ref.isnan()])


def test_linear_module_and_compile(monkeypatch):
    """model.Linear goes through the kernel once packed and the kernel is on, falls back to F.linear
    otherwise (fp32, kernel off); torch.compile traces the custom op and gives the same bits."""
    monkeypatch.setattr(cpu_gemm, "_ON", [True])
    lin = Linear(64, 30, bias=True).bfloat16()
    assert cpu_gemm.pack_linears(lin) == 1
    x = rand(5, 64).requires_grad_()
    lin(x).sum().backward()  # training (weights need grad): torch's GEMM, which has a backward
    assert torch.allclose(lin.weight.grad.float(), (x.detach().float().T @ torch.ones(5, 30)).T,
                          rtol=2 ** -6, atol=1e-2)
    lin.requires_grad_(False)
    lin.packed = None
    x = x.detach()
    plain = F.linear(x, lin.weight, lin.bias)
    assert torch.equal(lin(x), plain)  # not packed yet: torch
    assert cpu_gemm.pack_linears(lin) == 1 and lin.packed is not None
    y = lin(x)
    assert torch.equal(y, cpu_gemm.kernel_linear(x, lin.packed, 30, lin.bias))
    assert (y.float() - plain.float()).abs().max() < 0.1
    compiled = torch.compile(lin, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), y)
    monkeypatch.setattr(cpu_gemm, "_ON", [False])
    assert torch.equal(lin(x), plain)
    f32 = Linear(64, 30)
    monkeypatch.setattr(cpu_gemm, "_ON", [True])
    assert cpu_gemm.pack_linears(f32) == 0 and f32.packed is None  # fp32 weights: not the kernel's domain


def test_choose_is_cached_per_machine_and_overridable(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    for mode, want in (("kernel", True), ("torch", False)):
        monkeypatch.setenv(cpu_gemm.ENV, mode)
        assert cpu_gemm.choose([(48, 64)]) is want and cpu_gemm.enabled() is want
    monkeypatch.setenv(cpu_gemm.ENV, "fast")
    with pytest.raises(ValueError, match="auto, kernel or torch"):
        cpu_gemm.choose([(48, 64)])
    monkeypatch.setenv(cpu_gemm.ENV, "auto")
    calls = []
    monkeypatch.setattr(cpu_gemm, "_faster", lambda *a: calls.append(a) or True)
    assert cpu_gemm.choose([(48, 64), (48, 64), (96, 64)]) and cpu_gemm.choose([(48, 64), (48, 64), (96, 64)])
    assert len(calls) == 1 and calls[0][0] == {(48, 64): 2, (96, 64): 1}  # repeats weigh; asked once
    saved = json.loads((tmp_path / "cpu_gemm.json").read_text())
    assert list(saved.values()) == [True] and cpu_gemm.machine_id() in next(iter(saved))
    monkeypatch.setattr(cpu_gemm, "_faster", lambda *a: False)
    assert not cpu_gemm.choose([(24, 64)]) and not cpu_gemm.enabled()


def test_the_timing_check_runs():
    """The real check on tiny shapes returns a bool without touching the process's choice."""
    before = cpu_gemm.enabled()
    assert cpu_gemm._faster({(48, 64): 2}, (1, 4), 1) in (True, False)
    assert cpu_gemm.enabled() == before


def test_isa_choice(monkeypatch):
    """The variant follows the CPU's flags; NANOSPEC_CPU_ISA=avx512 or avx2 asks for a smaller one (never one the
    CPU lacks); anything else is an error."""
    monkeypatch.delenv(cpu_gemm.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512_bf16"})
    assert cpu_gemm.pick_isa() == "avx512bf16"
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    assert cpu_gemm.pick_isa() == "avx512"
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"avx2", "fma"})
    assert cpu_gemm.pick_isa() == "avx2"
    monkeypatch.setenv(cpu_gemm.ISA_ENV, "avx512")
    assert cpu_gemm.pick_isa() == "avx2"
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512_bf16"})
    assert cpu_gemm.pick_isa() == "avx512"
    monkeypatch.setenv(cpu_gemm.ISA_ENV, "avx2")
    assert cpu_gemm.pick_isa() == "avx2"
    monkeypatch.setenv(cpu_gemm.ISA_ENV, "amx")
    with pytest.raises(ValueError, match="auto, avx512 or avx2"):
        cpu_gemm.pick_isa()
    assert cpu_gemm.ISA in cpu_gemm.machine_id()  # answers timed with one variant are not reused by the other


SMALLER = [isa for isa in ("avx512", "avx2") if isa != cpu_gemm.ISA and cpu_gemm.ISA != "avx2"
           and (isa == "avx2" or "avx512f" in cpu_gemm.cpu_flags())]


@pytest.mark.parametrize("isa", SMALLER or [
    pytest.param("avx2", marks=pytest.mark.skip("this process tests the AVX2 kernel"))])
def test_the_smaller_kernels_too(isa):
    """On an AVX-512 CPU the kernels that smaller CPUs run (AVX2-only; AVX-512 without bf16) pass this file's and
    the fused pass's tests too, each in a process of its own (the variant is fixed at import)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, cpu_gemm.ISA_ENV: isa}  # (conftest's test cache: machine_id and builds name the ISA)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                        "not smaller and not agree", "test_cpu_gemm.py", "test_cpu_forward.py"],
                       cwd=here, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


PRODUCTS = """
import sys, torch, cpu_gemm
g = torch.Generator().manual_seed(0)
out = []
for N, K, bias in [(96, 576, False), (130, 64, True), (49, 136, True), (3, 8, False), (200, 1536, False)]:
    w, b = torch.randn(N, K, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16() if bias else None
    x = torch.randn(61, K, generator=g).bfloat16()
    out += [cpu_gemm.kernel_linear(x[:r], cpu_gemm.pack(w), N, b) for r in (1, 2, 5, 7, 12, 13, 16, 26, 61)]
torch.save((cpu_gemm.ISA, out), sys.argv[1])
"""


@pytest.mark.skipif("avx512f" not in cpu_gemm.cpu_flags(), reason="needs a CPU with AVX-512F")
def test_fma_kernels_agree_bit_for_bit(tmp_path):
    """The AVX-512F kernel is the AVX2 kernel's arithmetic in wider registers: every output is the same fp32 FMA
    chain over k in order, so the two give the same bits for every shape, row count and padded panel."""
    here = os.path.dirname(os.path.abspath(__file__))
    got = {}
    for isa in ("avx512", "avx2"):
        # the test cache, where the tests above built each variant (a cache of its own built both again: 60 s)
        env = {**os.environ, cpu_gemm.ISA_ENV: isa, "PYTHONPATH": here}
        subprocess.run([sys.executable, "-c", PRODUCTS, str(tmp_path / isa)], cwd=here, env=env, check=True)
        got[isa] = torch.load(tmp_path / isa)
    assert got["avx512"][0] == "avx512" and got["avx2"][0] == "avx2"
    assert all(torch.equal(a, b) for a, b in zip(got["avx512"][1], got["avx2"][1]))
