"""tokenizer.py: the chat template, one-line errors for a missing or unreadable tokenizer, and the streamer
printing whole characters only."""
import io
import json

import pytest

from conftest import write_byte_tokenizer
from tokenizer import Streamer, Tokenizer


def test_chat_template_and_named_templates(tmp_path):
    write_byte_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "<user>hi\n<assistant>"
    assert tok.decode(tok.encode_chat(msgs)) == "<user>hi\n<assistant>"
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"},
                            {"name": "default", "template": cfg["chat_template"]}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(tmp_path).apply_chat_template(msgs) == "<user>hi\n<assistant>"  # the "default" one


def test_missing_or_unreadable_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        Tokenizer(tmp_path)


def test_streamer_waits_for_whole_characters(tmp_path):
    write_byte_tokenizer(tmp_path)
    tok, out = Tokenizer(tmp_path), io.StringIO()
    s = Streamer(tok, out)
    ids = tok.encode("é!", add_special_tokens=False)  # "é" is two bytes: two ids
    assert len(ids) == 3
    s(ids[:1])
    assert out.getvalue() == ""  # half a character: nothing printed yet
    s(ids[1:])
    assert out.getvalue() == "é!"
