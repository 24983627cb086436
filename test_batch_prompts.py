"""A file of prompts (batch_prompts.py, generate.py --prompts): one JSON line per prompt, each its text decoded
alone, the summary; run_prompts as a library call; bad files and flags as one line; a prompt too long errors alone."""
import json

import pytest

import batch_prompts
import cpu_gemm
from conftest import one_line_error
from errors import UsageError
from generate import main
from sampling import Sampling
from test_batch import target  # noqa: F401 (the tiny model: a fixture)


def test_cli_prompts_file(target, tmp_path, monkeypatch, capsys):
    """generate.py --prompts FILE --batch 2: one JSON line per prompt (in input order with --ordered), each the
    text of that prompt decoded alone, then the summary (--json: the last stdout line, without "index")."""
    monkeypatch.setenv(cpu_gemm.ENV, "torch")
    f = tmp_path / "prompts.jsonl"
    f.write_text('hello there\n{"prompt": "abc", "max_new_tokens": 5}\n\n{"prompt": "xyz", "seed": 3}\nlast one\n')
    rc = main(["--checkpoint", str(target), "--prompts", str(f), "--batch", "2", "--ordered", "--json", "--raw",
               "--max-new-tokens", "12", "--dtype", "float32"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [x["index"] for x in lines[:-1]] == [0, 1, 2, 3]
    assert [x["new_tokens"] for x in lines[:-1]][1] <= 5 and "index" not in lines[-1]
    assert lines[-1]["prompts"] == 4 and lines[-1]["new_tokens"] == sum(x["new_tokens"] for x in lines[:-1])
    assert {"tokens_per_s", "decode_tokens_per_s", "speculated_share", "occupancy"} <= set(lines[-1])
    for x, p, n in zip(lines, ["hello there", "abc", "xyz", "last one"], [12, 5, 12, 12]):
        assert main(["--checkpoint", str(target), "--prompt", p, "--raw", "--draft", "none", "--json",
                     "--max-new-tokens", str(n), "--dtype", "float32"]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == x["text"], p


def test_run_prompts_is_a_library_call(target, tmp_path, monkeypatch, capsys):
    """batch_prompts.run_prompts takes its settings as parameters (no command line): the CLI's lines for the same file;
    a batch asked to be exact without the fused CPU pass is refused."""
    from engine import load_target
    monkeypatch.setenv(cpu_gemm.ENV, "torch")
    f = tmp_path / "prompts.jsonl"
    f.write_text('hello there\n{"prompt": "abc", "seed": 3}\n')
    model, tok, _ = load_target(str(target), "cpu", "float32")
    assert batch_prompts.run_prompts(model, tok, str(f), Sampling(), batch=2, max_new_tokens=6, raw=True, ordered=True,
                             as_json=True) == 0
    lib = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert main(["--checkpoint", str(target), "--prompts", str(f), "--batch", "2", "--ordered", "--json", "--raw",
                 "--max-new-tokens", "6", "--dtype", "float32", "--draft", "none"]) == 0
    cli = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["text"] for x in lib[:-1]] == [x["text"] for x in cli[:-1]] and lib[-1]["prompts"] == 2
    with pytest.raises(UsageError, match="fused CPU pass"):
        batch_prompts.run_prompts(model, tok, str(f), Sampling(), exact=True)


@pytest.mark.parametrize("content,flags,words", [
    ('ok\n{"prompt": "x"\n', [], ["line 2", "JSON"]),
    ('{"text": "x"}\n', [], ["line 1", "prompt"]),
    ('{"prompt": "x", "max_new_tokens": "9"}\n', [], ["line 1", "max_new_tokens"]),
    ("\n\n", [], ["no prompt"]),
    ("x\n", ["--batch", "0"], ["--batch"]),
    ("x\n", ["--compile"], ["--prompts", "--compile"]),
    ("x\n", ["--draft", "DRAFT_MODEL"], ["draft model", "one prompt at a time"]),
    (None, [], ["cannot read"]),
])
def test_cli_bad_prompts(target, tmp_path, monkeypatch, capsys, content, flags, words):
    monkeypatch.setenv(cpu_gemm.ENV, "torch")
    f = tmp_path / "p.txt"
    if content is not None:
        f.write_text(content)
    flags = [str(target) if x == "DRAFT_MODEL" else x for x in flags]  # the target is a causal LM folder too
    rc = main(["--checkpoint", str(target), "--prompts", str(f), "--raw", "--dtype", "float32"] + flags)
    one_line_error(capsys, rc, *words)


def test_cli_too_long_prompt_errors_alone(target, tmp_path, monkeypatch, capsys):
    """A prompt too long for the model gets its own line with "error"; the others decode; exit code 0."""
    monkeypatch.setenv(cpu_gemm.ENV, "torch")
    f = tmp_path / "p.txt"
    f.write_text("short one\n" + " ".join(["word"] * 600) + "\nanother\n")
    rc = main(["--checkpoint", str(target), "--prompts", str(f), "--raw", "--dtype", "float32", "--ordered", "--json",
               "--max-new-tokens", "6"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert rc == 0 and [x.get("index") for x in lines[:3]] == [0, 1, 2]
    assert "positions" in lines[1]["error"] and "text" in lines[0] and "text" in lines[2]
    assert lines[-1]["errors"] == 1 and lines[-1]["prompts"] == 3


def test_cli_batch_needs_prompts(capsys):
    one_line_error(capsys, main(["--batch", "4"]), "--prompts")
