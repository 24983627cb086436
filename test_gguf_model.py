"""gguf_model.py: llama.cpp's q/k permutation undone, names and metadata mapped for llama, qwen2 and qwen3 (the model
loaded from a tiny GGUF runs the bits of transformers' folder of the same weights), every block type loaded as its
codes and equal to its dequantized values, the fused pass over q | k | v of different types, and damaged files as
one line."""
import json

import numpy as np
import pytest
import torch

import download
import gguf_model
from conftest import GGUF_TEMPLATE, llama_cpp_permute, write_tiny_gguf
from download import CheckpointError

Q8 = {"blk.0.attn_q.weight": "Q8_0", "token_embd.weight": "Q8_0"}


@pytest.mark.parametrize("n_head,head_dim,rest", [(9, 8, (5,)), (3, 4, (7,)), (1, 2, (3,)),
                                                  (4, 6, ())])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, rest):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, *rest))
    g = llama_cpp_permute(w, n_head)
    assert not np.array_equal(g, w) or head_dim == 2 and n_head == 1
    np.testing.assert_array_equal(gguf_model.unpermute_qk(g, n_head), w)
    np.testing.assert_array_equal(llama_cpp_permute(gguf_model.unpermute_qk(w, n_head), n_head), w)


def _rope_half(x, pos, theta=10000.0):  # HF: rotate (i, i + d/2) pairs
    d = x.shape[-1]
    f = pos * theta ** (-np.arange(0, d, 2) / d)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * np.cos(f) - b * np.sin(f), a * np.sin(f) + b * np.cos(f)], -1)


