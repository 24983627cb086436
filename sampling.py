"""Sampling (temperature / top-k / top-p, sync-free draws) and the speculative acceptance rules."""
from dataclasses import dataclass

import torch
from torch import Tensor

import cpu_gemm


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int):
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        self.top_k = min(self.top_k, vocab_size)


def logits_to_probs(logits: Tensor, s: Sampling) -> Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k and top-p (static shapes)."""
    logits = logits.float() / max(s.temperature, 1e-5)
    if s.top_k:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        sp = sp.masked_fill((sp.cumsum(-1) - sp) >= s.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# csrc/argmax.c: torch's CPU argmax is a scalar loop (108 us per 49,152-entry bf16 row on the AVX2 EPYC, 5% of a
# 16-node verification); two AVX2 sweeps per row (the largest value, then its first index) take microseconds.
def _argmax_fn():
    return cpu_gemm.c_function("argmax_rows")


def _argmax_c(x: Tensor) -> Tensor:
    fn = _argmax_fn()
    if fn is None:
        return torch.argmax(x, dim=-1)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.long)
    fn(x2.data_ptr(), int(x2.dtype == torch.bfloat16), *x2.shape, out.data_ptr(), torch.get_num_threads())
    return out.view(x.shape[:-1])


@torch.library.custom_op("nanospec::argmax", mutates_args=())
def argmax_op(x: Tensor) -> Tensor:
    return _argmax_c(x)


@argmax_op.register_fake
def _(x):
    return x.new_empty(x.shape[:-1], dtype=torch.long)


def argmax(x: Tensor) -> Tensor:
    """torch.argmax(x, dim=-1), the same indices; CPU bf16 / fp32 rows through csrc/argmax.c where it builds."""
    if (x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() == 0
            or x.shape[-1] == 0 or x.requires_grad):
        return torch.argmax(x, dim=-1)
    if torch.compiler.is_compiling():
        return torch.ops.nanospec.argmax(x)  # (whether the C code builds is decided when the op runs)
    return _argmax_c(x)  # eager: skip the custom-op dispatch


def sample_from(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """A draw from each row of probs [..., V] (unnormalised, >= 0): the inverse CDF at one uniform per row, fp64
    running sums (fp32 ones over 49k entries drift by 1e-5), no host sync unlike torch.multinomial. An entry of no
    mass is never drawn. The exponential race it replaced drew a number per entry: 1.13 ms a 49k row on Zen 4, a
    tenth of a sampled decode step; this takes 0.13 ms."""
    c = probs.double().cumsum(-1)
    total = c[..., -1:].contiguous()
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator) * total
    # u rounds up to the total at most; the last entry with mass is the first whose running sum reaches it
    return torch.minimum(torch.searchsorted(c, u, right=True), torch.searchsorted(c, total))[..., 0]


def sample(logits: Tensor, s: Sampling, generator: torch.Generator | None = None) -> Tensor:
    return argmax(logits) if s.greedy else sample_from(logits_to_probs(logits, s), generator)


def best_path(tree, correct: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """correct [N] bool (is node i the target's choice given its parent) -> (path [D+1] node ids, L 0-dim
    accepted nodes incl. the root, best node). Static shapes: entries of path past L are padding."""
    correct = correct & tree.valid
    correct[:1].fill_(True)  # (not correct[0] = True: a host-to-device copy, illegal in a CUDA graph)
    ok = ~(tree.anc & ~correct[None, :]).any(-1)  # every node on the root path is correct
    best = torch.argmax(torch.where(ok, tree.depth, -1))
    levels = torch.arange(tree.max_depth + 1, device=correct.device)
    # index_select with a 1-element tensor (not t[best]) keeps the index on device for tracing
    on_path = tree.anc.index_select(0, best.view(1)) & (tree.depth[None, :] == levels[:, None])  # [D+1, N]
    return torch.argmax(on_path.int(), dim=-1), tree.depth.index_select(0, best.view(1))[0] + 1, best


def accept_greedy(tree, logits: Tensor):
    """logits [N, V] -> (path, L, bonus): the longest path whose tokens equal the target argmax."""
    pred = argmax(logits)  # [N]
    path, L, best = best_path(tree, tree.tokens == pred[tree.parents.clamp(min=0)])
    return path, L, pred.index_select(0, best.view(1))[0]


def accept(tree, logits: Tensor, s: Sampling, generator: torch.Generator | None = None):
    """The acceptance rule: a tree's logits [N, V] -> (path, L, bonus), device tensors of static shapes. Greedy: the
    longest path the target's argmax agrees with; sampled: the lossless rule on generator's stream (None: torch's).
    An eager batch step reads the greedy path on host lists instead (greedy_path)."""
    if s.greedy:
        return accept_greedy(tree, logits)
    return accept_sample(tree, logits_to_probs(logits, s), generator)


def greedy_path(tree, pred: list[int]) -> tuple[list[int], int, int]:
    """accept_greedy's (path padded, L, bonus) from the target's choice after each node, pred [N], on host lists:
    eager CPU steps (accept_greedy's device ops cost 0.1 ms a step)."""
    toks, par, dep, val = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist(), tree.valid.tolist()
    ok, best = [True] + [False] * (len(toks) - 1), 0
    for i in range(1, len(toks)):
        ok[i] = val[i] and ok[par[i]] and toks[i] == pred[par[i]]
        if ok[i] and dep[i] > dep[best]:
            best = i
    path, i = [], best
    while i >= 0:
        path.append(i)
        i = par[i]
    path.reverse()
    return path + [0] * (tree.max_depth + 1 - len(path)), len(path), pred[best]


def accept_sample(tree, probs: Tensor, generator: torch.Generator | None = None):
    """probs [N, V] -> (path, L, bonus), exact in distribution; generator: the random stream (None: torch's). Tree
    (q None): siblings in rank order, x accepted with p(x) / (1 - rejected siblings' p). Sampled chain: min(1, p/q),
    residual max(0, p - q)."""
    N, dev = tree.tokens.shape[0], probs.device
    par = tree.parents.clamp(min=0)
    V = probs.shape[-1]  # (flat indices: probs[par] copied N rows of V, 0.2-0.3 ms at N 8-11)
    px = probs.reshape(-1)[par * V + tree.tokens] * tree.valid  # [N] under the parent's distribution
    ar = torch.arange(N, device=dev)
    if tree.q is None:
        sib_before = (tree.parents[None, :] == tree.parents[:, None]) & (ar[None, :] < ar[:, None])
        rejected_mass = (sib_before.float() * px[None, :]).sum(-1)
        acc = px / (1.0 - rejected_mass).clamp(min=1e-20)
    else:
        acc = px / tree.q.reshape(-1)[par * V + tree.tokens].clamp(min=1e-20)
    hit = torch.rand(N, device=dev, generator=generator) < acc
    if tree.q is None:  # only the first hit among siblings counts: later ones were never tried
        hit = hit & ~(sib_before & hit[None, :]).any(-1)
    path, L, best = best_path(tree, hit)
    children = (tree.parents == best) & tree.valid  # all tried and rejected (or none)
    p = probs.index_select(0, best.view(1))[0]
    if tree.q is None:
        res = p * (1.0 - torch.zeros_like(p).scatter_reduce(0, tree.tokens, children.float(), "amax"))
    else:
        res = torch.where(children.any(), (p - tree.q.index_select(0, best.view(1))[0]).clamp(min=0), p)
    res = torch.where(res.sum() > 0, res, p)  # numerical guard: never sample from an all-zero residual
    return path, L, sample_from(res, generator)  # the draw scales by the row's sum: no renormalisation needed
