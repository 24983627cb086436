"""The speculative budget: how many of the drafted tree's nodes to verify this step, or none at all.

Each step picks, from a fixed set of sizes (static shapes), the one with the best measured tokens per second:
E[tokens | b] = 1 + sum_{i<b} p_i over the running acceptance rate p_i of node rank i (drafts list nodes best
first, parents first), over the size's running step time. Probes re-measure the other sizes (at most
`probe_share` of the time while autoregressive decoding wins). Where a drafter offers several sources for a step
(the hybrid: prompt lookup's chain and the tree drafter's tree), budget_policy.Policy picks the one that has paid
best on this request, exploring each a bounded number of steps; a one-time set-up (the hybrid's late head) is paid
where the tokens left are expected to repay it (pays_back).
"""
from budget_policy import Policy, pays_back

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class Budget:
    def __init__(self, nodes: int, decay: float = 0.8, probe: int = 8, max_gap: int = 64, probe_share: float = 0.05,
                 settle: int = 2, pass_s: dict | None = None, spent: dict | None = None,
                 sizes: list[int] | None = None, start: int | None = None):
        # sizes: default SIZES below nodes, and nodes (the whole tree); start: the speculative size tried first
        self.sizes = sorted(set(sizes)) if sizes else [s for s in SIZES if s < nodes] + [nodes]
        assert self.sizes[0] == 1, "autoregressive decoding (size 1) is always a choice"
        nodes = self.nodes = self.sizes[-1]
        self.start = start if start in self.sizes else nodes
        self.pass_s = pass_s  # {size: seconds} of the target's pass here (budget_memory.pass_costs), or None
        self.settle = settle  # steps of a size before its time counts (the first ones may pay one-time set-up)
        # seconds of probes and of every step; Budgets shares one dict so the cap holds for the request
        self.spent = {"probe": 0.0, "total": 0.0} if spent is None else spent
        self.decay, self.probe, self.max_gap, self.probe_share = decay, probe, max_gap, probe_share
        self.probing = False
        self.hits, self.trials = [0.0] * nodes, [0.0] * nodes  # decayed counts per node rank (rank 0: the root)
        self.time, self.timed = {}, {}  # size -> running mean step seconds, steps timed
        self.steps = self.last_probe = self.probes = 0
        self.gap = probe  # steps between probes; doubles while autoregressive decoding keeps winning
        self.chosen = {}  # size -> steps (the request's budget histogram)

    def p(self, i: int) -> float:
        # prior 1/2 worth a twentieth of a step: summed over many deep nodes, a stronger prior adds phantom tokens
        return (self.hits[i] + 0.025) / (self.trials[i] + 0.05)

    def tokens(self, b: int) -> float:
        # an untried rank counts as likely as the deepest tried one before it (a flat 1/2 overrated big trees)
        total, last = 1.0, None
        for i in range(1, b):
            if self.trials[i] > 0 or last is None:
                last = self.p(i)
            total += last
        return total

    def seconds(self, b: int) -> float:
        # unsettled: the nearest smaller settled size's plus the passes' difference (CPU: not linear), or interpolated
        known = [s for s in self.sizes if self.timed.get(s, 0) >= self.settle]
        if b in known:
            return self.time[b]
        if not known:  # early in a request: what there is
            return self.time.get(b, sum(self.time.values()) / len(self.time))
        lo = max((s for s in known if s < b), default=None)
        hi = min((s for s in known if s > b), default=None)
        if self.pass_s and lo is not None and b in self.pass_s and lo in self.pass_s:
            return self.time[lo] + max(self.pass_s[b] - self.pass_s[lo], 0.0) + (self.overhead() if lo == 1 else 0.0)
        if lo is None or hi is None:
            return self.time[lo if hi is None else hi]
        return self.time[lo] + (self.time[hi] - self.time[lo]) * (b - lo) / (hi - lo)

    def overhead(self) -> float:
        """Drafting seconds a speculative step pays beyond an autoregressive one and the passes' difference."""
        if not self.pass_s or self.timed.get(1, 0) < self.settle or 1 not in self.pass_s:
            return 0.0
        ov = [self.time[s] - self.time[1] - max(self.pass_s[s] - self.pass_s[1], 0.0) for s in self.sizes
              if s > 1 and s in self.pass_s and self.timed.get(s, 0) >= self.settle]
        return max(0.0, min(ov)) if ov else 0.0

    def rate(self, b: int) -> float:
        return self.tokens(b) / self.seconds(b)

    def hoped(self, b: int, evidence: float) -> float:
        """rate(b), but where the first rank has under `evidence` decayed trials, at the untried prior (1/2 a rank):
        what a one-time set-up is weighed by. One unlucky step (a draft model's 7-chain on an 8-token warm-up, one
        node accepted) had priced its drafts below decoding for every later request."""
        if self.trials[1] >= evidence:
            return self.rate(b)
        return (1.0 + 0.5 * (b - 1)) / self.seconds(b)

    def pick(self) -> int:
        ends = [s for s in (self.start, 1) if self.timed.get(s, 0) < self.settle]
        if ends:
            b = ends[0]  # the whole tree (or start), then autoregressive decoding, settle times each
        else:
            b = best = max(self.sizes, key=self.rate)
            if best > 1:
                self.gap = self.probe
            due = self.steps - self.last_probe >= self.gap and len(self.sizes) > 1
            if due and best == 1 and self.probe_s > self.probe_share * self.total_s:
                due = False  # hopeless text: probes stay under probe_share of the request's time
            if due:  # re-measure what the current choice does not
                self.last_probe, self.probes = self.steps, self.probes + 1
                if best > 1:  # speculating: alternately the next size up and an autoregressive step
                    b = 1 if self.probes % 2 == 0 else min([s for s in self.sizes if s > best], default=best)
                else:  # autoregressive: alternately the most promising speculative size and the next one up
                    # (the climb back one size at a time), less often each time
                    b = max(self.sizes[1:], key=self.rate)
                    if self.probes % 2 == 0:
                        b = min([s for s in self.sizes if s > b], default=b)
                    self.gap = min(2 * self.gap, self.max_gap)
        self.probing = not ends and b != best and best == 1
        self.chosen[b] = self.chosen.get(b, 0) + 1
        return b

    def instead(self, b: int, new: int):  # the step pick() chose b for takes size `new` (waiting for a set-up)
        self.chosen[b] -= 1
        if not self.chosen[b]:
            del self.chosen[b]
        self.chosen[new] = self.chosen.get(new, 0) + 1
        self.probing = False

    def trial_size(self, sizes: list[int] | None = None) -> int:
        """A trial's draft: the start while the size times are not known, else one size past the best speculative
        one (the whole draft cost a trial 2.2 decode steps on Zen 4 with chains of 11; a size up finds depth);
        sizes: those a trial may draft (default all)."""
        sizes = sizes or self.sizes
        if any(self.timed.get(s, 0) < self.settle for s in (self.start, 1)) or len(sizes) < 2:
            return self.start if self.start in sizes else sizes[-1]
        best = max(sizes[1:], key=self.rate)
        return min([s for s in sizes if s > best], default=best)

    def best_without(self, sizes: list[int]) -> int | None:
        alt = [s for s in self.sizes if s not in sizes]
        return max(alt, key=self.rate) if alt else None

    def observe(self, b: int, accepted: list[int], seconds: float):  # accepted: node indices, root first
        self.steps += 1
        self.spent["total"] += seconds
        if self.probing:
            self.spent["probe"] += seconds
        d, on = self.decay, set(accepted)
        for i in range(1, b):
            self.hits[i] = d * self.hits[i] + (i in on)
            self.trials[i] = d * self.trials[i] + 1.0
        self.time_step(b, seconds)

    @property
    def probe_s(self) -> float:
        return self.spent["probe"]

    @property
    def total_s(self) -> float:
        return self.spent["total"]

    def carry(self, old: "Budget", weight: float | None = None):
        """Start from an earlier request's or a sibling's acceptance and step times; weight: at most so many steps."""
        f = 1.0 if weight is None else weight / max(max(old.trials), weight)
        self.hits, self.trials = [h * f for h in old.hits], [t * f for t in old.trials]
        self.time, self.timed = dict(old.time), dict(old.timed)

    def state(self) -> dict:
        """What carry() reads, as JSON (budget_memory.BudgetMemory)."""
        return dict(sizes=self.sizes, hits=self.hits, trials=self.trials,
                    time={str(k): v for k, v in self.time.items()}, timed={str(k): v for k, v in self.timed.items()})

    @classmethod
    def from_state(cls, d: dict) -> "Budget":
        """A Budget holding state()'s values, for carry(); ValueError where d is not one."""
        try:
            sizes = [int(x) for x in d["sizes"]]
            b = cls(sizes[-1], sizes=sizes)
            b.hits, b.trials = [float(x) for x in d["hits"]], [float(x) for x in d["trials"]]
            b.time = {int(k): float(v) for k, v in d["time"].items()}
            b.timed = {int(k): int(v) for k, v in d["timed"].items()}
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, AssertionError) as e:
            raise ValueError(f"not a budget state: {e}") from None
        if len(b.hits) != b.nodes or len(b.trials) != b.nodes or not set(b.time) <= set(sizes):
            raise ValueError("not a budget state: sizes and counts disagree")
        return b

    def time_step(self, b: int, seconds: float):
        """Only the step time of size b (no acceptance)."""
        n = self.timed.get(b, 0)
        self.timed[b] = n + 1
        self.time[b] = seconds if n < self.settle else self.decay * self.time[b] + (1 - self.decay) * seconds

    def stats(self) -> dict:
        """The budget histogram, speculated share and cost curve (per size: step ms, expected tokens)."""
        spec = sum(v for s, v in self.chosen.items() if s > 1)
        d = dict(budget_hist={str(k): v for k, v in sorted(self.chosen.items())},
                 speculated_share=round(spec / max(sum(self.chosen.values()), 1), 4))
        if self.time:
            d["budget_curve"] = {str(b): [round(self.seconds(b) * 1000, 2), round(self.tokens(b), 3)]
                                 for b in self.sizes}
        return d


