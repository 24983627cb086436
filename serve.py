"""An OpenAI-compatible server over the batch engine, with a chat page that colours each token by where it came from.

    python serve.py                                        # the embedded default model and its default drafter
    python serve.py --checkpoint DIR --draft none --batch 32 --port 8080 --api-key KEY

Endpoints: /v1/chat/completions, /v1/completions (SSE streaming in OpenAI's chunk shape), /v1/models, /health (503
until the model and kernels are ready), /metrics (Prometheus), and the chat page at /. One engine loop (a thread,
`EngineLoop`) owns the model and the `batch.BatchEngine`: requests join the running batch as they arrive, and each
step's tokens go to their requests' queues. The HTTP side (FastAPI on uvicorn) validates, enqueues and streams; it
never touches a tensor. A request whose client goes away, or that runs past --timeout, is aborted at the next step
and its KV range freed. Each response carries its speculative statistics in the extension field "nanospec".
"""
import argparse
import asyncio
import itertools
import json
import queue
import secrets
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

import draft_config as dc
from batch import TARGET, BatchEngine
from download import CheckpointError
from errors import UsageError
from engine import DEFAULT_HEAD, load_target
from model import ModelError
from sampling import Sampling

PAGE = Path(__file__).resolve().parent / "serve_page.html"
disable_created_metrics()  # (a *_created series per counter only doubles /metrics)
LOAD_ERRORS = (UsageError, ModelError, CheckpointError, ValueError)


# ---------------------------------------------------------------- requests and their errors

class ApiError(Exception):
    """An error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


KINDS = {"an integer": (int,), "a number": (int, float), "a boolean": (bool,), "a string": (str,),
         "an object": (dict,), "an array": (list,)}


def get(body: dict, name: str, kind: str, default=None):
    """body[name] if it is of `kind` (KINDS; booleans are not numbers), default where absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, KINDS[kind]) or (isinstance(v, bool) and kind != "a boolean"):
        raise ApiError(400, f"'{name}' must be {kind}, got {json.dumps(v)[:40]}", name)
    return v


@dataclass
class Params:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool


