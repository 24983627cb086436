"""bench_kernels.py: a row per format and row count, in cache and streamed, every rate positive and the streamed
bytes the matrix's own; an unknown format or a width off the super-block is one line."""
import pytest

import bench_kernels
import cpu_gemm
from errors import UsageError

pytestmark = pytest.mark.skipif(cpu_gemm.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")


def test_table(capsys):
    res = bench_kernels.main(["--formats", "bf16,Q4_K,Q6_K", "--rows", "1,3", "--n", "128", "--k", "256",
                              "--reps", "1", "--stream-mb", "1"])
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert [(r["format"], r["rows"]) for r in res] == [(f, m) for f in ("bf16", "Q4_K", "Q6_K") for m in (1, 3)]
    assert len(rows) == 6 and all(r["cached_gws"] > 0 and r["streamed_gws"] > 0 for r in res)
    size = {r["format"]: r["bytes"] for r in res}
    assert size["bf16"] == 128 * 256 * 2 and size["Q4_K"] < size["Q6_K"] < size["bf16"]


def test_bad_flags_are_one_line():
    with pytest.raises(UsageError, match="unknown format 'Q3_K'"):
        bench_kernels.main(["--formats", "Q3_K", "--n", "64", "--k", "256"])
    with pytest.raises(UsageError, match="multiple of 256"):
        bench_kernels.main(["--k", "100"])
