"""Batched decoding: many sequences in one target pass, with continuous batching (nano-vllm's scheduler in a few
functions). The sequences share one KV cache, each in its own range of max_seq slots; a pass carries every running
sequence's rows, and each row attends to its own range only (the mask), so the weights are read once a step for the
whole batch. With the fused CPU pass (row-invariant GEMMs, attention over a row's allowed keys in slot order, one
chain per key) a sequence's output is its batch-1 output bit for bit.

    engine = BatchEngine(model, batch=8, max_seq=1024)
    outs = engine.generate_batch(prompts, 128)                      # token lists, in input order
    engine.submit(prompt, 128); done = engine.step()                # streaming: finished sequences per step

Sequences decode autoregressively: per-sequence drafting (its own NanoSpec window) and the load-aware budget are
not part of this engine yet.
"""
import json
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from errors import UsageError
from model import Transformer
from sampling import Sampling, argmax, logits_to_probs


@dataclass
class Seq:
    index: int
    prompt: list[int]
    max_new: int
    sampling: Sampling
    gen: torch.Generator | None  # its own random stream (sampled sequences)
    out: list[int] = field(default_factory=list)
    slot: int = -1  # its range's first KV slot
    t_submit: float = 0.0
    t_done: float = 0.0


class BatchEngine:
    """Up to `batch` sequences at a time; waiting prompts join as running ones finish (prefill steps first)."""

    def __init__(self, model: Transformer, batch: int, max_seq: int, sampling: Sampling = Sampling(),
                 prefill_rows: int = 2048):
        if batch < 1:
            raise UsageError(f"--batch must be >= 1, got {batch}")
        self.model, self.B, self.S, self.sampling, self.prefill_rows = model, batch, max_seq, sampling, prefill_rows
        self.device = model.lm_head.weight.device
        self.eos = set(model.args.eos_ids)
        model.setup_caches(1, max_seq, slots=batch * max_seq)
        self.free, self.waiting, self.running = list(range(batch)), deque(), []
        self.submitted = 0
        self.decode_fn = self.decode_step  # graphs.py may compile it (one graph per batch size)
        self.steps = {"prefill": 0, "decode": 0}
        self.rows = 0  # sequences over every decode step (occupancy = rows / (decode steps * batch))
        self.decode_s = 0.0

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: Sampling | None = None,
               seed: int | None = None) -> int:
        """Queue a prompt -> its index (the order of submission)."""
        s = sampling or self.sampling
        s.validate(self.model.args.vocab_size)
        if not prompt:
            raise UsageError(f"prompt {self.submitted} is empty")
        if max_new_tokens < 1:
            raise UsageError(f"prompt {self.submitted}: max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.S:
            raise UsageError(f"prompt {self.submitted}: {len(prompt)} tokens + {max_new_tokens} new exceed the "
                             f"{self.S} positions a sequence has (--max-seq)")
        gen = None
        if not s.greedy:
            gen = torch.Generator(self.device).manual_seed(seed if seed is not None else self.submitted)
        self.waiting.append(Seq(self.submitted, list(prompt), max_new_tokens, s, gen, t_submit=time.perf_counter()))
        self.submitted += 1
        return self.submitted - 1

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @torch.no_grad()
    def step(self) -> list[Seq]:
        """One target pass: the prefill of waiting sequences that fit, else one token for every running one.
        -> the sequences that finished in it (eos or their token budget)."""
        admit, rows = [], 0
        while self.waiting and self.free and (not admit or rows + len(self.waiting[0].prompt) <= self.prefill_rows):
            s = self.waiting.popleft()
            s.slot, rows = self.free.pop(0) * self.S, rows + len(s.prompt)
            admit.append(s)
        seqs = admit or self.running
        if not seqs:
            return []
        t0 = time.perf_counter()
        logits = self._prefill(admit) if admit else self._decode(self.running)
        toks = self._sample(logits, seqs).tolist()  # the step's one host sync
        self.steps["prefill" if admit else "decode"] += 1
        if not admit:
            self.rows += len(seqs)
            self.decode_s += time.perf_counter() - t0
        self.running += admit
        done = []
        for s, t in zip(seqs, toks):
            s.out.append(t)
            if t in self.eos or len(s.out) >= s.max_new:
                s.t_done = time.perf_counter()
                done.append(s)
        for s in done:
            self.running.remove(s)
            self.free.append(s.slot // self.S)
        return done

    def _mask(self, pos: Tensor) -> Tensor:
        """[R] rows' positions -> [R, max_seq] over each row's own range (model.forward's mask_base): the keys up to
        its position. Why a window: a dense [R, batch * max_seq] mask grows with the batch squared."""
        return self.model.seq_range[None, :self.S] <= pos[:, None]

    def _prefill(self, seqs: list[Seq]) -> Tensor:
        # every admitted prompt in one pass, each at its own slots; the logits of each prompt's last row
        dev = self.device
        toks = torch.tensor([t for s in seqs for t in s.prompt], device=dev)
        pos = torch.cat([torch.arange(len(s.prompt), device=dev) for s in seqs])
        slot = torch.cat([torch.full((len(s.prompt),), s.slot, device=dev) for s in seqs])
        _, hid, _ = self.model(toks[None], pos, mask=self._mask(pos), mask_base=slot, cache_pos=slot + pos,
                               return_hidden=True, compute_logits=False)
        last = torch.tensor([len(s.prompt) for s in seqs], device=dev).cumsum(0) - 1
        return self.model.lm_head(hid[0, last])

    def _decode(self, seqs: list[Seq]) -> Tensor:
        # each sequence's last token at its next position (the token is not in the cache yet)
        host = torch.tensor([[s.out[-1], len(s.prompt) + len(s.out) - 1, s.slot] for s in seqs])
        return self.decode_fn(*host.to(self.device).unbind(1))

    def decode_step(self, toks: Tensor, pos: Tensor, slot: Tensor) -> Tensor:
        """[R] tokens, positions and range starts -> [R, V] logits: static shapes per batch size, no host sync."""
        return self.model(toks[None], pos, mask=self._mask(pos), mask_base=slot, cache_pos=slot + pos)[0]

    def _sample(self, logits: Tensor, seqs: list[Seq]) -> Tensor:
        out = argmax(logits)
        for i, s in enumerate(seqs):
            if not s.sampling.greedy:  # exponential race on the sequence's own stream (sampling.sample_from)
                p = logits_to_probs(logits[i], s.sampling)
                out[i] = argmax(p / torch.empty_like(p).exponential_(1, generator=s.gen))
        return out

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Every prompt's new tokens, in input order."""
        for p in prompts:
            self.submit(p, max_new_tokens)
        done = {}
        while self.busy():
            done.update((s.index, s.out) for s in self.step())
        return [done[i] for i in sorted(done)]


def read_prompts(path: str) -> list[dict]:
    """One prompt a line: a JSON object {"prompt", optional "max_new_tokens", "temperature", "seed"} or plain text
    -> [{"prompt", ...}]; a bad line is a UsageError naming it."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"cannot read --prompts {path}: {e.strerror}") from None
    out, kinds = [], {"max_new_tokens": int, "temperature": (int, float), "seed": int}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            out.append({"prompt": line})
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {n} is not valid JSON ({e.msg})") from None
        if not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise UsageError(f"{path} line {n} has no \"prompt\" string")
        for k, t in kinds.items():
            if k in obj and (not isinstance(obj[k], t) or isinstance(obj[k], bool)):
                raise UsageError(f"{path} line {n}: \"{k}\" must be a number" + (" (an integer)" if t is int else ""))
        out.append(obj)
    if not out:
        raise UsageError(f"--prompts {path} holds no prompt")
    return out


def run_prompts(model: Transformer, tok, args, sampling: Sampling) -> int:
    """generate.py --prompts FILE --batch N: one JSON line per prompt as it finishes (--ordered: in input order),
    then a summary on stderr (--json: also as the last stdout line)."""
    items = read_prompts(args.prompts)
    chat = not args.raw and tok.chat_template is not None
    ids = [tok.encode_chat([{"role": "user", "content": it["prompt"]}]) if chat else tok.encode(it["prompt"])
           for it in items]
    news = [it.get("max_new_tokens", args.max_new_tokens) for it in items]
    limit = model.args.max_position_embeddings
    for i, (p, n) in enumerate(zip(ids, news)):
        if n < 1 or len(p) + n > limit:
            raise UsageError(f"prompt {i}: {len(p)} tokens + {n} new tokens must be 1 to {limit} positions")
    S = -(-max(len(p) + n for p, n in zip(ids, news)) // 16) * 16  # every sequence's range fits the longest
    eng = BatchEngine(model, args.batch, min(S, limit), sampling)
    for i, (it, p, n) in enumerate(zip(items, ids, news)):
        s = Sampling(float(it["temperature"]), sampling.top_k, sampling.top_p) if "temperature" in it else sampling
        eng.submit(p, n, s, it.get("seed", args.seed + i))
    t0, pending, next_out, total = time.perf_counter(), {}, 0, 0
    while eng.busy():
        for s in eng.step():
            total += len(s.out)
            pending[s.index] = dict(index=s.index, text=tok.decode([t for t in s.out if t not in eng.eos]),
                                    new_tokens=len(s.out), mean_accepted_length=1.0,
                                    seconds=round(s.t_done - s.t_submit, 4))
            for i in sorted(pending) if not args.ordered else []:
                print(json.dumps(pending.pop(i)), flush=True)
            while args.ordered and next_out in pending:
                print(json.dumps(pending.pop(next_out)), flush=True)
                next_out += 1
    dt = time.perf_counter() - t0
    dec = eng.steps["decode"]
    summary = dict(prompts=len(items), batch=args.batch, new_tokens=total, tokens_per_s=round(total / dt, 2),
                   decode_tokens_per_s=round(eng.rows / max(eng.decode_s, 1e-9), 2), decode_steps=dec,
                   prefill_steps=eng.steps["prefill"],
                   occupancy=round(eng.rows / max(dec * args.batch, 1), 3), speculated_share=0.0)
    print(f"[{len(items)} prompts, batch {args.batch}: {total} new tokens, {summary['tokens_per_s']:.2f} tok/s, "
          f"occupancy {summary['occupancy']:.0%}, speculated on 0% of steps]", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    return 0
