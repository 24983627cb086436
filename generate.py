"""CLI and decode loops: prefill, autoregressive decode, speculative steps, sampling, streaming, stats.

    python generate.py                                   # embedded SmolLM2-135M-Instruct, "capital of France"
    python generate.py --checkpoint meta-llama/Llama-3.1-8B-Instruct --prompt "Hi" --device cuda --compile
"""
import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

import draft as dr
from download import CheckpointError, resolve_checkpoint
from exact import MAX_ROWS, Invariance, PassRows, machine_id
from model import RECENT, ModelError, Transformer, causal_recent, load_model
from sampling import Sampling, accept_greedy, accept_sample, logits_to_probs, sample
from vocab import make_vocab

DEFAULT_PROMPT = "What is the capital of France?"
# EAGLE-2 tree (top-k, depth, nodes): the papers' 10/5/60 on GPUs; on CPU a 60-node verify costs about three
# decode steps (compute-bound), so a 16-node tree is faster at nearly the same acceptance (measured).
TREE_GPU, TREE_CPU = (10, 5, 60), (8, 5, 16)
DEFAULT_HEAD = Path(__file__).resolve().parent / "heads" / "SmolLM2-135M-Instruct-eagle3"  # trained by eagle_train.py


class UsageError(Exception):
    """Bad flags or input; reported as one line."""


# ---------------------------------------------------------------- tokenizer and chat template

