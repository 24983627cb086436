"""exact.py: this machine's row-invariance answers, checked on fresh data, with controls that must fail."""
import json

import pytest
import torch
import torch.nn.functional as F

import cpu_gemm
import draft as dr
import draft_eagle as de
import exact
from conftest import write_tiny_hf
from eagle import load_eagle
from engine import Engine
from model import causal_recent, exact_attention, exact_plan, load_model
from test_generate import PROMPTS, tiny  # noqa: F401 (tiny: a fixture)
from vocab import make_vocab
from model import Plan


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


def verify_matches_decode(tiny, dtype, nodes, plain_sdpa=False, fault=None, trust_all=False, cache=None, kernel=False,
                          fused=False):
    """For one EAGLE-3 tree on the tiny target: per node, do its verify logits equal, bit for bit, the logits
    autoregressive decoding computes for the same token sequence (as runner.Runner._decode_one runs it)?"""
    path, heads, _, _ = tiny
    m = load_model(path, dtype=dtype)
    if fault:
        fault(m)
    head = load_eagle(heads["eagle3"], m, dtype, "cpu")
    d = de.EagleDrafter(head, make_vocab("full", head.lm_weight()), topk=4, depth=4, nodes=nodes)
    e = Engine(m, drafter=d)
    if cache:  # a faulty model must not share the machine's answers for healthy kernels of its shapes
        e.planner.invariance = exact.Invariance(m, cache)
    if trust_all:  # the control: take every pass size as row-invariant without asking the machine
        e.planner.invariance.gemm_agrees = e.planner.invariance.attn_agrees = lambda r, S=None: True
    p = torch.tensor(PROMPTS[2] * 3)
    T = len(p)
    req = e.planner.plan(T, 8, nodes)
    S, R_ver, R_dec = req.S, req.rows, e.planner.pass_rows(req, 1)
    assert req.exact
    assert (cpu_gemm.enabled() and m.lm_head.packed is not None) == kernel
    assert (m.cpu_pass is not None) == fused
    if fused:  # the fused CPU pass: row-invariant by construction, no padding at all
        assert R_dec == exact.PassRows(1, 1) and R_ver == exact.PassRows(nodes, nodes), (R_dec, R_ver)
    elif kernel:  # row-invariant GEMMs by construction: no padding rows past the ladder's next size
        assert R_dec.gemm == 1 and R_ver.gemm == next(r for r in exact.LADDER if r >= nodes), (R_dec, R_ver)
    if plain_sdpa:
        R_ver, R_dec = exact.PassRows(nodes, nodes), exact.PassRows(1, 1)
    m.setup_caches(1, S)
    d.setup(S)
    with torch.no_grad():
        logits, hid, aux = m(p[None], torch.arange(T), return_hidden=True, plan=Plan(d.aux_layers))
        tok = logits[0, -1].argmax().view(1)
        d.prefill(dr.Prefill(p, tok, logits[0], hid, aux))
        tree = d.draft(tok, torch.tensor(T))
        assert bool((tree.depth != torch.arange(len(tree.depth))).any())  # some nodes are off the spine
        tree_logits = e.runner._verify(tree.tokens, tree.depth, tree.anc, torch.tensor(T), R_ver)[0]
        same = []
        for i in range(len(tree.tokens)):
            chain = sorted(torch.nonzero(tree.anc[i])[:, 0].tolist(), key=lambda j: int(tree.depth[j]))
            m(p[None], torch.arange(T))  # same prefix KV; later slots are rewritten before being read
            for t, j in enumerate(chain):  # autoregressive decode steps, as runner.Runner._decode_one runs them
                pos = T + t + torch.arange(R_dec.gemm)
                out = m(tree.tokens[j].view(1, 1).expand(1, R_dec.gemm), pos,
                        recent=causal_recent(pos) if R_dec.recent else None, attn_rows=R_dec.attn)[0, 0]
            same.append(torch.equal(out, tree_logits[i]))
    return same


@pytest.mark.parametrize("dtype,plain_sdpa,nodes,gemm", [
    (torch.bfloat16, False, 14, "torch"), (torch.bfloat16, False, 14, "kernel"), (torch.float32, False, 14, "torch"),
    (torch.float32, True, 14, "torch"), (torch.float32, False, 17, "torch"), (torch.bfloat16, False, 50, "torch"),
    (torch.bfloat16, False, 50, "kernel"), (torch.float32, False, 50, "torch"), (torch.bfloat16, False, 14, "fused"),
    (torch.bfloat16, False, 50, "fused")])
def test_tree_verify_is_bitwise_autoregressive(tiny, dtype, plain_sdpa, nodes, gemm, monkeypatch):
    """CPU: every tree node's verify logits equal, bit for bit, the logits autoregressive decoding
    computes for the same token sequence (exact attention + the pass sizes exact.py finds on this machine).
    This is what makes greedy speculative output identical to autoregressive output even at near-ties.
    The plain-SDPA variant is the control (fp32, where attention's rounding differences reach the logits
    directly): a tree node off the spine sees its ancestors at scattered KV slots and rounds differently,
    so the assertion must fail there for at least one node (it shows the test can fail). gemm: torch's bf16
    GEMM, cpu_gemm's kernel in the PyTorch layers (row-invariant by construction, so no pass needs padding),
    or the fused CPU pass (cpu_forward.py: no exact attention, no padding)."""
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", "torch" if gemm == "torch" else "kernel")
    monkeypatch.setenv("NANOSPEC_CPU_FORWARD", "on" if gemm == "fused" else "off")
    if gemm != "torch" and cpu_gemm.kernel() is None:
        pytest.skip("cpu_gemm's kernel needs x86-64 with AVX2+FMA and a C compiler")
    same = verify_matches_decode(tiny, dtype, nodes, plain_sdpa, kernel=gemm != "torch", fused=gemm == "fused")
    if plain_sdpa:
        assert not all(same)
    else:
        assert all(same), same


def test_exact_mode_pads_past_a_faulty_kernel(tiny, tmp_path):
    """The control for exact.py: a GEMM that rounds short passes differently (as a GEMV or partial-block path
    does on some CPUs) breaks bit-exactness when every pass size is trusted, and the machine check finds
    the sizes that keep it."""
    fault = lambda m: fault_small_passes(m, below=8)
    assert not all(verify_matches_decode(tiny, torch.float32, 14, fault=fault, trust_all=True, cache=tmp_path / "a"))
    assert all(verify_matches_decode(tiny, torch.float32, 14, fault=fault, cache=tmp_path / "b"))
