import json

import pytest
import torch

from conftest import write_tiny_hf
from download import CheckpointError, resolve_checkpoint
from engine import Engine
from model import ModelArgs, ModelError, Transformer, load_model
from tokenizer import Tokenizer
from model import Plan


def hf_logits(m, ids):
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch,shard", [("llama", False), ("qwen2", False), ("qwen3", True)])
def test_matches_transformers(tmp_path, arch, shard):
    path, hf = write_tiny_hf(tmp_path / arch, arch, shard=shard)
    m = load_model(path, dtype=torch.float32)
    m.setup_caches(1, 64)
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = m(torch.tensor([ids]), torch.arange(20))[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling(tmp_path):
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    path, hf = write_tiny_hf(tmp_path / "l3", rope_scaling=scaling, rope_theta=500000.0, tie_word_embeddings=True)
    m = load_model(path, dtype=torch.float32)
    assert m.args.rope_scaling["rope_type"] == "llama3" and m.args.tie_word_embeddings
    assert m.lm_head.weight is m.embed_tokens.weight
    m.setup_caches(1, 256)
    ids = list(range(3, 200))
    ours = m(torch.tensor([ids]), torch.arange(len(ids)))[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_cached_decode_equals_full_recompute(tiny_llama):
    path, _ = tiny_llama
    m = load_model(path, dtype=torch.float32)
    m.setup_caches(1, 64)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(2))
    full = m(ids, torch.arange(24))
    m.setup_caches(1, 64)
    step = [m(ids[:, :10], torch.arange(10))]
    for t in range(10, 24):
        step.append(m(ids[:, t:t + 1], torch.tensor([t])))
    torch.testing.assert_close(torch.cat(step, 1), full, atol=1e-5, rtol=1e-5)


def after_prefix(tiny_llama, n: int, seed: int):
    """The tiny model in fp32 with a random n-token prefix in its cache (64 slots)."""
    m = load_model(tiny_llama[0], dtype=torch.float32)
    m.setup_caches(1, 64)
    prefix = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))
    m(prefix, torch.arange(n))
    return m, prefix


def test_tree_masked_forward_equals_each_path(tiny_llama):
    m, prefix = after_prefix(tiny_llama, 8, 3)
    # tree: 0 root; 1,2 children of 0; 3 child of 1; 4 child of 3; 5 child of 2
    parents = [-1, 0, 0, 1, 3, 2]
    toks = torch.tensor([[5, 6, 7, 8, 9, 10]])
    n = len(parents)
    depth, anc = [], torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
    S = m.max_seq
    mask = torch.zeros(n, S, dtype=torch.bool)
    mask[:, :8] = True
    mask[:, 8:8 + n] = anc
    tree_logits = m(toks, 8 + torch.tensor(depth), mask=mask, cache_pos=8 + torch.arange(n))[0]
    for leaf in (4, 5):
        path_nodes, i = [], leaf
        while i >= 0:
            path_nodes.insert(0, i)
            i = parents[i]
        m.setup_caches(1, 32)
        seq = torch.cat([prefix, toks[:, path_nodes]], 1)
        ref = m(seq, torch.arange(seq.shape[1]))[0, 8:]
        torch.testing.assert_close(tree_logits[path_nodes], ref, atol=1e-5, rtol=1e-5)


