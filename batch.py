"""The engine's step, for one sequence and many (engine.Engine runs a request as a batch of one): many sequences in one
target pass, with continuous batching (nano-vllm's scheduler in a few functions). The sequences share one KV cache,
each in its own range of max_seq slots; a pass carries every running sequence's rows, and each row attends to its
own range only (a window mask), so the weights are read once a step for the whole batch. With the fused CPU pass
(row-invariant GEMMs, attention over a row's allowed keys in slot order, one chain per key) a sequence's output is
its output alone bit for bit.

With drafters (one per sequence: its own EAGLE head cache, NanoSpec window and lookup index), each sequence
drafts its own tree, one pass verifies every tree, and each keeps its accepted path (budget_batch.py picks each
tree's size for the batch's tokens per second, or none).

    engine = BatchEngine(model, batch=8, max_seq=1024)
    outs = engine.generate_batch(prompts, 128)                      # token lists, in input order
    engine.submit(prompt, 128); done = engine.step()                # streaming: finished sequences per step
    for s in engine.stepped: print(s.index, s.new, s.new_from)      # each step's tokens and who proposed them
    engine.abort(index)                                             # a cancelled request: its range freed
"""
import dataclasses
import itertools
import time
from collections import deque

import torch
from torch import Tensor

import cpu_draft
import cpu_forward
import graphs
from budget_batch import BatchBudget
from budget_memory import BudgetMemory, pass_costs
from draft import Accepted, Behind, Prefill, Tree, chain_tree, stop_at
from errors import UsageError
from model import Plan, Transformer, tree_mask
from prefix_cache import PrefixCache
from sampling import Sampling, accept, argmax, greedy_path, sample
from sequence import TARGET, HeldRow, Seq, accepted_tokens, node_sources


