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


def test_main_runs_every_part_on_fakes(tmp_path, monkeypatch, capsys):
    """main()'s glue (the parts, their rows, the tables written) with the CUDA work faked: GPU time is scarce, so
    a slip in it must show here, not on the GPU. A part that raises is a FAIL row and the others still run."""
    path, _ = write_tiny_hf(tmp_path / "t")
    m, _, _ = gpu_check.load_target(str(path), "cpu", "float32")
    names = ["autoregressive", "ngram", "eagle3 full", "fr-spec 8k", "nanospec", "default: nanospec + lookup, budget"]
    outs, prompts = [[1, 2, 3], [4, 5]], [[7, 8], [9]]

    def fake_run_all(path, device, dtype, compile, head, n_new, repeats=1):
        return {n: (outs, 100.0 + i) for i, n in enumerate(names)}, m, prompts

    def fake_batch(path, device, dtype, n_new, batch=4):
        return dict(single=outs, batch=outs, spec=outs, graphs=outs, tps=50.0, tps_graphs=80.0, tps1=10.0,
                    model=m, prompts=prompts)

    def fake_kernel(rows):
        rows.append(["gather kernel == fallback", "bfloat16", "PASS", ""])
        return True

    def broken(out, quick):
        raise RuntimeError("no 8B shape here\nsecond line")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(gpu_check, "resolve_checkpoint", lambda arg: path)
    monkeypatch.setattr(gpu_check, "run_all", fake_run_all)
    monkeypatch.setattr(gpu_check, "check_batch", fake_batch)
    monkeypatch.setattr(gpu_check, "check_kernel", fake_kernel)
    monkeypatch.setattr(gpu_check, "check_quantized", lambda path, n: [["quantized target: int8", "", "PASS", ""]])
    monkeypatch.setattr(gpu_check, "copy_bandwidth", lambda: 3000.0)
    monkeypatch.setattr(gpu_check, "check_training", lambda path, head, seconds: (True, f"trained {seconds} s"))
    monkeypatch.setattr(gpu_check, "latency_rows", broken)
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--quick", "--out", str(tmp_path / "out")])
    assert gpu_check.main() == 1  # the broken part fails the run
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    res = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert res["done"] and not res["ok"] and res["gpu"] == "Fake GPU"
    assert "| latency | raised | FAIL | RuntimeError: no 8B shape here |" in md
    assert "| device-to-device copy bandwidth | read + write | 3000 GB/s |  |" in md
    for n in names:
        assert f"| greedy, eager: {n} | bf16 CUDA vs its AR | PASS | 2/2 same" in md
        assert f"| CUDA graphs: {n} | bf16, vs its AR | PASS | 2/2 same" in md
    assert "bf16 batch 16: 50.0 tok/s eager, 80.0 graphs, one at a time 10.0" in md
    assert "| quantized target: int8 |" in md
    assert "| EAGLE-3 training (eagle_train.py) | bf16, from the shipped head | PASS | trained 30 s |" in md
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--parts", "kernel,nope"])
    assert gpu_check.main() == 2 and "unknown part(s) nope" in capsys.readouterr().err


def test_training_check_runs_on_cpu(tmp_path, monkeypatch):
    """check_training (gpu_check's train part) on the CPU with a tiny model: data from the batch engine, a
    --time-limit run from a head, the export, and its lossless drafting."""
    monkeypatch.setenv("EAGLE_TRAIN_QUIET", "1")
    path, _ = write_tiny_hf(tmp_path / "t")
    import eagle_ckpt
    import eagle_ttt
    m, _, _ = gpu_check.load_target(str(path), "cpu", "float32")
    head = eagle_ckpt.export_head(eagle_ttt.new_head(m, m.eagle3_aux_layers(), seed=0), tmp_path / "h", torch.float32,
                                  with_lm_head=False)  # as the shipped heads: no embedding, no lm_head
    ok, detail = gpu_check.check_training(path, head, 3, device="cpu", dtype="float32", work=tmp_path / "w")
    assert ok, detail
    assert (tmp_path / "w" / "head" / "config.json").is_file() and " steps in 3 s" in detail and "3/3 same" in detail
