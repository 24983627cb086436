"""bench_train.py: on the tiny target, a row per part of the trainer's step whose times add up to the step, the
supervised tokens of the trainer's own first batches, the JSON, and one-line errors for bad input."""
import json

import pytest
import torch

import bench_train
import eagle_data as ed
from conftest import one_line_error
from eagle_data import read_records

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


def test_table_and_json(tiny, tmp_path, capsys):
    data, js = tiny["root"] / "train.jsonl", tmp_path / "r.json"
    assert bench_train.main(["--checkpoint", str(tiny["path"]), "--target-dtype", "float32", "--data", str(data),
                             "--steps", "3", "--warmup", "1", "--batch-tokens", "256", "--loss-vocab", "64",
                             "--json", str(js)]) == 0
    out = capsys.readouterr().out
    rows = [x.split(" | ") for x in out.splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert [r[0].strip("| *") for r in rows] == list(bench_train.PARTS) + ["step"]
    assert sum(int(r[2].strip("%| ")) for r in rows[:-1]) in range(97, 104)
    res = json.loads(js.read_text())
    assert len(res["steps"]) == 3 and all(len(s["seconds"]) == len(bench_train.PARTS) for s in res["steps"])
    # the trainer's own epoch-0 batches 1..3 (after the warm-up one), their supervised tokens
    recs = read_records(data, 260, 2048)
    batches = ed.make_batches(recs, 256)
    order = list(torch.utils.data.distributed.DistributedSampler(batches, num_replicas=1, rank=0, seed=0))
    want = [int(ed.collate(recs, batches[order[k]], 0, "cpu")[1][:, 2:].sum()) for k in (1, 2, 3)]
    assert [s["supervised"] for s in res["steps"]] == want
    total = sum(sum(s["seconds"]) for s in res["steps"])
    assert res["supervised_tok_s"] == pytest.approx(sum(want) / total)
    assert f"{sum(want)} supervised tokens" in out


@pytest.mark.parametrize("extra,words", [(["--data", "nope.jsonl"], ["nope.jsonl"]),
                                         (["--steps", "0"], ["--steps"])])
def test_bad_input(tiny, capsys, extra, words):
    args = ["--checkpoint", str(tiny["path"]), "--target-dtype", "float32", "--data", str(tiny["root"] / "train.jsonl")]
    one_line_error(capsys, bench_train.main(args + extra), *words)
