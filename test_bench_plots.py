"""bench_plots.py: figures drawn only from measured points."""
import bench_plots


def test_figure_1_is_drawn_only_from_measured_points(tmp_path):
    """A run whose draft never measured coverage (a head that never drafted) gets no empty coverage figure, and
    its speed figure is still drawn from the points it has; the report links only the files that exist."""
    pts = [{"head": "h", "series": "nanospec", "size": 3072, "coverage": None, "decode_rate": 70.0}]
    logs = []
    bench_plots.make_plots(tmp_path, "t", {"points": pts}, {}, [], [], logs.append)
    assert not (tmp_path / "bench_t_fig1a_coverage.png").exists() and any("fig1a_coverage" in m for m in logs)
    assert (tmp_path / "bench_t_fig1b_speed.png").read_bytes()[:4] == b"\x89PNG"
    pts[0]["coverage"] = 0.9
    bench_plots.make_plots(tmp_path, "t", {"points": pts}, {}, [], [], logs.append)
    assert (tmp_path / "bench_t_fig1a_coverage.png").is_file()