class Tokenizer:
    """`tokenizers.Tokenizer` + the jinja2 chat template from tokenizer_config.json."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer
        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            raise UsageError(f"no tokenizer.json in {path}")
        try:
            self.tok = HFTokenizer.from_file(str(f))
        except Exception as e:
            raise UsageError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
        cfg_file = Path(path) / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # some configs hold several named templates
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"), None)
        self._template = None

    def special(self, name: str) -> str:
        v = self.config.get(name)
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise UsageError("this tokenizer has no chat template; use --raw")
        if self._template is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise jinja2.exceptions.TemplateError(msg)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
            env.filters["tojson"] = lambda x, indent=None, **k: json.dumps(x, indent=indent, ensure_ascii=False)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.special("bos_token"), eos_token=self.special("eos_token"))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already spells out BOS where the model wants it.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


# ---------------------------------------------------------------- decode loops

@dataclass
class Stats:
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    target_forwards: int = 0
    accept_hist: dict = field(default_factory=dict)  # accepted tokens per target forward -> count
    phase_s: dict = field(default_factory=dict)  # speculative phases (draft, lm_head, verify, ...)
    extra: dict = field(default_factory=dict)

    @property
    def total_s(self):
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        d = dict(new_tokens=self.new_tokens, prefill_s=round(self.prefill_s, 4), decode_s=round(self.decode_s, 4),
                 tokens_per_s=round(self.new_tokens / max(self.total_s, 1e-9), 2),
                 decode_tokens_per_s=round(self.new_tokens / max(self.decode_s, 1e-9), 2),
                 target_forwards=self.target_forwards)
        if self.accept_hist:
            d["mean_accepted_length"] = round(self.mean_accepted_length, 3)
            d["accept_hist"] = {str(k): v for k, v in sorted(self.accept_hist.items())}
        if self.phase_s:
            d["phase_s"] = {k: round(v, 4) for k, v in self.phase_s.items()}
        d.update(self.extra)
        return d

    @property
    def mean_accepted_length(self):
        n = sum(self.accept_hist.values())
        return sum(k * v for k, v in self.accept_hist.items()) / max(n, 1)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def cache_len(prompt_len: int, max_new: int, margin: int, limit: int) -> int:
    need = prompt_len + max_new + margin
    if need > limit:
        raise UsageError(f"prompt of {prompt_len} tokens + {max_new} new tokens exceeds the model's context of {limit} tokens")
    return min(limit, (need + 63) // 64 * 64)  # round up so nearby lengths share compiled graphs


# ---------------------------------------------------------------- speculative verification

def tree_mask(seq_range: Tensor, anc: Tensor, n: Tensor) -> Tensor:
    """[N, S] bool: every node sees the cached prefix (slots < n) and its own ancestors (slots n + j)."""
    N = anc.shape[0]
    cols = torch.zeros(N, seq_range.shape[0], dtype=torch.bool, device=anc.device)
    cols = cols.index_copy(1, n + torch.arange(N, device=anc.device), anc)
    return (seq_range[None, :] < n) | cols


def tree_recent(anc: Tensor, depth: Tensor, n: Tensor, W: int = RECENT) -> Tensor:
    """[N, W] KV slots of each tree node's last W keys in logical order (model.exact_attention): keys before
    the step's first slot n are the prefix (slot == position), the rest are the node's ancestors at depth
    t = position - n, which sit at slot n + (ancestor's node index). Exact for chains of any length and
    for trees shallower than W (deeper tree nodes would meet scattered ancestors in the flash half)."""
    N, dev = anc.shape[0], anc.device
    lv = torch.arange(N, device=dev)  # depth < N: chains of any length work too
    anc_at = torch.argmax((anc[:, None, :] & (depth[None, None, :] == lv[None, :, None])).int(), dim=-1)  # [N, N]
    j = (n + depth)[:, None] - (W - 1) + torch.arange(W, device=dev)  # [N, W] logical positions
    in_tree = n + anc_at.gather(1, (j - n).clamp(0, N - 1))
    return torch.where(j < n, torch.where(j >= 0, j, -1), in_tree)


# ---------------------------------------------------------------- the engine

class Engine:
    """Holds the target (and optionally a drafter with its draft vocabulary); one generation at a time."""

    def __init__(self, model: Transformer, sampling: Sampling = Sampling(), compile: bool = False, drafter=None,
                 max_seq: int = 4096, backend: str = "inductor", exact: bool | None = None):
        self.model = model
        self.sampling = sampling
        self.drafter = drafter
        self.device = model.lm_head.weight.device
        self.decode_fn = self._decode_one
        self.verify_step, self.advance_step = self._spec_verify, self._spec_advance
        cuda = self.device.type == "cuda"
        # CPU: bit-exact greedy output (exact attention + pass sizes this machine's kernels keep row-invariant,
        # exact.py). exact=None uses it wherever the machine's check passes; True insists; False turns it off.
        # CUDA's SDPA and cuBLAS kernels are not batch-invariant, so there greedy output equals autoregressive
        # output up to floating-point near-ties (as in vLLM and SGLang).
        if exact and cuda:
            raise UsageError("--exact is CPU-only (CUDA kernels are not batch invariant)")
        # exact tree verification gathers each node's last RECENT keys: trees must be shallower (chains need not)
        too_deep = getattr(drafter, "depth", 0) >= RECENT and hasattr(drafter, "nodes")
        if exact and too_deep:
            raise UsageError(f"--tree-depth must be below {RECENT} (exact tree verification), got {drafter.depth}")
        self.exact_requested = exact
        self.invariance = None if exact is False or cuda or too_deep else Invariance(model)
        self.exact = False  # decided per request (plan): the attention check depends on the KV length
        self.R_dec = self.R_ver = PassRows(1, 1)  # rows of the decode and verify passes of the current request
        # CUDA graphs need fixed buffer addresses: one KV cache of max_seq slots for every request
        self.graphs = compile and cuda
        self.graph_addresses = None
        self.max_seq = min(max_seq, model.args.max_position_embeddings)
        self.fused_steps = compile  # eager keeps the steps apart to time each phase
        if compile:
            if getattr(drafter, "static", True) is False:
                print("note: n-gram drafting under --compile without static chains retraces the verify step per "
                      "proposal length (build it with NgramDrafter(..., static=True))", file=sys.stderr)
            # reduce-overhead = CUDA graphs on CUDA; on CPU inductor fuses the small per-layer ops.
            self.decode_fn = torch.compile(self._decode_one, mode="reduce-overhead" if cuda else None,
                                           fullgraph=True, dynamic=False, backend=backend)
            if cuda:  # explicit capture of the eager steps: robust with the copy-stream fork/join inside
                self.verify_step = Graphed(self._spec_verify)
                self.advance_step = Graphed(self._spec_advance)
            else:
                self.verify_step = torch.compile(self._spec_verify, fullgraph=True, dynamic=False, backend=backend)
                self.advance_step = torch.compile(self._spec_advance, fullgraph=True, dynamic=False, backend=backend)

    def _buffer_addresses(self) -> tuple:
        """Addresses of the KV caches and RoPE tables of the target and the draft model or head."""
        mods = [self.model] + [getattr(self.drafter, a, None) for a in ("head", "model")]
        return tuple(b.data_ptr() for mod in mods if isinstance(mod, torch.nn.Module) for b in mod.buffers())

    def plan(self, T: int, max_new: int, n: int) -> tuple[int, PassRows]:
        """(KV slots S, rows of each target pass after the prefill) for a request whose passes carry at most
        n tokens; decides self.exact. Exact mode sizes the cache without the drafter's margin, so that
        autoregressive and speculative runs attend over the same KV length (one kernel class), and pads passes
        to the smallest size that this machine keeps row-invariant at that length (exact.py)."""
        limit = self.model.args.max_position_embeddings
        S, R = cache_len(T, max_new, n + 1, limit), PassRows(n, n)  # raises when even the plain request does not fit
        fixed = self.max_seq if self.graphs else None  # one cache size for every request: no re-capture per length
        if fixed is not None:
            if T + max_new + n + 1 > fixed:
                raise UsageError(f"prompt of {T} tokens + {max_new} new tokens exceeds --max-seq {fixed}")
            S = fixed
        self.exact = False
        Re = None
        if self.invariance is not None and n <= MAX_ROWS:
            Se = fixed or min(limit, -(-(T + max_new + MAX_ROWS) // 128) * 128)
            Re = self.invariance.pass_rows(n, Se)
            if Re is not None and T + max_new + Re.attn + 1 <= Se:
                self.exact, S, R = True, Se, Re
        if self.exact_requested and not self.exact:
            why = (f"a pass of {n} tokens is more than exact mode's {MAX_ROWS} rows" if n > MAX_ROWS else
                   f"no target pass of {n} to {MAX_ROWS} rows gives every row the same bits on this CPU ({machine_id()})"
                   if Re is None else "the padded passes do not fit the model's context")
            raise UsageError(f"--exact: {why}; use --no-exact")
        return S, R

    def rows(self, n: int, S: int) -> PassRows:
        """Rows to pad a pass of n tokens to, in this request's mode (plan)."""
        if not self.exact:
            return PassRows(n, n)
        R = self.invariance.pass_rows(n, S)
        if R is None:
            raise UsageError(f"--exact: no target pass of {n} rows is row-invariant on this CPU; use --no-exact")
        return R

    def _decode_one(self, tok: Tensor, pos: Tensor) -> Tensor:
        # tok [1, 1], pos [1] -> next token [1] (sampled on device). Padded to R_dec rows (exact mode, see
        # plan) so every row gets the bits a tree verification gives it: the pad rows write KV slots past
        # the prefix, which the next step overwrites before anything attends to them.
        R = self.R_dec.gemm
        p = pos + torch.arange(R, device=pos.device)
        logits = self.model(tok.expand(1, R), p, recent=causal_recent(p) if self.exact else None,
                            attn_rows=self.R_dec.attn)[:, 0]
        return sample(logits, self.sampling)

    def _verify(self, tokens: Tensor, depth: Tensor, anc: Tensor, n: Tensor):
        # one target pass over the flattened tree: positions n + depth, KV slots n + node index.
        # Pad nodes up to R_ver rows (exact mode, see plan) see only themselves.
        m = self.model
        N = tokens.shape[0]
        R = max(self.R_ver.gemm, N)
        if N < R:
            P = R - N
            tokens = torch.cat([tokens, tokens.new_zeros(P)])
            depth = torch.cat([depth, depth.new_zeros(P)])
            eye = torch.eye(R, dtype=torch.bool, device=anc.device)
            anc = torch.cat([torch.cat([anc, anc.new_zeros(N, P)], 1), eye[N:]], 0)
        mask = tree_mask(m.seq_range, anc, n)
        recent = tree_recent(anc, depth, n) if self.exact else None
        logits, hid, aux = m(tokens[None], n + depth, mask=mask, cache_pos=n + torch.arange(tokens.shape[0], device=n.device),
                             return_hidden=True, recent=recent, attn_rows=max(self.R_ver.attn, R))
        return logits[:, :N], hid[:, :N], (aux[:, :N] if aux is not None else None)

    def warmup(self):
        """One tiny prefill + decode so one-time kernel set-up (oneDNN, cuBLAS) is not billed to the first prompt."""
        saved = self.drafter
        self.drafter = None
        try:
            self.generate([0, 1], 2)
        finally:
            self.drafter = saved

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, on_tokens=None) -> tuple[list[int], Stats]:
        T = len(prompt)
        if T == 0:
            raise UsageError("empty prompt")
        if self.drafter is not None:
            return self._generate_spec(prompt, max_new_tokens, on_tokens)
        m, dev = self.model, self.device
        S, self.R_dec = self.plan(T, max_new_tokens, 1)
        m.setup_caches(1, S)
        st = Stats(extra=dict(exact=self.exact))
        t0 = time.perf_counter()
        logits = m(torch.tensor([prompt], device=dev), torch.arange(T, device=dev))[:, -1]
        tok = sample(logits, self.sampling)  # [1]
        out = [int(tok)]
        st.prefill_s = time.perf_counter() - t0
        st.target_forwards = 1
        if on_tokens:
            on_tokens(out)
        t0 = time.perf_counter()
        pos = torch.tensor([T], device=dev)
        while len(out) < max_new_tokens and out[-1] not in m.args.eos_ids:
            tok = self.decode_fn(tok.view(1, 1), pos)
            pos += 1
            out.append(int(tok))  # the one host sync per token: needed for eos and streaming
            st.target_forwards += 1
            if on_tokens:
                on_tokens(out[-1:])
        sync(dev)
        st.decode_s = time.perf_counter() - t0
        st.new_tokens = len(out)
        return out, st

    # ------------------------------------------------ speculative decoding
    # A step is split in two static-shape, sync-free halves so each can be torch.compiled (CPU) or replayed
    # from a CUDA graph (CUDA --compile): verify = target pass + acceptance + KV compaction; advance =
    # drafter update + vocabulary update + the next draft. Between them sits the step's one host sync.

    def _spec_verify(self, tokens, parents, depth, anc, valid, q, n, max_depth: int):
        d = self.drafter
        tree = dr.Tree(tokens, parents, depth, anc, valid, q, max_depth)
        logits, hid, aux = self._verify(tokens, depth, anc, n)
        logits = logits[0]  # [N, V]
        if self.sampling.greedy:
            path, L, bonus = accept_greedy(tree, logits)
        else:
            path, L, bonus = accept_sample(tree, logits_to_probs(logits, self.sampling))
        self.model.compact_kv(n + path, n)
        host = torch.cat([L.view(1), tokens[path], bonus.view(1)])  # what the host needs, read in one sync
        feats = (aux if d.version == 3 else hid).index_select(1, path) if isinstance(d, dr.EagleDrafter) else None
        vocab = d.vocab
        ver = torch.topk(logits.index_select(0, path), vocab.k_ver, dim=-1).indices if hasattr(vocab, "k_ver") else None
        return host, path, L, bonus, feats, ver

    def _spec_update(self, tokens, valid, path, L, bonus, feats, ver, n):
        """Feed the accepted path to the drafter and the candidate stream; returns the step's vocabulary
        stats (coverage hits, active size), measured before this step's append."""
        d, vocab, dev = self.drafter, self.drafter.vocab, tokens.device
        Dp = path.shape[0]
        nxt = torch.cat([tokens[path[1:]], bonus.view(1)])  # the token after each path node; bonus last
        nxt = torch.where(torch.arange(Dp, device=dev) == L - 1, bonus, nxt)
        if isinstance(d, dr.EagleDrafter):
            d.update(feats, nxt, L, n)
        else:
            d.update(tokens[path], L)
        # coverage (paper Fig. 1b): were the emitted tokens in the active vocabulary during this step?
        em_rows, em_ok = d.rows_of(nxt)
        em_ok = em_ok & (torch.arange(Dp, device=dev) < L)
        cov = (vocab.contains(em_rows) & em_ok).sum()
        act = vocab.active_size()
        if ver is not None:
            drows, dvalid = d.rows_of(tokens)
            vrows, vvalid = d.rows_of(ver)
            vocab.update(drows, dvalid & valid, vrows, vvalid & (torch.arange(Dp, device=dev) < L)[:, None])
        return cov, act

    def _spec_advance(self, tokens, valid, path, L, bonus, feats, ver, n):
        """update + next draft in one function (one graph: the vocabulary gather on the copy stream
        overlaps the draft backbone and joins right before the first LM-head projection)."""
        cov, act = self._spec_update(tokens, valid, path, L, bonus, feats, ver, n)
        t = self.drafter.draft(bonus.view(1), n + L)
        return t.tokens, t.parents, t.depth, t.anc, t.valid, t.q, cov, act

    def _generate_spec(self, prompt: list[int], max_new_tokens: int, on_tokens=None) -> tuple[list[int], Stats]:
        m, dev, d = self.model, self.device, self.drafter
        eos = set(m.args.eos_ids)
        T = len(prompt)
        D = d.depth
        N = getattr(d, "nodes", D + 1)  # tokens per verification (n-gram chains: at most k + 1)
        S, self.R_ver = self.plan(T, max_new_tokens, N)
        m.setup_caches(1, S)
        d.setup(S)
        graphed = [s for s in (self.verify_step, self.advance_step) if isinstance(s, Graphed)]
        if graphed:  # (torch.compile'd CPU steps guard on their buffers themselves)
            addresses = self._buffer_addresses()
            if addresses != self.graph_addresses:
                # another engine sharing this model or head resized its caches: the captured graphs would
                # read the freed buffers, so capture again on the new ones
                for step in graphed:
                    step.reset()
                self.graph_addresses = addresses
        vocab = d.vocab
        ngram = isinstance(d, dr.NgramDrafter)
        st = Stats(phase_s=dict(draft=0.0, lm_head=0.0, verify=0.0, sync=0.0, update=0.0), extra=dict(exact=self.exact))
        d.lm_head_s = 0.0
        t0 = time.perf_counter()
        ptoks = torch.tensor(prompt, device=dev)
        logits, hid, aux = m(ptoks[None], torch.arange(T, device=dev), return_hidden=True)
        tok = sample(logits[:, -1], self.sampling)  # [1]
        n_dev = torch.tensor(T, device=dev)
        if isinstance(d, dr.EagleDrafter):
            d.prefill(aux if d.version == 3 else hid, torch.cat([ptoks[1:], tok]))
        elif isinstance(d, dr.ModelDrafter):
            d.prefill(ptoks)
        else:
            d.prefill(prompt)
        if vocab is not None:
            rows, _ = d.rows_of(ptoks)
            top = d.rows_of(torch.topk(logits[0], vocab.k_pre, dim=-1).indices)[0] if hasattr(vocab, "k_pre") else None
            vocab.reset(rows, top)
        out = [int(tok)]
        st.prefill_s = time.perf_counter() - t0
        st.target_forwards = 1
        if on_tokens:
            on_tokens(out)
        cov_hit, cov_n, active = 0, 0, []
        t_start = time.perf_counter()
        fused = self.fused_steps
        tree = None
        if not ngram:
            ts = time.perf_counter()
            t = d.draft(tok.view(1), n_dev)
            tree = (t.tokens, t.parents, t.depth, t.anc, t.valid, t.q)
            st.phase_s["draft"] += time.perf_counter() - ts
        while len(out) < max_new_tokens and out[-1] not in eos:
            ts = time.perf_counter()
            if ngram:
                t = d.draft(out[-1], dev)
                tree = (t.tokens, t.parents, t.depth, t.anc, t.valid, t.q)
                self.R_ver = self.rows(t.tokens.shape[0], S)  # chains vary in length (static ones do not)
                st.phase_s["draft"] += time.perf_counter() - ts
                ts = time.perf_counter()
            max_depth = tree[0].shape[0] - 1 if ngram else D
            host, path, L, bonus, feats, ver = self.verify_step(*tree, n_dev, max_depth)
            t1 = time.perf_counter()
            host = host.tolist()  # the one host sync of the step: accepted length and tokens
            Lh = host[0]
            emitted = host[2:1 + Lh] + [host[-1]]
            t2 = time.perf_counter()
            st.phase_s["verify"] += t1 - ts
            st.phase_s["sync"] += t2 - t1  # the step's one host sync (accepted length and tokens)
            if ngram:
                d.update(emitted)
            elif fused:
                *tree, cov, act = self.advance_step(tree[0], tree[4], path, L, bonus, feats, ver, n_dev)
                st.phase_s["draft"] += time.perf_counter() - t2
            else:
                lm0 = d.lm_head_s
                cov, act = self._spec_update(tree[0], tree[4], path, L, bonus, feats, ver, n_dev)
                t3 = time.perf_counter()
                t = d.draft(bonus.view(1), n_dev + L)
                tree = (t.tokens, t.parents, t.depth, t.anc, t.valid, t.q)
                t4 = time.perf_counter()
                st.phase_s["update"] += t3 - t2
                st.phase_s["lm_head"] += d.lm_head_s - lm0
                st.phase_s["draft"] += (t4 - t3) - (d.lm_head_s - lm0)
            if not ngram:
                cov_hit = cov_hit + cov  # device tensors: no extra sync
                active.append(act.clone())
                cov_n += Lh
            st.target_forwards += 1
            st.accept_hist[Lh] = st.accept_hist.get(Lh, 0) + 1
            n_dev = n_dev + Lh
            for i, t in enumerate(emitted):  # stop at eos or the token budget, exactly like autoregressive
                if len(out) >= max_new_tokens:
                    emitted = emitted[:i]
                    break
                out.append(t)
                if t in eos:
                    emitted = emitted[:i + 1]
                    break
            if on_tokens and emitted:
                on_tokens(emitted)
        sync(dev)
        st.decode_s = time.perf_counter() - t_start
        st.new_tokens = len(out)
        if vocab is not None and active:
            sizes = torch.stack(active).float()
            st.extra.update(vocab_active_mean=round(float(sizes.mean()), 1), vocab_active_max=int(sizes.max()),
                            vocab_coverage=round(int(cov_hit) / max(cov_n, 1), 4), vocab_state_bytes=vocab.state_bytes())
        return out, st


