"""bench_ar.py --profile on a tiny checkpoint: one row per pass size, each part measured, and the weight floor."""
import sys

import bench_ar
from conftest import write_tiny_hf


def test_profile_prints_one_row_per_pass_size(tmp_path, capsys, monkeypatch):
    path, _ = write_tiny_hf(tmp_path / "t")
    monkeypatch.setattr(bench_ar, "read_bandwidth_gbs", lambda: 10.0)  # a 1 GiB read is not a unit test
    monkeypatch.setattr(sys, "argv", ["bench_ar.py", "--checkpoint", str(path), "--profile", "--context", "20",
                                      "--rows", "1,4", "--dtype", "float32"])
    bench_ar.main()
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "4"]
    assert "reading the weights once takes" in out
    for r in rows:
        whole, gemms, attn = (float(c) for c in r.split("|")[2:5])
        assert whole > 0 and gemms > 0 and attn > 0
