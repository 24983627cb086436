"""Batched decoding: every sequence of a batch is its batch-1 output (bit for bit through the fused CPU pass, and
on the PyTorch layers), continuous batching (prompts join as others finish), per-sequence sampling streams, the
decode step traced whole, bad input as one-line errors."""
import json

import pytest
import torch

import cpu_forward
import cpu_gemm
import model as M
from batch import BatchEngine
from conftest import one_line_error, write_tiny_hf
from errors import UsageError
from generate import Engine, main
from sampling import Sampling

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40], [7, 7, 7, 7, 8], list(range(20, 60)),
           [3, 4], [100, 90, 80, 70]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """SmolLM2's head size (64) and 3 query heads per KV head."""
    path, _ = write_tiny_hf(tmp_path_factory.mktemp("batch"), hidden_size=192, intermediate_size=256,
                            num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, vocab_size=300,
                            max_position_embeddings=512)
    return path


def load(path, fused: bool, monkeypatch, dtype=torch.bfloat16):
    monkeypatch.setenv(cpu_gemm.ENV, "kernel" if fused else "torch")
    monkeypatch.setenv(cpu_forward.ENV, "on" if fused else "off")
    m = M.load_model(path, dtype=dtype)
    assert (m.cpu_pass is not None) == fused
    m.args.eos_ids = [batch1(m, PROMPTS[:1], 6)[0][5]]  # a token the model writes: some sequences end early
    return m


def batch1(m, prompts, max_new, sampling=Sampling()):
    eng = Engine(m, sampling)
    return [eng.generate(p, max_new)[0] for p in prompts]


@pytest.mark.parametrize("fused,max_seq", [(True, 128), (True, 100), (False, 128)])
def test_every_sequence_is_its_batch1_output(target, monkeypatch, fused, max_seq):
    """Batch 3 over 7 prompts (4 join as others finish), 24 new tokens each: each output equals decoding that
    prompt alone, through the fused pass (row-invariant by construction) and through the PyTorch layers (fp32).
    Ranges of 100 slots start off the attention's 16-slot blocks."""
    if fused and cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, fused, monkeypatch, torch.bfloat16 if fused else torch.float32)
    ref = batch1(m, PROMPTS, 24)
    eng = BatchEngine(m, batch=3, max_seq=max_seq)
    got = eng.generate_batch(PROMPTS, 24)
    assert got == ref
    assert any(len(r) < 24 for r in ref) and any(len(r) == 24 for r in ref)  # eos and budget endings both seen
    assert eng.steps["prefill"] >= 3  # waiting prompts joined between decode steps
    assert eng.rows > eng.steps["decode"]  # decode steps carried several sequences


def test_streaming_submit_and_step(target, monkeypatch):
    """submit / step: finished sequences come back as they finish, each with its own budget; a range freed by a
    finished sequence is reused, and its old keys are never read."""
    m = load(target, cpu_forward.kernel() is not None, monkeypatch)
    budgets = [3, 30, 5, 30, 1]
    ref = [batch1(m, [p], n)[0] for p, n in zip(PROMPTS, budgets)]
    eng = BatchEngine(m, batch=2, max_seq=96)
    for p, n in zip(PROMPTS, budgets):
        eng.submit(p, n)
    order, got = [], {}
    while eng.busy():
        for s in eng.step():
            order.append(s.index)
            got[s.index] = s.out
    assert [got[i] for i in range(len(budgets))] == ref
    assert order != sorted(order)  # a later, shorter request finished first
    assert eng.step() == []


def test_sampled_sequences_have_their_own_streams(target, monkeypatch):
    """A sampled sequence with a given seed draws the same tokens alone or beside others (its own generator, its
    logits the same bits); different seeds draw differently."""
    m = load(target, cpu_forward.kernel() is not None, monkeypatch)
    s = Sampling(temperature=1.0)
    alone = BatchEngine(m, batch=1, max_seq=96)
    alone.submit(PROMPTS[1], 20, s, seed=7)
    (a,) = alone.step() + [x for _ in range(40) for x in alone.step()]
    crowd = BatchEngine(m, batch=4, max_seq=96)
    idx = [crowd.submit(p, 20, s, seed=7 if i == 1 else i) for i, p in enumerate(PROMPTS[:4])]
    done = {}
    while crowd.busy():
        done.update((x.index, x.out) for x in crowd.step())
    assert done[idx[1]] == a.out
    other = BatchEngine(m, batch=1, max_seq=96)
    other.submit(PROMPTS[1], 20, s, seed=8)
    b = [x for _ in range(41) for x in other.step()][0]
    assert b.out != a.out


def test_decode_step_traces_whole(target, monkeypatch):
    """The decode step is one graph (torch.compile fullgraph, eager backend), with the same logits."""
    m = load(target, False, monkeypatch, torch.float32)
    eng = BatchEngine(m, batch=2, max_seq=64)
    for p in PROMPTS[:2]:
        eng.submit(p, 8)
    eng.step()  # the prefill
    args = (torch.tensor([5, 6]), torch.tensor([3, 11]), torch.tensor([0, 64]))
    want = eng.decode_step(*args)
    got = torch.compile(eng.decode_step, fullgraph=True, backend="eager")(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bad_input(target, monkeypatch):
    m = load(target, False, monkeypatch, torch.float32)
    with pytest.raises(UsageError, match="--batch"):
        BatchEngine(m, batch=0, max_seq=64)
    eng = BatchEngine(m, batch=2, max_seq=64)
    with pytest.raises(UsageError, match="prompt 0 is empty"):
        eng.submit([], 4)
    with pytest.raises(UsageError, match="exceed the 64 positions"):
        eng.submit(list(range(60)), 8)
    with pytest.raises(UsageError, match="max_new_tokens"):
        eng.submit([1, 2], 0)
    with pytest.raises(ValueError, match="temperature"):
        eng.submit([1, 2], 4, Sampling(temperature=-1.0))


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


@pytest.mark.parametrize("content,flags,words", [
    ('ok\n{"prompt": "x"\n', [], ["line 2", "JSON"]),
    ('{"text": "x"}\n', [], ["line 1", "prompt"]),
    ('{"prompt": "x", "max_new_tokens": "9"}\n', [], ["line 1", "max_new_tokens"]),
    ("\n\n", [], ["no prompt"]),
    ("x\n", ["--batch", "0"], ["--batch"]),
    ("x\n", ["--draft", "ngram"], ["--prompts", "drafting"]),
    ("x\n", ["--max-new-tokens", "600"], ["prompt 0", "positions"]),
    (None, [], ["cannot read"]),
])
def test_cli_bad_prompts(target, tmp_path, monkeypatch, capsys, content, flags, words):
    monkeypatch.setenv(cpu_gemm.ENV, "torch")
    f = tmp_path / "p.txt"
    if content is not None:
        f.write_text(content)
    rc = main(["--checkpoint", str(target), "--prompts", str(f), "--raw", "--dtype", "float32"] + flags)
    one_line_error(capsys, rc, *words)


def test_cli_batch_needs_prompts(capsys):
    one_line_error(capsys, main(["--batch", "4"]), "--prompts")
