"""What the speculative budget keeps past a request: each source's state (per engine, and across processes
where the caller asks) and the machine's target-pass costs."""
import os

import cpu_forward
import cpu_gemm
from budget import SIZES, Budget
from model import Plan, Transformer


def pass_key(model: Transformer, plan: Plan | None = None) -> str:
    return (f"{cpu_gemm.machine_id()} {cpu_forward.shape_key(model.args)} {model.norm.weight.dtype} "
            f"{'fused pass' if model.cpu_pass is not None else 'layers'} {'kernel' if cpu_gemm.enabled() else 'torch'}"
            + (f", layers from {plan.layers_from} rows" if plan and plan.layers_from else ""))


def pass_costs(model: Transformer, nodes: int, extra=(), plan: Plan | None = None) -> dict[int, float] | None:
    """Seconds of the target's pass per budget size on this CPU, as the engine's plan runs it (measured once,
    cached in pass_cost.json); None on other devices (budget.py interpolates)."""
    if model.norm.weight.device.type != "cpu":
        return None
    sizes = sorted(set([s for s in SIZES if s < nodes] + [nodes] + list(extra)))
    key = pass_key(model, plan)
    f = cpu_gemm.cache_dir() / "pass_cost.json"
    costs = cpu_gemm.read_json(f).get(key, {})
    missing = [s for s in sizes if str(s) not in costs]
    if missing:
        new, quiet = cpu_gemm.measured_quietly(lambda: cpu_forward.pass_seconds(model, missing, plan=plan))
        costs.update({str(r): t for r, t in new.items()})
        if quiet:  # (a busy machine's timings serve this request only)
            cpu_gemm.merge_json(f, key, costs)
    return {s: costs[str(s)] for s in sizes}


class BudgetMemory:
    """Each budget source's state after the last request that used it, and the drafter's start_rate. With a key
    (the caller's drafter and sampling settings) it outlives the process in budget.json, keyed also by machine,
    model, pass and device; NANOSPEC_BUDGET_CACHE=off keeps it in the process."""

    LENGTH_DECAY = 0.8  # the expected length follows the last few requests

    def __init__(self, model: Transformer, drafter, key: str | None, plan: Plan | None = None):
        self.drafter, self.sources, self.where = drafter, {}, None
        self.length = 0.0  # new tokens the engine's requests ran to (decayed mean; 0: none yet)
        if key is not None and os.environ.get("NANOSPEC_BUDGET_CACHE", "on") != "off":
            self.where = (cpu_gemm.cache_dir() / "budget.json",
                          f"{pass_key(model, plan)} {model.norm.weight.device.type} {key}")
        self.load()

    def load(self):  # a missing, stale or unreadable entry leaves the memory empty
        if self.where is None:
            return
        d = cpu_gemm.read_json(self.where[0]).get(self.where[1])
        try:
            rate, length = float(d.get("start_rate", 0.0)), float(d.get("length", 0.0))
            self.sources = {k: Budget.from_state(v) for k, v in d["sources"].items()}
        except (TypeError, KeyError, AttributeError, ValueError):
            return
        self.drafter.start_rate, self.length = rate, max(length, 0.0)

    def ran(self, tokens: int):
        """A request emitted `tokens` new tokens."""
        self.length = tokens if not self.length else self.LENGTH_DECAY * self.length + (1 - self.LENGTH_DECAY) * tokens

    def save(self):
        if self.where is not None:
            cpu_gemm.merge_json(*self.where, dict(sources={k: b.state() for k, b in self.sources.items()},
                                                  start_rate=self.drafter.start_rate, length=self.length))

