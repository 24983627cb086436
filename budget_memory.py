"""What the speculative budget keeps past a request: each source's state (per engine, and across processes
where the caller asks) and the machine's target-pass costs."""
import os

import cpu_forward
import cpu_gemm
from budget import SIZES, Budget
from model import Transformer


def pass_key(model: Transformer) -> str:
    """The machine, the model's shapes and dtype, and how its passes run: what a pass's cost depends on."""
    return (f"{cpu_gemm.machine_id()} {cpu_forward.shape_key(model.args)} {model.lm_head.weight.dtype} "
            f"{'fused pass' if model.cpu_pass is not None else 'layers'} {'kernel' if cpu_gemm.enabled() else 'torch'}")


def pass_costs(model: Transformer, nodes: int, extra=()) -> dict[int, float] | None:
    """Seconds of the target's pass at each budget size up to nodes and the extra sizes, on this machine
    (CPU; measured once and cached per machine, model and pass kind in cache_dir()/pass_cost.json; a second
    or so): budget.py's estimate for the sizes a request has not timed. None on other devices (budget.py
    interpolates)."""
    if model.lm_head.weight.device.type != "cpu":
        return None
    sizes = sorted(set([s for s in SIZES if s < nodes] + [nodes] + list(extra)))
    key = pass_key(model)
    f = cpu_gemm.cache_dir() / "pass_cost.json"
    costs = cpu_gemm.read_json(f).get(key, {})
    missing = [s for s in sizes if str(s) not in costs]
    if missing:
        costs.update({str(r): t for r, t in cpu_forward.pass_seconds(model, missing).items()})
        cpu_gemm.merge_json(f, key, costs)
    return {s: costs[str(s)] for s in sizes}


class BudgetMemory:
    """Each budget source's state at the end of the last request that used it (budget.Budgets starts a source
    from it), and the drafter's set-up price (its start_rate). With a key (the caller's: its drafter's and
    sampling's settings, whose acceptance differs) it outlives the process in cache_dir()/budget.json, keyed
    also by the machine, the model and its pass, and the device: one CLI answer starts from what earlier
    answers measured (acceptance per node rank, step times, the hybrid head's start price) instead of timing
    the whole tree and autoregressive decoding and starting the head to learn them again.
    NANOSPEC_BUDGET_CACHE=off keeps it in the process."""

    def __init__(self, model: Transformer, drafter, key: str | None):
        self.drafter, self.sources = drafter, {}
        self.where = None
        if key is not None and os.environ.get("NANOSPEC_BUDGET_CACHE", "on") != "off":
            self.where = (cpu_gemm.cache_dir() / "budget.json",
                          f"{pass_key(model)} {model.lm_head.weight.device.type} {key}")
        self.load()

    def load(self):
        """A missing, stale or unreadable entry leaves the memory empty."""
        if self.where is None:
            return
        d = cpu_gemm.read_json(self.where[0]).get(self.where[1])
        try:
            self.sources = {k: Budget.from_state(v) for k, v in d["sources"].items()}
            rate = float(d.get("start_rate", 0.0))
        except (TypeError, KeyError, AttributeError, ValueError):
            self.sources = {}
            return
        self.drafter.start_rate = rate

    def save(self):
        if self.where is not None:
            cpu_gemm.merge_json(*self.where, dict(sources={k: b.state() for k, b in self.sources.items()},
                                                  start_rate=self.drafter.start_rate))

