"""Drafters: EAGLE-1/2 and EAGLE-3 heads, an independent draft model, prompt-lookup n-grams, and the
EAGLE-2 dynamic tree. Every drafter proposes a `Tree` (chains are the one-child case). Every LM-head
projection goes through `self.vocab.logits(h)` (vocab.py), which scores the active rows only.

What generate.py calls (batch 1, n = tokens already in the target's KV cache; root = the last emitted token,
not yet in the cache; L = accepted nodes, root included). The three drafters still differ in what they take:
    setup(max_seq)                                      every drafter, before a request
    EagleDrafter: prefill(feats, next_tokens), draft(root [1], n) -> Tree, update(path_feats, next_tokens, L, n)
    ModelDrafter: prefill(prompt ids), draft(root [1], n) -> Tree, update(path_tokens, L)
    NgramDrafter: prefill(prompt list), draft(root int, device) -> Tree, update(emitted list)  (host side)
"""
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import (Attention, KVCache, MLP, ModelArgs, ModelError, RMSNorm, Transformer, load_state_dict,
                   rope_cache)
from sampling import logits_to_probs, sample_from


# ---------------------------------------------------------------- trees

@dataclass
class Tree:
    tokens: Tensor  # [N] long, node 0 is the root (the last emitted token)
    parents: Tensor  # [N] long, -1 for the root; parents come before children
    depth: Tensor  # [N] long, root 0
    anc: Tensor  # [N, N] bool, anc[i, j] = j is i or an ancestor of i
    valid: Tensor  # [N] bool, padding nodes are never accepted
    q: Tensor | None = None  # [N, V] draft distribution that proposed each node's children (sampled chains)
    max_depth: int = 0  # static bound on depth: the accepted path has at most max_depth + 1 nodes


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """[N] parents (parents before children) -> [N, N] ancestor-or-self closure, in max_depth static steps."""
    N = parents.shape[0]
    eye = torch.eye(N, dtype=torch.bool, device=parents.device)
    # P[i, j] = j is the parent of i; ancestors = I + P + P^2 + ...; fp32 matmul keeps it static and sync-free.
    P = F.one_hot(parents.clamp(min=0), N).float() * (parents >= 0).float()[:, None]
    anc, step = eye.float(), eye.float()
    for _ in range(max_depth):
        step = step @ P
        anc = anc + step
    return anc > 0


def chain_tree(tokens: Tensor, valid: Tensor | None = None, q: Tensor | None = None) -> Tree:
    """A chain root -> t1 -> ... -> tk as a Tree."""
    N = tokens.shape[0]
    ar = torch.arange(N, device=tokens.device)
    anc = ar[None, :] <= ar[:, None]
    if valid is None:
        valid = torch.ones(N, dtype=torch.bool, device=tokens.device)
    return Tree(tokens, ar - 1, ar, anc, valid, q, N - 1)


def check_tree_budget(topk: int, depth: int, nodes: int):
    if depth < 1:
        raise ValueError(f"--tree-depth must be >= 1, got {depth}")
    if topk < 1:
        raise ValueError(f"--tree-topk must be >= 1, got {topk}")
    most = 1 + topk + (depth - 1) * topk * topk  # root + k first-level + k*k per deeper level
    if not 2 <= nodes <= most:
        raise ValueError(f"--tree-nodes {nodes} cannot fit a top-{topk} depth-{depth} tree (2..{most} nodes)")


# ---------------------------------------------------------------- EAGLE heads

