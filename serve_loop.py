"""serve.py's engine loop: one thread owns the model and the batch engine (EngineLoop), takes requests (Job) from the
HTTP side's queue between steps, streams each step's tokens to their requests' queues, aborts the ones whose
client left or whose time ran out, and keeps the Prometheus figures (Metrics)."""
import asyncio
import itertools
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

import draft_config as dc
import tp
from batch import BatchEngine
from download import CheckpointError
from engine import DEFAULT_HEAD, load_target
from errors import UsageError
from model import ModelError
from sampling import Sampling
from sequence import TARGET

disable_created_metrics()  # (a *_created series per counter only doubles /metrics)
LOAD_ERRORS = (UsageError, ModelError, CheckpointError, ValueError)


# ---------------------------------------------------------------- the engine loop

class Metrics:
    """/metrics: prometheus-client figures in a registry of their own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.requests = Counter("nanospec_requests", "Requests by outcome: stop, length (finished), disconnect, "
                                "timeout, rejected (429), invalid (400, 401), error", ["outcome"], registry=r)
        self.prompt_tokens = Counter("nanospec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Gauge("nanospec_prompt_tokens_cached", "Prompt tokens copied from the batch's shared "
                                   "prefix (prefix_cache.py) rather than prefilled", registry=r)
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
        self.events = []  # what this turn of the loop did to the engine, for the other TP ranks (follow)

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
            busy = self.eng.busy()
            self._share(busy)
            if busy:
                self._step()
        self._share(None)
        for job in list(self.jobs.values()):
            self._end(job, {"error": "the server shut down"}, "error")

    def _share(self, step: bool | None):
        """Under TP, the turn's submits and aborts, then whether to step (None: stop), to the other ranks' engines;
        an idle server sends every 0.2 s (_take's wait), which keeps them from timing out."""
        if tp.world() > 1:
            tp.share((self.events, step))
        self.events = []

    def load(self):
        a = self.args
        model, self.tok, path = load_target(a.checkpoint, a.device, a.dtype)
        if a.exact and model.cpu_pass is None:
            raise UsageError("--exact batches need the fused CPU pass (bf16 on a CPU with AVX2)")
        tp.shard(model, a.exact is not False)  # (torchrun: this rank's slices of the layers; one process: as it is)
        tp.sync_budget()
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
        self.events.append(("submit", job.prompt, job.max_tokens, job.sampling, job.seed, job.id))
        self.jobs[job.id] = job
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self._gauges()

    def _abort(self, job_id: int, why: str):
        job = self.jobs.get(job_id)
        if job is not None:
            self.eng.abort(job_id)
            self.events.append(("abort", job_id))
            self._end(job, None, why)

    def _expire(self):
        now = time.perf_counter()
        for job in [j for j in self.jobs.values() if j.deadline < now]:
            self.eng.abort(job.id)
            self.events.append(("abort", job.id))
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
        self.metrics.cached_tokens.set(e.prefix.saved)


def follow(args):
    """A tensor-parallel rank other than 0 (torchrun): rank 0's engine, built the same way, fed what rank 0's loop
    did each turn (its submits and aborts, then a step or not) until it stops. Rank 0 alone serves HTTP. A signal
    (the launcher passes SIGTERM to every rank) is rank 0's to act on: this rank follows until rank 0 stops."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    loop = EngineLoop(args, Metrics())
    loop.load()
    while True:
        events, step = tp.share()
        for e in events:
            if e[0] == "submit":
                loop.eng.submit(e[1], e[2], e[3], seed=e[4], index=e[5])
            else:
                loop.eng.abort(e[1])
        if step is None:
            return
        if step:
            try:
                loop.eng.step()
            except Exception:  # as rank 0's loop: a fresh batch
                traceback.print_exc()
                loop.eng = loop._engine()
