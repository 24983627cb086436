"""bench.py smoke tests on a tiny random model: reports are written, the correctness guard fires, EAGLE-2
heads, --compile both side by side, partial frequency files."""
import json

import pytest
import torch

import bench
import batch
import sampling
from conftest import write_eagle_head, write_tiny_hf


QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it shorter."]},
    {"question_id": 90, "category": "roleplay", "turns": ["Pretend to be a pirate and greet me."]},
    {"question_id": 201, "category": "qa", "turns": ["Why is the sky blue? Why is the sky blue?"]},
    {"question_id": 202, "category": "qa", "turns": ["What is a virus?"]},
    {"id": "x1", "task": "rag", "prompt": "Passage: the cat sat on the mat. Question: where did the cat sit?"},
]


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    path, _ = write_tiny_hf(root / "target")  # with a byte-level tokenizer and a chat template
    q = root / "questions.jsonl"
    q.write_text("".join(json.dumps(x) + "\n" for x in QUESTIONS))
    return path, q, root


def argv(tiny_bench, out, *extra):
    path, q, root = tiny_bench
    return ["--checkpoint", str(path), "--questions", str(q), "--out", str(out), "--cache", str(root / "cache"),
            "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "12", "--random-head",
            "--tree-topk", "4", "--tree-depth", "3", "--tree-nodes", "10", "--w-max", "64",
            "--freq-ks", "32", "--sweep-ks", "16,128", "--sweep-w", "32", "--freq-corpus", "4x48",
            "--no-progress", "--threads", "1", *extra]


def test_bench_writes_reports(tiny_bench, tmp_path, capsys):
    rc = bench.main(argv(tiny_bench, tmp_path, "--methods", "all", "--limit", "2"))
    out = capsys.readouterr()
    assert rc == 0, out.err
    js = json.loads((tmp_path / "bench_questions.json").read_text())
    md = (tmp_path / "bench_questions.md").read_text()
    names = set(js["methods"])
    assert {"ar", "ar-fast", "ngram", "eagle3", "eagle3+freq-32", "eagle3+nanospec", "eagle3+nanospec-ctx",
            "eagle3+nanospec-ext", "eagle3+nanospec-noasync", "eagle3+nanospec-nofill", "eagle3+freq-16",
            "eagle3+freq-128", "eagle3+nanospec-w32"} <= names
    assert js["mismatches"] == []
    # --limit 2 per task: MT-bench takes one writing + one roleplay question (round robin); 2 qa; 1 rag
    assert sorted({r["qid"] for r in js["runs"]}) == ["201", "202", "81", "90", "x1"]
    assert len(js["runs"]) == len(names) * 6  # 81 has two turns
    t1, t2 = ([r["prompt_tokens"] for r in js["runs"] if r["qid"] == "81" and r["method"] == "ar" and r["turn"] == t]
              for t in (1, 2))
    assert t2[0] > t1[0] + 12  # turn 2 follows the method's own turn-1 answer
    s = js["summary"]
    # speedups are ratios to the fastest autoregressive configuration of the run (ar-fast or exact ar)
    assert max(s[n]["overall"]["speedup"] for n in ("ar", "ar-fast")) == pytest.approx(1.0)
    assert all(s[n]["overall"]["speedup"] <= 1.0 + 1e-9 for n in ("ar", "ar-fast"))
    assert "Exact mode's cost" in md and "ar-fast" in md
    assert all(r["exact"] is (r["method"] != "ar-fast") for r in js["runs"])  # the guard runs in exact mode
    for task in ("mt_bench", "qa", "rag"):
        assert s["eagle3+nanospec"][task]["tokens_per_s"] > 0
    assert s["eagle3+nanospec"]["overall"]["step_ms"]["lm_head"] >= 0
    assert 0 < s["eagle3+freq-32"]["overall"]["vocab_coverage"] <= 1
    for title in ("Table 2/3", "Table 4", "Table 5", "Table 6", "Figure 1a/1b", "Figure 4", "RANDOMLY INITIALISED"):
        assert title in md, title
    assert "llama3.1-8b (d=4096, V=128256" in md
    assert f"All {len(js['runs']) - 12} outputs" in md  # every run but the two AR configurations' (66)
    assert any(p.get("oracle") for p in js["figure1"]["points"])
    assert (tmp_path / "bench_questions_outputs.jsonl").is_file()
    assert "all outputs identical" in out.out


