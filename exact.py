"""Batch invariance, asked of this machine: which target-pass row counts give every row the same bits.

Greedy speculative output equals autoregressive output bit for bit only if a token's logits do not depend on how
many rows share its pass, and CPU kernels pick code paths by row count (per CPU and torch version). So each size
of LADDER is checked on this machine, every op of the model against REF-row passes on at least SAMPLES outputs
(a one-in-10^4 rounding escapes with probability e^-26), and passes are padded to the smallest agreeing size.
"""
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

import cpu_gemm
from cpu_gemm import cache_dir, machine_id, merge_json, read_json
from model import Transformer, causal_recent, exact_attention, exact_plan, kv_dtype

LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # pass sizes on offer (static shapes)
MAX_ROWS = LADDER[-1]  # exact mode's largest target pass (trees / chains up to this many nodes)
REF = 64  # the reference pass size every other size is compared with
SHIFT = 5  # the second offset: rows move to other places in their pass (and in any register block)
SAMPLES = 1 << 18  # outputs compared per pass size and op, at least (see above)


def check_rows(r: int, outputs: int) -> int:
    """Random rows to check r-row passes of an op with `outputs` values per row on (both offsets: SAMPLES)."""
    return max(REF, r + SHIFT, -(-SAMPLES // (2 * outputs)))


def rows_agree(fn, x: torch.Tensor, r: int) -> bool:
    """True iff fn (row-wise) in passes of r rows, from offsets 0 and SHIFT, gives x the bits of REF-row passes."""
    n, ref = x.shape[0], None
    for s in list(range(0, n - REF, REF)) + [n - REF]:  # REF-row passes covering all n rows, the last flush
        y = fn(x[s:s + REF])
        ref = y.new_empty((n, *y.shape[1:])) if ref is None else ref
        ref[s:s + REF] = y
    return all(torch.equal(fn(x[s:s + r]), ref[s:s + r]) for o in (0, SHIFT) for s in range(o, n - r + 1, r))


class PassRows(NamedTuple):
    gemm: int  # rows of the pass's GEMMs, norms and activations: the tokens, padded
    attn: int  # query rows of exact attention (>= gemm), padded with copies of the last row
    recent: bool = False  # the PyTorch layers take exact_attention's recent-key tables (exact mode, no fused pass)


class Invariance:
    """This machine's answers: pass_rows(n, S) -> PassRows at KV length S, None where no size agrees."""

    def __init__(self, model: Transformer, path: Path | None = None):
        self.model, self.path = model, path or cache_dir() / "invariance-v2.json"
        self.machine, self.memo = machine_id(), {}  # memo: (n, S) -> PassRows or None
        # the passes' dtype and device: the norm's (a quantized head's .weight widens all its rows on every read:
        # Qwen's 233M values had made a 3.1 GB transient here)
        w = model.norm.weight
        self.dtype, self.device = w.dtype, w.device
        self.answers = read_json(self.path).get(self.machine, {})

    def pass_rows(self, n: int, S: int) -> PassRows | None:
        if self.model.cpu_pass is not None:  # the fused CPU pass is row-invariant by construction (cpu_forward.py)
            return PassRows(n, n)
        if (n, S) not in self.memo:
            R = next((r for r in LADDER if r >= n and self.gemm_agrees(r)), None)
            A = None if R is None else next((r for r in LADDER if r >= R and self.attn_agrees(r, S)), None)
            self.memo[n, S] = None if A is None else PassRows(R, A)
        return self.memo[n, S]

    def gemm_agrees(self, r: int) -> bool:
        return all(self._answer(key, r, check) for key, check in self._gemm_checks())

    def attn_agrees(self, r: int, S: int) -> bool:
        a = self.model.args
        kdt = str(kv_dtype(self.dtype, self.device))[6:]
        key = f"exact-attention {kdt} H{a.n_heads}/{a.n_kv_heads} hd{a.head_dim} S{S}"
        return self._answer(key, r, lambda r: self._attention_agrees(r, S, self._randn()))

    def _answer(self, key: str, r: int, check) -> bool:
        k = f"{key} r={r}"
        if k not in self.answers:
            with torch.no_grad():
                self.answers[k] = bool(check(r))
            merge_json(self.path, self.machine, self.answers)
        return self.answers[k]

    def _randn(self):
        g = torch.Generator(device="cpu").manual_seed(0)
        return lambda *shape, dtype=self.dtype: torch.randn(*shape, generator=g).to(device=self.device, dtype=dtype)

    def _gemm_checks(self):
        """(cache key, check(r) -> bool) for the GEMMs, the norm and the activation of a target pass."""
        m, seen, randn = self.model, set(), self._randn()
        a, layer, dt = m.args, m.layers[0], self.dtype
        for mod in [mod for mod in layer.modules() if isinstance(mod, torch.nn.Linear)] + [m.lm_head]:
            w = mod.weight
            kern = " cpu_gemm" if cpu_gemm.enabled() and getattr(mod, "packed", None) is not None else ""
            key = f"linear {str(w.dtype)[6:]} {w.shape[1]}x{w.shape[0]}{' bias' if mod.bias is not None else ''}{kern}"
            if key not in seen:
                seen.add(key)
                N, K = w.shape
                yield key, lambda r, mod=mod, N=N, K=K: rows_agree(mod, randn(check_rows(r, N), K), r)
        norm, D, I = layer.input_layernorm, a.dim, a.intermediate_size
        yield f"rmsnorm {str(dt)[6:]} {D}", lambda r: rows_agree(norm, randn(check_rows(r, D), D), r)
        yield f"silu-mul {str(dt)[6:]} {I}", lambda r: rows_agree(lambda x: F.silu(x[:, :I]) * x[:, I:],
                                                                 randn(check_rows(r, I), 2 * I), r)

    def _attention_agrees(self, r: int, S: int, randn) -> bool:
        a = self.model.args
        kdt = kv_dtype(self.dtype, self.device)
        n = min(check_rows(r, a.n_heads * a.head_dim), S)  # query rows at the last positions (at most S)
        k, v = randn(1, a.n_kv_heads, S, a.head_dim, dtype=kdt), randn(1, a.n_kv_heads, S, a.head_dim, dtype=kdt)
        q = randn(1, a.n_heads, n, a.head_dim, dtype=kdt)
        pos = torch.arange(S - n, S, device=q.device)  # the last positions: the flash half sees most keys
        seq, g = torch.arange(S, device=q.device), a.n_heads // a.n_kv_heads

        def attn(rows):  # rows: [T] positions of a pass, with their queries
            i = rows - pos[0]
            return exact_attention(q.index_select(2, i), k, v, exact_plan(rows, causal_recent(rows), seq, g))
        return rows_agree(lambda rows: attn(rows).movedim(2, 0), pos, r)  # rows of the pass first