def unsupported(body: dict):
    """OpenAI's fields this server does not implement: only their neutral values pass."""
    if get(body, "n", "an integer", 1) != 1:
        raise ApiError(400, "n > 1 is not supported: send one request per completion", "n")
    if get(body, "best_of", "an integer", 1) != 1:
        raise ApiError(400, "best_of is not supported", "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if get(body, name, "a number", 0) != 0:
            raise ApiError(400, f"{name} is not supported", name)
    for name in ("logit_bias", "tools"):
        if body.get(name):
            raise ApiError(400, f"{name} is not supported", name)
    logprobs = body.get("logprobs")
    if logprobs not in (None, False, 0):
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if get(body, "echo", "a boolean", False):
        raise ApiError(400, "echo is not supported", "echo")
    fmt = get(body, "response_format", "an object", {"type": "text"})
    if fmt.get("type") != "text":
        raise ApiError(400, "only response_format {\"type\": \"text\"} is supported", "response_format")


def sampling_of(body: dict, vocab: int) -> tuple[Sampling, int | None]:
    temperature = get(body, "temperature", "a number", 0.0)
    top_p, top_k = get(body, "top_p", "a number", 1.0), get(body, "top_k", "an integer", 0)
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    if top_k < -1:
        raise ApiError(400, f"top_k must be >= 0 (or -1: off), got {top_k}", "top_k")
    s = Sampling(float(temperature), max(top_k, 0), float(top_p))
    s.validate(vocab)
    return s, get(body, "seed", "an integer")


def stops_of(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise ApiError(400, "'stop' must be a non-empty string or an array of up to 16 of them", "stop")
    return stop


def text_of(content, i: int) -> str:
    """A message's content: a string, or text parts [{"type": "text", "text": ...}]."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                         and isinstance(c.get("text"), str) for c in content):
        return "".join(c["text"] for c in content)
    raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts", "messages")


def chat_prompt(body: dict, tok) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role' string", "messages")
        out.append({"role": m["role"], "content": text_of(m.get("content", ""), i)})
    if tok.chat_template is None:
        raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    try:
        return tok.encode_chat(out)
    except Exception as e:  # the template's own checks (roles that must alternate, ...)
        raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None


def completion_prompt(body: dict, tok, vocab: int) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str) and p:
        return tok.encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                         for t in p):
        return p
    raise ApiError(400, "'prompt' must be a non-empty string or token array (one prompt a request)", "prompt")


def parse_request(body, chat: bool, model_id: str, tok, vocab: int, context: int) -> Params:
    """A request body -> Params, or an ApiError naming the first thing wrong. context: prompt + completion tokens
    a sequence may hold."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = get(body, "model", "a string", model_id)
    if model != model_id:
        raise ApiError(400, f"the model '{model}' does not exist (this server serves '{model_id}')", "model",
                       "model_not_found")
    unsupported(body)
    sampling, seed = sampling_of(body, vocab)
    stop = stops_of(body)
    stream = get(body, "stream", "a boolean", False)
    usage = get(get(body, "stream_options", "an object", {}), "include_usage", "a boolean", False)
    prompt = chat_prompt(body, tok) if chat else completion_prompt(body, tok, vocab)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    n = get(body, name, "an integer")
    if n is not None and n < 1:
        raise ApiError(400, f"'{name}' must be >= 1, got {n}", name)
    if len(prompt) + 1 > context:
        raise ApiError(400, f"this model's context is {context} tokens, and the prompt alone has {len(prompt)}",
                       "messages" if chat else "prompt", "context_length_exceeded")
    if n is not None and len(prompt) + n > context:
        raise ApiError(400, f"this model's context is {context} tokens: {len(prompt)} in the prompt leave "
                       f"{context - len(prompt)} for the completion, not {name} = {n}", name,
                       "context_length_exceeded")
    return Params(prompt, context - len(prompt) if n is None else n, sampling, seed, stop, stream, usage)


# ---------------------------------------------------------------- a completion's text

class Output:
    """A completion's text as its steps arrive: each token's piece of text (incremental detokenization, whole
    UTF-8 characters: vLLM's two offsets), stop strings held back while one could still begin, the request's
    speculative statistics. Tokens are released as [id, text, source]."""

    def __init__(self, tok, stop: list[str]):
        self.tok, self.stop = tok, stop
        self.ids, self.prefix, self.read = [], 0, 0
        self.text, self.sent, self.held, self.count = "", 0, [], 0  # count: tokens released
        self.finish, self.timed_out = None, False
        self.steps = self.emitted = self.drafted = 0  # decode steps, their tokens (bonus and eos included)
        self.sources = {}
        self.t0, self.t_first, self.t_last = time.perf_counter(), None, None

    def add(self, ev: dict) -> list:
        """One step's tokens (ev: {"ids", "src", "n", "drafted"}) -> the tokens that can go out now."""
        self.t_last = time.perf_counter()
        if self.t_first is None:
            self.t_first = self.t_last  # the prefill's token
        else:
            self.steps, self.emitted = self.steps + 1, self.emitted + ev["n"]
            self.drafted += ev["drafted"]
        for t, s in zip(ev["ids"], ev["src"]):
            piece = self._piece(t)
            self.held.append([t, piece, s])
            self.text += piece
            self.sources[s] = self.sources.get(s, 0) + 1
        return self._release()

    def close(self, finish: str) -> list:
        """The sequence ended (eos, its budget): whatever was held, and the decoder's last characters."""
        tail = self.tok.decode(self.ids)[len(self.text):] if self.held else ""
        if tail:
            self.held[-1][1] += tail
            self.text += tail
        out = self._release(final=True)
        self.finish = self.finish or finish
        return out

    def _piece(self, t: int) -> str:
        self.ids.append(t)
        prev = self.tok.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        new = self.tok.decode(self.ids[self.prefix:])
        if len(new) <= len(prev) or new.endswith("\ufffd"):  # a character's first bytes: wait for the rest
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return new[len(prev):]

    def _release(self, final: bool = False) -> list:
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
        if hits:
            return self._cut(min(hits))
        safe = len(self.text) if final else len(self.text) - max([self._overlap(s) for s in self.stop] + [0])
        out, pos = [], self.sent
        while self.held and pos + len(self.held[0][1]) <= safe:
            if not final and len(self.held) == 1 and not self.held[0][1]:
                break  # its character's first bytes: close() may add the decoder's rest to it
            out.append(self.held.pop(0))
            pos += len(out[-1][1])
        self.sent, self.count = pos, self.count + len(out)
        return out

    def _overlap(self, s: str) -> int:
        """The longest end of the unsent text that could begin the stop string s."""
        n = len(self.text) - self.sent
        return next((k for k in range(min(len(s) - 1, n), 0, -1) if self.text.endswith(s[:k])), 0)

    def _cut(self, at: int) -> list:
        """A stop string at character `at`: every held token goes, its text up to there."""
        out, pos = [], self.sent
        for t, piece, s in self.held:
            out.append([t, piece[:max(0, at - pos)], s])
            pos += len(piece)
        self.held, self.text, self.sent, self.finish = [], self.text[:at], at, "stop"
        self.count += len(out)
        return out

    def stats(self) -> dict:
        """The "nanospec" extension field: how the request was decoded."""
        drafts = {k: v for k, v in self.sources.items() if k != TARGET}
        total = sum(drafts.values())
        dt = (self.t_last or self.t0) - (self.t_first or self.t0)
        return dict(mean_accepted_length=round(self.emitted / self.steps, 3) if self.steps else None,
                    target_steps=self.steps + 1, speculated_steps=self.drafted, tokens_from=dict(self.sources),
                    accepted_from={k: round(v / total, 4) for k, v in drafts.items()} if total else {},
                    time_to_first_token_s=round((self.t_first or self.t0) - self.t0, 4),
                    decode_tokens_per_s=round(self.count / dt, 2) if dt > 0 else None, timed_out=self.timed_out)


# ---------------------------------------------------------------- the engine loop

class Metrics:
    """/metrics: prometheus-client figures in a registry of their own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.requests = Counter("nanospec_requests", "Requests by outcome: stop, length (finished), disconnect, "
                                "timeout, rejected (429), invalid (400, 401), error", ["outcome"], registry=r)
        self.prompt_tokens = Counter("nanospec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.tokens = Counter("nanospec_generation_tokens", "Tokens generated", registry=r)
        self.queue = Gauge("nanospec_queue_depth", "Requests waiting for a KV range", registry=r)
        self.running = Gauge("nanospec_running_sequences", "Sequences decoding", registry=r)
        self.free = Gauge("nanospec_free_kv_ranges", "KV cache ranges (one per sequence of the batch) free",
                          registry=r)
        self.ttft = Histogram("nanospec_time_to_first_token_seconds", "Arrival to first token", buckets=lat,
                              registry=r)
        self.itl = Histogram("nanospec_inter_token_latency_seconds", "Time between a sequence's tokens (a step's "
                             "tokens share its time)", buckets=(0.001, 0.0025) + lat, registry=r)
        self.steps = Counter("nanospec_sequence_steps", "Decode steps of each sequence, by whether it verified a "
                             "draft", ["speculated"], registry=r)
        self.draft_tokens = Counter("nanospec_accepted_draft_tokens", "Accepted draft tokens by the drafter that "
                                    "proposed them (both: the EAGLE head and prompt lookup)", ["source"], registry=r)
        self.mean_accepted = Gauge("nanospec_mean_accepted_length", "Tokens per sequence-step, bonus included",
                                   registry=r)
        self.share = Gauge("nanospec_speculated_share", "Share of sequence-steps that verified a draft", registry=r)
        self.totals = [0, 0, 0]  # sequence-steps, their tokens, those that speculated

    def step(self, emitted: int, drafted: bool):
        t = self.totals
        t[0], t[1], t[2] = t[0] + 1, t[1] + emitted, t[2] + drafted
        self.steps.labels(str(drafted).lower()).inc()
        self.mean_accepted.set(t[1] / t[0])
        self.share.set(t[2] / t[0])


@dataclass
class Job:
    """A request as the engine loop sees it: its events go to `queue` ({"ids", "src", "n", "drafted"} per step,
    then {"done": finish reason} or {"error": message})."""
    id: int
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    queue: asyncio.Queue
    deadline: float
    t_arrive: float = field(default_factory=time.perf_counter)
    t_last: float = 0.0  # its latest step (0: none yet)
    drafted: int = 0


class EngineLoop:
    """The one thread that owns the model: it loads it, then admits requests, steps the batch, hands each step's
    tokens to their requests (one call_soon_threadsafe a step) and aborts what was cancelled or is past its
    deadline. The HTTP side only calls admit, put and cancel."""

    def __init__(self, args, metrics: Metrics):
        self.args, self.metrics = args, metrics
        self.inbox, self.jobs, self.ids = queue.SimpleQueue(), {}, itertools.count()
        self.ready, self.error, self.loop = threading.Event(), None, None
        self.lock, self.inflight = threading.Lock(), 0  # admitted and not yet finished, queued ones included
        self.thread = None

    def admit(self) -> bool:
        """A place for one more request: at most --batch running and --max-queue waiting."""
        with self.lock:
            if self.inflight >= self.args.batch + self.args.max_queue:
                return False
            self.inflight += 1
            return True

    def put(self, job: Job):
        self.inbox.put(("submit", job))

    def cancel(self, job_id: int, why: str):
        self.inbox.put(("abort", job_id, why))

    def stop(self):
        self.inbox.put(("stop",))
        if self.thread is not None:
            self.thread.join(timeout=10)

    def run(self, on_ready=None, on_fail=None):
        try:
            self.load()
        except Exception as e:  # a bad checkpoint or flag: the server exits with it
            self.error = e
            if not isinstance(e, LOAD_ERRORS):
                traceback.print_exc()
            on_fail and on_fail()
            return
        self.ready.set()
        on_ready and on_ready()
        while self._take():
            self._expire()
            if self.eng.busy():
                self._step()
        for job in list(self.jobs.values()):
            self._end(job, {"error": "the server shut down"}, "error")

    def load(self):
        a = self.args
        model, self.tok, path = load_target(a.checkpoint, a.device, a.dtype)
        if a.exact and model.cpu_pass is None:
            raise UsageError("--exact batches need the fused CPU pass (bf16 on a CPU with AVX2)")
        self.model, self.model_id, self.vocab = model, path.name, model.args.vocab_size
        self.drafters = dc.make_drafters(dc.from_flags(a, DEFAULT_HEAD), model, a.batch, Sampling(), self.tok)
        self.S = min(-(-a.max_seq // 16) * 16, model.args.max_position_embeddings)  # 16: attention blocks
        self.context = self.S - (self.drafters[0].nodes if self.drafters else 0)
        if self.context < 2:
            raise UsageError(f"--max-seq {a.max_seq} leaves no room for a prompt and a draft tree")
        self.eng = self._engine()
        self.eng.submit(self.tok.encode("Hello") or [0], 4, index=-1)  # warm-up: kernels and first-use set-ups
        while self.eng.busy():
            self.eng.step()
        self._gauges()

    def _engine(self) -> BatchEngine:
        a = self.args
        return BatchEngine(self.model, a.batch, self.S, drafters=self.drafters, budget=a.budget == "auto",
                           exact=a.exact is not False)

    def _take(self) -> bool:
        """Admits what arrived (waiting a while for it when nothing runs) -> False once told to stop."""
        block = not self.eng.busy()
        while True:
            try:
                item = self.inbox.get(timeout=0.2) if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if item[0] == "stop":
                return False
            if item[0] == "submit":
                self._submit(item[1])
            else:
                self._abort(*item[1:])

    def _submit(self, job: Job):
        try:
            self.eng.submit(job.prompt, job.max_tokens, job.sampling, seed=job.seed, index=job.id)
        except (UsageError, ValueError) as e:  # (parse_request checked what these check)
            self._end(job, {"error": str(e)}, "error")
            return
        self.jobs[job.id] = job
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self._gauges()

    def _abort(self, job_id: int, why: str):
        job = self.jobs.get(job_id)
        if job is not None:
            self.eng.abort(job_id)
            self._end(job, None, why)

    def _expire(self):
        now = time.perf_counter()
        for job in [j for j in self.jobs.values() if j.deadline < now]:
            self.eng.abort(job.id)
            self._end(job, {"done": "length", "timed_out": True}, "timeout")

    def _end(self, job: Job, event: dict | None, outcome: str):
        """The job leaves: its last event, its outcome counted, its place freed."""
        self.jobs.pop(job.id, None)
        if event is not None:
            self._post([(job.queue, event)])
        self.metrics.requests.labels(outcome).inc()
        with self.lock:
            self.inflight -= 1
        self._gauges()

    def _step(self):
        try:
            done = self.eng.step()
        except Exception:  # every running request fails, the server goes on with a fresh batch
            traceback.print_exc()
            for job in list(self.jobs.values()):
                self._end(job, {"error": "the engine failed on this batch"}, "error")
            self.eng = self._engine()
            return
        now, out, m = time.perf_counter(), [], self.metrics
        for s in self.eng.stepped:
            job = self.jobs.get(s.index)
            if job is None:
                continue
            ids, src = s.new, s.new_from
            if ids and ids[-1] in self.eng.eos:  # the eos token ends the text; it is not part of it
                ids, src = ids[:-1], src[:-1]
            drafted, job.drafted = s.drafted != job.drafted, s.drafted
            if job.t_last:
                m.step(len(s.new), drafted)
                for _ in ids:
                    m.itl.observe((now - job.t_last) / len(ids))
            else:
                m.ttft.observe(now - job.t_arrive)
            for x in src:
                if x != TARGET:
                    m.draft_tokens.labels(x).inc()
            m.tokens.inc(len(ids))
            job.t_last = now
            out.append((job.queue, {"ids": ids, "src": src, "n": len(s.new), "drafted": drafted}))
        self._post(out)
        for s in done:
            if (job := self.jobs.get(s.index)) is not None:
                reason = "stop" if s.out[-1] in self.eng.eos else "length"
                self._end(job, {"done": reason}, reason)
        self._gauges()

    def _post(self, items: list):
        def put(items):
            for q, ev in items:
                q.put_nowait(ev)
        try:
            self.loop.call_soon_threadsafe(put, items)
        except RuntimeError:  # the event loop is gone (shutting down)
            pass

    def _gauges(self):
        e = self.eng
        self.metrics.queue.set(len(e.waiting))
        self.metrics.running.set(len(e.running))
        self.metrics.free.set(len(e.free))


# ---------------------------------------------------------------- the HTTP side

def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Server:
    """The routes' state: the engine loop, the metrics, the key, whether it is draining."""

    def __init__(self, args):
        self.args, self.metrics = args, Metrics()
        self.engine, self.draining, self.uvicorn = EngineLoop(args, self.metrics), False, None

    def authorize(self, request: Request):
        key = self.args.api_key
        if key is None:
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", None, "invalid_api_key",
                           "authentication_error")

    def check_ready(self):
        if self.draining:
            raise ApiError(503, "the server is shutting down", kind="unavailable_error")
        if not self.engine.ready.is_set():
            raise ApiError(503, "loading the model", kind="unavailable_error")

    async def complete(self, request: Request, chat: bool) -> Response:
        self.authorize(request)
        self.check_ready()
        e = self.engine
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as x:
            raise ApiError(400, f"the body is not valid JSON ({x})") from None
        try:
            p = parse_request(body, chat, e.model_id, e.tok, e.vocab, e.context)
        except ValueError as x:  # Sampling.validate
            raise ApiError(400, str(x)) from None
        if not e.admit():
            raise ApiError(429, f"{self.args.max_queue} requests are waiting already: retry later", None,
                           "queue_full", "rate_limit_error", {"Retry-After": "1"})
        job = Job(next(e.ids), p.prompt, p.max_tokens, p.sampling, p.seed, asyncio.Queue(),
                  time.perf_counter() + self.args.timeout)
        e.put(job)
        out = Output(e.tok, p.stop)
        head = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", created=int(time.time()),
                    model=e.model_id)
        if p.stream:
            return StreamingResponse(self.stream(job, out, p, head, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.whole(request, job, out, p, head, chat)

    async def tokens(self, job: Job, out: Output):
        """The tokens released step by step, until the sequence ends or a stop string matches."""
        while True:
            ev = await job.queue.get()
            if "error" in ev:
                raise ApiError(500, ev["error"], kind="server_error")
            if "done" in ev:
                out.timed_out = ev.get("timed_out", False)
                yield out.close(ev["done"])
                return
            released = out.add(ev)
            if out.finish:  # a stop string: the sequence's further tokens are not needed
                self.engine.cancel(job.id, "stop")
                yield released
                return
            if released:
                yield released

    async def whole(self, request: Request, job: Job, out: Output, p: Params, head: dict, chat: bool) -> Response:
        async def collect():
            async for _ in self.tokens(job, out):
                pass

        async def gone():  # vLLM's with_cancellation: race the request against its client's disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(gone())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                self.engine.cancel(job.id, "disconnect")
        if not work.done():
            return Response(status_code=499)
        work.result()  # (an ApiError of the engine's)
        text = out.text
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text})
        choice.update(logprobs=None, finish_reason=out.finish)
        return JSONResponse(dict(head, object="chat.completion" if chat else "text_completion", choices=[choice],
                                 usage=self.usage(p, out), nanospec=out.stats()))

    async def stream(self, job: Job, out: Output, p: Params, head: dict, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish=None, ext=None) -> str:
            if chat:
                c = {"index": 0, "delta": {} if text is None else {"content": text}}
            else:
                c = {"index": 0, "text": text or ""}
            c.update(logprobs=None, finish_reason=finish)
            return sse(dict(head, object=kind, choices=[c], nanospec=ext))

        finished = False
        try:
            if chat:
                yield sse(dict(head, object=kind, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None, "finish_reason": None}]))
            async for toks in self.tokens(job, out):
                if toks:
                    ext = {"tokens": [{"id": t, "text": x, "source": s} for t, x, s in toks],
                           "mean_accepted_length": round(out.emitted / out.steps, 3) if out.steps else None}
                    yield chunk("".join(x for _, x, _ in toks), ext=ext)
            yield chunk(None, out.finish, out.stats())
            if p.include_usage:
                yield sse(dict(head, object=kind, choices=[], usage=self.usage(p, out)))
            finished = True
        except ApiError as e:
            finished = True
            yield sse(e.body)
        finally:
            if not finished:  # the client went away (or the server is stopping): free the sequence
                self.engine.cancel(job.id, "disconnect")
        yield "data: [DONE]\n\n"

    @staticmethod
    def usage(p: Params, out: Output) -> dict:
        return dict(prompt_tokens=len(p.prompt), completion_tokens=out.count,
                    total_tokens=len(p.prompt) + out.count)

    def on_ready(self):
        a, e = self.args, self.engine
        url = f"http://{a.host}:{a.port}"
        key = ' -H "Authorization: Bearer $API_KEY"' if a.api_key else ""
        print(f"NanoSpec serves {e.model_id} at {url} (chat page: {url}/, {a.batch} sequences of {e.context} "
              f"tokens)\ntry:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key} -d "
              f"'{{\"model\": \"{e.model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the "
              f"capital of France?\"}}]}}'", flush=True)

    def on_fail(self):
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True


