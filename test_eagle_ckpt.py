"""eagle_ckpt.py: an exported head loads back (eagle.load_eagle) with the same logits, with and without its
lm_head; an interrupted checkpoint save leaves the previous checkpoint whole."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import eagle_ckpt as ec
import eagle_ttt as ttt
from eagle import load_eagle
from model import Plan

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


def test_export_round_trip_reproduces_logits(tiny, tmp_path):
    m = tiny["model"]
    aux_layers = m.eagle3_aux_layers()
    head = ttt.new_head(m, aux_layers, rope_theta=5000.0, seed=1)
    with torch.no_grad():
        head.lm_head.weight.add_(0.01)  # a trained lm_head: must travel with the export
    full = ec.export_head(head, tmp_path / "full", torch.float32)
    cfg = json.loads((full / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == cfg["vocab_size"] == 260
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3] and cfg["rope_theta"] == 5000.0
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    with safe_open(str(full / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight"} <= keys and not any(k.startswith("embed") for k in keys)
    toks = torch.tensor([tiny["recs"][1]["ids"][:24]])
    m.setup_caches(1, 32)
    _, _, aux = m(toks, torch.arange(24), return_hidden=True, plan=Plan(aux_layers))
    cos, sin = ttt.rope_cache(30, head.c.args.head_dim, 5000.0, None)

    def logits(h):
        with torch.no_grad():
            return [o @ h.lm_head.weight.T for o in ttt.ttt_forward(h, aux, toks, 3, cos, sin)]
    ref = logits(head)
    loaded = load_eagle(full, m, torch.float32, "cpu")
    assert loaded.c.args.rope_theta == 5000.0 and loaded.c.aux_layers == (2, 3, 3)
    for a, b in zip(ref, logits(loaded)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # without lm_head (a frozen, target-tied head): eagle.load_eagle takes the target's
    frozen = ttt.new_head(m, aux_layers, seed=1)
    lean = ec.export_head(frozen, tmp_path / "lean", torch.float32, with_lm_head=False)
    assert "draft_vocab_size" not in json.loads((lean / "config.json").read_text())
    loaded = load_eagle(lean, m, torch.float32, "cpu")
    assert torch.equal(loaded.lm_head.weight, m.lm_head.weight)
    for a, b in zip(logits(frozen), logits(loaded)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_interrupted_save_leaves_no_complete_looking_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / ec.CKPT_NAME
    ec.atomic_save({"format": ec.CKPT_FORMAT, "step": 1}, target)
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ec.atomic_save({"format": ec.CKPT_FORMAT, "step": 2}, target)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(target, weights_only=False)["step"] == 1  # the old one stays whole
