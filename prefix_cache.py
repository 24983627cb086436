"""A batch's shared prompt prefix (the chat template's system prompt, a few-shot preamble): its KV rows, and the
target's states there that drafters read, kept once and copied into the range of each new sequence whose prompt
starts with it, so that sequence's prefill runs over the rest alone (vLLM's prefix caching, llama-server's slot
prompt cache, for the one prefix a server's requests share most).

Exact: with the fused CPU pass a row's K, V and states depend on its tokens and position alone (row-invariant
GEMMs, attention over its own keys in slot order), so the copies are the bits a whole prefill writes (test_batch
compares both caches slot for slot). SmolLM2's chat template opens every prompt with the same 24 tokens: 12% of
the first Spec-Bench prompts' 203 on average, and a server at 16 clients spends about half its time in prefill."""
import torch
from torch import Tensor

MIN_ROWS = 16  # a shared prefix shorter than this is not kept: its copies cost about what its rows do


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The prefix the last two prompts without a hit share (at least MIN_ROWS tokens): its tokens, KV rows (and
    transposed keys) and states; hit() says how many rows of a prompt it holds, put() writes them."""

    def __init__(self, model):
        self.model, self.tokens, self.last = model, [], None
        self.rows = self.hid = self.aux = None
        self.hits = self.saved = 0  # sequences that reused it, prompt rows they did not prefill

    def hit(self, prompt: list[int]) -> int:
        """Rows of prompt the cache holds (0: none); one row is always left to prefill (its logits)."""
        P = len(self.tokens)
        return P if P and len(prompt) > P and prompt[:P] == self.tokens else 0

    def put(self, start: int):
        """Writes the prefix's KV rows at slots start .. start + P - 1."""
        m, dst = self.model, start + torch.arange(len(self.tokens), device=self.model.norm.weight.device)
        self.hits, self.saved = self.hits + 1, self.saved + len(self.tokens)
        if m.kv is not None:
            kv, kt = self.rows
            m.kv.index_copy_(3, dst, kv)
            if kt is not None:  # kt [L, Hkv, S/16, hd/2, 16]: slot s is lane s % 16
                m.kt[:, :, dst // 16, :, dst % 16] = kt
            return
        for layer, (k, v) in zip(m.layers, self.rows):
            layer.self_attn.kv_cache.k.index_copy_(2, dst, k)
            layer.self_attn.kv_cache.v.index_copy_(2, dst, v)

    def keep(self, prompt: list[int], start: int, hid: Tensor | None, aux: Tensor | None):
        """After a prefill that did not hit: where prompt shares MIN_ROWS tokens or more with the last such prompt
        (and they are not the prefix held), keep them from its range (slots start ..) and its states hid, aux
        [1, T, *] (None: not needed)."""
        last, self.last = self.last, prompt
        P = min(common(prompt, last or []), len(prompt) - 1)
        if P < MIN_ROWS or prompt[:P] == self.tokens:
            return
        m, src = self.model, start + torch.arange(P, device=self.model.norm.weight.device)
        if m.kv is not None:
            kt = m.kt[:, :, src // 16, :, src % 16].clone() if m.kt is not None and m.kt.numel() else None
            self.rows = (m.kv.index_select(3, src), kt)
        else:
            self.rows = [(layer.self_attn.kv_cache.k.index_select(2, src),
                          layer.self_attn.kv_cache.v.index_select(2, src)) for layer in m.layers]
        self.tokens = prompt[:P]
        self.hid = None if hid is None else hid[:, :P].clone()
        self.aux = None if aux is None else aux[:, :P].clone()
