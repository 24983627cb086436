"""Write a weight-only quantized copy of a checkpoint, gpt-fast's interface:

    python quantize.py --checkpoint DIR --mode int8|int4 [--groupsize 32|64|128] --out DIR

int8: every linear per output channel (or per --groupsize k), symmetric. int4: the decoder layers' linears in
groups of --groupsize k (default 32, which divides the widths of the models we run; gpt-fast's 128 does not divide
SmolLM2's 576) with scales and offsets; the LM head int8 per channel, as llama.cpp keeps its output matrix
wider than the layers'. The embedding stays bf16 (a lookup reads a few rows). quant.py holds the formats; the
folder's config.json records the scheme and `generate.py --checkpoint OUT` loads it. A quantized checkpoint (a GGUF
file's folder, an earlier output) is widened to its bf16 values first and quantized again.
"""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import qlinear
import quant
from download import CheckpointError, resolve_checkpoint
from errors import UsageError
from model import ModelArgs, ModelError, Transformer, load_model, load_state_dict, safetensor_files


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="HF folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--mode", choices=("int8", "int4"), required=True)
    p.add_argument("--groupsize", type=int, default=None,
                   help="k per scale (int4 default 32; int8 default: the whole row, one scale per output channel)")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    return p.parse_args(argv)


def linear_names(args: ModelArgs) -> list[str]:
    """The checkpoint's names of the model's linear weights (HF names: 'model.' before the decoder's)."""
    with torch.device("meta"):
        m = Transformer(args)
    return [("" if n == "lm_head" else "model.") + n for n, mod in m.named_modules()
            if isinstance(mod, torch.nn.Linear)]


def widened(src: Path) -> dict:
    """A quantized checkpoint's tensors with every quantized matrix widened to its bf16 values (HF names): a GGUF's
    or an earlier quantize.py's weights, quantized again (a draft model drafts faster in another scheme: it only
    proposes, so the output stays lossless)."""
    m = load_model(src, torch.bfloat16, "cpu")
    out = {}
    for name, mod in m.named_modules():
        hf = name if name == "lm_head" else f"model.{name}"
        if isinstance(mod, (qlinear.QLinear, qlinear.QEmbedding)):
            out[f"{hf}.weight"] = mod.weight.to(torch.bfloat16).contiguous()
            if getattr(mod, "bias", None) is not None:
                out[f"{hf}.bias"] = mod.bias.detach().to(torch.bfloat16)
        elif not list(mod.children()):
            out.update({f"{hf}.{k}": v.detach() for k, v in mod.named_parameters(recurse=False)})
    if m.lm_head.weight is m.embed_tokens.weight:
        out.pop("lm_head.weight", None)
    return out


def quantize_folder(src: Path, out: Path, mode: str, groupsize: int | None) -> dict:
    """Write out/ from src/; -> a summary (bytes before and after, linears per scheme, seconds)."""
    cfg = json.loads((src / "config.json").read_text())
    source = quant.read_record(cfg)
    args = ModelArgs.from_hf_config(cfg)
    bits = 8 if mode == "int8" else 4
    if groupsize is not None and groupsize <= 0:
        raise UsageError(f"--groupsize must be positive, got {groupsize}")
    t0 = time.perf_counter()
    sd = load_state_dict(safetensor_files(src), torch.bfloat16, "cpu") if source is None else widened(src)
    names, before = linear_names(args), sum(t.numel() * t.element_size() for t in sd.values())
    if "lm_head" in names and "lm_head.weight" not in sd:  # tied: the LM head is the embedding's matrix
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    out_sd, counts = {}, {}
    for key, t in sd.items():
        base = key.removesuffix(".weight")
        if base not in names:
            out_sd[key] = t.contiguous()
            continue
        K = t.shape[1]
        if base == "lm_head":
            s = quant.Scheme(8, K)
        else:
            s = quant.Scheme(bits, groupsize or (K if bits == 8 else 32))
        try:
            s.check(base, K)
        except quant.QuantError as e:
            raise UsageError(str(e)) from None
        out_sd.update(quant.quantize(t, s).tensors(base))
        label = f"int{s.bits} group {'row' if s.group == K else s.group}"
        counts[label] = counts.get(label, 0) + 1
    after = sum(t.numel() * t.element_size() for t in out_sd.values())
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation config, chat template: as they are
        if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors" \
                and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    save_file(out_sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; others may read it
    cfg[quant.CONFIG_KEY] = quant.config_record(mode, bits, groupsize or (0 if bits == 8 else 32),
                                                {"bits": 8, "group_size": 0})
    if source is not None:
        cfg[quant.CONFIG_KEY]["requantized_from"] = source.get("mode")
    cfg["tie_word_embeddings"] = False  # the LM head has its own (quantized) matrix
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dict(bytes_before=before, bytes_after=after, linears=counts, seconds=time.perf_counter() - t0)


def run(a) -> int:
    src = resolve_checkpoint(a.checkpoint)
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty folder")
    r = quantize_folder(src, out, a.mode, a.groupsize)
    print(f"wrote {out}: {a.mode}, " + ", ".join(f"{n} {k}" for k, n in r["linears"].items())
          + f"; weights {r['bytes_before'] / 2**20:.1f} -> {r['bytes_after'] / 2**20:.1f} MiB in {r['seconds']:.1f} s",
          file=sys.stderr)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return run(a)
    except (UsageError, ModelError, CheckpointError, quant.QuantError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
