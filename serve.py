"""An OpenAI-compatible server over the batch engine, with a chat page that colours each token by where it came from.

    python serve.py                                        # the embedded default model and its default drafter
    python serve.py --checkpoint DIR --draft none --batch 32 --port 8080 --api-key KEY

Endpoints: /v1/chat/completions, /v1/completions (SSE streaming in OpenAI's chunk shape), /v1/models, /health (503
until the model and kernels are ready), /metrics (Prometheus), and the chat page at /. One engine loop (a thread,
`EngineLoop`) owns the model and the `batch.BatchEngine`: requests join the running batch as they arrive, and each
step's tokens go to their requests' queues. The HTTP side (FastAPI on uvicorn) validates, enqueues and streams; it
never touches a tensor. A request whose client goes away, or that runs past --timeout, is aborted at the next step
and its KV range freed. Each response carries its speculative statistics in the extension field "nanospec".
Requests are checked in serve_request.py; the engine loop is serve_loop.py.
"""
import argparse
import asyncio
import json
import secrets
import sys
import threading
import time
import uuid
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import draft_config as dc
import tp
from errors import UsageError
from serve_loop import LOAD_ERRORS, EngineLoop, Job, Metrics, follow
from serve_request import ApiError, Output, Params, parse_request

PAGE = Path(__file__).resolve().parent / "serve_page.html"


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
        tp.setup(args.device)  # torchrun: this rank joins the group; ranks other than 0 follow rank 0's engine
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if tp.rank() > 0:
        try:
            follow(args)
        except LOAD_ERRORS:  # (rank 0 says it)
            return 2
        return 0
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
