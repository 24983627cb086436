"""serve.py's requests: the OpenAI request bodies checked and turned into a prompt and its settings (Params; any bad
field an ApiError in OpenAI's error shape), and a request's text as its tokens arrive (Output: incremental decoding,
stop strings held back until they can no longer begin, each piece's source)."""
import json
import time
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from sampling import Sampling
from sequence import TARGET


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