class Graphed:
    """Calls fn through CUDA graphs captured per input signature (tensor shapes/dtypes and plain values).

    The first call of a signature runs fn eagerly (it warms up lazily initialised kernels and libraries on
    the real state); the second captures fn (capture records kernels without running them) and replays it,
    so every call executes fn exactly once and state-mutating steps stay correct. Tensor inputs are copied
    into the graph's static buffers; the returned tensors are the graph's own outputs, valid until its next
    replay (callers consume them within the step)."""

    def __init__(self, fn):
        self.fn, self.graphs, self.seen = fn, {}, set()

    def reset(self):
        self.graphs.clear()
        self.seen.clear()

    def __call__(self, *args):
        key = tuple((tuple(a.shape), a.dtype) if torch.is_tensor(a) else a for a in args)
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self.fn(*args)
            static = [a.clone() if torch.is_tensor(a) else a for a in args]
            self.graphs[key] = (*self._capture(static), static)
        graph, out, static = self.graphs[key]
        for buf, a in zip(static, args):
            if torch.is_tensor(a):
                buf.copy_(a)
        graph.replay()
        return out

    def _capture(self, static):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(*static)
        return graph, out


# ---------------------------------------------------------------- CLI

class Streamer:
    """Prints text as tokens arrive; decodes the whole tail so multi-byte characters come out whole."""

    def __init__(self, tok: Tokenizer, out=sys.stdout):
        self.tok, self.ids, self.printed, self.out = tok, [], "", out

    def __call__(self, new_ids):
        self.ids.extend(new_ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="NanoSpec engine: generate text with speculative decoding")
    p.add_argument("--checkpoint", default=None, help="HF folder or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", default=None, help="prompt text, or @file to read it from a file")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--compile", action="store_true",
                   help="torch.compile decode/verify/draft steps (inductor on CPU; CUDA graphs on CUDA)")
    p.add_argument("--max-seq", type=int, default=4096, help="KV cache slots when CUDA graphs are captured")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=False,
                   help="CPU: bit-exact greedy output, identical for every drafter and for autoregressive decoding "
                        "(passes padded to sizes this CPU keeps row-invariant, exact attention; README 'Why greedy "
                        "output is bit-identical'); an error where this CPU's check fails. Default off: the fastest "
                        "arithmetic, equal to autoregressive output up to floating-point near-ties")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text + stats")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", default=None, help="EAGLE head or draft-model folder/hub id, 'ngram', or 'none' (default: "
                   "the shipped EAGLE-3 head with the default model, else none)")
    g.add_argument("--tree-topk", type=int, default=None, help="EAGLE-2 children per frontier node (10 CUDA, 8 CPU)")
    g.add_argument("--tree-depth", type=int, default=None, help="EAGLE-2 tree depth (5)")
    g.add_argument("--tree-nodes", type=int, default=None, help="EAGLE-2 nodes verified per step, root included "
                   "(60 CUDA, 16 CPU)")
    g.add_argument("--spec-k", type=int, default=None, help="chain length for draft models (5) and n-grams (10)")
    g.add_argument("--ngram-min", type=int, default=1)
    g.add_argument("--ngram-max", type=int, default=3)
    v = p.add_argument_group("draft vocabulary")
    v.add_argument("--vocab", default=None, help="full | freq:PATH[:K] | nanospec (default: nanospec with the shipped "
                   "head, else full)")
    v.add_argument("--w-max", type=int, default=3072, help="NanoSpec window size (slots)")
    v.add_argument("--k-pre", type=int, default=3, help="NanoSpec target top-K per prompt position")
    v.add_argument("--k-ver", type=int, default=3, help="NanoSpec target top-K per accepted position")
    v.add_argument("--vocab-ablation", default=None, choices=["ctx", "ext", "noasync"])
    return p.parse_args(argv)