def make_app(srv: Server) -> FastAPI:
    app = FastAPI(title="NanoSpec", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        outcome = {401: "invalid", 429: "rejected", 503: "unavailable"}.get(e.status, "invalid" if e.status < 500
                                                                            else "error")
        srv.metrics.requests.labels(outcome).inc()
        return e.response()

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        try:
            srv.check_ready()
        except ApiError as e:
            return e.response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        srv.authorize(request)
        srv.check_ready()
        return {"object": "list", "data": [{"id": srv.engine.model_id, "object": "model", "created": 0,
                                            "owned_by": "nanospec", "max_model_len": srv.engine.context}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await srv.complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.complete(request, chat=False)

    return app


class Uvicorn(uvicorn.Server):
    """uvicorn's server: the engine loop starts loading once the socket listens (so /health answers 503 meanwhile),
    and a signal also turns new requests away (503) while running ones finish (up to --shutdown-timeout), then
    the process exits 0."""

    def __init__(self, config, srv: Server):
        super().__init__(config)
        self.srv = srv

    async def startup(self, sockets=None):
        await super().startup(sockets)
        e = self.srv.engine
        e.loop = asyncio.get_running_loop()
        e.thread = threading.Thread(target=e.run, args=(self.srv.on_ready, self.srv.on_fail), name="engine",
                                    daemon=True)
        e.thread.start()

    def handle_exit(self, sig, frame):
        self.srv.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a graceful stop exits 0 (uvicorn would raise the signal again)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="NanoSpec's OpenAI-compatible server over the batch engine")
    p.add_argument("--checkpoint", default=None, help="HF folder, hub id, .gguf or named model (default: embedded "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--batch", type=int, default=16, help="sequences decoded together, each in its own KV range")
    p.add_argument("--max-seq", type=int, default=2048, help="a sequence's positions: prompt + completion (+ a "
                   "draft tree)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a range; past it: 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may run (then it ends, "
                   "finish_reason length)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="on SIGINT/SIGTERM: seconds running "
                   "requests get to finish")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="a greedy request's output is its batch-1 output bit for bit (default: on, through the "
                        "fused CPU pass; --no-exact: large passes may run the PyTorch layers)")
    g = dc.add_flags(p)
    g.add_argument("--budget", default="auto", choices=["auto", "fixed"],
                   help="auto: each sequence's tree size for the batch's tokens per second; fixed: whole trees")
    args = p.parse_args(argv)
    args.given = dc.given_flags(p, argv)
    # from_flags: no torch.compile; a named model's draft model is not its default here (the batch engine drafts
    # with EAGLE heads and prompt lookup, as --prompts does)
    args.compile, args.prompts = False, "served"
    for name, v, least in (("--batch", args.batch, 1), ("--max-seq", args.max_seq, 16), ("--max-queue",
                                                                                         args.max_queue, 0)):
        if v < least:
            raise UsageError(f"{name} must be >= {least}, got {v}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.timeout <= 0 or args.shutdown_timeout < 0:
        raise UsageError("--timeout must be > 0 and --shutdown-timeout >= 0")
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    srv = Server(args)
    config = uvicorn.Config(make_app(srv), host=args.host, port=args.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=args.shutdown_timeout)
    srv.uvicorn = Uvicorn(config, srv)
    srv.uvicorn.run()
    srv.engine.stop()
    if srv.engine.error is not None:
        print(f"error: {srv.engine.error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