def _rope_interleaved(x, pos, theta=10000.0):  # llama.cpp: rotate (2i, 2i + 1) pairs
    d = x.shape[-1]
    f = pos * theta ** (-np.arange(0, d, 2) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * np.cos(f) - b * np.sin(f), a * np.sin(f) + b * np.cos(f)
    return out


def test_permutation_matches_rope_conventions():
    # Attention scores from HF weights with rotate-half RoPE equal those from the
    # GGUF-permuted weights with llama.cpp's interleaved RoPE; unpermute gives HF back.
    rng = np.random.default_rng(1)
    n_head, n_kv, hd, d = 4, 2, 8, 12
    wq, wk = rng.standard_normal((n_head * hd, d)), rng.standard_normal((n_kv * hd, d))
    x1, x2 = rng.standard_normal(d), rng.standard_normal(d)
    gq, gk = llama_cpp_permute(wq, n_head), llama_cpp_permute(wk, n_kv)

    def scores(q_w, k_w, rope):
        q = rope((q_w @ x1).reshape(n_head, hd), 7)
        k = rope((k_w @ x2).reshape(n_kv, hd), 3)
        return np.einsum("hd,hd->h", q, np.repeat(k, n_head // n_kv, axis=0))

    np.testing.assert_allclose(scores(wq, wk, _rope_half), scores(gq, gk, _rope_interleaved))
    np.testing.assert_array_equal(gguf_model.unpermute_qk(gq, n_head), wq)
    np.testing.assert_array_equal(gguf_model.unpermute_qk(gk, n_kv), wk)


def test_gguf_to_hf_name():
    m = gguf_model.gguf_to_hf_name
    assert m("token_embd.weight") == "model.embed_tokens.weight"
    assert m("output_norm.weight") == "model.norm.weight"
    assert m("output.weight") == "lm_head.weight"
    assert m("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert m("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert m("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert m("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert m("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight"
    assert m("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert m("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert m("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert m("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert m("rope_freqs.weight") is None


def check_tiny_folder(out, hf):
    """A widened tiny llama GGUF's folder: its tensors, config, generation config and tokenizer."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == set(hf)
    for name, ref in hf.items():
        got = sd[name]
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == ref.shape, name
        assert torch.equal(got, torch.from_numpy(ref).bfloat16()), name  # the file's values, rounded to bf16
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["intermediate_size"] == 96 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["num_hidden_layers"] == 2 and cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["max_position_embeddings"] == 256 and cfg["vocab_size"] == 3 + 256 + 4
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == GGUF_TEMPLATE and tc["eos_token"] == "<|im_end|>"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("<|im_start|>hello world<|im_end|>", add_special_tokens=False)
    assert enc.tokens[:3] == ["<|im_start|>", "hell", "o"] and enc.ids[-1] == 2
    assert "Ġw" in enc.tokens
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello world"


def test_convert_tiny_gguf(tmp_path):
    hf = write_tiny_gguf(tmp_path / "tiny.gguf", types=Q8)
    out = tmp_path / "out"
    out.mkdir()
    gguf_model.convert_gguf(tmp_path / "tiny.gguf", out)
    check_tiny_folder(out, hf)


def _hf_folder(path, arch, hf, **cfg):
    """transformers' own folder of the weights hf (the oracle of the metadata's meaning)."""
    import transformers as tf
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    m = cls[1](cls[0](**cfg)).float()
    m.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()}, strict=False)
    assert torch.equal(m.lm_head.weight, torch.from_numpy(hf.get("lm_head.weight", hf["model.embed_tokens.weight"])))
    m.save_pretrained(path, safe_serialization=True)
    json.dump({"eos_token_id": [2, 0]}, open(path / "generation_config.json", "w"))
    return path


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_each_architecture_runs_the_bits_of_its_hf_folder(tmp_path, arch, tied, monkeypatch):
    """A tiny llama / qwen2 / qwen3 GGUF (F32) loads as transformers' folder of the same weights: every logit of a
    prompt equal (bf16, fused pass where the architecture has it), and the same greedy tokens as transformers."""
    import model as M
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / f"{arch}.gguf"
    hf = write_tiny_gguf(f, arch=arch, tied=tied, layers=2)
    cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=263, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=256,
               tie_word_embeddings=tied)
    ref = _hf_folder(tmp_path / "hf", arch, hf, **cfg)
    got = download.resolve_checkpoint(str(f))
    assert json.loads((got / "config.json").read_text())["architectures"] == [gguf_model.ARCHS[arch]]
    p = torch.tensor([[5, 9, 100, 3, 7, 7, 200, 261]])
    a, b = M.load_model(got), M.load_model(ref)
    for m in (a, b):
        m.setup_caches(1, 64)
    assert torch.equal(a(p, torch.arange(8)), b(p, torch.arange(8)))
    import transformers as tf
    hfm = tf.AutoModelForCausalLM.from_pretrained(ref, torch_dtype=torch.float32)
    want = hfm.generate(p, max_new_tokens=6, do_sample=False)[0, 8:].tolist()
    from engine import Engine
    assert Engine(M.load_model(got, dtype=torch.float32)).generate(p[0].tolist(), 6)[0] == want


K_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("kind", K_TYPES)
def test_every_block_type_loads_as_its_codes(tmp_path, monkeypatch, kind):
    """Each type's matrices (and a quantized embedding) load as their codes, equal to the widened file's values, and
    the model runs the widened model's bits, fused pass on and off; q | k | v of three types at once. Where the C
    kernel multiplies K-quants unwidened (every ISA's: their products are the unrounded weights'), the same bits
    fused and layer by layer, close to the widened model's."""
    from safetensors.torch import load_file

    import cpu_forward
    import cpu_gemm
    import model as M
    import qlinear
    import quant
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    f = tmp_path / "t.gguf"
    layer = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    mixed = {"blk.1.attn_q.weight": "Q4_K", "blk.1.attn_k.weight": "Q5_0", "blk.1.attn_v.weight": "Q6_K"}
    types = {f"blk.0.{n}.weight": kind for n in layer} | {"token_embd.weight": kind} | mixed
    hf = write_tiny_gguf(f, arch="qwen2", types=types, dim=256, ffn=512, heads=4, kv_heads=2, head_dim=64,
                         tied=False)
    native = download.resolve_checkpoint(str(f))
    cfg = json.loads((native / "config.json").read_text())
    assert cfg[quant.CONFIG_KEY]["gguf_types"][kind] >= 8
    sd = load_file(str(native / "model.safetensors"))
    assert "model.embed_tokens.qweight" in sd and "model.embed_tokens.weight" not in sd
    for base in [f"model.layers.0.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")] + ["model.embed_tokens"]:
        qw = quant.QWeight.pop(dict(sd), base, "t", *hf[base + ".weight"].shape)
        assert torch.equal(qw.dequantize(), torch.from_numpy(hf[base + ".weight"]).bfloat16()), base
    wide = tmp_path / "wide"
    wide.mkdir()
    gguf_model.convert_gguf(f, wide)
    p = torch.tensor([[5, 9, 100, 3, 7, 7, 200]])
    unwidened = cpu_gemm.kernel() is not None  # (the mixed layer's Q4_K and Q6_K: every kind meets a K-quant)
    native_out = {}
    for fused in ("on", "off"):
        monkeypatch.setenv(cpu_forward.ENV, fused)
        a, b = M.load_model(native), M.load_model(wide)
        assert (isinstance(a.embed_tokens, qlinear.QEmbedding)
                and isinstance(a.layers[1].self_attn.v_proj, qlinear.QLinear))
        assert (a.cpu_pass is not None) == (fused == "on")
        for m in (a, b):
            m.setup_caches(1, 64)
        native_out[fused], widened = a(p, torch.arange(7)), b(p, torch.arange(7))
        if unwidened:
            assert torch.allclose(native_out[fused].float(), widened.float(), atol=0.05 * widened.abs().max().item())
        else:
            assert torch.equal(native_out[fused], widened), fused
        assert torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    assert torch.equal(native_out["on"], native_out["off"])


def test_tied_quantized_embedding_is_the_lm_head(tmp_path, monkeypatch):
    """Tied: the LM head reads the embedding's codes (Q4_0 here, no offsets: a zero point of 8)."""
    import model as M
    import qlinear
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "t.gguf"
    hf = write_tiny_gguf(f, types={"token_embd.weight": "Q4_0", "blk.1.ffn_down.weight": "Q4_0"})
    m = M.load_model(download.resolve_checkpoint(str(f)))
    assert isinstance(m.lm_head, qlinear.QLinear) and m.lm_head.zero == 8 and m.lm_head.offsets is None
    emb = torch.from_numpy(hf["model.embed_tokens.weight"]).bfloat16()
    assert torch.equal(m.lm_head.weight, emb) and torch.equal(m.embed_tokens(torch.tensor([[4, 7]]))[0], emb[[4, 7]])


def test_gguf_of_another_block_type_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "q3.gguf"
    write_tiny_gguf(f, types={"blk.1.ffn_up.weight": "Q3_K"}, dim=256, ffn=256)
    with pytest.raises(CheckpointError) as e:
        download.resolve_checkpoint(str(f))
    assert "\n" not in str(e.value) and "blk.1.ffn_up.weight has type Q3_K" in str(e.value)
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


@pytest.mark.parametrize("cut", [5, 200, 2000, -100])
def test_truncated_or_corrupt_gguf_is_one_line(tmp_path, monkeypatch, capsys, cut):
    """A file cut short anywhere (header, metadata, tensor data) or not a GGUF: one line, exit code 2, no cache."""
    import generate
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "t.gguf"
    write_tiny_gguf(f)
    data = f.read_bytes()
    f.write_bytes(data[:cut] if cut > 0 else data[:cut])
    rc = generate.main(["--checkpoint", str(f), "--prompt", "hi", "--max-new-tokens", "2", "--draft", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and str(f) in err[0], err
    assert "truncated" in err[0] or "not a readable GGUF" in err[0]
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())
    f.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert generate.main(["--checkpoint", str(f), "--prompt", "hi", "--draft", "none"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_unknown_architecture_is_one_line(tmp_path):
    import gguf
    f = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(f), "mamba")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'mamba' is not supported"):
        gguf_model.convert_gguf(f, tmp_path)
