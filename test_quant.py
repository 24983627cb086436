"""Weight-only quantization (quant.py, quantize.py): the codes' error bounds, the layouts' round trips, GGUF's
blocks as gguf's dequantized values, the machine's kernel choice and its cache, a quantized model's pass
equal bit for bit to the bf16 pass on its dequantized weights, tree rows equal to autoregressive bits, every drafter
lossless on int8 and int4 targets, and bad input as one line."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import cpu_gemm
import draft_eagle as de
import draft_hybrid as dh
import draft_lookup as dl
import generate
import model as M
import qlinear
import quant
import quantize
from conftest import advised_huge, gguf_blocks, write_eagle_head, write_tiny_hf
from eagle import load_eagle
from engine import Engine
from test_cpu_forward import load, toks  # the fused-pass tests' loader (GEMM kernel on) and tokens
from vocab import make_vocab

needs_kernel = pytest.mark.skipif(cpu_gemm.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")

@pytest.mark.parametrize("bits,group", [(8, 64), (8, 192), (4, 32), (4, 64)])
def test_codes_are_within_half_a_step(bits, group):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 192, generator=g) * torch.rand(40, 1, generator=g)
    w[3, :group] = 0.25  # a constant group: scale 0, every code exact
    qw = quant.quantize(w, quant.Scheme(bits, group))
    s, m, c = qw.scales, qw.offsets, qw.values().to(torch.int16)
    assert c.shape == w.shape and (c.min() >= (0 if bits == 4 else -127)) and c.max() <= (15 if bits == 4 else 127)
    assert (m is None) == (bits == 8) and s.dtype == torch.float16 and s.shape == (40, 192 // group)
    step = s.float().repeat_interleave(group, 1)
    err = (qw.dequantize().float() - w).abs()
    # half a step, plus fp16's rounding of the scale and offset, plus bf16's of the weight
    assert (err <= step * 0.5 + w.abs() * 2 ** -8 + step * 16 * 2 ** -10 + 2 ** -20).all()
    assert torch.equal(qw.dequantize()[3, :group].float(), torch.full((group,), 0.25))
    assert (err.mean() < step.mean() * 0.3)  # codes are rounded, not truncated


def test_nibbles_round_trip():
    c = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    assert torch.equal(quant.unpack_nibbles(quant.pack_nibbles(c)), c)
    assert quant.pack_nibbles(c)[0, 0] == c[0, 0] | (c[0, 1] << 4)


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_layout_round_trips(bits):
    for N, K, group in SHAPES:
        qw = quant.quantize(torch.randn(N, K), quant.Scheme(bits, group))
        assert torch.equal(quant.unpack_planes(*quant.pack_planes(qw.values(), bits), N, bits), qw.values())
        back = quant.from_kernel(quant.to_kernel(qw), N)
        assert torch.equal(back.codes, qw.codes) and torch.equal(back.scales, qw.scales)
        assert torch.equal(quant.unpack_groups(quant.pack_groups(qw.scales), N), qw.scales)


def test_scheme_errors():
    with pytest.raises(quant.QuantError, match="does not divide its input width 576"):
        quant.Scheme(4, 128).check("x", 576)
    with pytest.raises(quant.QuantError, match="not supported"):
        quant.Scheme(3, 32).check("x", 64)


SHAPES = [(9, 64, 32), (200, 192, 64), (69, 256, 256), (128, 96, 32)]  # N: under a panel, tails, whole panels


GGUF_KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_blocks_are_gguf_dequantized_values(kind):
    """Each GGUF type's blocks read as they are: the QWeight's values are the gguf package's dequantize(), rounded
    to bf16, and the checkpoint layout round-trips through the kernel's."""
    import gguf
    rng = np.random.default_rng(GGUF_KINDS.index(kind))
    for N, K in [(9, 256), (130, 768)]:
        raw = gguf_blocks(kind, N, K, rng)
        ref = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), dtype=np.float32)
        qw = quant.from_gguf(raw, kind, K)
        assert torch.equal(qw.dequantize(), torch.from_numpy(ref.reshape(N, K)).bfloat16())
        assert torch.equal(quant.from_kernel(quant.to_kernel(qw), N).dequantize(), qw.dequantize())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A Qwen2-shaped tiny target (q/k/v bias, head size 64), its int8 and int4 copies, and each copy's
    dequantized bf16 twin (the same weights as plain bf16 tensors)."""
    root = tmp_path_factory.mktemp("quant")
    path, _ = write_tiny_hf(root / "bf16", arch="qwen2", hidden_size=192, intermediate_size=256,
                            num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, vocab_size=300,
                            max_position_embeddings=512)
    out = {"bf16": path}
    for mode in ("int8", "int4"):
        q = root / mode
        quantize.quantize_folder(path, q, mode, None)
        sd, twin = load_file(str(q / "model.safetensors")), {}
        for k, t in sd.items():
            if k.endswith(".qweight"):
                base = k.removesuffix(".qweight")
                twin[base + ".weight"] = quant.QWeight(t, sd[base + ".scales"], sd.get(base + ".offsets"),
                                                       8 if t.dtype == torch.int8 else 4).dequantize()
            elif not k.endswith((".scales", ".offsets")):
                twin[k] = t
        d = root / f"{mode}_twin"
        d.mkdir()
        save_file(twin, str(d / "model.safetensors"))
        cfg = json.loads((q / "config.json").read_text())
        del cfg[quant.CONFIG_KEY]
        (d / "config.json").write_text(json.dumps(cfg))
        out[mode], out[mode + "_twin"] = q, d
    return out


@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("fused", [True, False])
@torch.no_grad()
def test_quantized_pass_is_the_bf16_pass_on_its_dequantized_weights(folders, mode, fused, monkeypatch):
    q, twin = load(folders[mode], fused, monkeypatch), load(folders[mode + "_twin"], fused, monkeypatch)
    assert isinstance(q.layers[0].mlp.down_proj, qlinear.QLinear) and isinstance(q.lm_head, qlinear.QLinear)
    assert q.lm_head.bits == 8 and q.layers[0].mlp.down_proj.bits == (8 if mode == "int8" else 4)
    plan = M.Plan((2, 0))
    p = toks(37)
    for m in (q, twin):
        m.setup_caches(1, 256)
    a, b = (q(p, torch.arange(37), return_hidden=True, plan=plan),
            twin(p, torch.arange(37), return_hidden=True, plan=plan))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # one copy of the codes: the fused pass's q | k | v and gate | up chain the linears' own buffers
    at = q.layers[0].self_attn
    if fused:
        qkv = q.cpu_pass.keep[0]
        assert [c.w for c in qkv.chain] == [m.codes.data_ptr() for m in (at.q_proj, at.k_proj, at.v_proj)]
    assert qlinear.weight_bytes(q) < qlinear.weight_bytes(twin) * (0.7 if mode == "int8" else 0.6)


@needs_kernel
@torch.no_grad()
def test_int4_tree_rows_are_autoregressive_bits(folders, monkeypatch):
    """The exact-mode property on an int4 target: one pass over a tree gives each node the logits that decoding
    its path one token at a time gives (the fused pass is row-invariant by construction)."""
    m = load(folders["int4"], True, monkeypatch)
    parents = [-1, 0, 0, 1, 2, 2, 4, 3, 0]
    anc = torch.zeros(9, 9, dtype=torch.bool)
    for i in range(9):
        j = i
        while j >= 0:
            anc[i, j], j = True, parents[j]
    depth = anc.sum(1) - 1
    tk, T, n = toks(9, 2)[0], 37, torch.tensor(37)
    p = toks(T)
    m(p, torch.arange(T))
    lt = m(tk[None], n + depth, mask=M.tree_mask(m.seq_range, anc, n), cache_pos=n + torch.arange(9))
    for i in range(9):
        m(p, torch.arange(T))
        for t, j in enumerate(torch.nonzero(anc[i])[:, 0].tolist()):
            lo = m(tk[j].view(1, 1), torch.tensor([T + t]))
        assert torch.equal(lo[0, 0], lt[0, i]), i


PROMPTS = [[5, 17, 99, 3, 42, 42, 8], [200, 201, 202, 203, 200, 201, 202], list(range(30, 60))]


@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_every_drafter_is_lossless_on_quantized_targets(folders, mode, tmp_path):
    m = M.load_model(folders[mode], dtype=torch.bfloat16)
    cfg = json.loads((folders[mode] / "config.json").read_text())
    heads = {3: write_eagle_head(tmp_path / "e3", cfg), 1: write_eagle_head(tmp_path / "e2", cfg, version=1)}

    def eagle(vocab, version=3):
        head = load_eagle(heads[version], m, torch.bfloat16, "cpu")
        v = make_vocab(vocab, head.lm_weight(), w_max=64, max_append=10 + 4 * 3,
                       token_to_row=de.EagleDrafter.token_to_row_map(head))
        return de.EagleDrafter(head, v, 4, 3, 10, m.lm_head)

    drafters = {"ngram": lambda: dl.NgramDrafter(k=4), "eagle3": lambda: eagle("full"),
                "eagle2+nanospec": lambda: eagle("nanospec", version=1),
                "eagle3+nanospec": lambda: eagle("nanospec"),
                "hybrid": lambda: dh.HybridDrafter(eagle("nanospec"), dl.NgramDrafter(k=4)),
                "self": lambda: de.ModelDrafter(M.load_model(folders[mode], dtype=torch.bfloat16),
                                                make_vocab("full", m.lm_head.weight), k=3)}
    for p in PROMPTS:
        ref = Engine(m).generate(p, 40)[0]
        for name, make in drafters.items():
            out, st = Engine(m, drafter=make()).generate(p, 40)
            assert out == ref, (mode, name, p)
            if name == "self":
                assert st.mean_accepted_length > 3.0  # the quantized target drafting for itself is always right


def test_speculative_sampling_is_exact_on_an_int4_target(tmp_path, monkeypatch):
    """test_generate's chi-square test of the joint law of tokens 2 and 3 (prompt lookup's first tree, with
    siblings), its target the int4 copy of the tiny model (teacher-forced probabilities from the int4 model too)."""
    import test_generate as tg
    from sampling import Sampling
    real = tg.load_model

    def int4(path, dtype=None):
        q = tmp_path / "int4"
        if not q.exists():
            quantize.quantize_folder(path, q, "int4", None)
        m = real(q, dtype=torch.bfloat16)
        assert isinstance(m.layers[0].mlp.up_proj, qlinear.QLinear)
        return m
    monkeypatch.setattr(tg, "load_model", int4)
    tg.test_speculative_sampling_is_exact(tmp_path, monkeypatch, "ngram", Sampling(1.0), None)


def one_line(capsys, rc, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for w in words:
        assert w in err[0], err[0]


def test_quantize_cli_errors(folders, tmp_path, capsys):
    one_line(capsys, quantize.main(["--checkpoint", str(folders["bf16"]), "--mode", "int4", "--groupsize", "128",
                                    "--out", str(tmp_path / "a")]), "group size 128", "192")
    # a quantized checkpoint is quantized again from its bf16 values: the twin's int4 copy, bit for bit
    assert quantize.main(["--checkpoint", str(folders["int8"]), "--mode", "int4", "--out", str(tmp_path / "b")]) == 0
    assert quantize.main(["--checkpoint", str(folders["int8_twin"]), "--mode", "int4",
                          "--out", str(tmp_path / "b2")]) == 0
    re_sd, tw_sd = (load_file(str(tmp_path / "b" / "model.safetensors")),
                    load_file(str(tmp_path / "b2" / "model.safetensors")))
    assert set(re_sd) == set(tw_sd) and all(torch.equal(re_sd[k], tw_sd[k]) for k in re_sd)
    assert json.loads((tmp_path / "b" / "config.json").read_text())[quant.CONFIG_KEY]["requantized_from"] == "int8"
    capsys.readouterr()
    one_line(capsys, quantize.main(["--checkpoint", str(tmp_path / "nope"), "--mode", "int8",
                                    "--out", str(tmp_path / "c")]), "not found")
    one_line(capsys, quantize.main(["--checkpoint", str(folders["bf16"]), "--mode", "int8",
                                    "--out", str(folders["int8"])]), "not an empty folder")
    assert quantize.main(["--checkpoint", str(folders["bf16"]), "--mode", "int8", "--groupsize", "64",
                          "--out", str(tmp_path / "g64")]) == 0
    m = M.load_model(tmp_path / "g64", dtype=torch.bfloat16)
    assert m.layers[0].mlp.down_proj.group == 64 and m.lm_head.group == 192


@pytest.mark.parametrize("drop", [".scales", ".offsets"])
def test_a_quantized_checkpoint_missing_a_tensor_is_one_line(folders, tmp_path, capsys, drop):
    src = folders["int4"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj" + drop
    del sd[name]
    save_file(sd, str(bad / "model.safetensors"))
    one_line(capsys, generate.main(["--checkpoint", str(bad), "--prompt", "hi", "--max-new-tokens", "2",
                                    "--draft", "none"]), "layers.1.mlp.up_proj", drop.strip("."))


def test_the_machine_picks_the_kernel_once(folders, monkeypatch, tmp_path):
    """Quantized products take the C kernel or torch's by a timing check cached per machine (NANOSPEC_CPU_GEMM
    decides when set); a model loaded where torch's won runs torch's kernels in the PyTorch layers."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_gemm.ENV, raising=False)
    calls = []
    monkeypatch.setattr(qlinear, "_c_faster", lambda counts, rows, reps: calls.append(counts) or False)
    schemes = qlinear.schemes_of(load_file(str(folders["int4"] / "model.safetensors")))
    assert (4, 32, True, 192, 192) in schemes and (8, 192, False, 300, 192) in schemes
    try:
        assert qlinear.choose(schemes) is False and qlinear.choose(schemes) is False and len(calls) == 1  # cached
        m = M.load_model(folders["int4"], dtype=torch.bfloat16)
        assert m.cpu_pass is None and m.layers[0].mlp.down_proj.tq is not None
        assert len(Engine(m).generate([5, 6, 7], 4)[0]) == 4
        monkeypatch.setenv(cpu_gemm.ENV, "kernel")
        assert qlinear.choose(schemes) is True and len(calls) == 1
    finally:
        qlinear._C[0] = True


