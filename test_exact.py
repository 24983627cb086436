"""exact.py: this machine's row-invariance answers, checked on fresh data, with controls that must fail."""
import json

import pytest
import torch
import torch.nn.functional as F

import exact
from conftest import write_tiny_hf
from errors import UsageError
from model import causal_recent, exact_attention, exact_plan, load_model


@pytest.fixture(scope="module")
def smol_shaped(tmp_path_factory):
    """One layer at SmolLM2-135M's widths (d 576, 9 query / 3 KV heads of 64, MLP 1536), small vocabulary."""
    path, _ = write_tiny_hf(tmp_path_factory.mktemp("smol1"), hidden_size=576, intermediate_size=1536,
                            num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                            max_position_embeddings=1024)
    return path


def test_rows_agree_on_known_functions():
    x = torch.randn(exact.REF + exact.SHIFT, 8)
    small_path = lambda x: x * (1 + 2 ** -20 * (x.shape[0] < 8))  # a different code path for short passes
    last_row = lambda x: torch.cat([x[:-1], x[-1:] * (1 + 2 ** -20)])  # the last row of a pass rounds apart
    for r in exact.LADDER[:-2]:
        assert exact.rows_agree(lambda x: x * 3, x, r)
        assert exact.rows_agree(small_path, x, r) == (r >= 8), r
        assert not exact.rows_agree(last_row, x, r), r


def per_row(lin):
    """lin's product one row at a time: row-invariant by construction on every machine (torch's own GEMMs
    need not be: fp32 on an AVX-512 Ice Lake Xeon agrees with 64-row passes only from 16-64 rows)."""
    return lambda x: torch.cat([F.linear(row, lin.weight, lin.bias) for row in x.split(1, dim=-2)], dim=-2)


def fault_small_passes(model, below=8):
    """Make the target's first down projection round differently for passes of fewer than `below` rows,
    like a GEMV or partial-block kernel path, over linear layers that are otherwise row-invariant (so the
    sizes that agree are known: machine independent, unlike the real kernels)."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = per_row(mod)
    lin = model.layers[0].mlp.down_proj
    lin.forward = lambda x: per_row(lin)(x) * (1 + 2 ** -12 * (x.shape[-2] < below))


def test_invariance_rejects_a_faulty_kernel_and_caches(tmp_path, smol_shaped):
    m = load_model(smol_shaped, dtype=torch.float32)
    fault_small_passes(m)
    inv = exact.Invariance(m, tmp_path / "inv.json")
    for n in range(1, 20):
        R = inv.pass_rows(n, 512)
        assert R.gemm >= max(n, 8) and R.attn >= R.gemm
    saved = json.loads((tmp_path / "inv.json").read_text())[exact.machine_id()]
    down = {int(k.split("r=")[1]): v for k, v in saved.items() if k.startswith("linear float32 1536x576 r=")}
    assert down and all(v == (r >= 8) for r, v in down.items()), down
    # a second engine on this machine reads the answers instead of checking again
    again = exact.Invariance(m, tmp_path / "inv.json")
    again._answer = lambda key, r, check: again.answers[f"{key} r={r}"]
    assert again.pass_rows(1, 512) == inv.pass_rows(1, 512)


@pytest.mark.parametrize("gemm", ["auto", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()  # as the engine runs (with grad, cpu_gemm.linear leaves bf16 products to torch)
def test_chosen_pass_sizes_hold_on_fresh_data(tmp_path, smol_shaped, dtype, gemm, monkeypatch):
    """Real head size (64), 3 query heads per KV head as in SmolLM2: for every pass of n <= 40 rows, the size
    the check picks gives each row of exact_attention and of every GEMM the bits of a REF-row pass, on data
    the check never saw; exact_attention itself matches SDPA numerically. (The PyTorch layers, with this
    machine's choice of GEMM and with torch's, whose one-row path rounds apart on some CPUs: the fused CPU
    pass needs no check, test_cpu_forward.py.)"""
    monkeypatch.setenv("NANOSPEC_CPU_FORWARD", "off")
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", gemm)
    m = load_model(smol_shaped, dtype=dtype)
    assert m.cpu_pass is None
    inv = exact.Invariance(m, tmp_path / "inv.json")
    torch.manual_seed(1)
    S, a = 640, m.args
    kdt = torch.float32  # the CPU KV cache dtype
    k, v = torch.randn(1, 3, S, 64, dtype=kdt), torch.randn(1, 3, S, 64, dtype=kdt)
    q = torch.randn(1, 9, exact.REF, 64, dtype=kdt)
    pos, sr = 300 + torch.arange(exact.REF), torch.arange(S)
    attn = lambda i: exact_attention(q[:, :, i], k, v, exact_plan(pos[i], causal_recent(pos[i]), sr, 3))
    ref = attn(torch.arange(exact.REF))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=sr[None, :] <= pos[:, None], enable_gqa=True)
    torch.testing.assert_close(ref, sdpa, rtol=1e-5, atol=1e-5)
    x = torch.randn(exact.REF, a.intermediate_size, dtype=dtype)
    down = m.layers[0].mlp.down_proj
    lin_ref = down(x)
    for n in range(1, 41):
        R = inv.pass_rows(n, S)
        assert R is not None and R.attn >= R.gemm >= n
        if R.attn <= exact.REF:  # attention pads its query rows with copies of the last token (model.exact_plan)
            i = torch.arange(R.attn).clamp(max=R.gemm - 1)
            assert torch.equal(attn(i)[:, :, :n], ref[:, :, :n]), (n, R)
            assert torch.equal(down(x[:R.gemm])[:n], lin_ref[:n]), (n, R)


def test_machine_id_names_cpu_torch_and_threads():
    mid = exact.machine_id()
    assert torch.__version__ in mid and f"{torch.get_num_threads()} threads" in mid


def test_planner_sizes_the_cache_and_refuses_what_does_not_fit(tmp_path):
    """A request's KV slots (rounded up to 64, or the fixed size CUDA graphs keep), its pass rows outside exact
    mode, and one-line refusals: past the model's context, past the fixed size, --exact with a tree deeper than
    exact verification gathers."""
    m = load_model(write_tiny_hf(tmp_path / "t")[0], dtype=torch.float32)
    p = exact.Planner(m, False, None)
    assert p.invariance is None and p.plan(10, 20, 5) == (64, exact.PassRows(5, 5)) and not p.exact
    assert p.pass_rows(3, 64) == exact.PassRows(3, 3) and not p.attention
    with pytest.raises(UsageError, match="exceeds the model's context of 512"):
        p.plan(500, 20, 5)
    fixed = exact.Planner(m, False, 128)
    assert fixed.plan(10, 20, 5)[0] == 128
    with pytest.raises(UsageError, match="exceeds --max-seq 128"):
        fixed.plan(110, 20, 5)

    class Deep:
        depth, nodes = 20, 40

    with pytest.raises(UsageError, match="--tree-depth must be below"):
        exact.Planner(m, True, None, Deep())
    assert exact.Planner(m, None, None, Deep()).invariance is None  # too deep for exact mode: off
