"""bench_gguf.py end to end on tiny GGUF files (a qwen2 target and a draft of its vocabulary) with llama.cpp's tools
replaced by scripts that print its log lines: every method's row, the peers', the speculative outputs checked
against the engine's own autoregressive ones, the LM-head costs, memory, parity and the reports."""
import json

import pytest

import bench_gguf
from conftest import write_tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_gguf")
    q4 = {f"blk.{i}.{n}.weight": "Q4_0" for i in range(2) for n in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                       "ffn_gate", "ffn_up", "ffn_down")}
    write_tiny_gguf(root / "target.gguf", arch="qwen2", types=q4, dim=128, ffn=256, heads=4, kv_heads=2,
                    head_dim=32, tied=False, seed=3)
    write_tiny_gguf(root / "draft.gguf", arch="qwen2", types=q4, dim=128, ffn=256, heads=4, kv_heads=2, head_dim=32,
                    layers=1, tied=False, seed=4)
    (root / "q.jsonl").write_text("".join(json.dumps(dict(question_id=i, category=c, turns=[t])) + "\n" for i, (c, t)
                                          in enumerate([("qa", "hello world hello"), ("code", "hell hell he")])))
    bin_ = root / "bin"
    bin_.mkdir()
    # (llama-completion prints prefill's line first: its rate is not the decode rate)
    for name, log in (("llama-completion", "common_perf_print: prompt eval time =     10.00 ms /     9 tokens\n"
                                           "common_perf_print:        eval time =     150.00 ms /     9 runs"),
                      ("llama-speculative", "decoded   20 tokens in    0.500 seconds, speed: 40.0 t/s")):
        (bin_ / name).write_text(f"#!/bin/sh\necho 'hello'\necho '{log}' >&2\n")
        (bin_ / name).chmod(0o755)
    return root


def test_the_report(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path / "cache"))
    rc = bench_gguf.main(["--checkpoint", str(files / "target.gguf"), "--draft", str(files / "draft.gguf"),
                          "--llama-cpp", str(files / "bin"), "--workload", "spec-bench", "--questions",
                          str(files / "q.jsonl"), "--limit", "1", "--max-new-tokens", "12", "--parity", "1",
                          "--methods", "ar,default,full,chain,chain-nanospec,lookup", "--out", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    r = json.loads(next(tmp_path.glob("bench_gguf_*.json")).read_text())
    assert {x["method"] for x in r["records"]} == {"ar", "default", "full", "chain", "chain-nanospec", "lookup"}
    assert not r["mismatches"] and len(r["records"]) == 6 * r["prompts"] == 12
    # the peer's own peak memory (a shell script's), not this process's pages a fork copied
    assert r["rss_mb"]["llama_cpp"] is None or r["rss_mb"]["llama_cpp"] < r["rss_mb"]["engine"] / 4
    peers = {x["method"]: x["tokens_per_s"] for x in r["peers"]}
    assert peers["llama.cpp AR"] == pytest.approx(60.0) and len(peers) == 4
    assert peers["llama.cpp speculative n_max 3"] == pytest.approx(40.0)
    assert r["lm_head"]["rows"]["full"] == 263 and r["lm_head"]["full"] > 0 and r["lm_head"]["nanospec"] > 0
    assert r["rss_mb"]["engine"] > 0 and r["parity"] and r["parity"][0]["qid"] == "0"
    assert r["bytes_per_token"]["ar"] == pytest.approx(r["target_bytes"], rel=0.01)
    md = next(tmp_path.glob("bench_gguf_*.md")).read_text()
    assert "| llama.cpp AR | 60.00 |" in md and "Draft LM head per projection" in md and md in out.out


def test_bad_input_is_one_line(files, capsys):
    with pytest.raises(SystemExit) as e:
        bench_gguf.main(["--checkpoint", str(files / "target.gguf"), "--methods", "ar,nope"])
    assert e.value.code == 2 and "unknown method 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_gguf.main(["--checkpoint", str(files / "target.gguf"), "--methods", "default,lookup"])
    assert e.value.code == 2 and "--methods must include ar" in capsys.readouterr().err
    rc = bench_gguf.main(["--checkpoint", str(files / "target.gguf"), "--methods", "ar,default", "--workload",
                          "spec-bench", "--questions", str(files / "q.jsonl"), "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == f"error: {files / 'target.gguf'} has no named draft: give --draft"
