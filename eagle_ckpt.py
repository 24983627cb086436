"""EAGLE-3 training's files: the resumable run checkpoint and the exported head folder (official / SpecForge layout)."""
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle_data import TrainError, log
from eagle_ttt import head_config
from model import Transformer

CKPT_NAME = "checkpoint.pt"
CKPT_FORMAT = 1


def signature(target: Transformer, head, freeze_lm_head: bool) -> dict:
    return dict(target=dict(vocab_size=target.args.vocab_size, dim=target.args.dim, n_layers=target.args.n_layers),
                head=head_config(head), freeze_lm_head=freeze_lm_head)


def atomic_save(obj, path: Path):
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a partial write never carries the final name


def load_checkpoint(path: Path, expect: dict | None = None) -> dict:
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise TrainError(f"cannot resume from {path}: not a readable checkpoint "
                         f"({str(e).splitlines()[0][:120]})") from None
    if not isinstance(ck, dict) or ck.get("format") != CKPT_FORMAT or "signature" not in ck:
        raise TrainError(f"cannot resume from {path}: not an eagle_train.py checkpoint")
    if expect is not None and ck["signature"] != expect:
        key, was, now = _first_diff(ck["signature"], expect)
        raise TrainError(f"cannot resume from {path}: it was trained with {key}={was!r}, this run has {now!r}")
    return ck


def _first_diff(a, b, prefix=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_diff(a.get(k), b.get(k), f"{prefix}{k}.")
    return prefix.rstrip("."), a, b


def export_head(head, out_dir, dtype=torch.bfloat16, with_lm_head: bool = True):
    """An EAGLE-3 folder as vLLM's and SGLang's LlamaForCausalLMEagle3 load it; without lm_head (and
    draft_vocab_size) SGLang, vLLM and eagle.load_eagle use the target's."""
    c, a = head.c, head.c.args
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_act="silu",
               hidden_size=a.dim, intermediate_size=a.intermediate_size, num_attention_heads=a.n_heads,
               num_key_value_heads=a.n_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.norm_eps,
               rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings,
               vocab_size=a.vocab_size, draft_vocab_size=c.draft_vocab_size, num_hidden_layers=1,
               tie_word_embeddings=False, target_hidden_size=c.fc_in // 3,
               eagle_config=dict(eagle_aux_hidden_state_layer_ids=list(c.aux_layers), use_aux_hidden_state=True),
               torch_dtype=str(dtype).removeprefix("torch."))
    if a.rope_scaling:
        cfg["rope_scaling"] = a.rope_scaling
    sd = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    if not with_lm_head:
        del sd["lm_head.weight"], cfg["draft_vocab_size"]
        cfg["load_lm_head_from_target"] = True
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def init_from(head, folder: Path):
    """Start from an exported EAGLE-3 head of this run's shapes and aux layers (without lm_head: the target's)."""
    cfg_p, w_p = folder / "config.json", folder / "model.safetensors"
    if not (cfg_p.is_file() and w_p.is_file()):
        raise TrainError(f"--init {folder}: not an EAGLE-3 head folder (config.json + model.safetensors)")
    aux = json.loads(cfg_p.read_text()).get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and tuple(aux) != tuple(head.c.aux_layers):
        raise TrainError(f"--init {folder}: its aux layers are {tuple(aux)}, this run's are {tuple(head.c.aux_layers)}")
    sd, own = load_file(str(w_p)), head.state_dict()
    extra, missing = set(sd) - set(own), set(own) - set(sd) - {"lm_head.weight"}
    bad = sorted(k for k in set(sd) & set(own) if sd[k].shape != own[k].shape)
    if extra or missing or bad:
        what = (f"unknown tensor {sorted(extra)[0]}" if extra else f"no {sorted(missing)[0]}" if missing
                else f"{bad[0]} is {tuple(sd[bad[0]].shape)}, this head's is {tuple(own[bad[0]].shape)}")
        raise TrainError(f"--init {folder}: does not fit this target's head ({what})")
    with torch.no_grad():
        for k, v in sd.items():
            own[k].copy_(v.to(own[k].dtype))
    log(f"initialised from {folder} ({len(sd)} tensors)")