class Budgets:
    """One Budget per source of drafts (the drafter's budget_keys), each with its own sizes_of(key), start_of(key),
    and the Policy that picks the source where the drafter offers several."""

    START_EVIDENCE = 2.0  # decayed steps of a source's first rank past which its set-up is weighed on them

    def __init__(self, nodes: int, sizes_of=None, start_of=None, memory: dict | None = None, setup_of=None,
                 policy: "Policy | None" = None, needs_of=None, **kw):
        self.nodes, self.kw, self.of, self.key, self.chosen = nodes, kw, {}, None, None  # chosen: the policy's
        self.sizes_of, self.start_of = sizes_of, start_of
        self.setup_of = setup_of  # setup_of(key, b): seconds a draft of b nodes pays once first (0: none)
        # needs_of(key, b): whether it needs one, priced or not yet (default: a price above 0)
        self.needs_of = needs_of or (lambda key, b: setup_of is not None and setup_of(key, b) > 0)
        self.policy = policy or Policy()
        self.policy.estimate = self.estimate
        self.spent = {"probe": 0.0, "total": 0.0}  # one probe cap for the request (Budget.probe_share)
        self.emitted = self.steps = 0  # tokens of the steps observed, steps observed
        self.served = {}  # source -> tokens of its steps that needed no set-up
        self.memory = memory  # {source: Budget} of the engine's earlier requests (keep() adds this one's)

    @property
    def settle(self) -> int:
        return self.kw.get("settle", 2)

    def budget(self, key) -> Budget:
        """Source key's Budget: the engine's last one, else a speculating sibling's weighed as one step, else new."""
        if key in self.of:
            return self.of[key]
        new = self.of[key] = Budget(self.nodes, spent=self.spent, sizes=self.sizes_of(key) if self.sizes_of else None,
                                    start=self.start_of(key) if self.start_of else None, **self.kw)
        old = (self.memory or {}).get(key)
        if old is not None and old.sizes == new.sizes:
            new.carry(old)
            self.policy.known(key)
        else:
            sibs = [x for x in self.of.values() if x is not new and x.sizes == new.sizes and x.steps
                    and x.timed.get(1, 0) and max(x.sizes, key=x.rate) > 1]
            if sibs:
                new.carry(max(sibs, key=lambda x: x.steps), weight=1.0)
        # an autoregressive step is the same whatever the source: take the time the others measured
        ar = max(self.of.values(), key=lambda x: x.timed.get(1, 0))
        if ar is not new and ar.timed.get(1, 0):
            new.time[1], new.timed[1] = ar.time[1], max(ar.timed[1], new.timed.get(1, 0))
        return new

    def free(self, key, bud: Budget) -> list[int]:
        """Source key's sizes that need no set-up (size 1 always): a trial's, even before a set-up is priced."""
        return [s for s in bud.sizes if s == 1 or not self.needs_of(key, s)]

    def estimate(self, key) -> float:
        """Source key's best estimated rate over its speculative sizes that need no set-up (0: none, or unknown)."""
        bud = self.of.get(key)
        if bud is None or not bud.time:
            return 0.0
        return max((bud.rate(s) for s in self.free(key, bud)[1:]), default=0.0)

    def ar_rate(self) -> float:
        t = [x.time[1] for x in self.of.values() if x.timed.get(1, 0)]
        return 1.0 / t[0] if t and t[0] > 0 else 0.0

    def pick(self, keys, left: float = float("inf")) -> int:
        """The next step's size; keys: its source, or the sources the drafter offers (the policy's choice is then
        self.key); left: tokens the request is expected to emit still."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        may_try = lambda k: self.may_try(k, keys, left)
        key = self.policy.only(keys[0]) if len(keys) == 1 else self.policy.choose(keys, self.ar_rate(), may_try)
        trial = self.policy.trying
        self.chosen, self.key = key, keys[0] if key is None else key
        bud = self.budget(self.key)
        b = bud.pick()
        new = 1 if key is None else self.trial_size(self.key) if trial else b  # neither; a trial: a size past the best
        if new != b:
            bud.instead(b, new)
            b = new
        need = [s for s in bud.sizes if s > 1 and self.setup_of(self.key, s) > 0] if self.setup_of else []
        if need and not trial and key is not None:  # a set-up the policy did not weigh: where it pays back
            # within the request against decoding, on the tokens the other sources leave (unserved); a source
            # that drafts nothing without it is weighed at its hoped rate while its evidence is thin
            ev = self.START_EVIDENCE
            alone = len(self.free(self.key, bud)) == 1 and bud.time  # no draft of its own without the set-up
            h = max(need, key=lambda s: bud.hoped(s, ev)) if alone else b
            if h in need:
                a = (bud.best_without(need) or 1) if bud.time else 1
                r = bud.hoped(h, ev)
                pays = bud.time and pays_back(self.setup_of(self.key, h), self.unserved(left, r, keys), r, bud.rate(a))
                new = h if pays else a
                if new != b:
                    bud.instead(b, new)
                    b = new
        return b

    def trial_size(self, key) -> int:
        """What a trial of source key drafts: past its best size, but among the sizes without a set-up where it has
        some (the hybrid's merged tree would start the head for a chain's trial: 0.15 s on a RAG prompt on Zen 4)."""
        bud = self.budget(key)
        free = self.free(key, bud)
        return bud.trial_size(free if len(free) > 1 else None)

    def may_try(self, key, keys: list, left: float) -> bool:
        """Whether the policy may try source key: its set-up (if any) pays back at its Budget's best estimate
        against the best of decoding and the other sources offered."""
        bud = self.budget(key)
        setup = self.setup_of(key, self.trial_size(key)) if self.setup_of is not None else 0.0
        if setup <= 0:
            return True
        best = max((bud.hoped(s, self.START_EVIDENCE) for s in bud.sizes[1:]), default=0.0) if bud.time else 0.0
        other = max([self.ar_rate()] + [self.policy.rate(k) for k in keys if k != key])
        return pays_back(setup, self.unserved(left, best, keys), best, other)

    def unserved(self, left: float, rate: float, offered=()) -> float:
        """Of `left` tokens, those a set-up drafting at `rate` gains on over decoding: the sources that need no
        set-up, other than those offered with it (weighed against it as they are), keep their share of the tokens
        so far (what they drafted, they keep drafting), each counted by how much of the gain its own rate leaves
        (none at `rate` or better, all at decoding's). A 3-gram chain's step emits ~8 tokens where a decoding step
        emits 1 (HumanEval on the Qwen pair): a share of steps had started the 0.5B 10 tokens before the end of
        HumanEval/2."""
        ar, kept = self.ar_rate(), 0.0
        for k, n in self.served.items():
            if k in offered:
                continue
            r = self.policy.rate(k)
            if r >= rate:
                kept += n
            elif ar > 0 and r > ar:
                kept += n * (1 / ar - 1 / r) / (1 / ar - 1 / rate)
        return left * (1 - kept / self.emitted) if self.emitted else left

    def keep(self):
        if self.memory is not None:
            self.memory.update(self.of)

    def observe(self, b: int, accepted: list[int], seconds: float):
        self.of[self.key].observe(b, accepted, seconds)
        self.emitted += len(accepted)
        self.steps += 1
        if b > 1 and not (self.setup_of is not None and self.setup_of(self.key, b) > 0):
            self.served[self.key] = self.served.get(self.key, 0) + len(accepted)
        self.policy.observe(self.chosen, len(accepted), seconds, b > 1)  # what the source handed the step delivered
        if b == 1:  # every source's autoregressive time follows it (see pick)
            for k, bud in self.of.items():
                if k != self.key:
                    bud.time_step(1, seconds)

    def stats(self) -> dict:
        """Budget.stats over every source: summed histogram, the busiest source's curve, each source's share."""
        hist = {}
        for bud in self.of.values():
            for s, v in bud.chosen.items():
                hist[s] = hist.get(s, 0) + v
        spec, total = sum(v for s, v in hist.items() if s > 1), max(sum(hist.values()), 1)
        d = dict(budget_hist={str(k): v for k, v in sorted(hist.items())}, speculated_share=round(spec / total, 4))
        if self.of:
            main = max(self.of.values(), key=lambda x: sum(x.chosen.values()))
            d.update({k: v for k, v in main.stats().items() if k == "budget_curve"})
        if len(self.of) > 1:
            d["budget_sources"] = {str(k): dict(share=round(sum(x.chosen.values()) / total, 4), **x.stats())
                                   for k, x in self.of.items()}
        return d

