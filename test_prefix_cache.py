"""The batch's shared prompt prefix (prefix_cache.py): prompts that open alike prefill only past it, every sequence
still its batch-1 output (fused pass and PyTorch layers, with and without drafters), and the caches a hit leaves
are the bits a whole prefill writes."""
import pytest
import torch

import cpu_forward
import draft_config as dc
from batch import BatchEngine
from prefix_cache import MIN_ROWS, PrefixCache, common
from test_batch import batch1, drafting, load, target  # noqa: F401 (target: the tiny model's fixture)

SYSTEM = list(range(100, 100 + MIN_ROWS + 4))  # a chat template's opening, shared by every prompt below
PROMPTS = [SYSTEM + t for t in ([5, 6, 7], [9, 10, 11, 12, 13], [40], [7, 7, 7, 7, 8], list(range(20, 40)),
                                [3, 4])]


def test_common_and_hit():
    assert common([1, 2, 3], [1, 2, 4]) == 2 and common([], [1]) == 0 and common([1, 2], [1, 2]) == 2
    pc = PrefixCache.__new__(PrefixCache)
    pc.tokens = SYSTEM
    assert pc.hit(SYSTEM + [1]) == len(SYSTEM)
    assert pc.hit(SYSTEM) == 0  # one row is left to prefill: its logits give the first token
    assert pc.hit([0] + SYSTEM + [1]) == 0 and pc.hit(SYSTEM[:-1] + [0, 1]) == 0


@pytest.mark.parametrize("fused", [True, False])
def test_prompts_sharing_a_prefix_are_their_batch1_output(target, monkeypatch, fused):  # noqa: F811
    """Batch 2 over 6 prompts opening with the same 20 tokens: from the third on each copies them in, and every
    output equals decoding it alone (fp32 on the PyTorch layers, whose caches are per layer)."""
    if fused and cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, fused, monkeypatch, torch.bfloat16 if fused else torch.float32)
    ref = batch1(m, PROMPTS, 16)
    eng = BatchEngine(m, batch=2, max_seq=96)
    assert eng.generate_batch(PROMPTS, 16) == ref
    assert eng.prefix.tokens == SYSTEM and eng.prefix.hits >= 3 and eng.prefix.saved == eng.prefix.hits * len(SYSTEM)


@pytest.mark.parametrize("kind", ["eagle", "hybrid"])
def test_drafters_read_the_whole_prompt_after_a_hit(target, tmp_path, monkeypatch, kind):  # noqa: F811
    """An EAGLE-3 head (its prefill over the prompt's states and aux layers, NanoSpec's window over its tokens)
    and the default's hybrid, every tree verified: the states of the copied rows come from the cache, and every
    output still equals the autoregressive batch-1 output."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, True, monkeypatch)
    ref = batch1(m, PROMPTS, 16)
    ds = dc.make_drafters(drafting(kind, target, tmp_path), m, 2)
    eng = BatchEngine(m, batch=2, max_seq=96, drafters=ds, budget=False)
    assert eng.generate_batch(PROMPTS, 16) == ref
    assert eng.prefix.hits >= 3 and eng.decode_tokens > eng.rows  # drafts were accepted


def test_a_hit_leaves_the_caches_a_whole_prefill_writes(target, monkeypatch):  # noqa: F811
    """The KV rows and transposed keys of a prompt prefilled past a hit equal, slot for slot, those of the same
    prompt prefilled whole; a mutation (one copied row of the wrong slot) fails."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, True, monkeypatch)
    T = len(PROMPTS[2])
    lanes = torch.arange(T)

    def cache_after(prompts, mutate=False):
        eng = BatchEngine(m, batch=1, max_seq=96)
        if mutate:
            put = eng.prefix.put
            eng.prefix.put = lambda start: (put(start), m.kv[:, :, :, start + 3].copy_(m.kv[:, :, :, start + 4]))
        m.kv.zero_()
        eng.generate_batch(prompts, 1)  # one token: the prefill alone writes the range
        kt = m.kt[:, :, lanes // 16, :, lanes % 16].clone() if m.kt.numel() else None
        return eng, m.kv[:, :, :, :T].clone(), kt

    hit, kv, kt = cache_after(PROMPTS[:3])
    assert hit.prefix.hits == 1  # the third prompt: the first two kept the prefix
    whole, kv0, kt0 = cache_after(PROMPTS[2:3])
    assert whole.prefix.hits == 0
    assert torch.equal(kv, kv0) and (kt is None or torch.equal(kt, kt0))
    _, bad, _ = cache_after(PROMPTS[:3], mutate=True)
    assert not torch.equal(bad, kv0)
