"""CLI and decode loops: prefill, autoregressive decode, speculative steps, sampling, streaming, stats.

    python generate.py                                   # embedded SmolLM2-135M-Instruct, "capital of France"
    python generate.py --checkpoint meta-llama/Llama-3.1-8B-Instruct --prompt "Hi" --device cuda --compile
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import Tensor

import cpu_forward
import cpu_gemm
import draft as dr
from download import CheckpointError, resolve_checkpoint
from budget import SIZES, Budget, Budgets
from exact import MAX_ROWS, Invariance, PassRows, machine_id
from model import RECENT, ModelError, Transformer, causal_recent, load_model, tree_mask, tree_recent
from sampling import Sampling, accept_greedy, accept_greedy_host, accept_sample, logits_to_probs, sample
from tokenizer import Streamer, Tokenizer

DEFAULT_PROMPT = "What is the capital of France?"
DEFAULT_HEAD = Path(__file__).resolve().parent / "heads" / "SmolLM2-135M-Instruct-eagle3"  # trained by eagle_train.py


class UsageError(Exception):
    """Bad flags or input; reported as one line."""


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


# ---------------------------------------------------------------- the engine

class Clock:
    """Adds the wall time of each `with clock(phase):` block to phase_s[phase] (on CUDA, unsynced: launch time)."""

    def __init__(self, phase_s: dict):
        self.phase_s, self.name = phase_s, None

    def __call__(self, name: str) -> "Clock":
        self.name = name
        return self

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.phase_s[self.name] += time.perf_counter() - self.t0


PHASES = ("draft", "lm_head", "verify", "sync", "update")


def accepted_tokens(host: list[int]) -> tuple[int, list[int], list[int]]:
    """host = [L, bonus, path tokens (root first, padded to D+1)..., path node indices...] -> (L, the tokens
    this step emits: the accepted draft tokens after the root, then the bonus, the accepted node indices)."""
    L, P = host[0], (len(host) - 2) // 2
    return L, host[3:2 + L] + [host[1]], host[2 + P:2 + P + L]


class Engine:
    """Holds the target (and optionally a drafter with its draft vocabulary); one generation at a time."""

    def __init__(self, model: Transformer, sampling: Sampling = Sampling(), compile: bool = False, drafter=None,
                 max_seq: int = 4096, backend: str = "inductor", exact: bool | None = None, budget: bool = False,
                 budget_cache: str | None = None):
        self.model = model
        self.budget = budget  # fit the verified tree size to this machine and request each step (budget.py)
        self.budget_memory = {}  # each budget source's state at the end of the last request that used it
        self.sampling = sampling
        self.drafter = drafter
        self.device = model.lm_head.weight.device
        self.decode_fn = self._decode_one
        # a one-node tree's accepted path and length (_spec_decode), made once: no allocation inside a step
        self.root_path = (torch.zeros(1, dtype=torch.long, device=self.device),
                          torch.ones((), dtype=torch.long, device=self.device))
        self.verify_step, self.advance_step = self._spec_verify, self._spec_advance
        cuda = self.device.type == "cuda"
        # CPU: bit-exact greedy output (exact attention + pass sizes this machine's kernels keep row-invariant,
        # exact.py). exact=None uses it wherever the machine's check passes; True insists; False turns it off.
        # CUDA's SDPA and cuBLAS kernels are not batch-invariant, so there greedy output equals autoregressive
        # output up to floating-point near-ties (as in vLLM and SGLang).
        if exact and cuda:
            raise UsageError("--exact is CPU-only (CUDA kernels are not batch invariant)")
        # exact tree verification gathers each node's last RECENT keys: trees must be shallower (chains need not)
        too_deep = drafter is not None and drafter.depth >= RECENT and drafter.nodes > drafter.depth + 1
        if exact and too_deep:
            raise UsageError(f"--tree-depth must be below {RECENT} (exact tree verification), got {drafter.depth}")
        self.exact_requested = exact
        self.invariance = None if exact is False or cuda or too_deep else Invariance(model)
        self.exact = False  # decided per request (plan): the attention check depends on the KV length
        self.R_dec = self.R_ver = PassRows(1, 1)  # rows of the decode and verify passes of the current request
        # CUDA graphs need fixed buffer addresses: one KV cache of max_seq slots for every request
        self.graphs = compile and cuda
        self.compiled = compile
        self.graph_addresses = None
        self.max_seq = min(max_seq, model.args.max_position_embeddings)
        # compiled: the drafter's update and next draft run as one step (eager keeps them apart to time each);
        # drafters that read host values (prompt lookup) always run eagerly
        self.fused_steps = compile and getattr(drafter, "graphable", False)
        if compile:
            # reduce-overhead = CUDA graphs on CUDA; on CPU inductor fuses the small per-layer ops.
            self.decode_fn = torch.compile(self._decode_one, mode="reduce-overhead" if cuda else None,
                                           fullgraph=True, dynamic=False, backend=backend)
            if cuda:  # explicit capture of the eager steps: robust with the copy-stream fork/join inside
                self.verify_step = Graphed(self._spec_verify)
                self.advance_step = Graphed(self._spec_advance)
            else:
                self.verify_step = torch.compile(self._spec_verify, fullgraph=True, dynamic=False, backend=backend)
                self.advance_step = torch.compile(self._spec_advance, fullgraph=True, dynamic=False, backend=backend)
        # budget_cache: the caller's key of its drafter and sampling settings; with it the budget memory
        # outlives the process (cache_dir()/budget.json; the CLI gives one, benchmarks start afresh)
        self.budget_cache = budget_cache if budget and drafter is not None else None
        self._load_memory()

    def _buffer_addresses(self) -> tuple:
        """Addresses of the KV caches and RoPE tables of the target and of the drafter's modules (head, model)."""
        mods = [self.model] + [v for v in vars(self.drafter).values() if isinstance(v, torch.nn.Module)]
        return tuple(b.data_ptr() for mod in mods for b in mod.buffers())

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

    @property
    def exact_attention(self) -> bool:
        """Exact mode through model.exact_attention's recent-key tables: the PyTorch layers need them, the fused
        CPU pass (row-invariant by construction, cpu_forward.py) does not."""
        return self.exact and self.model.cpu_pass is None

    def pass_rows(self, n: int, S: int) -> PassRows:
        """Rows to pad a target pass of n tokens to, in this request's mode (plan)."""
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
        logits = self.model(tok.expand(1, R), p, recent=causal_recent(p) if self.exact_attention else None,
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
        recent = tree_recent(anc, depth, n) if self.exact_attention else None
        logits, hid, aux = m(tokens[None], n + depth, mask=mask, cache_pos=n + torch.arange(tokens.shape[0], device=n.device),
                             return_hidden=True, recent=recent, attn_rows=max(self.R_ver.attn, R))
        return logits[0, :N], hid[:, :N], (aux[:, :N] if aux is not None else None)

    def _prefill(self, ptoks: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """The target's pass over the prompt [T] -> (logits [R, V] of the last R = min(T, rows) positions, at
        least the last one; hidden [1, T, d]; aux). The last position's logits are their own one-row projection
        either way, so the first token has the same bits in every mode; the other rows are projected only when
        a drafter reads them (an LM head over 200 prompt rows costs a fifth of the prefill on a CPU)."""
        T = ptoks.shape[0]
        _, hid, aux = self.model(ptoks[None], torch.arange(T, device=ptoks.device), return_hidden=True,
                                 compute_logits=False)
        last = self.model.lm_head(hid[0, -1:])  # [1, V]
        R = min(T, rows)
        return (torch.cat([self.model.lm_head(hid[0, T - R:-1]), last]) if R > 1 else last), hid, aux

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
        logits = self._prefill(torch.tensor(prompt, device=dev), 0)[0]
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
    # A step is two static-shape, sync-free halves so each can be torch.compiled (CPU) or replayed from a
    # CUDA graph (CUDA --compile): verify = target pass + acceptance + KV compaction; advance = the drafter's
    # update (with its vocabulary's) + the next draft. Between them sits the step's one host sync.

    def _spec_verify(self, tree: dr.Tree, n: Tensor) -> tuple[Tensor, dr.Accepted]:
        if tree.tokens.shape[0] == 1 and self.R_ver.gemm == 1 and not self.exact_attention:
            return self._spec_decode(tree, n)
        logits, hid, aux = self._verify(tree.tokens, tree.depth, tree.anc, n)  # [N, V], [1, N, d], [1, N, 3d]
        if self.sampling.greedy and self.device.type == "cpu" and not torch.compiler.is_compiling():
            # eager CPU: the acceptance on host lists and the KV moves in one C call (model.compact_kv): the
            # small device ops they replace met cold caches after the pass (in-process A/B on Zen 5: 0.2-0.4 ms
            # less a step of 2-16 nodes, 1.02-1.06x)
            p, L, bonus = accept_greedy_host(tree, logits)
            if tree.tokens.shape[0] > 1:
                n0 = int(n)
                self.model.compact_kv([n0 + i for i in p], n0)
            toks = tree.tokens.tolist()
            host = torch.tensor([L, bonus] + [toks[i] for i in p] + p)  # [2 + 2 (D + 1)]
            P = 2 + len(p)  # the Accepted's tensors are views of it: no more allocations
            return host, dr.Accepted(tree, host[P:], host[0], host[1], logits, hid, aux, n)
        if self.sampling.greedy:
            path, L, bonus = accept_greedy(tree, logits)
        else:
            path, L, bonus = accept_sample(tree, logits_to_probs(logits, self.sampling))
        if tree.tokens.shape[0] > 1:  # (a one-node tree, an autoregressive step, has its KV in place)
            self.model.compact_kv(n + path, n)  # the accepted path's KV moves to slots n .. n + L - 1
        host = torch.cat([L.view(1), bonus.view(1), tree.tokens[path], path])  # what the host needs, in one sync
        return host, dr.Accepted(tree, path, L, bonus, logits, hid, aux, n)

    def _spec_decode(self, tree: dr.Tree, n: Tensor) -> tuple[Tensor, dr.Accepted]:
        """_spec_verify of a one-node tree (an autoregressive step: budget.py's fallback, or no draft): the decode
        step's pass (causal mask: slots <= n, as the tree's mask; the same bits) and the bonus sampled as the
        decode step samples it, without the tree mask, the path search and the KV compaction. Why: those are
        about 25 small ops (in-process A/B on Zen 5: 7.21 -> 6.90 ms a step), and most steps of hard text are
        such steps."""
        logits, hid, aux = self.model(tree.tokens[None], n.view(1), return_hidden=True)  # [1, 1, V], [1, 1, d], ..
        logits = logits[0]
        bonus = sample(logits, self.sampling).view(())
        path, L = self.root_path  # (never written: every reader indexes with them)
        host = torch.cat([L.view(1), bonus.view(1), tree.tokens, path])
        return host, dr.Accepted(tree, path, L, bonus, logits, hid, aux, n)

    def _spec_advance(self, a: dr.Accepted) -> dr.Tree:
        # one graph: the vocabulary gather on the copy stream overlaps the draft backbone and joins right
        # before the first LM-head projection
        self.drafter.update(a)
        return self.drafter.draft(a.bonus.view(1), a.n + a.L)

    def _generate_spec(self, prompt: list[int], max_new_tokens: int, on_tokens=None) -> tuple[list[int], Stats]:
        m, d, dev = self.model, self.drafter, self.device
        T, eos = len(prompt), set(m.args.eos_ids)
        S, self.R_ver = self.plan(T, max_new_tokens, d.nodes)
        sizes_of = getattr(d, "budget_sizes", None)  # a drafter's own size set per source (the hybrid's)
        # (before the caches: it times passes)
        pass_s = self.pass_costs(d.nodes, sizes_of() if sizes_of else ()) if self.budget else None
        m.setup_caches(1, S)
        d.setup(S)
        self._check_graphs()
        st = Stats(phase_s=dict.fromkeys(PHASES, 0.0), extra=dict(exact=self.exact))
        clock = Clock(st.phase_s)
        t0 = time.perf_counter()
        ptoks = torch.tensor(prompt, device=dev)
        logits, hid, aux = self._prefill(ptoks, d.prompt_logits)
        tok = sample(logits[-1:], self.sampling)  # [1]
        d.prefill(dr.Prefill(ptoks, tok, logits, hid, aux))
        out, n = [int(tok)], torch.tensor(T, device=dev)
        st.prefill_s, st.target_forwards = time.perf_counter() - t0, 1
        if on_tokens:
            on_tokens(out)
        t_start = t_step = time.perf_counter()
        # eager CPU steps pay no one-time set-up per shape: one timing step of each end of the budget range
        settle = 1 if dev.type == "cpu" and not self.compiled else 2
        budget = self.last_budget = (Budgets(d.nodes, sizes_of, getattr(d, "budget_start", None), settle=settle,
                                             pass_s=pass_s, memory=self.budget_memory,
                                             setup_of=getattr(d, "budget_setup", None)) if self.budget else None)
        paid = getattr(d, "setup_paid", lambda: 0.0)  # one-time set-up inside a step's draft (the hybrid's head)
        # nodes to verify; 1 = an autoregressive step (no draft); per source of the next drafts (budget_key)
        left = lambda done: (max_new_tokens - done) / done  # tokens still to come per token so far, at most
        b = budget.pick(d.budget_key(prompt + out), left(len(out))) if budget else d.nodes
        with clock("draft"):
            tree = d.draft(tok, n, b if budget else None) if b > 1 else dr.chain_tree(tok)
        planned, pending = None, []  # pending: autoregressive steps the drafter has not seen yet
        while len(out) < max_new_tokens and out[-1] not in eos:
            sub = tree.prefix(b)
            if sub.tokens.shape[0] != planned:  # a new budget, or an unpadded n-gram chain of another length
                planned = sub.tokens.shape[0]
                self.R_ver = self.pass_rows(planned, S)
            with clock("verify"):
                host, acc = self.verify_step(sub, n)  # target pass over the tree, acceptance, KV compaction
            with clock("sync"):
                L, emitted, nodes = accepted_tokens(host.tolist())  # the one host sync of the step
            acc = dataclasses.replace(acc, tree=tree)  # the drafter learns from every drafted token (NanoSpec)
            if budget:  # a step's time: the drafter's last update, this draft, the verification and the sync
                t_step, t = time.perf_counter(), t_step
                budget.observe(b, nodes, t_step - t - paid())
                b = budget.pick(d.budget_key(prompt + out + emitted), left(len(out) + len(emitted)))
            if tree.tokens.shape[0] == 1 and b == 1 and len(pending) < 128:  # autoregressive, and so is the next
                pending.append(acc)  # the drafter catches up on a run of these later, in one update
                tree = dr.chain_tree(acc.bonus.view(1))
            elif self.fused_steps and b > 1 and not pending:
                with clock("draft"):
                    tree = self.advance_step(acc)  # update + next draft, one compiled step or CUDA graph
            else:
                if pending:
                    pending, acc = [], dr.chained(pending + [acc], states=d.reads_states, top=d.reads_top)
                with clock("update"):
                    d.update(acc)  # the drafter's state and its vocabulary's window follow the accepted path
                with clock("draft"):
                    tree = (d.draft(acc.bonus.view(1), acc.n + acc.L, b if budget else None) if b > 1
                            else dr.chain_tree(acc.bonus.view(1)))
            n = n + L
            st.target_forwards += 1
            st.accept_hist[L] = st.accept_hist.get(L, 0) + 1
            emitted = stop_at(emitted, out, max_new_tokens, eos)
            out += emitted
            if on_tokens and emitted:
                on_tokens(emitted)
        sync(dev)
        st.decode_s, st.new_tokens = time.perf_counter() - t_start, len(out)
        if budget:
            budget.keep()
            self._save_memory()
        st.extra.update(d.stats(), **(budget.stats() if budget else {}))
        lm = st.extra.pop("lm_head_s", 0.0)  # drafting time spent in the LM head (eager only)
        st.phase_s["lm_head"], st.phase_s["draft"] = lm, st.phase_s["draft"] - lm
        return out, st

    def _memory_file(self) -> tuple[Path, str] | None:
        """Where the budget memory of this engine's configuration lives across processes, or None (no
        budget_cache key, or NANOSPEC_BUDGET_CACHE=off): cache_dir()/budget.json, keyed by the machine, the
        model and its pass (as pass_costs), the device and the caller's key (the drafter's and sampling's
        settings: acceptance differs with each)."""
        if self.budget_cache is None or os.environ.get("NANOSPEC_BUDGET_CACHE", "on") == "off":
            return None
        key = f"{self.pass_key()} {self.device.type} exact={self.exact_requested} compile={self.compiled} {self.budget_cache}"
        return cpu_gemm.cache_dir() / "budget.json", key

    def pass_key(self) -> str:
        """The machine, the model's shapes and dtype, and how its passes run: what a pass's cost depends on."""
        m = self.model
        return (f"{cpu_gemm.machine_id()} {cpu_forward.shape_key(m.args)} {m.lm_head.weight.dtype} "
                f"{'fused pass' if m.cpu_pass is not None else 'layers'} {'kernel' if cpu_gemm.enabled() else 'torch'}")

    def _load_memory(self):
        """The last process's budget memory for this configuration: one CLI answer starts from what earlier
        answers measured (acceptance per node rank, step times, the hybrid head's start price) instead of
        timing the whole tree and autoregressive decoding and starting the head to learn them again. A missing,
        stale or unreadable entry leaves the memory empty."""
        where = self._memory_file()
        if where is None:
            return
        d = cpu_gemm.read_json(where[0]).get(where[1])
        try:
            self.budget_memory = {k: Budget.from_state(v) for k, v in d["sources"].items()}
            rate = float(d.get("start_rate", 0.0))
        except (TypeError, KeyError, AttributeError, ValueError):
            self.budget_memory = {}
            return
        if hasattr(self.drafter, "start_rate"):
            self.drafter.start_rate = rate

    def _save_memory(self):
        where = self._memory_file()
        if where is not None:
            cpu_gemm.merge_json(where[0], where[1], dict(sources={k: b.state() for k, b in self.budget_memory.items()},
                                                         start_rate=getattr(self.drafter, "start_rate", 0.0)))

    def pass_costs(self, nodes: int, extra=()) -> dict[int, float] | None:
        """Seconds of the target's pass at each budget size up to nodes and the extra sizes, on this machine
        (CPU; measured once and cached per machine, model and pass kind in cache_dir()/pass_cost.json; a second
        or so): budget.py's estimate for the sizes a request has not timed. None on other devices (budget.py
        interpolates)."""
        m = self.model
        if self.device.type != "cpu":
            return None
        sizes = sorted(set([s for s in SIZES if s < nodes] + [nodes] + list(extra)))
        key = self.pass_key()
        f = cpu_gemm.cache_dir() / "pass_cost.json"
        costs = cpu_gemm.read_json(f).get(key, {})
        missing = [s for s in sizes if str(s) not in costs]
        if missing:
            costs.update({str(r): t for r, t in cpu_forward.pass_seconds(m, missing).items()})
            cpu_gemm.merge_json(f, key, costs)
        return {s: costs[str(s)] for s in sizes}

    def _check_graphs(self):
        graphed = [s for s in (self.verify_step, self.advance_step) if isinstance(s, Graphed)]
        if graphed:  # (torch.compile'd CPU steps guard on their buffers themselves)
            addresses = self._buffer_addresses()
            if addresses != self.graph_addresses:
                # another engine sharing this model or head resized its caches: the captured graphs would
                # read the freed buffers, so capture again on the new ones
                for step in graphed:
                    step.reset()
                self.graph_addresses = addresses


def stop_at(emitted: list[int], out: list[int], max_new: int, eos: set) -> list[int]:
    """The emitted tokens up to the token budget and through the first eos, exactly like autoregressive."""
    emitted = emitted[:max(max_new - len(out), 0)]
    for i, t in enumerate(emitted):
        if t in eos:
            return emitted[:i + 1]
    return emitted


class Graphed:
    """Calls fn through CUDA graphs captured per input signature (pytree structure, tensor shapes/dtypes
    and plain values).

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
        leaves, spec = pytree.tree_flatten(args)
        key = (spec, tuple((tuple(a.shape), a.dtype) if torch.is_tensor(a) else a for a in leaves))
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self.fn(*args)
            static = [a.clone() if torch.is_tensor(a) else a for a in leaves]
            self.graphs[key] = (*self._capture(pytree.tree_unflatten(static, spec)), static)
        graph, out, static = self.graphs[key]
        for buf, a in zip(static, leaves):
            if torch.is_tensor(a):
                buf.copy_(a)
        graph.replay()
        return out

    def _capture(self, static_args):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(*static_args)
        return graph, out


# ---------------------------------------------------------------- CLI

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
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: bit-exact greedy output, identical for every drafter and for autoregressive decoding "
                        "(README 'Why greedy output is bit-identical'); an error where this CPU's check fails. "
                        "Default: on where it is free (the fused CPU pass, cpu_forward.py, is row-invariant by "
                        "construction), else off: the fastest arithmetic, equal to autoregressive output up to "
                        "floating-point near-ties")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text + stats")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", default=None, help="EAGLE head or draft-model folder/hub id, 'ngram', or 'none' (default: "
                   "the shipped EAGLE-3 head with the default model, else none)")
    g.add_argument("--tree-topk", type=int, default=None, help="EAGLE-2 children per frontier node (10 CUDA, 8 CPU)")
    g.add_argument("--tree-depth", type=int, default=None, help="EAGLE-2 tree depth (5)")
    g.add_argument("--tree-nodes", type=int, default=None, help="EAGLE-2 nodes verified per step, root included "
                   "(60 CUDA, 16 CPU)")
    g.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=None,
                   help="with an EAGLE head: merge a prompt-lookup chain (longest suffix match in prompt + output) "
                        "into the tree, verified together (default on with EAGLE heads)")
    g.add_argument("--budget", default="auto", choices=["auto", "fixed"],
                   help="auto: verify as many of the drafted nodes as pays on this machine for this request, "
                        "decoding autoregressively when none does (measured as it generates); fixed: the whole tree")
    g.add_argument("--spec-k", type=int, default=None, help="chain length for draft models (5) and n-grams (10)")
    g.add_argument("--ngram-min", type=int, default=1)
    g.add_argument("--ngram-max", type=int, default=3)
    g.add_argument("--ngram-occurrences", type=int, default=8, help="prompt lookup: merge the continuations of this many earlier occurrences of the matched suffix into one tree (1: the most recent one's chain)")
    v = p.add_argument_group("draft vocabulary")
    v.add_argument("--vocab", default=None, help="full | freq:PATH[:K] | nanospec (default: nanospec with the shipped "
                   "head, else full)")
    v.add_argument("--w-max", type=int, default=3072, help="NanoSpec window size (slots)")
    v.add_argument("--k-pre", type=int, default=3, help="NanoSpec target top-K per prompt position")
    v.add_argument("--k-ver", type=int, default=3, help="NanoSpec target top-K per accepted position")
    v.add_argument("--vocab-ablation", default=None, choices=["ctx", "ext", "noasync", "nofill"],
                   help="NanoSpec without: prompt tokens (ctx), appends (ext), the packed copy (noasync), the head "
                        "folder's freq.pt in free slots (nofill)")
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


def load_target(checkpoint: str | None, device: str = "cpu", dtype: str = "bfloat16") -> tuple[Transformer, Tokenizer, Path]:
    """The target model, its tokenizer and folder, from an HF folder or hub id (None: the embedded default model)."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    path = resolve_checkpoint(checkpoint)
    tok = Tokenizer(path)
    model = load_model(path, dtype=getattr(torch, dtype), device=dev)
    if not model.args.eos_ids:
        raise UsageError(f"no eos_token_id in {path}/generation_config.json or config.json")
    return model, tok, path


def build_engine(model: Transformer, tok: Tokenizer | None, draft: dr.DraftConfig = dr.DraftConfig(),
                 sampling: Sampling = Sampling(), *, compile: bool = False, max_seq: int = 4096,
                 backend: str = "inductor", exact: bool | None = None, head=None, budget: bool = True,
                 budget_cache: bool = False) -> Engine:
    """The engine with its drafter and draft vocabulary (CLI, bench, GPU check and trainer build it here);
    budget=False verifies the whole drafted tree every step instead of fitting its size (budget.py);
    budget_cache=True keeps the budget's memory across processes, keyed by these settings (the CLI)."""
    sampling.validate(model.args.vocab_size)
    drafter = dr.make_drafter(draft, model, sampling, tok, head)
    return Engine(model, sampling, compile=compile, drafter=drafter, max_seq=max_seq, backend=backend, exact=exact,
                  budget=budget, budget_cache=f"{draft} {sampling}" if budget_cache else None)


def draft_config(args) -> dr.DraftConfig:
    """The CLI's drafting flags; out of the box the default model drafts with its shipped EAGLE-3 head + NanoSpec."""
    shipped = args.checkpoint is None and (DEFAULT_HEAD / "config.json").is_file()
    draft = args.draft or (str(DEFAULT_HEAD) if shipped else "none")
    vocab = args.vocab or ("nanospec" if args.draft is None and shipped else "full")
    return dr.DraftConfig(draft, vocab, args.tree_topk, args.tree_depth, args.tree_nodes, args.spec_k,
                          args.ngram_min, args.ngram_max, args.w_max, args.k_pre, args.k_ver, args.vocab_ablation,
                          static=args.compile, ngram=args.ngram, ngram_occurrences=args.ngram_occurrences)


def stats_line(st: Stats, model: Transformer) -> str:
    d = st.as_dict()
    s = (f"[{d['new_tokens']} new tokens, {d['tokens_per_s']:.2f} tok/s (decode {d['decode_tokens_per_s']:.2f} tok/s), "
         f"prefill {st.prefill_s * 1000:.0f} ms")
    if "mean_accepted_length" in d:
        s += f", {st.target_forwards} target forwards, mean accepted length {d['mean_accepted_length']:.2f}"
    if "accepted_from" in d:
        s += ", accepted draft tokens from " + ", ".join(f"{k} {v:.0%}" for k, v in d["accepted_from"].items())
    if "speculated_share" in d:
        s += f", speculated on {d['speculated_share']:.0%} of steps (verified nodes: {d['budget_hist']})"
    if "exact" in d:
        s += ", exact" if d["exact"] else ", not exact"
    if model.lm_head.weight.is_cuda:
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        s += f", {nbytes * st.target_forwards / max(st.decode_s, 1e-9) / 1e9:.1f} GB/s, peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB"
    return s + "]"


def run(args) -> int:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model, tok, _ = load_target(args.checkpoint, args.device, args.dtype)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    exact = args.exact if args.exact is not None else (None if model.cpu_pass is not None else False)
    engine = build_engine(model, tok, draft_config(args), sampling, compile=args.compile, max_seq=args.max_seq,
                          exact=exact, budget=args.budget == "auto", budget_cache=True)
    torch.manual_seed(args.seed)
    engine.warmup()
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


def one_line_errors(fn, args, errors=(UsageError, ModelError, CheckpointError, ValueError)) -> int:
    """fn(args), with bad input reported as one line and exit code 2 instead of a traceback."""
    try:
        return fn(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv=None) -> int:
    return one_line_errors(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
