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
