"""bench_serve.py: its load loop, latencies and table against a fake llama-server (a stdlib HTTP server that
streams OpenAI chunks, recording how it was started), and serve.py itself on a tiny random model."""
import json
import stat
import sys

import pytest

import bench_serve as bs
from conftest import write_tiny_hf

FAKE = '''#!{python}
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
open({log!r}, "a").write(json.dumps(argv) + "\\n")


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.reply({{"status": "ok"}} if self.path == "/health" else {{"object": "list", "data": [{{"id": "fake"}}]}})

    def do_POST(self):
        n = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        head = {{"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake"}}

        def send(**kw):
            self.wfile.write(b"data: " + json.dumps(dict(head, **kw)).encode() + b"\\n\\n")
            self.wfile.flush()
        for i in range(0, n, 2):  # two tokens a chunk after the first, as accepted drafts come (serve.py's field)
            k = 1 if i == 0 else min(2, n - i)
            time.sleep(0.01)
            toks = [{{"id": 7, "text": "t ", "source": "target"}}] * k
            send(choices=[{{"index": 0, "delta": {{"content": "t " * k}}, "finish_reason": None}}],
                 nanospec={{"tokens": toks}})
        send(choices=[{{"index": 0, "delta": {{}}, "finish_reason": "length"}}])
        send(choices=[], usage={{"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}})
        self.wfile.write(b"data: [DONE]\\n\\n")
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
'''


@pytest.fixture
def fake(tmp_path):
    path, log = tmp_path / "llama-server", tmp_path / "argv.jsonl"
    path.write_text(FAKE.format(python=sys.executable, log=str(log)))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "m.gguf").write_bytes(b"")
    return path, log


def test_levels_against_a_fake_peer(tmp_path, fake, capsys):
    """Each level starts the peer with -np N -cb -t 2 and a context of N ranges, runs max(12, 2 N) requests from
    N clients; throughput, TTFT and per-token latencies come out of the stream (a chunk's gap shared by its
    tokens), the table, the JSON and the PNG."""
    qs = tmp_path / "q.jsonl"
    qs.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"question {i}"]})
                            for i, c in enumerate(["writing", "translation", "qa"])))
    rc = bs.main(["--configs", "", "--llama-server", str(fake[0]), "--gguf", str(tmp_path / "m.gguf"), "--clients",
                  "1,8", "--requests", "2", "--max-new-tokens", "5", "--questions", str(qs), "--max-seq", "512",
                  "--png", str(tmp_path / "b.png"), "--json", str(tmp_path / "b.json"), "--logs", str(tmp_path)])
    assert rc == 0
    starts = [json.loads(x) for x in fake[1].read_text().splitlines()]
    assert [(a[a.index("-np") + 1], a[a.index("-c") + 1], a[a.index("-t") + 1]) for a in starts] == \
        [("1", "512", "2"), ("8", "4096", "2")] and all("-cb" in a for a in starts)
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["clients"], r["system"], r["requests"], r["tokens"]) for r in rows] == \
        [(1, "llama-server", 12, 60), (8, "llama-server", 16, 80)]
    for r in rows:
        assert r["tok_s"] > 0 and 10 <= r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 4 <= r["itl_p50_ms"] <= 8  # 10 ms gaps, two tokens a chunk
    table = capsys.readouterr().out
    assert "| clients | system |" in table and table.count("| llama-server |") == 2
    assert (tmp_path / "b.png").stat().st_size > 10_000


def test_workload_interleaves_tasks_and_the_built_in_prompts(tmp_path):
    qs = tmp_path / "q.jsonl"
    qs.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [f"{c} {i}", "second"]})
                            for i, c in enumerate(["writing", "writing", "translation", "qa"])))
    w = bs.workload(str(qs), None)
    assert w[0] == "writing 0" and w[2] == "translation 2" and w[4] == "qa 3" and w[6] == "writing 1"
    assert w[1] == bs.BUILTIN_QUESTIONS[0]["turns"][0] and len(w) == 4 + len(bs.BUILTIN_QUESTIONS)
    assert bs.workload(None, None) == [q["turns"][0] for q in bs.BUILTIN_QUESTIONS]


def test_serve_itself_on_a_tiny_model(tmp_path, fake):
    """serve.py as a configuration (autoregressive: --draft none) beside the fake peer, in one run."""
    path, _ = write_tiny_hf(tmp_path / "tiny", vocab_size=256, max_position_embeddings=2048)  # the prompts: bytes
    out = tmp_path / "b.json"
    rc = bs.main(["--configs", "ar", "--checkpoint", str(path), "--serve-flags", "--dtype float32", "--llama-server",
                  str(fake[0]), "--gguf", str(tmp_path / "m.gguf"), "--clients", "2", "--requests", "1",
                  "--max-new-tokens", "6", "--questions", "", "--max-seq", "1024", "--json", str(out), "--logs",
                  str(tmp_path)])
    assert rc == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"nanospec ar", "llama-server"} and rows["nanospec ar"]["requests"] == 12
    assert 12 <= rows["nanospec ar"]["tokens"] <= 72 and rows["nanospec ar"]["mean_accepted_length"] == 1.0


@pytest.mark.parametrize("argv,words", [(["--clients", "0"], ">= 1"), (["--configs", "x"], "unknown"),
                                        (["--llama-server", "x"], "go together"), (["--configs", ""], "nothing")])
def test_bad_flags(argv, words, capsys):
    assert bs.main(argv) == 2 and words in capsys.readouterr().err
