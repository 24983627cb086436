"""bench_ar.py --profile on a tiny checkpoint: one row per pass size, each part measured, and the weight floor; the
llama.cpp peer's timings; the quantized rows."""
import sys

import pytest
import torch

import bench_ar
from conftest import write_tiny_hf
from model import load_model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_prints_one_row_per_pass_size(tmp_path, capsys, monkeypatch, dtype):
    """float32: the PyTorch layers, their GEMMs and attention timed alone; bfloat16 (where the fused CPU pass runs):
    its GEMM and attention phases timed inside it, which leave a non-negative rest."""
    path, _ = write_tiny_hf(tmp_path / "t")
    monkeypatch.setattr(bench_ar, "read_bandwidth_gbs", lambda: 10.0)  # a 1 GiB read is not a unit test
    monkeypatch.setattr(bench_ar.cpu_gemm, "peak_gflops", lambda: 1e-3)  # a slow CPU: the arithmetic floor counts
    monkeypatch.setattr(sys, "argv", ["bench_ar.py", "--checkpoint", str(path), "--profile", "--context", "20",
                                      "--rows", "4", "--dtype", dtype])
    bench_ar.main()
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "4"]  # the one-row pass is always measured
    assert "reading the weights once takes" in out and "ms of arithmetic per row" in out
    m = load_model(path, dtype=getattr(torch, dtype))
    fused = m.cpu_pass is not None
    assert ("timed inside it" in out) == fused and not bench_ar.cpu_forward._TIMED[0]
    flops = 2 * sum(l.in_features * l.out_features for l in m.modules() if isinstance(l, torch.nn.Linear))
    ones = []
    for T, r in zip((1, 4), rows):
        whole, gemms, attn = (float(c) for c in r.split("|")[2:5])
        assert whole > 0 and gemms > 0 and attn > 0
        if fused:  # the phases are parts of the pass
            assert gemms + attn <= whole * 1.05
        floor, ratio = r.split("|")[7:9]
        assert float(floor) == pytest.approx(T * flops / 1e-3 / 1e6, rel=0.01)  # above the weight floor here
        ones.append(whole)
        assert float(ratio.strip().rstrip("x")) == pytest.approx(float(floor) / ones[0], rel=0.01)


def test_llama_cpp_peer_reads_its_timings(tmp_path):
    """A llama-completion run's tokens/s: generated tokens (eval runs + the prompt eval's first token) over its
    prompt-eval + eval time; a failed run is one line, not a traceback."""
    fake = tmp_path / "llama-completion"
    fake.write_text("#!/bin/sh\necho 'Paris.'\n"
                    "echo 'common_perf_print: prompt eval time =      50.00 ms /    16 tokens ( 3 ms per token)' >&2\n"
                    "echo 'common_perf_print:        eval time =     150.00 ms /     9 runs   (16 ms per token)' >&2\n")
    fake.chmod(0o755)
    assert bench_ar.run_llama_cpp(str(fake), "m.gguf", "hi", 16) == pytest.approx(10 / 0.2)
    fake.write_text("#!/bin/sh\necho 'error: unable to load model' >&2\nexit 1\n")
    with pytest.raises(SystemExit, match="llama.cpp failed.*unable to load model"):
        bench_ar.run_llama_cpp(str(fake), "m.gguf", "hi", 16)


def test_quantized_rows(tmp_path):
    """--quant int8,int4: each a target of its own, quantized by quantize.py's defaults, decoding."""
    path, _ = write_tiny_hf(tmp_path / "t")
    rows = bench_ar.quantized_engines(path, ["int8", "int4"], torch.bfloat16, str(tmp_path / "q"))
    assert [k.split(" (")[0] for k in rows] == ["engine int8", "engine int4"]
    for eng in rows.values():
        assert eng.model.layers[0].mlp.down_proj.bits in (8, 4)
        assert len(eng.generate([5, 6, 7], 4)[0]) == 4