@needs_kernel
def test_the_kernel_layout_is_saved_beside_the_checkpoint(folders, tmp_path, monkeypatch):
    """A quantized checkpoint's kernel layout is written beside it at the first load on this ISA and mapped as it is
    afterwards (no packing, the same outputs); a changed checkpoint makes it stale; a read-only folder skips it."""
    import shutil
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    d = tmp_path / "int4"
    shutil.copytree(folders["int4"], d)
    p = toks(9)
    a = M.load_model(d)
    cache = d / f"kernel-{cpu_gemm.ISA}.safetensors"
    assert cache.is_file()
    packs = []
    real = quant.to_kernel
    monkeypatch.setattr(qlinear, "to_kernel", lambda qw: packs.append(1) or real(qw))
    b = M.load_model(d)
    for m in (a, b):
        m.setup_caches(1, 64)
    assert not packs and torch.equal(a(p, torch.arange(9)), b(p, torch.arange(9)))
    for m in (a, b):  # the weights a pass streams on 2 MiB pages, packed at this load or read from the layout's file
        assert advised_huge(m.layers[0].mlp.down_proj.codes.data_ptr()) in (True, None)
    os.utime(d / "model.safetensors", ns=(1, 1))  # the checkpoint changed: the saved layout is stale
    c = M.load_model(d)
    c.setup_caches(1, 64)
    assert packs and torch.equal(a(p, torch.arange(9)), c(p, torch.arange(9)))
    cache.unlink()
    packs.clear()
    d.chmod(0o555)
    try:
        M.load_model(d)
        assert packs and (os.geteuid() == 0 or not cache.exists())  # (root writes anyway)
    finally:
        d.chmod(0o755)


def test_an_engine_on_a_quantized_target_never_widens_its_lm_head(folders, monkeypatch):
    """Planning a request reads the passes' dtype and device, not a quantized LM head's .weight (which dequantizes
    every row: Qwen2.5-Coder-1.5B's 233M values had made a 3.1 GB transient when an engine was built)."""
    m = M.load_model(folders["int4"], dtype=torch.bfloat16)
    assert isinstance(m.lm_head, qlinear.QLinear)
    widened = []
    real = qlinear.QLinear.weight
    monkeypatch.setattr(qlinear.QLinear, "weight", property(lambda self: widened.append(self) or real.fget(self)))
    eng = Engine(m)
    assert len(eng.generate([5, 6, 7], 4)[0]) == 4
    assert not [w for w in widened if w is m.lm_head]