@dataclass
class EagleConfig:
    version: int  # 2 = EAGLE-1/2 (one layer on fc([emb; h])), 3 = EAGLE-3
    args: ModelArgs  # the draft layer's dims, norm eps and RoPE (from the head's own config)
    fc_in: int  # 2d (EAGLE-1/2) or 3 * d_target (EAGLE-3)
    fc_bias: bool
    draft_vocab_size: int
    aux_layers: tuple = ()

    @classmethod
    def from_folder(cls, path: Path, keys: dict, target: ModelArgs) -> "EagleConfig":
        cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        version = 3 if any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in keys) else 2
        fc = keys.get("fc.weight")
        if fc is None:
            raise ModelError(f"{path} is not an EAGLE head (no fc.weight)")
        d = fc[0]
        heads = cfg.get("num_attention_heads", target.n_heads)
        rope = cfg.get("rope_parameters") or {}
        args = ModelArgs(
            arch="eagle", dim=d, n_layers=1, n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or d // heads,
            intermediate_size=cfg.get("intermediate_size", target.intermediate_size),
            vocab_size=target.vocab_size, norm_eps=cfg.get("rms_norm_eps", target.norm_eps),
            # the draft's RoPE comes from its own config; official EAGLE-3 heads omit it: base 10000
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=max(cfg.get("max_position_embeddings", 0), target.max_position_embeddings),
            qkv_bias=any(k.endswith("q_proj.bias") for k in keys),
        )
        if d != target.dim:
            raise ModelError(f"draft hidden size {d} does not match the target's {target.dim}")
        L = target.n_layers
        eagle_cfg = cfg.get("eagle_config") or {}
        aux = tuple(eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("aux_layer_ids") or (2, L // 2, L - 3))
        if version == 3:
            if fc[1] != 3 * target.dim:
                raise ModelError(f"EAGLE-3 fc takes {fc[1]} inputs, expected 3 x target hidden size = {3 * target.dim}")
            if any(not 0 <= i < L for i in aux):
                raise ModelError(f"EAGLE-3 aux layers {list(aux)} do not exist in a {L}-layer target")
        elif fc[1] != 2 * d:
            raise ModelError(f"EAGLE fc takes {fc[1]} inputs, expected 2 x hidden size = {2 * d}")
        dv = keys["lm_head.weight"][0] if "lm_head.weight" in keys else target.vocab_size
        dv = cfg.get("draft_vocab_size", dv)
        if version == 3 and dv > target.vocab_size:
            raise ModelError(f"draft vocabulary {dv} is larger than the target's {target.vocab_size}")
        return cls(version, args, fc[1], "fc.bias" in keys, dv, aux if version == 3 else ())


class EagleHead(nn.Module):
    """EAGLE-1/2 (version 2) and EAGLE-3 (version 3) draft heads, parameter names as in the official releases."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        self.c = c
        a = c.args
        self.fc = nn.Linear(c.fc_in, a.dim, bias=c.fc_bias)
        layer = nn.Module()
        layer.self_attn = Attention(a, in_dim=2 * a.dim if c.version == 3 else a.dim)
        layer.mlp = MLP(a)
        layer.post_attention_layernorm = RMSNorm(a.dim, a.norm_eps)
        if c.version == 3:
            layer.input_layernorm = RMSNorm(a.dim, a.norm_eps)
            layer.hidden_norm = RMSNorm(a.dim, a.norm_eps)
            self.midlayer = layer
            self.norm = RMSNorm(a.dim, a.norm_eps)
            self.lm_head = nn.Linear(a.dim, c.draft_vocab_size, bias=False)
            if c.draft_vocab_size != a.vocab_size:
                self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
                self.register_buffer("t2d", torch.zeros(a.vocab_size, dtype=torch.bool))
        else:
            self.layers = nn.ModuleList([layer])
        self.embed_tokens: nn.Embedding | None = None  # the target's, attached by attach()
        self.target_lm_head: nn.Linear | None = None

    @property
    def layer(self):
        return self.midlayer if self.c.version == 3 else self.layers[0]

    def setup_caches(self, max_seq: int):
        if getattr(self, "max_seq", None) == max_seq:
            return  # keep buffer addresses stable (captured CUDA graphs point at them)
        self.max_seq = max_seq
        a, w = self.c.args, self.fc.weight
        self.layer.self_attn.kv_cache = KVCache(1, max_seq, a.n_kv_heads, a.head_dim, w.dtype, w.device)
        cos, sin = rope_cache(max_seq, a.head_dim, a.rope_theta, a.rope_scaling)
        self.register_buffer("rope_cos", cos.to(w.device, w.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(w.device, w.dtype), persistent=False)
        self.register_buffer("seq_range", torch.arange(max_seq, device=w.device), persistent=False)

    def project(self, feats: Tensor) -> Tensor:
        """Target features -> draft input features: EAGLE-3 fuses the three aux states with fc."""
        return self.fc(feats) if self.c.version == 3 else feats

    def forward(self, tokens: Tensor, feats: Tensor, input_pos: Tensor, cache_pos: Tensor, mask: Tensor):
        """tokens [1, T], feats [1, T, d] (target features, already project()ed, or the draft's own output)
        -> (out [1, T, d] fed to deeper tree steps, lm_in [1, T, d] fed to the LM head)."""
        emb = self.embed_tokens(tokens)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        L = self.layer
        if self.c.version == 3:
            x = torch.cat([L.input_layernorm(emb), L.hidden_norm(feats)], dim=-1)  # embedding first
            h = feats + L.self_attn(x, cos, sin, mask, cache_pos)
        else:
            x = self.fc(torch.cat([emb, feats], dim=-1))
            h = x + L.self_attn(x, cos, sin, mask, cache_pos)
        h = h + L.mlp(L.post_attention_layernorm(h))
        return h, (self.norm(h) if self.c.version == 3 else h)

    def lm_weight(self) -> Tensor:
        return self.lm_head.weight if self.c.version == 3 else self.target_lm_head.weight


def read_keys(path: Path) -> tuple[dict, Path]:
    """{name: shape} of a head's weights (model.safetensors or pytorch_model.bin), names without 'model.'."""
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    if st.is_file():
        from safetensors import safe_open
        try:
            with safe_open(str(st), framework="pt") as f:
                keys = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:
            raise ModelError(f"cannot read {st}: {str(e).splitlines()[0]}") from None
        return {k.removeprefix("model."): v for k, v in keys.items()}, st
    if pt.is_file():
        sd = torch.load(pt, map_location="meta", weights_only=True, mmap=True)
        return {k.removeprefix("model."): tuple(v.shape) for k, v in sd.items()}, pt
    raise ModelError(f"no model.safetensors or pytorch_model.bin in {path}")


def load_eagle(path, target: Transformer, dtype, device) -> EagleHead:
    path = Path(path)
    keys, wfile = read_keys(path)
    c = EagleConfig.from_folder(path, keys, target.args)
    with torch.device("meta"):
        head = EagleHead(c)
    if wfile.suffix == ".bin":
        raw = torch.load(wfile, map_location="cpu", weights_only=True)
        sd = {k.removeprefix("model."): v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in raw.items()}
    else:
        sd = load_state_dict([wfile], dtype, device, strip_prefix="model.")
    if c.version == 3:  # SpecForge/vLLM exports sometimes name the midlayer layers.0
        sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.startswith("embed_tokens")}  # the target's embedding is used
    expected = head.state_dict()
    if c.version == 3 and c.draft_vocab_size != c.args.vocab_size and "d2t" not in sd:
        raise ModelError(f"EAGLE-3 head with draft vocabulary {c.draft_vocab_size} < {c.args.vocab_size} lacks d2t")
    if c.version == 3 and "lm_head.weight" not in sd and "draft_vocab_size" not in json.loads(
            (path / "config.json").read_text() if (path / "config.json").is_file() else "{}"):
        sd["lm_head.weight"] = target.lm_head.weight  # no draft vocabulary, no lm_head: the target's (as SGLang/vLLM)
    missing = [k for k in expected if k not in sd]
    if missing:
        raise ModelError(f"EAGLE head {path} lacks {missing[0]!r}")
    for k, v in expected.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ModelError(f"EAGLE head tensor {k} has shape {tuple(sd[k].shape)}, expected {tuple(v.shape)}")
    sd = {k: sd[k].to(device=device, dtype=v.dtype if not v.is_floating_point() else dtype) for k, v in expected.items()}
    if "d2t" in sd:
        sd["d2t"], sd["t2d"] = sd["d2t"].long(), sd["t2d"].bool()
    head.load_state_dict(sd, assign=True, strict=True)
    attach(head, target)
    return head.eval()


def attach(head: EagleHead, target: Transformer):
    # Not registered as submodules: the head must not own (or save) the target's tensors.
    object.__setattr__(head, "embed_tokens", target.embed_tokens)
    object.__setattr__(head, "target_lm_head", target.lm_head)


# ---------------------------------------------------------------- drafters

def timed_lm_head(drafter, h: Tensor):
    """drafter.vocab.logits(h), adding its wall time to drafter.lm_head_s in eager mode (exact on CPU; on CUDA
    it measures launch time unless the caller syncs). Skipped under torch.compile, where it would break the graph."""
    if torch.compiler.is_compiling():
        return drafter.vocab.logits(h)
    t0 = time.perf_counter()
    out = drafter.vocab.logits(h)
    drafter.lm_head_s += time.perf_counter() - t0
    return out


class EagleDrafter:
    """EAGLE-2 dynamic tree over an EAGLE-1/2 or EAGLE-3 head.

    Draft position i holds the pair (target feature f_i, token x_{i+1}); its output predicts x_{i+2}."""

    def __init__(self, head: EagleHead, vocab, topk=10, depth=5, nodes=60):
        check_tree_budget(topk, depth, nodes)
        self.head, self.vocab = head, vocab
        self.topk, self.depth, self.nodes = topk, depth, nodes
        self.version = head.c.version
        self.lm_head_s = 0.0  # wall time inside vocab.logits (accurate on CPU; on CUDA only when synced)
        # row <-> token maps for heads with a pruned vocabulary (EAGLE-3 d2t); identity otherwise
        self.tok_to_row = self.token_to_row_map(head)
        self.row_to_tok = None if self.tok_to_row is None else torch.arange(head.c.draft_vocab_size, device=head.d2t.device) + head.d2t

    @staticmethod
    def token_to_row_map(head: EagleHead) -> Tensor | None:
        """[V] target token -> draft row (-1 when the pruned draft vocabulary lacks it), None if unpruned."""
        if not hasattr(head, "d2t"):
            return None
        Vd, dev = head.c.draft_vocab_size, head.d2t.device
        t2r = torch.full((head.c.args.vocab_size,), -1, dtype=torch.long, device=dev)
        return t2r.index_copy(0, torch.arange(Vd, device=dev) + head.d2t, torch.arange(Vd, device=dev))

    def setup(self, max_seq: int):
        self.head.setup_caches(max_seq + self.depth * self.topk)
        d, w = self.head.c.args.dim, self.head.fc.weight
        if getattr(self, "last_out", None) is None:
            # persistent state buffers, written with copy_: captured graphs keep reading the same memory
            self.last_out = torch.zeros(d, dtype=w.dtype, device=w.device)
            self.last_lm_in = torch.zeros(d, dtype=w.dtype, device=w.device)

    def rows_of(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """target token ids -> (vocab rows, valid) (a pruned draft vocabulary lacks some tokens)."""
        if self.tok_to_row is None:
            return ids, torch.ones_like(ids, dtype=torch.bool)
        r = self.tok_to_row[ids]
        return r.clamp(min=0), r >= 0

    def tokens_of(self, rows: Tensor) -> Tensor:
        return rows if self.row_to_tok is None else self.row_to_tok[rows]

    def _logp(self, lm_in: Tensor) -> tuple[Tensor, Tensor]:
        scores, ids = timed_lm_head(self, lm_in)  # [..., n], [n] rows
        return torch.log_softmax(scores.float(), dim=-1), ids

    @torch.no_grad()
    def prefill(self, feats: Tensor, next_tokens: Tensor):
        """feats [1, T, F] target features of the prompt; next_tokens [T] = prompt[1:] + [first token]."""
        T = next_tokens.shape[0]
        pos = torch.arange(T, device=feats.device)
        h = self.head
        out, lm_in = h(next_tokens[None], h.project(feats), pos, pos, h.seq_range[None, :] <= pos[:, None])
        self.last_out.copy_(out[0, -1])
        self.last_lm_in.copy_(lm_in[0, -1])

    @torch.no_grad()
    def update(self, feats: Tensor, next_tokens: Tensor, L: Tensor, n: Tensor):
        """feats [1, D+1, F] at the accepted path (padded), next_tokens [D+1] the token after each path node
        (bonus last), L 0-dim accepted count, n 0-dim prefix length before the step."""
        h = self.head
        pos = n + torch.arange(next_tokens.shape[0], device=n.device)
        out, lm_in = h(next_tokens[None], h.project(feats), pos, pos, h.seq_range[None, :] <= pos[:, None])
        idx = (L - 1).view(1)
        self.last_out.copy_(out[0].index_select(0, idx)[0])
        self.last_lm_in.copy_(lm_in[0].index_select(0, idx)[0])

    @torch.no_grad()
    def draft(self, root: Tensor, n: Tensor) -> Tree:
        """EAGLE-2: expand the top-k frontier by cumulative log-probability for `depth` levels,
        then keep the best `nodes - 1` candidates. Static shapes throughout, no host syncs."""
        h, k, D, dev = self.head, self.topk, self.depth, root.device
        logp, ids = self._logp(self.last_lm_in[None])  # [1, n_rows]
        s, idx = torch.topk(logp[0], k)  # [k]
        cand_tok, cand_score, cand_parent = [self.tokens_of(ids[idx])], [s], [torch.full((k,), -1, device=dev)]
        fr_tok, fr_score, fr_cand = cand_tok[0], s, torch.arange(k, device=dev)
        fr_feat = self.last_out[None].expand(k, -1)  # [k, d]
        fr_anc = F.one_hot(torch.arange(k, device=dev), D * k).bool()  # frontier ancestors among draft slots
        base = 0  # index of the first candidate of the current level
        for lvl in range(1, D):
            slots = n + (lvl - 1) * k + torch.arange(k, device=dev)  # draft cache slots of this frontier
            mask = (h.seq_range[None, :] < n) | self._slot_mask(fr_anc, n)
            out, lm_in = h(fr_tok[None], fr_feat[None], (n + lvl - 1).expand(k), slots, mask)
            logp, ids = self._logp(lm_in[0])  # [k, n_rows]
            s, idx = torch.topk(logp, k, dim=-1)  # [k, k]
            sc = (fr_score[:, None] + s).flatten()  # cumulative log-prob of the k*k children
            tok = self.tokens_of(ids[idx]).flatten()
            parent = fr_cand.repeat_interleave(k)
            cand_tok.append(tok), cand_score.append(sc), cand_parent.append(parent)
            base += k if lvl == 1 else k * k
            top = torch.topk(sc, k).indices  # next frontier: best k of the k*k
            prow = top // k
            fr_tok, fr_score, fr_cand = tok[top], sc[top], base + top
            fr_feat = out[0, prow]
            fr_anc = fr_anc[prow] | F.one_hot(lvl * k + torch.arange(k, device=dev), D * k).bool()
        return self._rerank(torch.cat(cand_tok), torch.cat(cand_score), torch.cat(cand_parent), root)

    def _slot_mask(self, fr_anc: Tensor, n: Tensor) -> Tensor:
        # place the [k, D*k] ancestor rows at draft cache columns n .. n + D*k
        k = fr_anc.shape[0]
        m = torch.zeros(k, self.head.seq_range.shape[0], dtype=torch.bool, device=fr_anc.device)
        return m.index_copy(1, n + torch.arange(fr_anc.shape[1], device=fr_anc.device), fr_anc)

    def _rerank(self, tok, score, parent, root) -> Tree:
        k, N, dev = self.topk, self.nodes, tok.device
        C = tok.shape[0]
        level = torch.cat([torch.zeros(k, device=dev), torch.arange(1, self.depth, device=dev).repeat_interleave(k * k)])
        # a child's score never exceeds its parent's; the small depth penalty breaks exact ties the same
        # way, so a selected child's parent is always selected too
        key = torch.nan_to_num(score, nan=-1e30, neginf=-1e30) - 1e-4 * level
        sel = torch.sort(torch.topk(key, N - 1).indices).values  # [N-1], candidate order = parents first
        pos_of = torch.full((C,), -1, dtype=torch.long, device=dev).index_copy(0, sel, torch.arange(N - 1, device=dev))
        cp = parent[sel]
        parents = torch.cat([torch.tensor([-1], device=dev), torch.where(cp < 0, 0, pos_of[cp.clamp(min=0)] + 1)])
        depth = torch.cat([torch.zeros(1, device=dev), level[sel] + 1]).long()
        tokens = torch.cat([root.view(1), tok[sel]])
        anc = ancestor_mask(parents, self.depth)
        return Tree(tokens, parents, depth, anc, torch.ones(N, dtype=torch.bool, device=dev), None, self.depth)


class ModelDrafter:
    """An independent small model sharing the target's tokenizer; drafts a chain of k tokens."""

    def __init__(self, model: Transformer, vocab, k=5, sampling=None):
        if k < 1:
            raise ValueError(f"--spec-k must be >= 1, got {k}")
        self.model, self.vocab, self.k, self.sampling = model, vocab, k, sampling
        self.depth = k
        self.lm_head_s = 0.0

    def setup(self, max_seq: int):
        # the chain needs k + 1 slots past the verified prefix; the engine's cache budget already counts
        # them, so clamping to the draft's context only drops slack
        self.model.setup_caches(1, min(max_seq + self.k + 1, self.model.args.max_position_embeddings))
        if getattr(self, "prev", None) is None:
            self.prev = torch.zeros(1, dtype=torch.long, device=self.model.lm_head.weight.device)

    def rows_of(self, ids):
        return ids, torch.ones_like(ids, dtype=torch.bool)

    @torch.no_grad()
    def prefill(self, prompt: Tensor):
        T = prompt.shape[0]
        self.model(prompt[None], torch.arange(T, device=prompt.device), compute_logits=False)
        self.prev.copy_(prompt[-1:])


    @torch.no_grad()
    def draft(self, root: Tensor, n: Tensor) -> Tree:
        m, k = self.model, self.k
        # re-feed the previous token with the root: its KV is missing when the whole last chain was accepted
        toks, pos = torch.cat([self.prev, root.view(1)]), n - 1 + torch.arange(2, device=n.device)
        chain, qs = [root.view(1)], []
        for i in range(k):
            _, h, _ = m(toks[None], pos, return_hidden=True, compute_logits=False)
            scores, ids = timed_lm_head(self, h[0, -1])  # [n_rows]
            if self.sampling is None or self.sampling.greedy:
                nxt = ids.index_select(0, torch.argmax(scores).view(1))
            else:
                # index_add: inactive slots (prob 0) may repeat a token id, adding 0 keeps the real entry
                q = torch.zeros(m.args.vocab_size, device=n.device).index_add(0, ids, logits_to_probs(scores, self.sampling))
                qs.append(q)
                nxt = sample_from(q).view(1)
            chain.append(nxt)
            toks, pos = nxt, pos[-1:] + 1
        q = torch.stack(qs + [torch.zeros_like(qs[0])]) if qs else None
        return chain_tree(torch.cat(chain), q=q)

    def update(self, path_tokens: Tensor, L: Tensor):
        # the cache already holds root + accepted chain tokens at the right positions
        self.prev.copy_(path_tokens.index_select(0, (L - 1).view(1)))


class NgramDrafter:
    """Prompt lookup: the longest suffix (nmax..nmin tokens) seen earlier in prompt + output proposes
    the tokens that followed it. Works on the host token list, which the loop has anyway."""

    def __init__(self, k=10, nmin=1, nmax=3, static=False):
        if not 1 <= nmin <= nmax:
            raise ValueError(f"need 1 <= --ngram-min <= --ngram-max, got {nmin}, {nmax}")
        if k < 1:
            raise ValueError(f"--spec-k must be >= 1, got {k}")
        self.k, self.nmin, self.nmax = k, nmin, nmax
        self.depth, self.vocab, self.lm_head_s = k, None, 0.0
        # static: always propose k + 1 nodes (invalid padding), so a compiled verify step is traced once
        # instead of once per proposal length (each CPU inductor compile costs tens of seconds); for --compile
        self.static = static

    def setup(self, max_seq):
        pass

    def prefill(self, prompt: list[int]):
        self.hist = list(prompt)

    def propose(self, hist: list[int]) -> list[int]:
        for n in range(min(self.nmax, len(hist) - 1), self.nmin - 1, -1):
            suffix = hist[-n:]
            for s in range(len(hist) - n - 1, -1, -1):  # most recent earlier occurrence first
                if hist[s:s + n] == suffix:
                    return hist[s + n:s + n + self.k]
        return []

    def draft(self, root: int, device) -> Tree:
        self.root = root
        prop = self.propose(self.hist + [root])
        if not self.static:
            return chain_tree(torch.tensor([root] + prop, device=device))
        pad = self.k - len(prop)
        valid = torch.tensor([True] * (1 + len(prop)) + [False] * pad, device=device)
        return chain_tree(torch.tensor([root] + prop + [0] * pad, device=device), valid)

    def update(self, emitted: list[int]):
        # history = every token before the next root: this step's root, then the accepted tokens
        # (emitted ends with the bonus token, which is the next step's root)
        self.hist.append(self.root)
        self.hist.extend(emitted[:-1])


def detect_draft_kind(path: Path) -> str:
    """'eagle' (fc.weight present) or 'model' (a checkpoint model.py loads)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"draft folder not found: {path}")
    if (path / "model.safetensors.index.json").is_file():
        return "model"
    try:
        keys, _ = read_keys(path)
    except ModelError:
        raise ModelError(f"draft folder {path} holds no weights (model.safetensors or pytorch_model.bin)") from None
    if "fc.weight" in keys:
        return "eagle"
    if any(k.startswith("layers.") for k in keys) and "embed_tokens.weight" in keys:
        return "model"
    raise ModelError(f"draft folder {path} is neither an EAGLE head nor a causal LM checkpoint")
