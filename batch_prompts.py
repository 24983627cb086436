"""A file of prompts decoded in batches (generate.py --prompts FILE --batch N): its lines read and checked, each
prompt's tokens through the batch engine, one JSON line per prompt as it finishes, a summary at the end."""
import json
import sys
import time
from pathlib import Path

from batch import BatchEngine
from draft_config import make_drafters
from errors import UsageError
from model import Transformer
from sampling import Sampling


def read_prompts(path: str) -> list[dict]:
    """One prompt a line: a JSON object {"prompt", optional "max_new_tokens", "temperature", "seed"} or plain text
    -> [{"prompt", ...}]; a bad line is a UsageError naming it."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UsageError(f"cannot read --prompts {path}: {e.strerror}") from None
    out, kinds = [], {"max_new_tokens": int, "temperature": (int, float), "seed": int}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            out.append({"prompt": line})
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {n} is not valid JSON ({e.msg})") from None
        if not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise UsageError(f"{path} line {n} has no \"prompt\" string")
        for k, t in kinds.items():
            if k in obj and (not isinstance(obj[k], t) or isinstance(obj[k], bool)):
                raise UsageError(f"{path} line {n}: \"{k}\" must be a number" + (" (an integer)" if t is int else ""))
        out.append(obj)
    if not out:
        raise UsageError(f"--prompts {path} holds no prompt")
    return out


def run_prompts(model: Transformer, tok, path: str, sampling: Sampling, draft=None, *, batch: int = 8,
                max_new_tokens: int = 256, raw: bool = False, budget: bool = True, exact: bool | None = None,
                cuda_graphs: bool = False, seed: int = 0, ordered: bool = False, as_json: bool = False) -> int:
    """generate.py --prompts FILE --batch N: one JSON line per prompt of the file at path as it finishes (ordered: in
    input order), then a summary on stderr (as_json: also as the last stdout line). draft: a DraftConfig (None: no
    drafting); raw: the prompts without the chat template; budget: the fitted budget (else whole trees); exact:
    None or True, the batch invariant arithmetic (False: plain); seed: prompt i's is seed + i unless its line
    gives one. A prompt too long for the model gets a line with "error" and the others run."""
    if exact and model.cpu_pass is None:
        raise UsageError("--exact batches need the fused CPU pass (bf16 on a CPU with AVX2): without it a "
                         "sequence's output can differ from its batch-1 output at near ties")
    sampling.validate(model.args.vocab_size)
    items = read_prompts(path)
    chat = not raw and tok.chat_template is not None
    ids = [tok.encode_chat([{"role": "user", "content": it["prompt"]}]) if chat else tok.encode(it["prompt"])
           for it in items]
    news = [it.get("max_new_tokens", max_new_tokens) for it in items]
    if bad := [i for i, n in enumerate(news) if n < 1]:
        raise UsageError(f"prompt {bad[0]}: max_new_tokens must be >= 1, got {news[bad[0]]}")
    drafters = make_drafters(draft, model, batch, sampling, tok) if draft is not None else []
    spare, limit = (drafters[0].nodes if drafters else 0), model.args.max_position_embeddings
    errors = {i: f"{len(p)} prompt tokens + {n} new" + (f" + {spare} draft nodes" if spare else "")
              + f" exceed the model's {limit} positions" for i, (p, n) in enumerate(zip(ids, news))
              if len(p) + n + spare > limit}
    ok = [i for i in range(len(items)) if i not in errors]
    S = -(-max([len(ids[i]) + news[i] + spare for i in ok] or [1]) // 16) * 16  # every range fits the longest
    eng = BatchEngine(model, batch, min(S, limit), sampling, drafters=drafters, budget=budget,
                      exact=exact is not False, cuda_graphs=cuda_graphs)
    for i in ok:
        it = items[i]
        s = Sampling(float(it["temperature"]), sampling.top_k, sampling.top_p) if "temperature" in it else sampling
        eng.submit(ids[i], news[i], s, it.get("seed", seed + i), index=i)
    t0, total, next_out = time.perf_counter(), 0, 0
    pending = {i: dict(index=i, error=e) for i, e in errors.items()}
    while True:
        for i in sorted(pending) if not ordered else []:
            print(json.dumps(pending.pop(i)), flush=True)
        while ordered and next_out in pending:
            print(json.dumps(pending.pop(next_out)), flush=True)
            next_out += 1
        if not eng.busy():
            break
        for s in eng.step():
            total += len(s.out)
            pending[s.index] = dict(index=s.index, text=tok.decode([t for t in s.out if t not in eng.eos]),
                                    new_tokens=len(s.out), mean_accepted_length=round(
                                        sum(s.accepted) / max(len(s.accepted), 1), 3),
                                    seconds=round(s.t_done - s.t_submit, 4))
    dt = time.perf_counter() - t0
    dec = eng.steps["decode"]
    share = (eng.budget.stats() if drafters and not eng.budget.fixed else
             dict(speculated_share=1.0 if drafters else 0.0, speculated_share_by_batch={}))
    summary = dict(prompts=len(items), batch=batch, new_tokens=total, tokens_per_s=round(total / dt, 2),
                   decode_tokens_per_s=round(eng.decode_tokens / max(eng.decode_s, 1e-9), 2), decode_steps=dec,
                   prefill_steps=eng.steps["prefill"], occupancy=round(eng.rows / max(dec * batch, 1), 3),
                   errors=len(errors), **share)
    print(f"[{len(items)} prompts, batch {batch}: {total} new tokens, {summary['tokens_per_s']:.2f} tok/s, "
          f"occupancy {summary['occupancy']:.0%}, speculated on {summary['speculated_share']:.0%} of sequence-steps"
          + (f", {len(errors)} prompts too long" if errors else "") + "]", file=sys.stderr)
    if as_json:
        print(json.dumps(summary))
    return 0
