"""A request's state in the engine (Seq), a step without a draft as its drafter reads it later (HeldRow), and what
a step's host reads of its verification (accepted_tokens, node_sources)."""
from dataclasses import dataclass, field

import torch

from draft import Accepted, Behind, chain_tree
from sampling import Sampling


@dataclass
class Seq:
    index: int
    prompt: list[int]
    max_new: int
    sampling: Sampling
    gen: torch.Generator | None  # its own random stream (sampled sequences)
    out: list[int] = field(default_factory=list)
    slot: int = -1  # its range's first KV slot
    cached: int = 0  # its prompt's first rows, copied from the batch's PrefixCache rather than prefilled
    t_submit: float = 0.0
    t_done: float = 0.0
    # speculative batches: its drafter, tokens in its range, the steps its drafter has not seen, budget state
    drafter: object = None
    n: int = 0
    behind: Behind | None = None  # the steps its drafter has not read (HeldRow runs, kept tree steps)
    budgets: dict = field(default_factory=dict)  # source -> budget.Budget (budget_batch.py)
    key: str = ""
    policy: object = None  # budget_policy.Policy where its drafter offers several sources; its choice, its step's share
    chosen: str | None = None
    step_s: float = 0.0
    alone: object = None  # budget.Budgets: its budget while it runs alone (budget_batch.BatchBudget.admit)
    paid: float = 0.0  # one-time set-up seconds its drafter paid in the step
    req: object = None  # planner.Request: its passes' rows, where runner.Runner steps it (engine.Engine)
    accepted: list = field(default_factory=list)  # tokens each step emitted (before its stop)
    budget_stats: dict = field(default_factory=dict)  # its lone budget's statistics, once finished
    # streaming: the latest step's tokens, who proposed each (TARGET: the target's own; else its drafter's
    # source, as accepted_from counts them), and the steps that verified a tree of its drafter's
    new: list = field(default_factory=list)
    new_from: list = field(default_factory=list)
    drafted: int = 0


@dataclass
class HeldRow:
    """A step without a draft, as its drafter will read it: row r of a pass's (hidden, aux, top-k) it shares with
    the step's other rows, the token it fed, the token it chose, and the tokens in the cache before it."""
    step: tuple
    r: int
    token: int
    bonus: int
    n: int

    @staticmethod
    def chain(run: list["HeldRow"]) -> Accepted:
        """Consecutive rows as one accepted chain (draft.Behind.take)."""
        hid, aux, _ = run[0].step
        dev, K = hid.device, len(run)
        cat = lambda j: torch.cat([x.step[j][:, x.r:x.r + 1] for x in run], 1)
        return Accepted(chain_tree(torch.tensor([x.token for x in run], device=dev)), torch.arange(K, device=dev),
                        torch.tensor(K, device=dev), torch.tensor(run[-1].bonus, device=dev), hid.new_zeros(0, 0),
                        cat(0), None if aux is None else cat(1), torch.tensor(run[0].n, device=dev),
                        torch.cat([x.step[2][x.r:x.r + 1] for x in run]))


TARGET = "target"  # a token the target chose itself (a step's bonus, an autoregressive step's token)


def accepted_tokens(host: list[int]) -> tuple[int, list[int], list[int]]:
    """[L, bonus, path tokens (root first)..., path node indices...] -> (L, emitted tokens, accepted nodes)."""
    L, P = host[0], (len(host) - 2) // 2
    return L, host[3:2 + L] + [host[1]], host[2 + P:2 + P + L]


def node_sources(d, key: str, N: int) -> list[str]:
    """Who proposed each of the N nodes of d's latest tree: the hybrid records it per node (what its accepted_from
    counts); a lone drafter is its budget source (key: "eagle", "ngram3" -> "ngram")."""
    return getattr(d, "source", None) or [key.rstrip("0123456789") or "draft"] * N
