"""bench_latency.py: the latency mode runs its CPU smoke shape and refuses real shapes without CUDA (through
bench.py's CLI)."""
import pytest
import torch

import bench


def test_latency_mode_cpu_smoke(tmp_path, capsys):
    rc = bench.main(["--latency", "--device", "cpu", "--shape", "tiny", "--out", str(tmp_path), "--threads", "1",
                     "--latency-iters", "2", "--latency-context", "64"])
    out = capsys.readouterr().out
    assert rc == 0
    for op in ("target decode step", "verify 60 nodes", "draft backbone", "LM head full", "LM head nanospec",
               "nanospec update", "gather"):
        assert op in out, op
    assert (tmp_path / "latency_tiny.md").is_file()


def test_latency_mode_needs_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert bench.main(["--latency", "--shape", "llama3.1-8b", "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "CUDA" in err and "\n" not in err
