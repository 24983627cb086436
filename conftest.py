"""Shared test fixtures: tiny random models written as real HF checkpoint folders, and the EAGLE-3 training
tests' fixtures (test_eagle_data, test_eagle_ckpt, test_eagle_train, test_eagle_ttt opt in to one_thread and quiet)."""
import atexit
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
import torch

import eagle_data as ed
from eagle import load_eagle
from model import load_model

# exact.py caches this machine's invariance answers on disk; tests start from an empty cache of their own
# (subprocesses inherit it, and processes that import this file again, as spawned ranks do, take it back from
# NANOSPEC_TEST_CACHE) so that they always exercise the check and never touch the user's cache
if not os.environ.get("NANOSPEC_TEST_CACHE"):  # the process that made it removes it (its kernels: 5 MB a run)
    os.environ["NANOSPEC_TEST_CACHE"] = tempfile.mkdtemp(prefix="nanospec-test-cache-")
    atexit.register(shutil.rmtree, os.environ["NANOSPEC_TEST_CACHE"], True)
os.environ["NANOSPEC_CACHE"] = os.environ["NANOSPEC_TEST_CACHE"]
# the CLI's budget memory outlives its process (engine.Engine's budget_cache): off, so that no test starts
# from another's; test_generate turns it on where it tests it
os.environ["NANOSPEC_BUDGET_CACHE"] = "off"
# bf16 models use cpu_gemm's kernel wherever it builds (not a timing check's verdict on tiny shapes), so runs
# are repeatable; tests that need torch's GEMM set NANOSPEC_CPU_GEMM=torch themselves
os.environ.setdefault("NANOSPEC_CPU_GEMM", "kernel")
# the one-time build (and its stderr note) happens here, once per test run, not inside a test that reads stderr
import cpu_gemm  # noqa: E402
import quant  # noqa: E402

cpu_gemm.kernel()

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5)


def write_tiny_hf(path, arch="llama", seed=0, shard=False, **over):
    """Save a randomly initialised HF model (transformers is the oracle) and return (folder, hf_model)."""
    import transformers as tf
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[arch]
    kw = dict(TINY, **over)
    if arch == "qwen3":
        kw.setdefault("head_dim", 16)
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    m = model_cls(cfg).float().eval()
    with torch.no_grad():  # random norms/biases so that code paths that ignore them fail
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(path, safe_serialization=True, max_shard_size="100KB" if shard else "5GB")
    json.dump({"eos_token_id": [1, 2]}, open(f"{path}/generation_config.json", "w"))
    if kw["vocab_size"] >= 256:
        write_byte_tokenizer(path)
    return path, m


