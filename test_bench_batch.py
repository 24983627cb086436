"""bench_batch.py: the table (the one-at-a-time baseline, then each batch size: AR, auto, forced), the figure and
the JSON on a tiny model (prompt lookup as its drafter), every configuration's tokens equal to AR's."""
import json

import bench_batch
from conftest import write_tiny_hf


def test_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", "torch")
    path, _ = write_tiny_hf(tmp_path / "t", vocab_size=300)
    png, js, q = tmp_path / "b.png", tmp_path / "b.json", tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"turns": [t], "category": c}) + "\n"
                         for t, c in [("a b a b", "qa"), ("c d", "writing"), ("e f e", "qa")]))
    assert bench_batch.main(["--checkpoint", str(path), "--questions", str(q), "--max-new-tokens", "6",
                             "--batches", "1,2", "--rounds", "1", "--forced-max", "1", "--hf", "2",
                             "--png", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    head, *rows = [x for x in out.splitlines() if x.startswith("| ") and "---" not in x]
    assert [r.split(" | ")[0] for r in rows] == ["| one at a time (engine, batch 1)", "| 1", "| 2"]
    col = {h.strip(" |"): i for i, h in enumerate(head.split(" | "))}
    cells = [c.strip(" |") for c in rows[2].split(" | ")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3] == "-"  # forced only up to --forced-max
    assert float(cells[col["transformers generate()"]]) > 0  # transformers at batch 2
    # the whole batch every step (no EOS), decode steps only, and its ratio to the same at batch 1
    assert float(cells[col["AR, full batch: decode tok/s"]]) > 0 and cells[col["vs its batch 1"]].endswith("x")
    assert [c.strip(" |") for c in rows[1].split(" | ")][col["vs its batch 1"]] == "1.00x"
    assert "tokens equal AR's at the same batch size: True" in out and "KV cache" in out
    assert png.stat().st_size > 1000 and json.loads(js.read_text())["same"] is True


def test_profile(tmp_path, capsys, monkeypatch):
    """--profile: a full batch's decode step per batch size, split into the fused pass's phases and the rest (they
    add up to the step), with the GEMMs' rate; without the fused pass a one-line error."""
    import cpu_forward
    import pytest
    from errors import UsageError
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", "kernel")
    path, _ = write_tiny_hf(tmp_path / "t", vocab_size=300, hidden_size=192, intermediate_size=256,
                            num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=2048)
    assert bench_batch.main(["--checkpoint", str(path), "--max-new-tokens", "6", "--batches", "1,3", "--profile"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "---" not in r][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| 1", "| 3"]
    for r in rows:
        step, tps, g, at, rest, outside, rate = (float(c.strip(" |")) for c in r.split(" | ")[1:])
        assert step > 0 and g > 0 and at >= 0 and outside >= 0 and rate > 0
        assert g + at + rest + outside == pytest.approx(step, abs=0.05)  # (each cell rounded to 0.01)
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", "torch")
    with pytest.raises(UsageError, match="fused CPU pass"):
        bench_batch.main(["--checkpoint", str(path), "--batches", "1", "--profile"])