def test_compact_kv_then_decode(tiny_llama):
    m, prefix = after_prefix(tiny_llama, 6, 4)
    # chain written at slots 6..9 but we "accept" nodes at slots 6, 8 (as if a tree with siblings)
    toks = torch.tensor([[11, 12, 13, 14]])
    mask = torch.zeros(4, m.max_seq, dtype=torch.bool)
    mask[:, :6] = True
    mask[0, 6] = True
    mask[1, [6, 7]] = True  # 1 child of 0 (rejected branch)
    mask[2, [6, 8]] = True  # 2 child of 0
    mask[3, [6, 8, 9]] = True
    m(toks, torch.tensor([6, 7, 7, 8]), mask=mask, cache_pos=torch.arange(6, 10))
    m.compact_kv(torch.tensor([6, 8, 9]), torch.tensor(6))
    out = m(torch.tensor([[15]]), torch.tensor([9]))[0, -1]
    m.setup_caches(1, 16)
    seq = torch.cat([prefix, torch.tensor([[11, 13, 14, 15]])], 1)
    ref = m(seq, torch.arange(10))[0, -1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_hidden_and_aux_states(tiny_llama):
    path, hf = tiny_llama
    m = load_model(path, dtype=torch.float32)
    m.setup_caches(1, 32)
    plan = Plan((0, 2, 3))
    ids = torch.arange(3, 13)[None]
    logits, h, aux = m(ids, torch.arange(10), return_hidden=True, plan=plan)
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    # HF hidden_states[i] is the input of layer i; the last entry is final-normed.
    torch.testing.assert_close(h, out.hidden_states[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, torch.cat([out.hidden_states[i] for i in (0, 2, 3)], -1), atol=1e-5, rtol=1e-5)


def test_causal_pass_over_the_whole_cache(tiny_llama):
    """causal=True (SDPA's is_causal, the trainer's pass) gives the masked pass's logits, hidden and aux states, and
    refuses rows that do not fill the cache or bring a mask."""
    path, hf = tiny_llama
    m = load_model(path, dtype=torch.float32)
    plan = Plan((0, 2, 3))
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    m.setup_caches(2, 12)
    ref = m(ids, torch.arange(12), return_hidden=True, plan=plan)
    got = m(ids, torch.arange(12), return_hidden=True, causal=True, plan=plan)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(got[0], hf(ids).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="fill the cache"):
        m(ids[:, :10], torch.arange(10), causal=True)
    with pytest.raises(ValueError, match="fill the cache"):
        m(ids, torch.arange(12), mask=m.causal_mask(torch.arange(12)), causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs(tiny_llama, dtype):
    m = load_model(tiny_llama[0], dtype=dtype)
    m.setup_caches(2, 32)
    out = m(torch.zeros(2, 5, dtype=torch.long), torch.arange(5))
    assert out.dtype == dtype and torch.isfinite(out.float()).all()


def test_loading_errors(tmp_path, tiny_llama):
    with pytest.raises(ModelError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        load_model(tmp_path / "empty")
    path, _ = tiny_llama
    cfg = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(ModelError, match="GPT2LMHeadModel"):
        load_model(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="no model.safetensors"):
        load_model(bad)
    (bad / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ModelError, match="cannot read"):
        load_model(bad)
    (bad / "config.json").write_text(json.dumps(dict(cfg, hidden_size=32)))
    (bad / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ModelError, match="shape"):
        load_model(bad)


def test_forward_traces_without_graph_breaks(tiny_llama):
    m = load_model(tiny_llama[0], dtype=torch.float32)
    m.setup_caches(1, 32)
    f = torch.compile(m.forward, fullgraph=True, backend="eager")
    ref = m(torch.tensor([[1, 2, 3]]), torch.arange(3))
    torch.testing.assert_close(f(torch.tensor([[1, 2, 3]]), torch.arange(3)), ref)
    torch.compile(m.compact_kv, fullgraph=True, backend="eager")(torch.tensor([1, 2]), torch.tensor(0))


DEFAULT_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
                   "Give me three tips for sleeping better.", "Translate 'good morning' into Spanish.",
                   "Summarize: The cat sat on the mat all day because it was warm."]


@pytest.fixture(scope="module")
def default_ckpt():
    try:
        return resolve_checkpoint(None)
    except CheckpointError as e:
        pytest.skip(f"default model unavailable: {e}")


def test_default_model_greedy_equals_transformers(default_ckpt):
    """Integration: our engine's greedy tokens == HF transformers' greedy tokens, fp32, 5 prompts x 64 tokens."""
    import transformers as tf
    tok = Tokenizer(default_ckpt)
    ours = Engine(load_model(default_ckpt, dtype=torch.float32))
    ours.model.args.eos_ids = []  # run all 64 tokens on both sides
    hf = tf.AutoModelForCausalLM.from_pretrained(default_ckpt, dtype=torch.float32).eval()
    for text in DEFAULT_PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": text}])
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        out, _ = ours.generate(ids, 64)
        assert out == ref, text


def test_default_chat_answer(default_ckpt):
    tok = Tokenizer(default_ckpt)
    eng = Engine(load_model(default_ckpt, dtype=torch.bfloat16))
    out, st = eng.generate(tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]), 32)
    assert "Paris" in tok.decode(out) and out[-1] in eng.model.args.eos_ids


def test_left_padded_batch_equals_single(tiny_llama):
    """Per-row RoPE positions + a per-row mask let rows of different lengths share one batch."""
    m = load_model(tiny_llama[0], dtype=torch.float32)
    a, b = [5, 6, 7, 8, 9], [11, 12, 13]
    pad = len(a) - len(b)
    m.setup_caches(2, 16)
    toks = torch.tensor([a, [0] * pad + b])
    pos = torch.stack([torch.arange(5), (torch.arange(5) - pad).clamp(min=0)])
    valid = torch.tensor([[True] * 5, [False] * pad + [True] * 3])
    causal = torch.arange(16)[None, :] <= torch.arange(5)[:, None]  # [T, S]
    keys = torch.cat([valid, torch.ones(2, 11, dtype=torch.bool)], 1)  # [B, S]
    mask = (causal[None] & keys[:, None, :])[:, None]  # [B, 1, T, S]
    out = m(toks, pos, mask=mask, cache_pos=torch.arange(5))
    m.setup_caches(1, 16)
    ref_b = m(torch.tensor([b]), torch.arange(3))[0]
    torch.testing.assert_close(out[1, pad:], ref_b, atol=1e-5, rtol=1e-5)