def read_prompt(arg: str | None) -> str:
    if arg is None:
        return DEFAULT_PROMPT
    if arg.startswith("@"):
        f = Path(arg[1:])
        if not f.is_file():
            raise UsageError(f"prompt file not found: {f}")
        return f.read_text()
    return arg


def build_engine(args):
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"unknown device {args.device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    path = resolve_checkpoint(args.checkpoint)
    tok = Tokenizer(path)
    model = load_model(path, dtype=getattr(torch, args.dtype), device=device)
    if not model.args.eos_ids:
        raise UsageError(f"no eos_token_id in {path}/generation_config.json or config.json")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    sampling.validate(model.args.vocab_size)
    drafter = build_drafter(args, model, tok, sampling)
    torch.manual_seed(args.seed)
    engine = Engine(model, sampling, compile=args.compile, drafter=drafter, max_seq=args.max_seq, exact=args.exact)
    engine.warmup()
    return engine, tok


def build_drafter(args, model: Transformer, tok: "Tokenizer", sampling: Sampling):
    """--draft none|ngram|PATH (EAGLE-1/2, EAGLE-3 head or independent draft model, detected from the folder)."""
    if args.draft is None:  # out of the box: the default model drafts with its shipped EAGLE-3 head + NanoSpec
        shipped = args.checkpoint is None and (DEFAULT_HEAD / "config.json").is_file()
        args.draft = str(DEFAULT_HEAD) if shipped else "none"
        if args.vocab is None and shipped:
            args.vocab = "nanospec"
    if args.vocab is None:
        args.vocab = "full"
    dflt = TREE_CPU if model.lm_head.weight.device.type == "cpu" else TREE_GPU
    args.tree_topk = dflt[0] if args.tree_topk is None else args.tree_topk
    args.tree_depth = dflt[1] if args.tree_depth is None else args.tree_depth
    args.tree_nodes = dflt[2] if args.tree_nodes is None else args.tree_nodes
    if args.draft == "none":
        if args.vocab != "full":
            raise UsageError("--vocab needs a drafter with an LM head (--draft PATH)")
        return None
    if args.draft == "ngram":
        if args.vocab != "full":
            raise UsageError("--vocab does not apply to --draft ngram (it has no LM head)")
        return dr.NgramDrafter(args.spec_k or 10, args.ngram_min, args.ngram_max, static=args.compile)
    path = resolve_checkpoint(args.draft, patterns=EXTRA_DRAFT_PATTERNS)
    kind = dr.detect_draft_kind(path)
    dev, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    if kind == "eagle":
        head = dr.load_eagle(path, model, dtype, dev)
        if head.c.version == 3:
            model.aux_layers = head.c.aux_layers
        make = lambda max_append: make_vocab(args.vocab, head.lm_weight(), w_max=args.w_max, k_pre=args.k_pre,
                                             k_ver=args.k_ver, ablation=args.vocab_ablation,
                                             eos_ids=model.args.eos_ids, max_append=max_append,
                                             token_to_row=tok_to_row)
        dr.check_tree_budget(args.tree_topk, args.tree_depth, args.tree_nodes)
        tok_to_row = dr.EagleDrafter.token_to_row_map(head)
        vocab = make(args.tree_nodes + (args.tree_depth + 1) * args.k_ver)
        return dr.EagleDrafter(head, vocab, args.tree_topk, args.tree_depth, args.tree_nodes)
    dm = load_model(path, dtype=dtype, device=dev)
    if dm.args.vocab_size != model.args.vocab_size:
        raise UsageError(f"draft model vocabulary ({dm.args.vocab_size}) differs from the target's ({model.args.vocab_size})")
    dtok = path / "tokenizer.json"
    if dtok.is_file() and Tokenizer(path).tok.get_vocab() != tok.tok.get_vocab():
        raise UsageError("draft model tokenizer differs from the target's")
    k = args.spec_k or 5
    vocab = make_vocab(args.vocab, dm.lm_head.weight, w_max=args.w_max, k_pre=args.k_pre, k_ver=args.k_ver,
                       ablation=args.vocab_ablation, eos_ids=model.args.eos_ids, max_append=(k + 1) * (1 + args.k_ver))
    return dr.ModelDrafter(dm, vocab, k, sampling)


