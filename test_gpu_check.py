"""gpu_check.py needs CUDA for its checks; the parts that are plain engine code run here on CPU."""
import json

import torch

import gpu_check
from conftest import write_eagle_head, write_tiny_hf


def test_gpu_check_methods_run_on_cpu(tmp_path):
    path, _ = write_tiny_hf(tmp_path / "t")
    head = write_eagle_head(tmp_path / "h", json.loads((path / "config.json").read_text()), version=3)
    res = gpu_check.run_all(path, "cpu", torch.float32, False, head, n_new=8)
    assert set(res) == {"autoregressive", "ngram", "eagle3 full", "fr-spec 8k", "nanospec"}
    for name, (outs, speed) in res.items():
        assert outs == res["autoregressive"][0], name  # every method is lossless
        assert speed > 0


def test_gpu_check_refuses_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["gpu_check.py"])
    assert gpu_check.main() == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_gpu_check_batch_runs_on_cpu(tmp_path):
    path, _ = write_tiny_hf(tmp_path / "t")
    same, tps, tps1, spec = gpu_check.check_batch(path, "cpu", torch.float32, n_new=6, batch=2)
    assert same and spec and tps > 0 and tps1 > 0


def test_gpu_check_quantized_runs_on_cpu(tmp_path, monkeypatch):
    """The quantized targets' rows, through torch's kernels (the CUDA path's choice) on the CPU here."""
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", "torch")
    path, _ = write_tiny_hf(tmp_path / "t")
    rows = gpu_check.check_quantized(path, 6, device="cpu", cache=tmp_path / "cache")
    assert [r[0] for r in rows] == ["quantized target: int8", "quantized target: int4"]
    assert all(r[2] == "PASS" for r in rows), rows
