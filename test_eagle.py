"""eagle.py: EAGLE heads in the official and SpecForge layouts, their RoPE base, and loader errors."""
import pytest
import torch
from safetensors.torch import load_file, save_file

import draft_eagle as de
from conftest import load_head, write_eagle_head
from eagle import load_eagle
from model import ModelError, load_model


@pytest.mark.parametrize("kw", [dict(version=1, fmt="bin", fc_bias=True), dict(version=1),
                                dict(version=3), dict(version=3, prefix="layers.0."),
                                dict(version=3, draft_vocab=100, fmt="bin")])
def test_loaders_official_layouts(draft_env, kw):
    m, head = load_head(draft_env, **kw)
    assert head.c.version == kw["version"]
    assert head.embed_tokens is m.embed_tokens  # the target's embedding, not the shipped copy
    if kw.get("draft_vocab"):
        t2r = de.EagleDrafter.token_to_row_map(head)
        rows = torch.arange(100)
        assert torch.equal(t2r[rows + head.d2t], rows)  # d2t and the inverse map agree
        assert head.lm_weight().shape[0] == 100
    if kw["version"] == 1:
        assert head.lm_weight() is m.lm_head.weight and (head.fc.bias is not None) == kw.get("fc_bias", False)


def test_eagle3_rope_base_from_own_config(draft_env):
    root, path, cfg = draft_env
    m = load_model(path, dtype=torch.float32)
    h = load_eagle(write_eagle_head(root / "r1", cfg, version=3), m, torch.float32, "cpu")
    assert h.c.args.rope_theta == 10000.0  # official heads omit rope_theta
    h = load_eagle(write_eagle_head(root / "r2", cfg, version=3, extra_cfg=dict(rope_theta=5e5)),
                   m, torch.float32, "cpu")
    assert h.c.args.rope_theta == 5e5


def test_loader_errors(draft_env, tmp_path):
    root, path, cfg = draft_env
    m = load_model(path, dtype=torch.float32)
    with pytest.raises(ModelError, match="hidden size"):
        load_eagle(write_eagle_head(tmp_path / "a", dict(cfg, hidden_size=32, intermediate_size=64), version=1),
                   m, torch.float32, "cpu")
    bad = write_eagle_head(tmp_path / "b", cfg, version=3)
    sd = load_file(f"{bad}/model.safetensors")
    sd["fc.weight"] = sd["fc.weight"][:, :128].contiguous()
    save_file(sd, f"{bad}/model.safetensors")
    with pytest.raises(ModelError, match="EAGLE-3 fc takes 128 inputs"):
        load_eagle(bad, m, torch.float32, "cpu")
    with pytest.raises(ModelError, match="aux layers"):
        load_eagle(write_eagle_head(tmp_path / "c", cfg, version=3,
                                    extra_cfg=dict(eagle_config=dict(eagle_aux_hidden_state_layer_ids=[1, 2, 9]))),
                   m, torch.float32, "cpu")
