"""serve.py under load, beside llama-server: N concurrent clients (the official `openai` async client, streaming)
send Spec-Bench's questions and the built-in prompts; per concurrency, throughput (completion tokens per second of
wall time), time to first token p50/p99 and inter-token latency p50/p99, for serve.py with its default drafter and
without drafting, and llama-server (`-np N -cb`) on a GGUF of the same weights in the same run. Prints a Markdown
table and saves a PNG of throughput and p99 latencies against concurrency.

    python bench_serve.py --clients 1,4,16,64 --max-new-tokens 256 --png results/bench_serve.png \\
        --llama-server LLAMA_BUILD/bin/llama-server --gguf checkpoints/SmolLM2-135M-Instruct-bf16.gguf

Each concurrency level sends max(12, requests x N) requests (all six Spec-Bench tasks at least), each client
taking the next prompt as its last answer ends (a closed loop), greedy; the systems take turns at each level. One
serve.py per configuration runs the whole benchmark with --batch max(N); llama-server starts per level with -np N.
A chunk carries several tokens where drafts were accepted: its gap is shared among them (one latency per token).
"""
import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench_workload import BUILTIN_QUESTIONS, load_questions, parse_question, select_questions
from errors import UsageError

HERE = Path(__file__).resolve().parent
SPEC_BENCH = HERE.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
CONFIGS = {"drafting": [], "ar": ["--draft", "none"]}  # serve.py's configurations: extra flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Endpoint:
    """A server subprocess (its log in a file), ready when /health answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path):
        self.name, self.url, self.log = name, f"http://127.0.0.1:{port}", log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE)

    def wait(self, timeout: float = 600) -> "Endpoint":
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise UsageError(f"{self.name} exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise UsageError(f"{self.name} was not ready after {timeout:.0f} s (log: {self.log})")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def nanospec(config: str, args, batch: int, logs: Path) -> Endpoint:
    port = free_port()
    cmd = [sys.executable, str(HERE / "serve.py"), "--port", str(port), "--batch", str(batch), "--max-seq",
           str(args.max_seq), "--max-queue", str(4 * batch)] + CONFIGS[config] + args.serve_flags
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    return Endpoint(f"nanospec {config}", cmd, port, logs / f"serve_{config}.log")


def llama_server(args, n: int, logs: Path) -> Endpoint:
    port = free_port()
    cmd = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(n), "-cb",
           "-t", str(args.threads), "-c", str(n * args.max_seq), "--no-webui"]
    return Endpoint("llama-server", cmd, port, logs / f"llama_server_{n}.log")


@dataclass
class Record:
    start: float
    end: float = 0.0
    ttft: float | None = None
    itl: list = field(default_factory=list)  # seconds per token after the first
    tokens: int = 0
    stats: dict | None = None  # serve.py's "nanospec" field


async def one(client, model: str, prompt: str, max_tokens: int) -> Record:
    """One streamed chat request: its first token's time, each later token's share of its chunk's gap."""
    rec = Record(time.perf_counter())
    last, counted = None, 0
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0.0, stream=True,
                                                  stream_options={"include_usage": True})
    async for c in stream:
        ext = (c.model_extra or {}).get("nanospec") or {}
        k = len(ext["tokens"]) if "tokens" in ext else int(bool(c.choices and c.choices[0].delta.content))
        now = time.perf_counter()
        if k and last is None:
            rec.ttft = now - rec.start
        elif k:
            rec.itl += [(now - last) / k] * k
        last, counted = (now, counted + k) if k else (last, counted)
        if c.choices and c.choices[0].finish_reason and "mean_accepted_length" in ext:
            rec.stats = ext
        if c.usage:
            rec.tokens = c.usage.completion_tokens
    rec.end, rec.tokens = time.perf_counter(), rec.tokens or counted
    return rec