def write_byte_tokenizer(path):
    """A byte-level tokenizer with ids 0..255 (one per byte) and a ChatML-like template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: ord(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(f"{path}/tokenizer.json")
    tmpl = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
    json.dump({"chat_template": tmpl, "eos_token": "\u0001"}, open(f"{path}/tokenizer_config.json", "w"))


@pytest.fixture
def tiny_llama(tmp_path):
    return write_tiny_hf(tmp_path / "llama")


def _rand(g, *shape, scale=0.05):
    return torch.randn(*shape, generator=g) * scale


def write_eagle_head(path, target_cfg: dict, version=3, seed=0, draft_vocab=None, fmt="safetensors",
                     fc_bias=False, prefix="midlayer.", extra_cfg=None):
    """A randomly initialised EAGLE head in the official layout (EAGLE-1/2: fc + layers.0 without
    input_layernorm; EAGLE-3: fc over 3 aux states, midlayer.*, norm, lm_head, d2t/t2d)."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    d, V = target_cfg["hidden_size"], target_cfg["vocab_size"]
    H, Hkv = target_cfg["num_attention_heads"], target_cfg["num_key_value_heads"]
    hd, I = d // H, target_cfg["intermediate_size"]
    qin = 2 * d if version == 3 else d
    lp = prefix if version == 3 else "layers.0."
    sd = {
        lp + "self_attn.q_proj.weight": _rand(g, H * hd, qin, scale=0.2),
        lp + "self_attn.k_proj.weight": _rand(g, Hkv * hd, qin, scale=0.2),
        lp + "self_attn.v_proj.weight": _rand(g, Hkv * hd, qin, scale=0.2),
        lp + "self_attn.o_proj.weight": _rand(g, d, H * hd, scale=0.2),
        lp + "mlp.gate_proj.weight": _rand(g, I, d, scale=0.2),
        lp + "mlp.up_proj.weight": _rand(g, I, d, scale=0.2),
        lp + "mlp.down_proj.weight": _rand(g, d, I, scale=0.2),
        lp + "post_attention_layernorm.weight": 1 + _rand(g, d),
        "fc.weight": _rand(g, d, 3 * d if version == 3 else 2 * d, scale=0.2),
        "embed_tokens.weight": _rand(g, V, d),  # some releases ship a copy; the engine must ignore it
    }
    if fc_bias:
        sd["fc.bias"] = _rand(g, d)
    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=d, intermediate_size=I, num_attention_heads=H,
               num_key_value_heads=Hkv, rms_norm_eps=1e-5, vocab_size=V, num_hidden_layers=1,
               max_position_embeddings=target_cfg.get("max_position_embeddings", 512))
    if version == 3:
        Vd = draft_vocab or V
        sd.update({lp + "input_layernorm.weight": 1 + _rand(g, d), lp + "hidden_norm.weight": 1 + _rand(g, d),
                   "norm.weight": 1 + _rand(g, d), "lm_head.weight": _rand(g, Vd, d, scale=1.0)})
        if Vd < V:
            keep = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
            sd["d2t"] = keep - torch.arange(Vd)
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[keep] = True
            sd["t2d"] = t2d
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=Vd)
    cfg.update(extra_cfg or {})
    json.dump(cfg, open(f"{path}/config.json", "w"))
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, f"{path}/model.safetensors")
    else:
        torch.save(sd, f"{path}/pytorch_model.bin")
    return path


@pytest.fixture(autouse=True)
def steady_machine(monkeypatch):
    """Timings taken in tests count as quiet (cbuild.measured_quietly), so a busy CI box measures each answer once,
    as the tests of the caches expect; test_cbuild.py drives the check itself."""
    import cbuild
    monkeypatch.setattr(cbuild, "run_delay", lambda: None)


# ---------------------------------------------------------------- EAGLE-3 training tests
# one_thread and quiet are not autouse here: the modules that want them say
# `pytestmark = pytest.mark.usefixtures("one_thread", "quiet")`

@pytest.fixture(scope="module")
def one_thread():
    # tiny matmuls: 2 OpenMP threads spin against other jobs on a shared 2-core box and run 100x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setenv("EAGLE_TRAIN_QUIET", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 6-layer random target (aux layers 2, 3, 3) with its own greedy continuations as training data."""
    root = tmp_path_factory.mktemp("eagle_train")
    path, _ = write_tiny_hf(root / "target", num_hidden_layers=6, vocab_size=260)
    m = load_model(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(176)]
    recs = ed.token_data(m, prompts, batch_size=32, max_new_tokens=48)
    ed.write_records(root / "train.jsonl", recs[:144], {})
    return dict(root=root, path=path, model=m, recs=recs, eval_prompts=prompts[144:])


def one_line_error(capsys, rc, *words):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for w in words:
        assert w in err[0], err[0]


@pytest.fixture(scope="module")
def draft_env(tmp_path_factory):
    """(root, tiny target folder, its config) for the drafter and EAGLE-head tests."""
    root = tmp_path_factory.mktemp("draft")
    path, _ = write_tiny_hf(root / "target")
    cfg = json.loads((path / "config.json").read_text())
    return root, path, cfg