def test_bench_guard_fires_on_tampered_output(tiny_bench, tmp_path, monkeypatch, capsys):
    real = sampling.accept_greedy

    def wrong_bonus(tree, logits):  # a subtly broken acceptance: the bonus token is off by one
        path, L, bonus = real(tree, logits)
        return path, L, (bonus + 1) % logits.shape[-1]
    real_host = batch.greedy_path

    def wrong_bonus_host(tree, pred):  # the same fault in eager CPU steps' host-side acceptance (the batch's step)
        path, L, bonus = real_host(tree, pred)
        return path, L, bonus ^ 1  # (another token: vocabularies here have an even size)
    monkeypatch.setattr(sampling, "accept_greedy", wrong_bonus)
    monkeypatch.setattr(batch, "greedy_path", wrong_bonus_host)
    rc = bench.main(argv(tiny_bench, tmp_path, "--methods", "ngram", "--categories", "qa", "--freq-corpus", "4x48"))
    err = capsys.readouterr().err
    assert rc == 1
    assert "OUTPUT MISMATCH: question 201 turn 1, method ngram" in err
    assert "likely a logic error" in err  # the diagnosis: not a float near tie
    js = json.loads((tmp_path / "bench_questions.json").read_text())
    assert {m["method"] for m in js["mismatches"]} == {"ngram"}
    assert "FAILED" in (tmp_path / "bench_questions.md").read_text()


def test_bench_eagle2_head(tiny_bench, tmp_path, capsys):
    path, q, root = tiny_bench
    head = write_eagle_head(tmp_path / "e2", json.loads((path / "config.json").read_text()), version=1)
    args = [a for a in argv(tiny_bench, tmp_path) if a != "--random-head"]
    rc = bench.main(args + ["--eagle2", str(head), "--methods", "eagle2,eagle2+nanospec", "--categories", "qa",
                            "--limit", "1"])
    assert rc == 0, capsys.readouterr().err
    js = json.loads((tmp_path / "bench_questions.json").read_text())
    assert set(js["methods"]) == {"ar", "ar-fast", "eagle2", "eagle2+nanospec"}
    assert "eagle2" in js["settings"]["heads"]


def test_bench_compile_both_side_by_side(tiny_bench, tmp_path, capsys):
    """--compile both: every method also runs compiled (NAME@compile), checked against compiled AR, and the
    report has the compiled / eager table (backend 'eager' here for speed; the CLI default is inductor)."""
    torch._dynamo.reset()
    rc = bench.main(argv(tiny_bench, tmp_path, "--methods", "ngram,eagle3+nanospec", "--categories", "qa",
                         "--limit", "1", "--compile", "both", "--compile-backend", "eager"))
    assert rc == 0, capsys.readouterr().err
    js = json.loads((tmp_path / "bench_questions.json").read_text())
    assert set(js["methods"]) == {"ar", "ar-fast", "ngram", "eagle3+nanospec", "ar@compile", "ar-fast@compile",
                                  "ngram@compile", "eagle3+nanospec@compile"}
    assert js["mismatches"] == []
    md = (tmp_path / "bench_questions.md").read_text()
    assert "torch.compile vs eager" in md and "| eagle3+nanospec | " in md


def test_bench_budget_both_side_by_side(tiny_bench, tmp_path, capsys):
    """--budget both: every speculative method also runs with the fitted budget (NAME@auto), its outputs
    checked against AR like every other method's, its budget histogram in the JSON."""
    rc = bench.main(argv(tiny_bench, tmp_path, "--methods", "ngram,eagle3+nanospec,eagle3+nanospec+ngram",
                         "--categories", "qa", "--limit", "1", "--budget", "both"))
    assert rc == 0, capsys.readouterr().err
    js = json.loads((tmp_path / "bench_questions.json").read_text())
    assert set(js["methods"]) == {"ar", "ar-fast", "ngram", "eagle3+nanospec", "ngram@auto", "eagle3+nanospec@auto",
                                  "eagle3+nanospec+ngram", "eagle3+nanospec+ngram@auto"}
    assert js["mismatches"] == [] and js["settings"]["budget"] == "both"
    curve = js["summary"]["eagle3+nanospec@auto"]["overall"]["budget_curve"]
    assert curve and all(p["step_ms"] > 0 and p["tokens"] >= 1 for p in curve.values())
    png = tmp_path / "bench_questions_tree_size.png"  # tokens/s against tree size, rendered
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "bench_questions.md").read_text()
    assert "## The fitted budget" in md and "## Hybrid drafting per task: eagle3+nanospec+ngram@auto" in md
    src = js["summary"]["eagle3+nanospec+ngram"]["overall"]["accepted_from"]  # shares of accepted draft tokens
    assert set(src) == {"ngram", "eagle", "both"} and sum(src.values()) == pytest.approx(1.0, abs=1e-3)


