"""bench_batch.py: the table's rows (the one-at-a-time baseline first, then each batch size) on a tiny model."""
import bench_batch
from conftest import write_tiny_hf


def test_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", "torch")
    path, _ = write_tiny_hf(tmp_path / "t", vocab_size=300)
    assert bench_batch.main(["--checkpoint", str(path), "--prompts", "3", "--max-new-tokens", "4", "--batches", "1,2",
                             "--rounds", "1"]) == 0
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| engine, one at a time", "| BatchEngine, batch 1",
                                                 "| BatchEngine, batch 2"]
    assert rows[0].endswith("| 1.00x |") and all(float(r.split(" | ")[1]) > 0 for r in rows)
