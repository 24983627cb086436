"""bench_tp.py end to end on a tiny random model: the five configurations' rows (one process fused and on the
PyTorch layers, two ranks under torch.distributed.run on each of the two passes and with --no-exact), exact TP's text
equal to one process's on the same pass, the exit status."""
import pytest

import bench_tp
import cpu_gemm
from conftest import write_tiny_hf


@pytest.mark.skipif(cpu_gemm.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")
def test_the_table(tmp_path, capsys):
    path, _ = write_tiny_hf(tmp_path / "m", hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=3, num_key_value_heads=1, vocab_size=300, max_position_embeddings=256)
    rc = bench_tp.main(["--checkpoint", str(path), "--draft", "none", "--rounds", "1", "--max-new-tokens", "8",
                        "--prompt", "hello"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [x for x in out.splitlines() if x.startswith("| ") and "tok/s" not in x]
    assert [r.split(" | ")[0] for r in rows] == ["| one process, fused pass", "| one process, PyTorch layers, exact",
                                                  "| 2 ranks (TP 2), fused pass", "| 2 ranks (TP 2), PyTorch layers",
                                                  "| 2 ranks, PyTorch layers, --no-exact (all-reduce)"]
    assert [r.rsplit(" | ", 1)[1] for r in rows] == ["yes (fused) |", "yes (layers) |", "yes (fused) |",
                                                     "yes (layers) |", "- |"]


def test_bad_flags(capsys):
    with pytest.raises(SystemExit):
        bench_tp.main(["--ranks", "1"])
    assert "--ranks must be >= 2" in capsys.readouterr().err