def load_head(env, version=3, **kw):
    """(fp32 tiny target, an EAGLE head of that version written with kw and loaded onto it)."""
    root, path, cfg = env
    m = load_model(path, dtype=torch.float32)
    name = f"h{version}_" + "_".join(f"{k}{v}" for k, v in sorted(kw.items()))
    head = load_eagle(write_eagle_head(root / name, cfg, version=version, **kw), m, torch.float32, "cpu")
    return m, head


# ---------------------------------------------------------------- tiny GGUF files, written as llama.cpp would

GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GGUF_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
                 "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GGUF_F16_AT = quant.GGUF_F16_AT
gguf_blocks = quant.random_blocks  # (tests call it by this name)

def gguf_byte_chars():
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def llama_cpp_permute(w, n_head):
    # Verbatim shape logic of llama.cpp's convert_hf_to_gguf.py `permute` (HF -> GGUF).
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, arch="llama", types=None, layers=2, dim=64, heads=4, kv_heads=2, head_dim=16, ffn=96,
                    tied=True, seed=2, pre="smollm"):
    """A tiny GGUF written as llama.cpp would (llama: q/k rows permuted; qwen2: q/k/v biases; qwen3: q/k norms),
    F32 tensors but those `types` names (tensor name -> GGUF type: gguf's quantizer where it has one, else random
    blocks). -> {HF name: fp32 array of the weights the file holds (quantized ones dequantized)}."""
    import gguf

    from gguf_model import gguf_to_hf_name
    rng = np.random.default_rng(seed)
    merges = ["h e", "l l", "he ll", "Ġ w"]
    tokens = GGUF_SPECIALS + gguf_byte_chars() + ["he", "ll", "hell", "Ġw"]
    V, q, kv = len(tokens), heads * head_dim, kv_heads * head_dim
    shapes = {"token_embd.weight": (V, dim), "output_norm.weight": (dim,)}
    if not tied:
        shapes["output.weight"] = (V, dim)
    for i in range(layers):
        b = f"blk.{i}."
        shapes.update({b + "attn_q.weight": (q, dim), b + "attn_k.weight": (kv, dim), b + "attn_v.weight": (kv, dim),
                       b + "attn_output.weight": (dim, q), b + "ffn_gate.weight": (ffn, dim),
                       b + "ffn_up.weight": (ffn, dim), b + "ffn_down.weight": (dim, ffn),
                       b + "attn_norm.weight": (dim,), b + "ffn_norm.weight": (dim,)})
        if arch == "qwen2":
            shapes.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
        if arch == "qwen3":
            shapes.update({b + "attn_q_norm.weight": (head_dim,), b + "attn_k_norm.weight": (head_dim,)})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (V - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template(GGUF_TEMPLATE)
    hf = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32) * (0.1 if len(shape) == 2 else 0.2)
        if "norm" in name:
            x = 1 + x
        perm = heads if ".attn_q." in name else kv_heads if ".attn_k." in name else 0
        if perm and arch == "llama":
            x = llama_cpp_permute(x, perm)
        kind = (types or {}).get(name)
        if kind is None:
            w.add_tensor(name, np.ascontiguousarray(x))
        else:
            ty = gguf.GGMLQuantizationType[kind]
            try:
                x = gguf.quants.quantize(x, ty)
            except NotImplementedError:
                x = gguf_blocks(kind, *shape, rng)
            w.add_tensor(name, x, raw_dtype=ty)
            x = np.asarray(gguf.quants.dequantize(x, ty), dtype=np.float32).reshape(shape)
        if perm and arch == "llama":
            from gguf_model import unpermute_qk
            x = unpermute_qk(x, perm)
        hf[gguf_to_hf_name(name)] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def advised_huge(ptr: int) -> bool | None:
    """Whether the mapping holding address ptr is advised for huge pages (smaps' "hg" flag); None off Linux."""
    import os
    if not os.path.exists("/proc/self/smaps"):
        return None
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False
