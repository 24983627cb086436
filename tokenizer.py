"""The tokenizer (`tokenizers` + the checkpoint's jinja2 chat template) and the streaming text printer."""
import json
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: Path):
        f = Path(path) / "tokenizer.json"
        if not f.is_file():
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            self.tok = HFTokenizer.from_file(str(f))
        except Exception as e:
            raise ValueError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
        cfg_file = Path(path) / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # some configs hold several named templates
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"), None)
        self._template = None

    def special(self, name: str) -> str:
        v = self.config.get(name)
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; use --raw")
        if self._template is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise jinja2.exceptions.TemplateError(msg)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
            env.filters["tojson"] = lambda x, indent=None, **k: json.dumps(x, indent=indent, ensure_ascii=False)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.special("bos_token"), eos_token=self.special("eos_token"))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)  # the template spells out BOS


class Streamer:
    """Prints text as tokens arrive; decodes the whole tail so multi-byte characters come out whole."""
    def __init__(self, tok: Tokenizer, out=sys.stdout):
        self.tok, self.ids, self.printed, self.out = tok, [], "", out

    def __call__(self, new_ids):
        self.ids.extend(new_ids)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text
