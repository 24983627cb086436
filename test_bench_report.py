"""bench_report.py: the Table 6 state rows and the offline coverage of a partial frequency ranking."""
import pytest

import bench_report


def test_state_table_llama8b():
    rows = bench_report.state_table("llama3.1-8b", 128256, 4096, 3072, [32768])
    ns = [r for r in rows if r[0].startswith("nanospec")][0]
    assert ns[1] == 3072 and ns[3].endswith("MiB") and 24 < float(ns[3].split()[0]) < 28


def test_freq_coverage_offline_with_a_partial_ranking():
    # a --freq file built from a corpus ranks only the ids it saw, in any id range
    refs = [[[7, 7, 3, 900]], [[2]]]
    cov = bench_report.freq_coverage_offline(refs, [7, 1000, 3], [1, 2, 3, 8])
    assert cov == pytest.approx({1: 0.4, 2: 0.4, 3: 0.6, 8: 0.6})


def test_figure_1_is_drawn_only_from_measured_points(tmp_path):
    """A run whose draft never measured coverage (a head that never drafted) gets no empty coverage figure, and
    its speed figure is still drawn from the points it has; the report links only the files that exist."""
    pts = [{"head": "h", "series": "nanospec", "size": 3072, "coverage": None, "decode_rate": 70.0}]
    logs = []
    bench_report.make_plots(tmp_path, "t", {"points": pts}, {}, [], [], logs.append)
    assert not (tmp_path / "bench_t_fig1a_coverage.png").exists() and any("fig1a_coverage" in m for m in logs)
    assert (tmp_path / "bench_t_fig1b_speed.png").read_bytes()[:4] == b"\x89PNG"
    pts[0]["coverage"] = 0.9
    bench_report.make_plots(tmp_path, "t", {"points": pts}, {}, [], [], logs.append)
    assert (tmp_path / "bench_t_fig1a_coverage.png").is_file()