def test_bench_sampling_runs_without_the_guard(tiny_bench, tmp_path, capsys):
    rc = bench.main(argv(tiny_bench, tmp_path, "--methods", "ngram", "--categories", "qa", "--limit", "1",
                         "--budget", "auto", "--temperature", "0.7"))
    out = capsys.readouterr().out
    assert rc == 0 and "not compared with autoregressive decoding" in out
    js = json.loads((tmp_path / "bench_questions.json").read_text())
    assert js["settings"]["temperature"] == 0.7 and js["mismatches"] == []
    assert bench.main(argv(tiny_bench, tmp_path, "--temperature", "-1")) == 2


def test_bench_partial_freq_file(tiny_bench, tmp_path, capsys):
    # a --freq file ranks only the ids its corpus saw: Figure 1's sweep stops there, the main sizes must fit
    freq = tmp_path / "freq.pt"
    torch.save(list(range(100, 0, -1)), freq)
    rc = bench.main(argv(tiny_bench, tmp_path, "--methods", "sweep", "--limit", "1", "--categories", "qa",
                         "--freq", str(freq)))
    out = capsys.readouterr()
    assert rc == 0, out.err
    js = json.loads((tmp_path / "bench_questions.json").read_text())
    assert "eagle3+freq-16" in js["methods"] and "eagle3+freq-128" not in js["methods"]
    assert "ranks 100 token ids: sweep sizes 128 were left out" in (tmp_path / "bench_questions.md").read_text()
    rc = bench.main(argv(tiny_bench, tmp_path, "--methods", "main", "--freq-ks", "128", "--freq", str(freq)))
    assert rc == 2 and "ranks 100 token ids, fewer than --freq-ks 128" in capsys.readouterr().err


def test_llama_cpp_peer(tiny_bench, tmp_path, capsys):
    """--llama-cpp BIN --gguf F: llama.cpp decodes every question's first turn after the methods ran; the report
    gives its mean tok/s and each method's mean over its own first turns against it; the flags go together."""
    fake = tmp_path / "llama-completion"
    fake.write_text("#!/bin/sh\necho 'Paris.'\n"
                    "echo 'common_perf_print: prompt eval time =      50.00 ms /    16 tokens ( 3 ms per token)' >&2\n"
                    "echo 'common_perf_print:        eval time =     150.00 ms /     9 runs   (16 ms per token)' >&2\n")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    rc = bench.main(argv(tiny_bench, tmp_path, "--methods", "ar,ngram", "--limit", "1", "--llama-cpp", str(fake),
                         "--gguf", str(gguf)))
    out = capsys.readouterr()
    assert rc == 0, out.err
    js = json.loads((tmp_path / "bench_questions.json").read_text())
    peer = js["peer"]
    assert (peer["tokens_per_s"] == pytest.approx(50.0)
            and peer["first_turns"] == len({r["qid"] for r in js["runs"]}) == 3
            and set(peer["methods"]) >= {"ar", "ngram"})
    first = [r["tokens_per_s"] for r in js["runs"] if r["method"] == "ngram" and r["turn"] == 1]
    assert peer["methods"]["ngram"] == pytest.approx(sum(first) / len(first))
    md = (tmp_path / "bench_questions.md").read_text()
    assert "A peer, llama.cpp m.gguf" in md and f"{peer['methods']['ar'] / 50:.2f}x" in md
    assert "llama.cpp m.gguf (first turns, autoregressive): 50.00 tok/s" in out.out
    assert bench.main(argv(tiny_bench, tmp_path, "--llama-cpp", str(fake))) == 2
    assert "--llama-cpp and --gguf go together" in capsys.readouterr().err
