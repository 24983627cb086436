"""A request's statistics (Stats): its prefill and decode times, acceptance and the speculative phases' wall time."""
from dataclasses import dataclass, field

import torch


@dataclass
class Stats:
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    target_forwards: int = 0
    accept_hist: dict = field(default_factory=dict)  # accepted tokens per target forward -> count
    phase_s: dict = field(default_factory=dict)  # speculative phases (draft, lm_head, verify, ...)
    extra: dict = field(default_factory=dict)

    @property
    def total_s(self):
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        d = dict(new_tokens=self.new_tokens, prefill_s=round(self.prefill_s, 4), decode_s=round(self.decode_s, 4),
                 tokens_per_s=round(self.new_tokens / max(self.total_s, 1e-9), 2),
                 decode_tokens_per_s=round(self.new_tokens / max(self.decode_s, 1e-9), 2),
                 target_forwards=self.target_forwards)
        if self.accept_hist:
            d["mean_accepted_length"] = round(self.mean_accepted_length, 3)
            d["accept_hist"] = {str(k): v for k, v in sorted(self.accept_hist.items())}
        if self.phase_s:
            d["phase_s"] = {k: round(v, 4) for k, v in self.phase_s.items()}
        d.update(self.extra)
        return d

    @property
    def mean_accepted_length(self):
        n = sum(self.accept_hist.values())
        return sum(k * v for k, v in self.accept_hist.items()) / max(n, 1)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


PHASES = ("draft", "lm_head", "verify", "sync", "update")