EXTRA_DRAFT_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "*.safetensors", "model.safetensors.index.json", "pytorch_model.bin"]


def stats_line(st: Stats, model: Transformer) -> str:
    d = st.as_dict()
    s = (f"[{d['new_tokens']} new tokens, {d['tokens_per_s']:.2f} tok/s (decode {d['decode_tokens_per_s']:.2f} tok/s), "
         f"prefill {st.prefill_s * 1000:.0f} ms")
    if "mean_accepted_length" in d:
        s += f", {st.target_forwards} target forwards, mean accepted length {d['mean_accepted_length']:.2f}"
    if "exact" in d:
        s += ", exact" if d["exact"] else ", not exact"
    if model.lm_head.weight.is_cuda:
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        s += f", {nbytes * st.target_forwards / max(st.decode_s, 1e-9) / 1e9:.1f} GB/s, peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB"
    return s + "]"


def run(args) -> int:
    engine, tok = build_engine(args)
    if args.chat:
        return chat_loop(engine, tok, args)
    text = read_prompt(args.prompt)
    ids = tok.encode(text) if args.raw or tok.chat_template is None else tok.encode_chat([{"role": "user", "content": text}])
    streamer = None if args.json else Streamer(tok)
    out, st = engine.generate(ids, args.max_new_tokens, on_tokens=streamer)
    if args.json:
        print(json.dumps(dict(text=tok.decode(out), **st.as_dict())))
    else:
        print()
        print(stats_line(st, engine.model), file=sys.stderr)
    return 0


def chat_loop(engine: Engine, tok: Tokenizer, args) -> int:
    messages = []
    print("chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        out, st = engine.generate(tok.encode_chat(messages), args.max_new_tokens, on_tokens=Streamer(tok))
        print()
        print(stats_line(st, engine.model), file=sys.stderr)
        messages.append({"role": "assistant", "content": tok.decode(out)})
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (UsageError, ModelError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