class BatchEngine:
    """Up to `batch` sequences at a time; waiting prompts join as running ones finish (prefill steps first)."""

    def __init__(self, model: Transformer, batch: int, max_seq: int, sampling: Sampling = Sampling(),
                 prefill_rows: int = 2048, drafters: list | None = None, budget: bool = True,
                 ignore_eos: bool = False, exact: bool = True, cuda_graphs: bool = False, memory_key: str | None = None,
                 settle: int = 1, prefix: bool = True):
        """drafters: one per sequence of the batch (draft_config.make_drafters), or None: autoregressive; max_seq
        bounds prompt + new tokens + a draft's nodes; budget=False: every step verifies every whole tree;
        ignore_eos: every sequence runs to its token budget (vLLM's ignore_eos, llama-batched-bench's shape);
        exact=False: passes from the size cpu_forward.layers_from measured run the PyTorch layers (torch's GEMMs,
        AMX where the CPU has it), so a sequence's output may differ from its output alone at near ties.
        cuda_graphs: decode steps replay CUDA graphs, one per padded batch size (1, 2, 4, ... up to batch, as
        nano-vllm pads to its captured sizes); pad rows decode in a scratch range of the cache past the batch's.
        memory_key: where a lone sequence's budget memory (budget_memory.BudgetMemory) outlives the process (the
        caller's drafter and sampling settings; None: it lives with the engine).
        settle: a lone budget's timing steps; prefix: keep the prompts' shared prefix (prefix_cache.py; its copies
        are exact on the fused pass)."""
        if batch < 1:
            raise UsageError(f"--batch must be >= 1, got {batch}")
        if drafters and len(drafters) != batch:
            raise ValueError(f"{len(drafters)} drafters for a batch of {batch}")
        self.model, self.B, self.S, self.sampling, self.prefill_rows = model, batch, max_seq, sampling, prefill_rows
        self.device = model.norm.weight.device
        self.ignore_eos = ignore_eos
        # what its passes return and run on (model.Plan): its heads' aux layers; exact=False: passes from the size
        # cpu_forward.layers_from measures (before the caches) on the PyTorch layers
        self.plan = Plan(drafters[0].aux_layers if drafters else (), None if exact else cpu_forward.layers_from(model))
        alone_pass, self.memory = None, None
        if drafters and budget:  # the pass's cost by rows, measured once per machine (before the caches: it
            cap = batch * drafters[0].nodes  # sets up its own): a budget that had to learn it drafted too little
            rows = sorted({min(1 << i, cap) for i in range(cap.bit_length() + 1)} | {batch})
            measured = pass_costs(model, 1, rows, self.plan) or {}
            d = drafters[0]
            alone_pass = pass_costs(model, d.nodes, d.budget_sizes() or (), self.plan)
        model.setup_caches(1, max_seq, slots=(batch + cuda_graphs) * max_seq)
        self.drafters = drafters or None
        self.spare = 0 if not drafters else drafters[0].nodes  # slots past a sequence's tokens for its tree
        if drafters:
            for d in drafters:
                d.setup(max_seq)
            d = drafters[0]
            # a lone sequence's budget reads what this engine's earlier requests paid (memory)
            self.memory = BudgetMemory(model, d, memory_key, self.plan) if budget else None
            self.budget = BatchBudget(d.nodes, d.budget_sizes, memory=self.memory, settle=settle, pass_s=alone_pass,
                                      fixed=not budget)
            for r, t in (measured.items() if budget else ()):
                self.budget.pass_s.observe(r, t)
            self._top = max(d.reads_top, 1)  # the target's top-k kept per accepted position (drafter.reads_top)
        # a batch of one's static-shape steps (runner.Runner: compiled, CUDA-graphed, or exact mode's padded passes on
        # the PyTorch layers), set by engine.Engine where it picks them; None: the batch's own passes
        self.runner = None
        self.free, self.waiting, self.running = list(range(batch)), deque(), []
        self.prefix = PrefixCache(model) if prefix else None
        self.stepped = []  # the sequences the latest step advanced (their new, new_from)
        self.submitted = 0
        self.decode_fn = graphs.Graphed(self.decode_step) if cuda_graphs else self.decode_step
        self.buckets = sorted({min(1 << i, batch) for i in range(batch.bit_length() + 1)}) if cuda_graphs else None
        self.steps = {"prefill": 0, "decode": 0}
        self.rows = 0  # sequences over every decode step (occupancy = rows / (decode steps * batch))
        self.decode_s, self.decode_tokens = 0.0, 0
        self.phase_s = None  # a dict of stats.PHASES: the speculative phases' seconds are added to it

    def resize(self, S: int):
        """Between requests of a batch of 1 (engine.Engine): KV slots for the next one (its planned length); the
        runner's captured steps are captured again where the caches moved."""
        if S != self.S:
            self.S = S
            for d in self.drafters or ():
                d.setup(S)
        self.model.setup_caches(1, S, slots=S)  # (another engine on the model may have resized them)
        if (r := self.runner) is not None:
            graphs.follow_buffers((r.decode_fn, r.verify_step, r.advance_step), self.model, r.drafter)

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: Sampling | None = None,
               seed: int | None = None, index: int | None = None, own_rng: bool = True, req=None) -> int:
        """Queue a prompt -> its index (the order of submission, or the caller's). own_rng=False: a sampled
        sequence draws from torch's global stream (generate.py's --seed sets it) instead of its own. req: a batch of
        one's planned request (planner.Request: the caches are sized for it here)."""
        s = sampling or self.sampling
        if req is not None:
            self.resize(req.S)
        s.validate(self.model.args.vocab_size)
        if not prompt:
            raise UsageError(f"prompt {self.submitted} is empty")
        if max_new_tokens < 1:
            raise UsageError(f"prompt {self.submitted}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens + self.spare > self.S:
            raise UsageError(f"prompt {self.submitted}: {len(prompt)} tokens + {max_new_tokens} new"
                             + (f" + {self.spare} draft nodes" if self.spare else "")
                             + f" exceed the {self.S} positions a sequence has (--max-seq)")
        gen = None
        if not s.greedy and own_rng:
            gen = torch.Generator(self.device).manual_seed(seed if seed is not None else self.submitted)
        i = self.submitted if index is None else index
        self.waiting.append(Seq(i, list(prompt), max_new_tokens, s, gen, t_submit=time.perf_counter(), req=req))
        self.submitted += 1
        return i

    @property
    def eos(self) -> set:
        return set() if self.ignore_eos else set(self.model.args.eos_ids)  # (read at each step: a caller may set them)

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @torch.no_grad()
    def step(self) -> list[Seq]:
        """One target pass: the prefill of waiting sequences that fit, with one token for every running sequence
        riding along; else a verification (or a decode step) of every running one. -> the sequences that finished
        in it (eos or their token budget). Why ride along: a prefill step had stalled every running sequence, and
        with sequences finishing one by one (drafting), a batch of 64 ran twice as many prefill steps."""
        admit = self._schedule()
        riders = self.running if admit else []
        seqs = admit + riders or self.running
        if not seqs:
            return []
        t0 = time.perf_counter()
        if self.drafters and not admit:
            emitted, sources = self._spec_step(seqs)
        else:
            emitted, sources = self._one_token(admit, riders)
        self.steps["prefill" if admit else "decode"] += 1
        if not admit:  # (decode statistics: riders' tokens come with the prefill's time)
            self.decode_s += time.perf_counter() - t0
            self.rows += len(seqs)
        self.running += admit
        return self._emit(seqs, emitted, sources, len(admit))

    def _schedule(self) -> list[Seq]:
        """The waiting sequences this step admits (a free range each, their prompts within prefill_rows), each with
        its range, prefix hit, drafter, its drafter's Behind and its budget."""
        admit, rows = [], 0
        while self.waiting and self.free and (not admit or rows + len(self.waiting[0].prompt) <= self.prefill_rows):
            s = self.waiting.popleft()
            s.slot, rows = self.free.pop(0) * self.S, rows + len(s.prompt)
            s.cached = self.prefix.hit(s.prompt) if self.prefix is not None else 0
            s.drafter = d = self.drafters[s.slot // self.S] if self.drafters else None
            if d is not None:
                s.behind = Behind(d.reads_states, self._top, d.reads_every_top)
                self.budget.admit(s)
            admit.append(s)
        return admit

    def _one_token(self, admit: list[Seq], riders: list[Seq]) -> tuple[list[list[int]], list[list[str]]]:
        """A prefill step (admitted prompts, riders' next tokens) or a decode step: one token each, the target's."""
        seqs = admit + riders or self.running
        logits = self._prefill(admit, riders) if admit else self._decode(seqs)
        first = self._sample(logits, seqs)
        emitted = [[t] for t in first.tolist()]  # the step's one host sync
        for s in seqs:
            s.n += len(s.prompt) if s in admit else 1
        if admit and self.drafters:
            self._start(admit, riders, first)
        return emitted, [[TARGET]] * len(seqs)

    def _emit(self, seqs: list[Seq], emitted: list, sources: list, admitted: int) -> list[Seq]:
        """Each sequence's tokens up to its token budget and first eos (the first `admitted` were prefilled); the
        finished ones leave, their ranges free -> them."""
        done, self.stepped, eos = [], list(seqs), self.eos  # (seqs may be self.running, which loses the finished)
        for i, (s, e, src) in enumerate(zip(seqs, emitted, sources)):
            if i >= admitted:
                s.accepted.append(len(e))
            e = stop_at(e, s.out, s.max_new, eos)
            s.out += e
            s.new, s.new_from = e, src[:len(e)]
            self.decode_tokens += 0 if admitted else len(e)
            if (s.out and s.out[-1] in eos) or len(s.out) >= s.max_new:
                s.t_done = time.perf_counter()
                done.append(s)
                if s.drafter is not None:  # what its sources paid, for the next request
                    s.budget_stats = self.budget.finish(s)
        for s in done:
            self.running.remove(s)
            self.free.append(s.slot // self.S)
        return done

    def abort(self, index: int) -> Seq | None:
        """Drops the sequence `index`, waiting or running (a cancelled request): its range is free for the next
        step. -> the sequence, or None where none has that index (it finished)."""
        for queue in (self.waiting, self.running):
            for s in queue:
                if s.index == index:
                    queue.remove(s)
                    if queue is self.running:
                        self.free.append(s.slot // self.S)
                    s.t_done, s.behind = time.perf_counter(), None
                    return s
        return None

    def _mask(self, pos: Tensor) -> Tensor:
        """[R] rows' positions -> [R, max_seq] over each row's own range (model.forward's mask_base): the keys up to
        its position. Why a window: a dense [R, batch * max_seq] mask grows with the batch squared."""
        return self.model.seq_range[None, :self.S] <= pos[:, None]

    def _prefill(self, seqs: list[Seq], riders: list[Seq]) -> Tensor:
        """Every admitted prompt in one pass (past the rows its PrefixCache hit copied in), each at its own slots,
        and each rider's last token at its next position -> the logits of each prompt's last row, then of each
        rider's row."""
        dev = self.device
        for s in seqs:
            if s.cached:
                self.prefix.put(s.slot)
        toks = torch.tensor([t for s in seqs for t in s.prompt[s.cached:]] + [s.out[-1] for s in riders], device=dev)
        pos = torch.cat([torch.arange(s.cached, len(s.prompt), device=dev) for s in seqs]
                        + [torch.tensor([s.n for s in riders], dtype=torch.long, device=dev)])
        slot = torch.cat([torch.full((len(s.prompt) - s.cached,), s.slot, device=dev) for s in seqs]
                         + [torch.tensor([s.slot for s in riders], dtype=torch.long, device=dev)])
        _, hid, aux = self.model(toks[None], pos, mask=self._mask(pos), mask_base=slot, cache_pos=slot + pos,
                                 return_hidden=True, compute_logits=False, plan=self.plan)
        ends = list(itertools.accumulate(len(s.prompt) - s.cached for s in seqs))  # each prompt's rows end here
        P = ends[-1]
        last = torch.tensor([e - 1 for e in ends] + list(range(P, P + len(riders))), device=dev)
        logits = self.model.lm_head(hid[0, last])
        states, d = [], self.drafters is not None  # each prompt's (tokens, states, aux) over all its rows: drafters'
        for s, e in zip(seqs, ends):
            rows = slice(e - len(s.prompt) + s.cached, e)
            h, a = hid[:, rows], None if aux is None else aux[:, rows]
            if not s.cached:
                if self.prefix is not None:
                    self.prefix.keep(s.prompt, s.slot, h if d else None, a if d else None)
            elif d:
                h, a = torch.cat([self.prefix.hid, h], 1), None if a is None else torch.cat([self.prefix.aux, a], 1)
            if d:
                states.append((torch.tensor(s.prompt, device=dev), h, a))
        self._prompt_states = (states, hid[:, P:], None if aux is None else aux[:, P:], logits) \
            if self.drafters else None
        return logits

    def _start(self, seqs: list[Seq], riders: list[Seq], nxt: Tensor):
        """Each admitted sequence's drafter reads its prompt's states (and the logits of its last rows); each
        rider keeps its step for its drafter, as _spec_step keeps a step without a draft."""
        states, rhid, raux, logits = self._prompt_states
        self._prompt_states = None
        for i, (s, (toks, hid, aux)) in enumerate(zip(seqs, states)):
            T, d = len(s.prompt), s.drafter
            R = max(1, min(T, d.prompt_logits))
            lg = logits[i:i + 1] if R == 1 else torch.cat([self.model.lm_head(hid[0, T - R:T - 1]), logits[i:i + 1]])
            d.prefill(Prefill(toks, nxt[i:i + 1], lg, hid, aux))
        if riders:  # their rows' own copies: views would keep the whole prefill's states alive
            k = len(seqs)
            held = (rhid.clone(), None if raux is None else raux.clone(),
                    cpu_draft.topk_rows(logits[k:].contiguous(), None, self._top))
            for r, s in enumerate(riders):  # (s.n and s.out: before this step's token)
                s.behind.add(HeldRow(held, r, s.out[-1], int(nxt[k + r]), s.n - 1))

    def _decode(self, seqs: list[Seq]) -> Tensor:
        # each sequence's last token at its next position (the token is not in the cache yet)
        if self.runner is not None:  # a batch of one on the runner's decode step
            s, dev = seqs[0], self.device
            return self.runner.decode_fn(torch.tensor([[s.out[-1]]], device=dev), torch.tensor([s.n], device=dev),
                                         s.req.rows)
        host = torch.tensor([[s.out[-1], len(s.prompt) + len(s.out) - 1, s.slot] for s in seqs])
        if self.buckets:  # pad rows: token 0 at position 0 of the scratch range (their KV lands there)
            pad = next(b for b in self.buckets if b >= len(seqs)) - len(seqs)
            host = torch.cat([host, torch.tensor([[0, 0, self.B * self.S]]).expand(pad, 3)])
            graphs.follow_buffers((self.decode_fn,), self.model, None)  # another engine may have resized the caches
        return self.decode_fn(*host.to(self.device).unbind(1))[:len(seqs)]

    def decode_step(self, toks: Tensor, pos: Tensor, slot: Tensor) -> Tensor:
        """[R] tokens, positions and range starts -> [R, V] logits: static shapes per batch size, no host sync."""
        return self.model(toks[None], pos, mask=self._mask(pos), mask_base=slot, cache_pos=slot + pos,
                          plan=self.plan)[0]

    def _spec_step(self, seqs: list[Seq]) -> tuple[list[list[int]], list[list[str]]]:
        """One verification of every sequence's tree (its size from the budget) -> each one's emitted tokens, and
        who proposed each.
        Sequences without a draft this step cost a row and a few list appends (the budget turns drafting off
        under load: the step is then a decode step)."""
        t0, bud = time.perf_counter(), self.budget
        sizes = bud.pick(seqs)
        if self.runner is not None:
            return self._spec_one(seqs[0], sizes[0], t0)
        drafted = [self._draft(s, b) for s, b in zip(seqs, sizes)]  # (its whole tree or None, drafting seconds)
        cost = [c for _, c in drafted]  # seconds a tree adds to the step besides its rows (drafting, host work)
        # a tree's first b nodes are verified, as at batch 1 (the drafter learns from all: a lookup tree holds up
        # to k, whatever b)
        trees = {i: t.prefix(b) for i, ((t, _), b) in enumerate(zip(drafted, sizes)) if t is not None}
        tv = time.perf_counter()
        ar = [i for i in range(len(seqs)) if i not in trees]  # one row each, first in the pass
        toks, pos, where = self._rows(seqs, ar, trees, cost)
        t1 = time.perf_counter()
        logits, hid, aux = self.model(toks, pos, **where, return_hidden=True, plan=self.plan)
        logits = logits[0]
        nxt = self._sample(logits[:len(ar)], [seqs[i] for i in ar])
        pred = argmax(logits[len(ar):]).tolist() if trees else []
        held = (hid, aux, cpu_draft.topk_rows(logits, torch.arange(len(ar), device=self.device), self._top)
                if ar else None)
        nxt = nxt.tolist()  # the step's one host sync (of greedy sequences)
        t2 = time.perf_counter()
        out, src, nodes = [None] * len(seqs), [[TARGET]] * len(seqs), {}  # nodes: accepted node indices, root first
        for r, i in enumerate(ar):  # what its drafter will read when it catches up: views into the step's tensors
            s = seqs[i]
            s.behind.add(HeldRow(held, r, s.out[-1], nxt[r], s.n))
            out[i], s.n, nodes[i] = [nxt[r]], s.n + 1, [0]
            bud.observe_seq(s, 1, [0])
        r = len(ar)
        for i, t in trees.items():
            tl, s, N = time.perf_counter(), seqs[i], t.tokens.shape[0]
            out[i], src[i], nodes[i] = self._accept(s, drafted[i][0], t, pred[r - len(ar):r - len(ar) + N],
                                                    logits[r:r + N], hid[:, r:r + N],
                                                    None if aux is None else aux[:, r:r + N])
            bud.observe_seq(s, sizes[i], nodes[i])
            bud.observe_draft(s.key, sizes[i], cost[i] + time.perf_counter() - tl)
            r += N
        if self.phase_s is not None:
            self.phase_s["verify"] += time.perf_counter() - tv
        bud.observe(r, t2 - t1, sum(len(e) for e in out), time.perf_counter() - t0)
        if len(seqs) == 1:
            bud.observe_lone(seqs[0], sizes[0], nodes[0], time.perf_counter() - t0)
        return out, src

    def _rows(self, seqs: list[Seq], ar: list[int], trees: dict, cost: list) -> tuple:
        """The pass's rows: the last token of each sequence in ar, then each tree's nodes -> (tokens [1, R],
        positions, where each row attends and writes: masks over its own range, range starts, KV slots); a tree's
        share is added to its cost."""
        dev = self.device
        host = torch.tensor([[seqs[i].out[-1], seqs[i].n, seqs[i].slot] for i in ar], dtype=torch.long).view(-1, 3)
        toks, pos, base = host.to(dev).unbind(1)
        mask, cache = [self._mask(pos)], [base + pos]
        for i, t in trees.items():
            tl, s, N = time.perf_counter(), seqs[i], t.tokens.shape[0]
            toks, pos = torch.cat([toks, t.tokens]), torch.cat([pos, s.n + t.depth])
            base = torch.cat([base, torch.full((N,), s.slot, device=dev)])
            mask.append(tree_mask(self.model.seq_range[:self.S], t.anc, torch.tensor(s.n, device=dev)))
            cache.append(s.slot + s.n + torch.arange(N, device=dev))
            cost[i] += time.perf_counter() - tl
        return toks[None], pos, dict(mask=torch.cat(mask), mask_base=base, cache_pos=torch.cat(cache))

    def _accept(self, s: Seq, full: Tree, t: Tree, pred: list[int], logits: Tensor, hid: Tensor, aux: Tensor | None
                ) -> tuple[list[int], list[str], list[int]]:
        """s's tree t (the first nodes of its drafted tree, full) as the pass verified it: the accepted path (greedy
        on host lists from the target's choices pred; sampled, the lossless rule on its own stream), the path's KV
        moved to n .. n + L - 1, the step kept for its drafter -> (its tokens, who proposed each, the path's nodes)."""
        dev = self.device
        if s.sampling.greedy:
            path, L, bonus = greedy_path(t, pred)
        else:
            p, Lt, bt = accept(t, logits, s.sampling, s.gen)
            L, bonus, path = int(Lt), int(bt), p.tolist()
        self.model.compact_kv([s.slot + s.n + j for j in path[:L]], s.slot + s.n)
        a = Accepted(full, torch.tensor(path, device=dev), torch.tensor(L, device=dev), torch.tensor(bonus, device=dev),
                     logits, hid, aux, torch.tensor(s.n, device=dev))
        s.behind.add(self._kept(a, s.drafter))
        toks, by = t.tokens.tolist(), node_sources(s.drafter, s.key, t.tokens.shape[0])
        s.n, s.drafted = s.n + L, s.drafted + 1
        return [toks[j] for j in path[1:L]] + [bonus], [by[j] for j in path[1:L]] + [TARGET], path[:L]

    def _draft(self, s: Seq, b: int) -> tuple[Tree | None, float]:
        """(s's tree of b nodes, or None for no draft (b = 1); its drafter's seconds less one-time set-ups). The
        drafter first catches up with the steps it has not seen (only to draft, or once HELD are waiting: one
        update over many steps costs about what one does)."""
        s.paid = 0.0
        if b == 1 and len(s.behind) < self.HELD:
            return None, 0.0
        t0, d = time.perf_counter(), s.drafter
        if s.behind:
            d.update(s.behind.take())
        tu = time.perf_counter()
        tree = d.draft(torch.tensor([s.out[-1]], device=self.device), torch.tensor(s.n, device=self.device), b) \
            if b > 1 else None
        s.paid, t1 = d.setup_paid(), time.perf_counter()
        seconds = t1 - t0 - s.paid
        if self.phase_s is not None:
            self.phase_s["update"] += tu - t0
            self.phase_s["draft"] += t1 - tu
        if tree is None:
            self.budget.observe_draft(s.key, 1, seconds)
        if d.start_rate:  # what a set-up costs per waiting token, as measured: every sequence's drafter prices it
            for x in self.drafters:
                x.start_rate = d.start_rate
        return tree, seconds

    def _spec_one(self, s: Seq, b: int, t0: float) -> tuple[list[list[int]], list[list[str]]]:
        """_spec_step for a batch of one on the runner's static-shape halves (a CUDA graph or compiled step each):
        the drafter's update and draft (one step where fused), then verify: pass, acceptance, KV compaction."""
        r, d, ph, dev = self.runner, s.drafter, self.phase_s, self.device
        n, root = torch.tensor(s.n, device=dev), torch.tensor([s.out[-1]], device=dev)
        t1 = time.perf_counter()
        if b == 1 and len(s.behind) < self.HELD:
            tree, tu = chain_tree(root), t1
        elif r.fused_steps and b > 1 and len(s.behind) == 1:  # one graph: the update, then the next draft
            if (vocab := getattr(d, "vocab", None)) is not None:
                vocab.wait()  # an eager update still on the copy stream: the replay must not overtake it
            tree, tu = r.advance_step(s.behind.take()), t1
        else:
            if s.behind:
                d.update(s.behind.take())
            tu = time.perf_counter()
            tree = d.draft(root, n, None if self.budget.fixed else b) if b > 1 else chain_tree(root)
        s.paid, t2 = d.setup_paid(), time.perf_counter()
        sub = tree.prefix(b)
        host, a = r.verify_step(sub, n, r.planner.pass_rows(s.req, sub.tokens.shape[0]))
        t3 = time.perf_counter()
        L, emitted, nodes = accepted_tokens(host.tolist())  # the step's one host sync
        if ph is not None:
            ph["update"], ph["draft"] = ph["update"] + tu - t1, ph["draft"] + t2 - tu
            ph["verify"], ph["sync"] = ph["verify"] + t3 - t2, ph["sync"] + time.perf_counter() - t3
        # the drafter learns from every drafted token (NanoSpec); what a CUDA graph returned, its next replay rewrites
        kept = self._kept(dataclasses.replace(a, tree=tree), d)
        s.behind.add(graphs.owned(kept) if isinstance(r.verify_step, graphs.Graphed) else kept)
        s.n += L
        by = node_sources(d, s.key, tree.tokens.shape[0]) if b > 1 else []
        s.drafted += b > 1
        self.budget.observe_lone(s, b, nodes, time.perf_counter() - t0)
        return [emitted], [[by[j] for j in nodes[1:]] + [TARGET]]

    HELD = 512  # steps a sequence's drafter may fall behind (their states: 512 x 4.6 KB a row of the passes)

    def _kept(self, a: Accepted, d) -> Accepted:
        """a as the drafter will read it, steps later: the target's top-k on the path (at every node where the
        drafter reads it there) instead of its logits, and its own copies of the states (not views that keep a whole
        pass's tensors alive)."""
        top = cpu_draft.topk_rows(a.logits, None if d.reads_every_top else a.path, self._top)
        return dataclasses.replace(a, logits=a.logits[:0], top=top,
                                   hidden=a.hidden.clone(), aux=None if a.aux is None else a.aux.clone())

    def _sample(self, logits: Tensor, seqs: list[Seq]) -> Tensor:
        out = argmax(logits)
        for i, s in enumerate(seqs):
            if not s.sampling.greedy:  # on the sequence's own stream
                out[i] = sample(logits[i], s.sampling, s.gen)
        return out

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Every prompt's new tokens, in input order."""
        for p in prompts:
            self.submit(p, max_new_tokens)
        done = {}
        while self.busy():
            done.update((s.index, s.out) for s in self.step())
        return [done[i] for i in sorted(done)]
