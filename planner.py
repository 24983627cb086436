"""A request's plan (Planner): its KV slots, the rows of its decode and verify passes, and whether it runs in exact
mode, where passes are padded to sizes exact.Invariance found row-invariant on this machine (CPU only)."""
from typing import NamedTuple

from cpu_gemm import machine_id
from errors import UsageError
from exact import MAX_ROWS, Invariance, PassRows
from model import RECENT, Transformer


class Request(NamedTuple):
    """A request's plan, passed with its steps (nothing of it is kept on the engine or the planner)."""
    S: int  # KV slots
    rows: PassRows  # the rows of its passes of the planned size
    exact: bool  # passes padded to row-invariant sizes (pass_rows)


def cache_len(prompt_len: int, max_new: int, margin: int, limit: int) -> int:
    need = prompt_len + max_new + margin
    if need > limit:
        raise UsageError(f"prompt of {prompt_len} tokens + {max_new} new tokens exceeds the model's context of "
                         f"{limit} tokens")
    return min(limit, (need + 63) // 64 * 64)  # round up so nearby lengths share compiled graphs


class Planner:
    """A request's KV slots, pass rows and exact mode (CPU only). requested: None where the check passes, True
    insists, False off. fixed: one cache size for every request (CUDA graphs), or None."""

    def __init__(self, model: Transformer, requested: bool | None, fixed: int | None, drafter=None):
        self.model, self.requested, self.fixed = model, requested, fixed
        cuda = model.norm.weight.device.type == "cuda"  # (a quantized head's .weight widens it)
        if requested and cuda:
            raise UsageError("--exact is CPU-only (CUDA kernels are not batch invariant)")
        # exact tree verification gathers each node's last RECENT keys: trees must be shallower (chains need not)
        too_deep = drafter is not None and drafter.depth >= RECENT and drafter.nodes > drafter.depth + 1
        if requested and too_deep:
            raise UsageError(f"--tree-depth must be below {RECENT} (exact tree verification), got {drafter.depth}")
        self.invariance = None if requested is False or cuda or too_deep else Invariance(model)

    def plan(self, T: int, max_new: int, n: int) -> Request:
        """The request's plan for passes of n rows (exact mode: decided per request, the attention check depends
        on the KV length)."""
        # exact mode sizes the cache without the drafter's margin: every run attends over the same KV length
        limit = self.model.args.max_position_embeddings
        S, R = cache_len(T, max_new, n + 1, limit), PassRows(n, n)  # raises where the plain request does not fit
        if self.fixed is not None:
            if T + max_new + n + 1 > self.fixed:
                raise UsageError(f"prompt of {T} tokens + {max_new} new tokens exceeds --max-seq {self.fixed}")
            S = self.fixed
        exact, Re = False, None
        if self.invariance is not None and n <= MAX_ROWS:
            Se = self.fixed or min(limit, -(-(T + max_new + MAX_ROWS) // 128) * 128)
            Re = self.invariance.pass_rows(n, Se)
            if Re is not None and T + max_new + Re.attn + 1 <= Se:
                exact, S, R = True, Se, Re._replace(recent=self.model.cpu_pass is None)
        if self.requested and not exact:
            why = (f"a pass of {n} tokens is more than exact mode's {MAX_ROWS} rows" if n > MAX_ROWS else
                   f"no target pass of {n} to {MAX_ROWS} rows gives every row the same bits on this CPU "
                   f"({machine_id()})"
                   if Re is None else "the padded passes do not fit the model's context")
            raise UsageError(f"--exact: {why}; use --no-exact")
        return Request(S, R, exact)

    def pass_rows(self, req: Request, n: int) -> PassRows:
        """The rows of req's pass of n tokens. Exact mode needs exact_attention's recent-key tables in the PyTorch
        layers (recent), not in the fused CPU pass."""
        if not req.exact:
            return PassRows(n, n)
        R = self.invariance.pass_rows(n, req.S)
        if R is None:
            raise UsageError(f"--exact: no target pass of {n} rows is row-invariant on this CPU; use --no-exact")
        return R._replace(recent=self.model.cpu_pass is None)
