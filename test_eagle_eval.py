"""eagle_eval.py: the diagnostic table's layout, and a refusal of heads whose rows are not token ids. Its
figures (recall rising with training, the engine's acceptance, full == full) are checked on a trained head
in test_eagle_train.py, where one is trained."""
import torch

import eagle_eval as ev
from conftest import write_eagle_head, write_tiny_hf
from model import load_model


def test_table_lists_every_depth_and_the_engine_column():
    res = dict(full=[[0.5, 0.7, 0.8, 0.9], [0.3, 0.5, 0.6, 0.7]], vocab=[[0.4, 0.6, 0.7, 0.8], [0.2, 0.4, 0.5, 0.6]],
               rows=[100, 90], window=321.5, ks=[1, 4, 8, 10], vocab_spec="nanospec")
    t = ev.table(res, dict(accept=[0.45, 0.2], tau=1.65, steps=50)).splitlines()
    assert t[0].count("full R@") == 4 and t[0].count("nanospec R@") == 4 and "engine accepted" in t[0]
    assert t[2].split(" | ")[1:] == ["0.500", "0.700", "0.800", "0.900", "0.400", "0.600", "0.700", "0.800",
                                      "0.450", "100 |"]
    assert len(t) == 6 and "321.5" in t[-1] and "τ 1.65" in t[-1]
    assert "engine" not in ev.table(res)


def test_pruned_head_is_refused(tmp_path):
    import json
    path, _ = write_tiny_hf(tmp_path / "t", vocab_size=300)
    cfg = json.loads((path / "config.json").read_text())
    target = load_model(path, dtype=torch.float32)
    write_eagle_head(tmp_path / "h", cfg, version=3, draft_vocab=100)
    try:
        ev.load_head(tmp_path / "h", target)
    except ValueError as e:
        assert "whole vocabulary" in str(e)
    else:
        raise AssertionError("a d2t head was accepted")


def test_curve_table_and_figure(tmp_path):
    """`eagle_train.py curve`: one row per point in token order, the reference head last, the PNG drawn; a bad
    point is one line."""
    import json

    import eagle_train
    rec = lambda r1, t: dict(recall=dict(full=[[r1, 0.6, r1 + 0.3, 0.9], [0.3, 0.4, 0.5, 0.6]]), engine=dict(tau=t))
    files = {}
    for name, r in (("a", rec(0.31, 1.7)), ("b", rec(0.41, 2.0)), ("ref", rec(0.40, 1.9))):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(r))
    png = tmp_path / "c.png"
    assert eagle_train.main(["curve", f"2.21M={files['b']}", f"410k={files['a']}", "--ref", f"shipped={files['ref']}",
                             "--png", str(png)]) == 0
    t = ev.curve([(4.1e5, rec(0.31, 1.7)), (2.21e6, rec(0.41, 2.0))], None, ("shipped", rec(0.40, 1.9))).splitlines()
    assert [r.split(" | ")[0] for r in t[2:]] == ["| 0.41M", "| 2.21M", "| shipped"]
    assert t[3].split(" | ")[1:] == ["0.410", "0.710", "0.500", "2.000 |"]
    assert png.stat().st_size > 1000
    assert eagle_train.main(["curve", f"lots={files['a']}"]) == 2
