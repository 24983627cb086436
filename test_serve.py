"""serve.py as its users meet it: the real server started as a subprocess on a free port over tiny random models
(HF folders), driven with the official `openai` client and plain HTTP. Chat and completion, streamed and not; usage
equal to the tokens received; 16 concurrent greedy requests each equal to its batch-1 output; a client that drops
mid-stream frees its range; 429 at the queue limit; bad input as 400/401 with the server serving on; /health 503
before ready; stop strings; SIGTERM with a request in flight; the chat page in a real browser (chromium). (Two
tensor-parallel ranks serving: test_tp.py.)"""
import concurrent.futures as cf
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

import cpu_forward
import prefix_cache
from conftest import write_eagle_head, write_tiny_hf
from engine import Engine
from model import load_model
from serve import Output, parse_request, ApiError
from tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
KEY = "test-key"
SHAPE = dict(hidden_size=192, intermediate_size=256, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, vocab_size=256)  # SmolLM2's head size (64), 3 query heads per KV head
QUESTIONS = ["What is the capital of France?", "hi", "Tell me a story about a dragon.", "abc", "Name three colours.",
             "x" * 40, "Why is the sky blue?", "2 + 2 = ?"]


def http(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET, or a POST of body: plain HTTP, without a client's checks."""
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


class Served:
    """A serve.py subprocess on a free port; its log in a file (a pipe nobody reads could fill and block it)."""

    def __init__(self, tmp: Path, *args: str, launch: tuple = (), env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{self.port}", tmp / f"serve-{self.port}.log"
        with open(self.log, "w") as f:  # launch: a launcher's command before the script (torchrun's)
            self.proc = subprocess.Popen([sys.executable, *launch, str(HERE / "serve.py"), "--port", str(self.port),
                                          *args], stdout=f, stderr=subprocess.STDOUT, cwd=HERE, env=env)
        self.seen = []  # /health's answers while starting

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            self.seen.append(http(self.url + "/health")[0])
        except (urllib.error.URLError, ConnectionError):
            return False
        return self.seen[-1] == 200

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        text = http(self.url + "/metrics")[2].decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """tiny: eos reachable, with an EAGLE-3 head; long: eos never drawn (its id past the vocabulary), 2,048
    positions, so that a request runs as long as asked."""
    root = tmp_path_factory.mktemp("serve")
    tiny, long = root / "tiny", root / "long"
    write_tiny_hf(tiny, **SHAPE, max_position_embeddings=512)
    write_eagle_head(root / "head", json.loads((tiny / "config.json").read_text()), version=3, seed=1)
    shutil.copytree(tiny, long)
    for f, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id")):
        cfg = json.loads((long / f).read_text())
        cfg.update({key: 999, "max_position_embeddings": 2048} if f == "config.json" else {key: [999]})
        (long / f).write_text(json.dumps(cfg))
    return root


@pytest.fixture(scope="module")
def servers(folders, tmp_path_factory):
    """a: the hybrid drafter (EAGLE-3 head + NanoSpec + prompt lookup), its whole tree verified every step (the
    budget would turn drafting off at will on this model), batch 8, an API key; b: autoregressive,
    one sequence, one waiting request at most. Started together: each loads while the other does."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler (exact batches)")
    tmp = tmp_path_factory.mktemp("logs")
    a = Served(tmp, "--checkpoint", str(folders / "tiny"), "--draft", str(folders / "head"), "--vocab", "nanospec",
               "--w-max", "64", "--tree-topk", "4", "--tree-depth", "3", "--tree-nodes", "10", "--spec-k", "4",
               "--budget", "fixed", "--batch", "8", "--max-queue", "16", "--max-seq", "256", "--api-key", KEY)
    b = Served(tmp, "--checkpoint", str(folders / "long"), "--draft", "none", "--batch", "1", "--max-queue", "1",
               "--max-seq", "2048", "--shutdown-timeout", "30")
    try:
        end, waiting = time.time() + 120, [a, b]
        while waiting and time.time() < end:
            waiting = [s for s in waiting if not s.ready()]
            time.sleep(0.01)
        assert not waiting, "the servers did not become ready:\n" + "\n".join(s.log.read_text() for s in waiting)
        yield a, b
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def reference(folders):
    """Batch-1 greedy outputs of the tiny model (engine.Engine in this process): (prompt ids, max_new) -> ids."""
    m = load_model(folders / "tiny", dtype=torch.bfloat16)
    eng, tok, cache = Engine(m), Tokenizer(folders / "tiny"), {}

    def ref(ids: list[int], n: int) -> list[int]:
        if (key := (tuple(ids), n)) not in cache:
            out = eng.generate(ids, n)[0]
            cache[key] = out[:-1] if out[-1] in m.args.eos_ids else out
        return cache[key]
    ref.tok = tok
    return ref


def chat_ids(tok, q: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": q}])


def streamed(stream) -> tuple[str, list[int], list[str], dict]:
    """A stream's text, token ids and sources (the "nanospec" extension), and its last chunks' fields."""
    text, ids, src, end = "", [], [], {}
    for c in stream:
        ext = (c.model_extra or {}).get("nanospec") or {}
        for t in ext.get("tokens", []):
            ids.append(t["id"])
            src.append(t["source"])
        if c.choices:
            ch = c.choices[0]
            text += (ch.delta.content or "") if hasattr(ch, "delta") else ch.text
            if ch.finish_reason:
                end.update(finish=ch.finish_reason, stats=ext)
        if c.usage:
            end["usage"] = c.usage
    return text, ids, src, end


def test_health_is_503_until_ready(servers):
    for s in servers:
        assert 503 in s.seen and s.seen[-1] == 200 and s.seen.index(503) < len(s.seen) - 1, s.seen
    assert "NanoSpec serves tiny at" in servers[0].log.read_text()  # the URL and a curl command, once ready


def test_chat_and_completion_streamed_and_not(servers, reference):
    """Each form's text is the batch-1 greedy output's; usage counts the tokens received; the speculative
    statistics ride along in "nanospec"."""
    a, c = servers[0], servers[0].client()
    tok, q = reference.tok, QUESTIONS[3]
    ref = reference(chat_ids(tok, q), 40)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=40)
    assert r.choices[0].message.content == tok.decode(ref) and r.object == "chat.completion"
    assert r.usage.completion_tokens == len(ref) and r.usage.prompt_tokens == len(chat_ids(tok, q))
    assert r.choices[0].finish_reason == ("length" if len(ref) == 40 else "stop")
    stats = r.model_extra["nanospec"]
    assert stats["target_steps"] >= 1 and sum(stats["tokens_from"].values()) == len(ref)
    s = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=40,
                                  stream=True, stream_options={"include_usage": True})
    text, ids, src, end = streamed(s)
    assert text == tok.decode(ref) and ids == ref and end["usage"].completion_tokens == len(ids)
    assert set(src) <= {"target", "eagle", "ngram", "both"} and end["stats"]["mean_accepted_length"] >= 1
    p = "Once upon a time"
    ref = reference(tok.encode(p), 30)
    r = c.completions.create(model="tiny", prompt=p, max_tokens=30)
    assert r.choices[0].text == tok.decode(ref) and r.usage.completion_tokens == len(ref)
    text, ids, _, end = streamed(c.completions.create(model="tiny", prompt=p, max_tokens=30, stream=True,
                                                      stream_options={"include_usage": True}))
    assert text == tok.decode(ref) and ids == ref and end["usage"].completion_tokens == len(ref)
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_16_concurrent_greedy_requests_equal_their_batch1_output(servers, reference):
    """16 streamed greedy requests at once on a batch of 8 (the rest wait, then join as others end): every one's
    tokens are its batch-1 output, whatever ran beside it."""
    a, tok = servers[0], reference.tok
    jobs = [(QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)), 16 + 3 * i) for i in range(16)]
    want = [reference(chat_ids(tok, q), n) for q, n in jobs]
    steps0 = a.metric('nanospec_sequence_steps_total{speculated="true"}')

    def run(job):
        q, n = job
        s = a.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                               max_tokens=n, stream=True, stream_options={"include_usage": True})
        return streamed(s)

    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, jobs))
    for (text, ids, src, end), ref in zip(got, want):
        assert ids == ref and text == tok.decode(ref) and end["usage"].completion_tokens == len(ref)
    assert a.metric('nanospec_sequence_steps_total{speculated="true"}') > steps0  # trees were verified
    assert any(x != "target" for g in got for x in g[2])  # and drafts accepted, each with its source


def test_requests_sharing_a_system_prompt_prefill_past_it(servers, reference):
    """Chat requests opening with the same system prompt: from the third on its rows are copied in rather than
    prefilled (prefix_cache.py; /metrics counts them), and each answer is still its batch-1 output."""
    a, tok = servers[0], reference.tok
    system = {"role": "system", "content": "You are a careful assistant; answer briefly."}
    cached0 = a.metric("nanospec_prompt_tokens_cached")
    for q in QUESTIONS[:4]:
        msgs = [system, {"role": "user", "content": q}]
        r = a.client().chat.completions.create(model="tiny", messages=msgs, max_tokens=8)
        assert r.choices[0].message.content == tok.decode(reference(tok.encode_chat(msgs), 8))
    assert a.metric("nanospec_prompt_tokens_cached") - cached0 >= 2 * prefix_cache.MIN_ROWS


def test_a_dropped_client_frees_its_range(servers):
    b = servers[1]
    before = b.metric('nanospec_requests_total{outcome="disconnect"}')
    s = b.client().completions.create(model="long", prompt="abc", max_tokens=1500, stream=True)
    for i, _ in enumerate(s):
        if i == 3:
            break
    assert b.metric("nanospec_free_kv_ranges") == 0
    s.close()  # the connection goes: the sequence is aborted at the next step
    end = time.time() + 10
    while b.metric("nanospec_free_kv_ranges") != 1 and time.time() < end:
        time.sleep(0.02)
    assert b.metric("nanospec_free_kv_ranges") == 1 and b.metric("nanospec_running_sequences") == 0
    assert b.metric('nanospec_requests_total{outcome="disconnect"}') == before + 1
    assert b.client().completions.create(model="long", prompt="abc", max_tokens=5).usage.completion_tokens == 5


def test_429_at_the_queue_limit_and_the_queued_requests_complete(servers):
    """One sequence and one waiting request at most: a third gets 429 with Retry-After, the two complete."""
    b = servers[1]
    c = b.client()
    first = c.completions.create(model="long", prompt="abc", max_tokens=600, stream=True)
    second = c.completions.create(model="long", prompt="xyz", max_tokens=20, stream=True)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="long", prompt="no room", max_tokens=5)
    assert e.value.response.headers["retry-after"] and e.value.code == "queue_full"
    for s, n in ((first, 600), (second, 20)):
        text, ids, _, end = streamed(s)
        assert len(ids) == n and end["finish"] == "length"
    assert b.metric('nanospec_requests_total{outcome="rejected"}') >= 1


BAD = [  # (body or raw bytes, headers, status, words in the message)
    (b"{not json", {}, 400, "JSON"),
    (b"[1, 2]", {}, 400, "object"),
    ({"messages": "hi"}, {}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, {}, 400, "content"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, {}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, {}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, {}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, {}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, {}, 400, "n > 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, {}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}, {}, 400, "context"),
    ({"messages": [{"role": "user", "content": "y" * 400}]}, {}, 400, "context"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-5"}, {}, 400, "does not exist"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, {}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}]}, {"Authorization": ""}, 401, "API key"),
    ({"messages": [{"role": "user", "content": "hi"}]}, {"Authorization": "Bearer wrong"}, 401, "API key"),
]


def test_bad_input_is_a_400_or_401_and_the_server_serves_on(servers):
    a = servers[0]
    for body, headers, status, words in BAD:
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **headers}
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        code, _, got = http(a.url + "/v1/chat/completions", raw, h)
        err = json.loads(got)["error"]
        assert code == status and words in err["message"] and err["type"], (body, got)
        r = a.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
        assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError):
        a.client().completions.create(model="tiny", prompt="hi", n=2)
    with pytest.raises(openai.AuthenticationError):
        a.client("wrong").models.list()
    assert http(a.url + "/health")[0] == 200  # no key needed
    assert a.metric('nanospec_requests_total{outcome="invalid"}') >= len(BAD)


def test_stop_strings(servers, reference):
    """The text ends before the first stop string (held back while one could still begin, so a stream never
    shows part of one); the tokens up to it are counted; a stop string that never appears changes nothing."""
    a, tok = servers[0], reference.tok
    q = QUESTIONS[3]
    ids = reference(chat_ids(tok, q), 60)
    ref = tok.decode(ids)
    at = next(k for k in range(5, len(ref)) if ref[k:k + 2].isascii() and ref[k:k + 2].isprintable()
              and ref.index(ref[k:k + 2]) == k)
    stop, got = ref[at:at + 2], []
    for stream in (False, True):
        r = a.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}],
                                               max_tokens=60, stop=["never", stop], stream=stream,
                                               stream_options={"include_usage": True} if stream else None)
        if stream:
            text, sent, _, end = streamed(r)
            finish, usage = end["finish"], end["usage"].completion_tokens
            assert usage == len(sent) and sent == ids[:usage]  # the tokens up to the stop string's end
        else:
            text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        assert text == ref[:at] and finish == "stop"
        got.append(usage)
    assert got[0] == got[1] < len(ids)
    r = a.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=60,
                                           stop="\u00e9t\u00e9")
    assert r.choices[0].message.content == ref


def test_engine_loop_timeout_and_admission(folders):
    """The engine loop alone, its event loop faked (each call runs at once): admission stops at --batch +
    --max-queue requests in flight and resumes as they end; a request past its deadline leaves at the next step
    (finish_reason length, timed_out), counted, and the next one runs to its budget."""
    import queue
    from types import SimpleNamespace

    from batch import BatchEngine
    from sampling import Sampling
    from serve import EngineLoop, Job, Metrics
    e = EngineLoop(SimpleNamespace(batch=1, max_queue=1), Metrics())
    e.loop = SimpleNamespace(call_soon_threadsafe=lambda f, *a: f(*a))
    e.eng = BatchEngine(load_model(folders / "long", dtype=torch.float32), 1, 64)
    assert e.admit() and e.admit() and not e.admit()
    now = time.perf_counter()
    jobs = [Job(i, [5, 6, 7], 40, Sampling(), None, queue.Queue(), now + d) for i, d in enumerate((0.05, 60))]
    for j in jobs:
        e.put(j)
    e._take()
    e._step()  # the first one's prefill
    time.sleep(0.06)
    while e.eng.busy():
        e._expire()
        e._step()
    events = [[j.queue.get_nowait() for _ in range(j.queue.qsize())] for j in jobs]
    assert events[0][-1] == {"done": "length", "timed_out": True} and len(events[0]) < 41
    assert events[1][-1] == {"done": "length"} and sum(len(x["ids"]) for x in events[1][:-1]) == 40
    assert e.metrics.requests.labels("timeout")._value.get() == 1 and e.inflight == 0 and e.eng.free == [0]
    assert e.admit()


class FakeTok:
    """Bytes as tokens (UTF-8 characters split across them), as the byte-level tokenizers decode them."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stop", [[], ["END"], ["é!", "xyz"]])
def test_output_holds_stop_strings_and_split_characters(stop):
    """Output alone: whatever the steps' split, the released pieces join to the text up to the first stop string
    (none sent early), a character split over tokens comes out whole, every token is released once."""
    text = "caf\u00e9 au lait, d\u00e9j\u00e0 vu! ENDING xyz"
    ids = list(text.encode())
    for cut in range(1, 6):
        out, sent, n = Output(FakeTok(), stop), "", 0
        for i in range(0, len(ids), cut):
            for t, piece, _ in out.add({"ids": ids[i:i + cut], "src": ["target"] * cut, "n": cut, "drafted": 0}):
                sent, n = sent + piece, n + 1
                assert not any(s in sent for s in stop)
            if out.finish:
                break
        if not out.finish:
            for _, piece, _ in out.close("length"):
                sent, n = sent + piece, n + 1
        ends = [text.index(s) for s in stop if s in text]
        assert sent == text[:min(ends)] if ends else sent == text
        assert n == out.count and (out.finish == "stop") == bool(ends)


def test_parse_request_limits():
    """Context arithmetic: the prompt and max_tokens must fit; no max_tokens: the rest of the context."""
    tok = Tokenizer.__new__(Tokenizer)
    tok.encode = lambda s: list(s.encode())
    p = parse_request({"prompt": "abcd"}, False, "m", tok, 256, 10)
    assert p.max_tokens == 6 and p.prompt == list(b"abcd")
    assert parse_request({"prompt": [1, 2], "max_tokens": 8}, False, "m", tok, 256, 10).max_tokens == 8
    for body in ({"prompt": "abcd", "max_tokens": 7}, {"prompt": "a" * 10}, {"prompt": [300]}, {"prompt": ""},
                 {"prompt": "a", "max_tokens": True}):
        with pytest.raises(ApiError):
            parse_request(body, False, "m", tok, 256, 10)


def chromium() -> tuple[str, str] | None:
    names = [shutil.which(n) for n in ("chromium", "chromium-browser")]
    driver = shutil.which("chromedriver")
    return (next(n for n in names if n), driver) if any(names) and driver else None


def test_chat_page_in_a_browser(servers, tmp_path):
    """Debian's chromium, headless, through selenium: the key and a question typed in, the answer streamed,
    its tokens in coloured spans (the target's and the drafters'), a screenshot under results/."""
    found = chromium()
    if found is None:
        pytest.skip("chromium and chromedriver are not installed (.ci/run installs them with apt-get)")
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
    opts = webdriver.ChromeOptions()
    opts.binary_location = found[0]
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,800"):
        opts.add_argument(flag)
    drv = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=found[1]))
    try:
        drv.get(servers[0].url + "/")
        key = drv.find_element(By.ID, "key")
        key.send_keys(KEY)
        drv.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
        WebDriverWait(drv, 20).until(lambda d: "tiny" in d.find_element(By.ID, "model").text)
        drv.find_element(By.ID, "max").clear()
        drv.find_element(By.ID, "max").send_keys("120")
        drv.find_element(By.ID, "prompt").send_keys("abc", Keys.ENTER)
        done = WebDriverWait(drv, 30).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=done]"))
        spans = done[0].find_elements(By.CSS_SELECTOR, "span.tok")
        kinds = {c for s in spans for c in s.get_attribute("class").split() if c.startswith("src-")}
        assert spans and "src-target" in kinds and kinds - {"src-target"}, kinds  # coloured by drafter too
        colours = {s.value_of_css_property("background-color") for s in spans}
        assert len(colours) >= 2
        assert "tok/s" in drv.find_element(By.ID, "rate").text
        assert "mean accepted length" in drv.find_element(By.ID, "tau").text
        out = HERE / "results" / "tmp"
        out.mkdir(parents=True, exist_ok=True)
        assert drv.save_screenshot(str(out / "serve_page_test.png"))
    finally:
        drv.quit()


def test_sigterm_finishes_the_request_in_flight(servers):
    """SIGTERM: no new requests, the running one streams to its end, then the process exits 0. (Last: it stops
    the server.)"""
    b = servers[1]
    s = b.client().completions.create(model="long", prompt="abc", max_tokens=1000, stream=True,
                                      stream_options={"include_usage": True})
    it = iter(s)
    first = next(it)
    b.proc.send_signal(signal.SIGTERM)
    text, ids, _, end = streamed(it)
    assert len(ids) + len(first.model_extra["nanospec"]["tokens"]) == 1000 and end["finish"] == "length"
    assert end["usage"].completion_tokens == 1000
    assert b.proc.wait(timeout=30) == 0
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        http(b.url + "/health")
