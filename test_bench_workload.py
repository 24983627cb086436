"""bench_workload.py: the built-in workload covers every Spec-Bench task; selection by task with a per-task limit."""
import pytest

import bench_workload
from errors import UsageError


def test_builtin_workload_and_selection():
    qs = bench_workload.load_questions(None)
    tasks = {q.task for q in qs}
    assert {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "code"} == tasks
    assert any(len(q.turns) == 2 for q in qs)
    assert [q.qid for q in bench_workload.select_questions(qs, "qa,rag", 1)] == ["b7", "b11"]
    with pytest.raises(UsageError, match="unknown category"):
        bench_workload.select_questions(qs, "nope", None)
