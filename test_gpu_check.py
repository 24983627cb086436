"""gpu_check.py needs CUDA for its checks; the parts that are plain engine code run here on CPU."""
import json

import torch

import gpu_check
from conftest import write_eagle_head, write_tiny_hf


def test_gpu_check_methods_run_on_cpu(tmp_path):
    path, _ = write_tiny_hf(tmp_path / "t")
    head = write_eagle_head(tmp_path / "h", json.loads((path / "config.json").read_text()), version=3)
    res, m, prompts = gpu_check.run_all(path, "cpu", torch.float32, False, head, n_new=8)
    assert set(res) == {"autoregressive", "ngram", "eagle3 full", "fr-spec 8k", "nanospec",
                        "default: nanospec + lookup, budget"}
    assert len(prompts) == len(gpu_check.PROMPTS)
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
    r = gpu_check.check_batch(path, "cpu", torch.float32, n_new=6, batch=2)
    assert r["batch"] == r["single"] and r["spec"] == r["single"] and r["tps"] > 0 and r["tps1"] > 0


def test_gpu_check_quantized_runs_on_cpu(tmp_path, monkeypatch):
    """The quantized targets' rows, through torch's kernels (the CUDA path's choice) on the CPU here."""
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", "torch")
    path, _ = write_tiny_hf(tmp_path / "t")
    rows = gpu_check.check_quantized(path, 6, device="cpu", cache=tmp_path / "cache")
    assert [r[0] for r in rows] == ["quantized target: int8", "quantized target: int4"]
    assert all(r[2] == "PASS" for r in rows), rows


def test_compare_passes_equal_outputs_and_near_ties_only(tmp_path):
    """compare: equal outputs pass; outputs that part where the target's two tokens have clearly different logits
    fail; a part at (made) equal logits passes as a near tie."""
    path, _ = write_tiny_hf(tmp_path / "t")
    m, _, _ = gpu_check.load_target(str(path), "cpu", "float32")
    prompt = [1, 2, 3]
    m.setup_caches(1, 16)
    lg = m(torch.tensor([prompt]), torch.arange(3))[0, -1]
    best, worst = int(lg.argmax()), int(lg.argmin())
    assert gpu_check.compare(m, [prompt], [[best, 5]], [[best, 5]]) == (True, "1/1 same")
    ok, detail = gpu_check.compare(m, [prompt], [[worst]], [[best]])
    assert not ok and "CLEAR MARGIN" in detail and "parts at token 0" in detail
    assert not gpu_check.compare(m, [prompt], [[best]], [[best, 5]])[0]  # one stopped early
    with torch.no_grad():  # the two tokens' output rows made equal: their logits tie exactly
        m.lm_head.weight[worst] = m.lm_head.weight[best]
    ok, detail = gpu_check.compare(m, [prompt], [[worst]], [[best]])
    assert ok and "near tie" in detail
