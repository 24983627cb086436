"""bench_quant.py: on a tiny model, a row per variant (bf16, int8, each int4 group size that divides the widths),
perplexity over the held-out ShareGPT chunk, agreement with bf16's greedy tokens (bf16's own: 100%), smaller
resident weights, and the JSON."""
import json

import bench_quant
from conftest import write_tiny_hf


def test_table(tmp_path, capsys):
    path, _ = write_tiny_hf(tmp_path / "t", vocab_size=300)
    q, sg, js = tmp_path / "q.jsonl", tmp_path / "sg.json", tmp_path / "r.json"
    q.write_text("".join(json.dumps({"turns": [t], "category": "qa"}) + "\n" for t in ("a b a b", "c d", "e f e")))
    convs = [{"conversations": [{"from": "human", "value": f"question {i} " * 3},
                                {"from": "gpt", "value": f"answer {i} " * 5}]} for i in range(5010)]
    sg.write_text(json.dumps(convs))
    assert bench_quant.main(["--checkpoint", str(path), "--questions", str(q), "--tokens", "5", "--sharegpt", str(sg),
                             "--ppl-tokens", "600", "--groups", "32,48", "--json", str(js)]) == 0
    out = capsys.readouterr()
    assert "skipping int4 g48" in out.err
    rows = [x.split(" | ") for x in out.out.splitlines() if x.startswith("| ") and "---" not in x][1:]
    assert [r[0] for r in rows] == ["| bf16", "| int8", "| int4 g32"]
    assert rows[0][3] == "100.0%" and all(float(r[2]) > 1 for r in rows)
    res = json.loads(js.read_text())
    mib = [r["weight_mib"] for r in res["rows"]]
    assert mib[1] < mib[0] * 0.8 and mib[2] < mib[1]
    assert res["ppl_tokens"] == 600 and len(res["rows"]) == 3 and res["rows"][0]["equal"] == 1.0
