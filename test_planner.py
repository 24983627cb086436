"""planner.py: a request's KV slots and pass rows, and one-line refusals of what does not fit."""
import pytest
import torch

from conftest import write_tiny_hf
from errors import UsageError
from exact import PassRows
from model import load_model
from planner import Planner, Request


def test_planner_sizes_the_cache_and_refuses_what_does_not_fit(tmp_path):
    """A request's KV slots (rounded up to 64, or the fixed size CUDA graphs keep), its pass rows outside exact
    mode, and one-line refusals: past the model's context, past the fixed size, --exact with a tree deeper than
    exact verification gathers."""
    m = load_model(write_tiny_hf(tmp_path / "t")[0], dtype=torch.float32)
    p = Planner(m, False, None)
    req = p.plan(10, 20, 5)
    assert p.invariance is None and req == Request(64, PassRows(5, 5), False) and not req.exact
    assert p.pass_rows(req, 3) == PassRows(3, 3) and not p.pass_rows(req, 3).recent
    with pytest.raises(UsageError, match="exceeds the model's context of 512"):
        p.plan(500, 20, 5)
    fixed = Planner(m, False, 128)
    assert fixed.plan(10, 20, 5).S == 128
    with pytest.raises(UsageError, match="exceeds --max-seq 128"):
        fixed.plan(110, 20, 5)

    class Deep:
        depth, nodes = 20, 40

    with pytest.raises(UsageError, match="--tree-depth must be below"):
        Planner(m, True, None, Deep())
    assert Planner(m, None, None, Deep()).invariance is None  # too deep for exact mode: off