async def level(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> tuple[list, float]:
    """`clients` closed-loop clients through `requests` prompts -> (records, wall seconds)."""
    import openai
    # a new connection per request: a kept-alive one that the server closes as the next request goes out drops
    # it ("Server disconnected without sending a response": llama-server, after about 20 requests on one)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600,
                                default_headers={"Connection": "close"})
    model = (await client.models.list()).data[0].id
    todo, out = list(range(requests)), []

    async def worker():
        while todo:
            i = todo.pop(0)
            out.append(await one(client, model, prompts[i % len(prompts)], max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return out, wall


def summarize(recs: list[Record], wall: float) -> dict:
    ttft = [r.ttft for r in recs if r.ttft is not None]
    itl = [x for r in recs for x in r.itl]
    q = lambda xs, p: round(float(np.percentile(xs, p)) * 1000, 1) if xs else None  # noqa: E731  (ms)
    tokens = sum(r.tokens for r in recs)
    d = dict(requests=len(recs), tokens=tokens, wall_s=round(wall, 2), tok_s=round(tokens / wall, 1),
             ttft_p50_ms=q(ttft, 50), ttft_p99_ms=q(ttft, 99), itl_p50_ms=q(itl, 50), itl_p99_ms=q(itl, 99))
    st = [r.stats for r in recs if r.stats]
    if st:
        steps = sum(s["target_steps"] - 1 for s in st)
        d["mean_accepted_length"] = round(sum(s["mean_accepted_length"] * (s["target_steps"] - 1) for s in st
                                              if s["mean_accepted_length"]) / max(steps, 1), 3)
        d["speculated_share"] = round(sum(s["speculated_steps"] for s in st) / max(steps, 1), 3)
    return d


def workload(questions: str | None, limit: int | None) -> list[str]:
    """Spec-Bench's first turns (task by task, round-robin) interleaved with the built-in prompts."""
    builtin = [parse_question(q, i).turns[0] for i, q in enumerate(BUILTIN_QUESTIONS, 1)]
    tasks = {}
    for q in (select_questions(load_questions(questions), None, limit) if questions else []):
        tasks.setdefault(q.task, []).append(q.turns[0])
    spec = [t[i] for i in range(max(map(len, tasks.values()), default=0)) for t in tasks.values() if i < len(t)]
    out = []
    for i in range(max(len(spec), len(builtin))):
        out += ([spec[i]] if i < len(spec) else []) + ([builtin[i]] if i < len(builtin) else [])
    return out


def table(rows: list[dict]) -> str:
    cols = ["clients", "system", "requests", "tokens", "tok_s", "vs llama-server", "ttft_p50_ms", "ttft_p99_ms",
            "itl_p50_ms", "itl_p99_ms", "mean_accepted_length", "speculated_share"]
    peer = {r["clients"]: r["tok_s"] for r in rows if r["system"] == "llama-server"}
    lines = ["| " + " | ".join(c.replace("_", " ") for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        vs = f"{r['tok_s'] / peer[r['clients']]:.2f}x" if r["clients"] in peer and peer[r["clients"]] else ""
        lines.append("| " + " | ".join(vs if c == "vs llama-server" else "" if r.get(c) is None else str(r[c])
                                       for c in cols) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in dict.fromkeys(r["system"] for r in rows):
        rs = [r for r in rows if r["system"] == name]
        x = [r["clients"] for r in rs]
        for a, key in zip(ax, ("tok_s", "ttft_p99_ms", "itl_p99_ms")):
            a.plot(x, [r[key] for r in rs], marker="o", label=name)
    for a, label in zip(ax, ("throughput (tok/s)", "time to first token p99 (ms)", "inter-token latency p99 (ms)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent clients")
        a.set_ylabel(label)
        a.grid(alpha=0.3)
    ax[1].set_yscale("log")
    ax[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="serve.py under load, beside llama-server")
    p.add_argument("--clients", default="1,4,16,64", help="concurrency levels")
    p.add_argument("--requests", type=int, default=2, help="requests per client at each level (at least 12 in all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--questions", default=str(SPEC_BENCH) if SPEC_BENCH.is_file() else None,
                   help="Spec-Bench's question.jsonl (read at run time; '' : the built-in prompts only)")
    p.add_argument("--limit", type=int, default=None, help="questions per Spec-Bench task")
    p.add_argument("--configs", default="drafting,ar", help=f"serve.py configurations: {', '.join(CONFIGS)} "
                   "('' : none)")
    p.add_argument("--checkpoint", default=None, help="serve.py's --checkpoint (default: the embedded model)")
    p.add_argument("--serve-flags", default="", help="more serve.py flags, one string")
    p.add_argument("--max-seq", type=int, default=2048, help="positions per sequence (llama-server: -c N x this)")
    p.add_argument("--llama-server", default=None, help="llama-server binary: the peer")
    p.add_argument("--gguf", default=None, help="llama-server's model: a GGUF of the same weights")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--logs", default=str(HERE / "results" / "tmp"), help="the servers' logs")
    args = p.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--clients takes integers, got {args.clients!r}") from None
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.config_list if c not in CONFIGS]
    if bad or not args.levels or min(args.levels) < 1 or args.requests < 1 or args.max_new_tokens < 1:
        raise UsageError(f"unknown --configs {bad}" if bad else
                         "--clients, --requests and --max-new-tokens must be >= 1")
    if bool(args.llama_server) != bool(args.gguf):
        raise UsageError("--llama-server and --gguf go together")
    if not args.config_list and not args.llama_server:
        raise UsageError("nothing to measure: give --configs or --llama-server")
    args.serve_flags = args.serve_flags.split()
    return args


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        fam = {k: line.split(":", 1)[1].strip() for line in out.splitlines() for k in ("CPU family", "Model")
               if line.startswith(k + ":")}
        return f"{model} family {fam.get('CPU family')} model {fam.get('Model')}, {os.cpu_count()} CPUs"
    except (OSError, StopIteration):
        return f"unknown CPU, {os.cpu_count()} CPUs"


def run(args) -> int:
    prompts = workload(args.questions or None, args.limit)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    print(f"{cpu_name()}; {len(prompts)} prompts; levels {args.levels}; {args.max_new_tokens} new tokens",
          file=sys.stderr)
    servers = {c: nanospec(c, args, max(args.levels), logs) for c in args.config_list}
    rows = []
    try:
        for s in servers.values():
            s.wait()
        for n in args.levels:
            systems = [(f"nanospec {c}", s) for c, s in servers.items()]
            peer = llama_server(args, n, logs).wait() if args.llama_server else None
            systems += [("llama-server", peer)] if peer else []
            try:
                for name, s in systems:
                    asyncio.run(level(s.url, prompts[:1], 1, 1, 8))  # warm-up: first-use set-ups
                    recs, wall = asyncio.run(level(s.url, prompts, n, max(12, args.requests * n),
                                                   args.max_new_tokens))
                    rows.append(dict(clients=n, system=name, **summarize(recs, wall)))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            finally:
                if peer:
                    peer.stop()
    finally:
        for s in servers.values():
            s.stop()
    print(table(rows))
    title = f"serve.py against llama-server, {cpu_name()}, {args.max_new_tokens} new tokens"
    if args.png:
        plot(rows, args.png, title)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(cpu=cpu_name(), args=sys.argv[1:], rows=rows), indent=1))
    return 0


def main(argv=None) -> int:
    try:
        return run(parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
