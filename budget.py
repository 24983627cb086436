"""The speculative budget: how many of the drafted tree's nodes to verify this step, or none at all.

Why: a step of b verified nodes pays when E[tokens it emits] / its time beats autoregressive decoding's one
token per decode step, and both depend on the machine (a 16-row target pass costs about 2x one row on an
AVX2 CPU with cpu_gemm, 1.0x on a GPU) and on the request (prompt lookup on a summary, or nothing on novel
text at temperature 1). So the engine measures both while it generates and picks the best of a small fixed
set of sizes (static shapes: one compiled step per size).

The model. Drafted trees list their nodes best first, parents before children (draft.py), so the first b
nodes are a tree of budget b, and a node is accepted when it and its ancestors match: E[tokens | b] = 1 +
sum_{i<b} p_i, p_i the running acceptance rate of node rank i (the bonus token is the 1). Each size's step
time (draft, verification, sync, the drafter's update) is a running average; size 1 is autoregressive
decoding. The whole tree and size 1 are timed first, `settle` times each (twice where a first step pays
one-time set-up: a compiled shape, a CUDA graph's capture; once for eager CPU steps); sizes between are
estimated until chosen (seconds()). Then every `probe`-th step re-measures what the current choice does
not: while speculating, the next size up or an autoregressive step; while decoding autoregressively, the
most promising speculative size or the one above it, which is the way back when the text turns
predictable. While autoregressive decoding keeps winning the probes thin out (up to max_gap steps apart) and
take at most `probe_share` (5%) of the request's time, so hopeless text loses at most that, by construction.

A draft that first pays a one-time set-up (the hybrid's lazy head, draft_hybrid.py) waits for it as in ski
rental: the best size without it until the steps held back would have saved as much as the set-up costs,
and the same saving over the rest of the request would repay it again. So a head that gains little never
starts in a short request (on Spec-Bench its start cost more than a whole 256-token answer's gain), and one
that gains much starts after a few steps (Budgets.start_probe: a probe may start it on thin evidence).
"""
from draft import Accepted, Drafter, chained

SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


class Budget:
    def __init__(self, nodes: int, decay: float = 0.8, probe: int = 8, max_gap: int = 64, probe_share: float = 0.05,
                 settle: int = 2, pass_s: dict | None = None, spent: dict | None = None,
                 sizes: list[int] | None = None, start: int | None = None):
        # sizes: the set to choose from (default: SIZES below nodes, and nodes); its largest is the whole tree;
        # start: the speculative size tried first (default: the whole tree)
        self.sizes = sorted(set(sizes)) if sizes else [s for s in SIZES if s < nodes] + [nodes]
        assert self.sizes[0] == 1, "autoregressive decoding (size 1) is always a choice"
        nodes = self.nodes = self.sizes[-1]
        self.start = start if start in self.sizes else nodes
        self.pass_s = pass_s  # {size: seconds} of the target's pass on this machine (budget_memory.pass_costs), or None
        self.settle = settle  # steps of a size before its time counts (the first ones may pay one-time set-up)
        self.probe_share = probe_share  # while decoding autoregressively: most of the time probes may take
        # seconds of those probes and of every step; Budgets passes one dict to all its sources, so the cap holds
        # for the request, not per source
        self.spent = {"probe": 0.0, "total": 0.0} if spent is None else spent
        self.probing = False
        self.decay, self.probe, self.max_gap = decay, probe, max_gap
        self.hits = [0.0] * nodes  # decayed counts per node rank (rank 0 = the root, always "accepted")
        self.trials = [0.0] * nodes
        self.time = {}  # size -> running mean step seconds
        self.timed = {}  # size -> steps timed
        self.steps = self.last_probe = self.probes = 0
        self.gap = probe  # steps between probes; doubles while autoregressive decoding keeps winning
        self.chosen = {}  # size -> steps (the request's budget histogram)

    def p(self, i: int) -> float:
        # prior 1/2 until seen, worth a twentieth of a step: summed over many rarely accepted deep nodes, a
        # stronger prior adds up to phantom tokens that make big trees look better than they are
        return (self.hits[i] + 0.025) / (self.trials[i] + 0.05)

    def tokens(self, b: int) -> float:
        """Expected tokens emitted by a step verifying the first b nodes. An untried rank counts as likely as
        the deepest tried rank before it (acceptance falls with rank), or the prior where none was: a flat 1/2
        promised the merged tree's 15 nodes past a chain 7.5 tokens (this rule: 1.08x faster decoding on 12
        short answers, the same tokens)."""
        total, last = 1.0, None
        for i in range(1, b):
            if self.trials[i] > 0 or last is None:
                last = self.p(i)
            total += last
        return total

    def seconds(self, b: int) -> float:
        """Step time of size b: its running mean once timed `settle` times. Else, with the machine's pass costs,
        the nearest smaller timed size's time plus the passes' difference (a CPU's cost is flat for a few rows,
        then grows: a straight line overrates the middle sizes), plus the drafting overhead above an
        autoregressive step; without them, interpolated linearly between the nearest timed sizes."""
        known = [s for s in self.sizes if self.timed.get(s, 0) >= self.settle]
        if b in known:
            return self.time[b]
        if not known:  # early in a request (or a caller that picks sizes off the set): what there is
            return self.time.get(b, sum(self.time.values()) / len(self.time))
        lo = max((s for s in known if s < b), default=None)
        hi = min((s for s in known if s > b), default=None)
        if self.pass_s and lo is not None and b in self.pass_s and lo in self.pass_s:
            # from an autoregressive step, the drafting it does not pay is added (overhead)
            return self.time[lo] + max(self.pass_s[b] - self.pass_s[lo], 0.0) + (self.overhead() if lo == 1 else 0.0)
        if lo is None or hi is None:
            return self.time[lo if hi is None else hi]
        return self.time[lo] + (self.time[hi] - self.time[lo]) * (b - lo) / (hi - lo)

    def overhead(self) -> float:
        """Seconds a speculative step took beyond an autoregressive step and the passes' difference (draft,
        bookkeeping, update): the least over its settled sizes, 0 where none is. Why: estimated from an
        autoregressive step alone an untimed size looked as cheap as its pass, and the hybrid's late head
        (~2 ms of drafting a step) started on a quarter of Spec-Bench's MT-bench requests and lost there
        (1.97x against prompt lookup's 2.20x)."""
        if not self.pass_s or self.timed.get(1, 0) < self.settle or 1 not in self.pass_s:
            return 0.0
        ov = [self.time[s] - self.time[1] - max(self.pass_s[s] - self.pass_s[1], 0.0) for s in self.sizes
              if s > 1 and s in self.pass_s and self.timed.get(s, 0) >= self.settle]
        return max(0.0, min(ov)) if ov else 0.0

    def rate(self, b: int) -> float:
        return self.tokens(b) / self.seconds(b)

    def pick(self) -> int:
        ends = [s for s in (self.start, 1) if self.timed.get(s, 0) < self.settle]
        if ends:
            b = ends[0]  # the whole tree (or start), then autoregressive decoding, settle times each
        else:
            b = best = max(self.sizes, key=self.rate)
            if best > 1:
                self.gap = self.probe
            due = self.steps - self.last_probe >= self.gap and len(self.sizes) > 1  # (sizes [1]: nothing to draft)
            if due and best == 1 and self.probe_s > self.probe_share * self.total_s:
                due = False  # hopeless text: probes stay under probe_share of the request's time
            if due:  # re-measure what the current choice does not
                self.last_probe, self.probes = self.steps, self.probes + 1
                if best > 1:  # speculating: alternately the next size up (deeper nodes' acceptance; a climb
                    # one size at a time reaches the whole tree where it pays, without paying for it on every
                    # probe) and an autoregressive step (its time drifts with the context)
                    up = min([s for s in self.sizes if s > best], default=best)
                    b = 1 if self.probes % 2 == 0 else up
                else:  # autoregressive: alternately the most promising speculative size (a cheap probe, often
                    # the prompt-lookup chain alone) and the next size up from it (the climb back, one size at a
                    # time: a whole-tree probe costs several decode steps, and at temperature 0.7 those were most
                    # of what the fallback lost); less often each time (a probe costs more than it emits while
                    # speculation keeps losing)
                    b = max(self.sizes[1:], key=self.rate)
                    if self.probes % 2 == 0:
                        b = min([s for s in self.sizes if s > b], default=b)
                    self.gap = min(2 * self.gap, self.max_gap)
        self.probing = not ends and b != best and best == 1
        self.chosen[b] = self.chosen.get(b, 0) + 1
        return b

    def instead(self, b: int, new: int):
        """The step pick() chose b for takes size `new` (Budgets' wait for a set-up)."""
        self.chosen[b] -= 1
        if not self.chosen[b]:
            del self.chosen[b]
        self.chosen[new] = self.chosen.get(new, 0) + 1
        self.probing = False

    def saving(self, sizes: list[int]) -> float:
        """Seconds the best of these sizes saves in one step against the best of the others (autoregressive
        decoding among them) emitting its tokens: what waiting for a set-up that only these sizes need costs a
        step. 0 where none is estimated to gain, or before an autoregressive step is timed."""
        if not self.timed.get(1, 0) or not sizes:
            return 0.0
        a = self.best_without(sizes)
        if a is None:
            return 0.0
        per_token = self.seconds(a) / self.tokens(a)
        return max(0.0, max(self.tokens(s) * per_token - self.seconds(s) for s in sizes))

    def best_without(self, sizes: list[int]) -> int | None:
        """The size of the best estimated rate among those not in sizes (None where every size is in them)."""
        alt = [s for s in self.sizes if s not in sizes]
        return max(alt, key=self.rate) if alt else None

    def observe(self, b: int, accepted: list[int], seconds: float):
        """A step verified the first b nodes, accepted these node indices (root first) and took seconds."""
        self.steps += 1
        self.spent["total"] += seconds
        if self.probing:
            self.spent["probe"] += seconds
        d = self.decay
        on = set(accepted)
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
        """Start from what the same source measured in an earlier request (Budgets' memory), or a sibling source
        with the same sizes in this one: acceptance per rank and step times, so the ends need not be timed
        again; the probes start afresh. weight: the acceptance counts as this many steps at most (a sibling's
        is a guess its own steps soon override)."""
        f = 1.0 if weight is None else weight / max(max(old.trials), weight)
        self.hits, self.trials = [h * f for h in old.hits], [t * f for t in old.trials]
        self.time, self.timed = dict(old.time), dict(old.timed)

    def state(self) -> dict:
        """What carry() reads, as JSON (budget_memory.BudgetMemory keeps it across processes)."""
        return dict(sizes=self.sizes, hits=self.hits, trials=self.trials, time={str(k): v for k, v in self.time.items()},
                    timed={str(k): v for k, v in self.timed.items()})

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
        """Only the step time of size b (no acceptance): what observe() keeps of a step's time."""
        d = self.decay
        n = self.timed.get(b, 0)
        self.timed[b] = n + 1
        self.time[b] = seconds if n < self.settle else d * self.time[b] + (1 - d) * seconds  # until settled: the latest

    def stats(self) -> dict:
        """The request's budget histogram and speculated share, and its cost curve: per size, the step time
        (ms; estimated where not timed `settle` times) and the expected tokens per step, at the request's end."""
        spec = sum(v for s, v in self.chosen.items() if s > 1)
        d = dict(budget_hist={str(k): v for k, v in sorted(self.chosen.items())},
                 speculated_share=round(spec / max(sum(self.chosen.values()), 1), 4))
        if self.time:
            d["budget_curve"] = {str(b): [round(self.seconds(b) * 1000, 2), round(self.tokens(b), 3)] for b in self.sizes}
        return d


class Budgets:
    """One Budget per source of the next step's drafts (the drafter's budget_key): the hybrid's steps with a
    prompt-lookup chain and those without accept differently at every size (a 4-node step is a chain in one,
    a small EAGLE tree in the other), so each keeps its own acceptance and step times. sizes_of(key) (the
    drafter's budget_sizes) is a source's own set of sizes and start_of(key) the size it tries first: the
    hybrid's chain steps add the chain alone, which sizes cut for the merged tree would miss, and start there."""

    START_EVIDENCE = 2.0  # decayed steps of a source's first rank past which no probe pays its set-up (start_probe)

    def __init__(self, nodes: int, sizes_of=None, start_of=None, memory: dict | None = None, setup_of=None, **kw):
        self.nodes, self.kw, self.of, self.key = nodes, kw, {}, None
        self.sizes_of, self.start_of = sizes_of, start_of
        # setup_of(key, b): seconds a draft of b nodes for that source pays once first (the drafter's
        # budget_setup), 0 for none; held_back: what the steps that waited for one would have saved
        self.setup_of, self.held_back = setup_of, 0.0
        self.spent = {"probe": 0.0, "total": 0.0}  # one probe cap for the request (Budget.probe_share)
        # {source: Budget} of the engine's earlier requests (keep() adds this one's): a source starts from its
        # last state instead of paying a whole-tree step and an autoregressive one to learn it again
        self.memory = memory

    @property
    def settle(self) -> int:
        return self.kw.get("settle", 2)

    def pick(self, key, left: float = float("inf")) -> int:
        """The next step's size for source key; left: tokens the request may still emit per token so far (a
        set-up waits also until the savings held back, extrapolated over what is left, would repay it)."""
        self.key = key
        if key not in self.of:
            new = self.of[key] = Budget(self.nodes, spent=self.spent,
                                        sizes=self.sizes_of(key) if self.sizes_of else None,
                                        start=self.start_of(key) if self.start_of else None, **self.kw)
            old = (self.memory or {}).get(key)
            if old is not None and old.sizes == new.sizes:
                new.carry(old)
            else:  # new to the engine: start from a sibling with the same sizes that speculates (prompt lookup's
                # other match lengths), weighed as one step, instead of a whole-tree step per source (four
                # sources: a tenth of a short answer's time); its first step is then at most as large
                sibs = [x for x in self.of.values() if x is not new and x.sizes == new.sizes and x.steps
                        and x.timed.get(1, 0) and max(x.sizes, key=x.rate) > 1]
                if sibs:
                    new.carry(max(sibs, key=lambda x: x.steps), weight=1.0)
            # an autoregressive step is the same step whatever drafts the next one: a new source starts with
            # the time the others measured (one timing step fewer for it)
            ar = max(self.of.values(), key=lambda x: x.timed.get(1, 0))
            if ar is not new and ar.timed.get(1, 0):  # (this request's time: fresher than a carried one)
                new.time[1], new.timed[1] = ar.time[1], max(ar.timed[1], new.timed.get(1, 0))
        bud = self.of[key]
        b = bud.pick()
        setup = self.setup_of(key, b) if self.setup_of is not None and b > 1 else 0.0
        if setup > 0:  # ski rental (module doc): the best size without it until waiting has cost the set-up
            need = [s for s in bud.sizes if s > 1 and self.setup_of(key, s) > 0]
            self.held_back += bud.saving(need)
            if (self.held_back < setup or self.held_back * left < setup) and not self.start_probe(bud, setup, left):
                a = (bud.best_without(need) or 1) if bud.time else 1
                bud.instead(b, a)
                b = a
        return b

    def start_probe(self, bud: Budget, setup: float, left: float) -> bool:
        """May this probe (bud.probing) pay the set-up the ski rental still holds back? Only while the source's
        first rank has been seen less than START_EVIDENCE (decayed) steps, and where the set-up fits the probe
        share of the request's time (so far, times 1 + left); it is billed to the probes then. Why: the
        estimate that holds a set-up back comes from the source's own steps, which stop while it waits: one
        unlucky step (nothing accepted, carried by the engine's memory) would lock the head out for good."""
        if not bud.probing or bud.nodes < 2 or bud.trials[1] >= self.START_EVIDENCE:
            return False
        if self.spent["probe"] + setup > bud.probe_share * self.spent["total"] * (1 + left):
            return False
        self.spent["probe"] += setup
        return True

    def keep(self):
        """The request is over: its sources' states are what the next request of the engine starts from."""
        if self.memory is not None:
            self.memory.update(self.of)

    def observe(self, b: int, accepted: list[int], seconds: float):
        self.of[self.key].observe(b, accepted, seconds)
        if b == 1:  # every source's autoregressive time follows it (see pick)
            for k, bud in self.of.items():
                if k != self.key:
                    bud.time_step(1, seconds)

    def stats(self) -> dict:
        """Budget.stats of the request, over every source: the summed histogram and speculated share, the cost
        curve of the source with the most steps, and with several sources each one's curve and step share."""
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


class StepBudget:
    """The budget as a request's loop asks it: each step's nodes (Budgets per source of drafts, or without a
    memory to fit with the whole tree), its time, and the autoregressive steps the drafter catches up on."""

    MAX_PENDING = 128

    def __init__(self, drafter: Drafter, prompt: list[int], max_new: int, memory=None, settle: int = 2,
                 pass_s: dict | None = None):  # memory: budget_memory.BudgetMemory
        self.d, self.prompt, self.max_new, self.memory = drafter, prompt, max_new, memory
        self.budgets = None if memory is None else Budgets(
            drafter.nodes, drafter.budget_sizes, drafter.budget_start, settle=settle, pass_s=pass_s,
            memory=memory.sources, setup_of=drafter.budget_setup)
        self.pending = []

    def pick(self, out: list[int]) -> int:
        """Nodes the next step verifies (1: an autoregressive step, no draft); out: the tokens so far."""
        if self.budgets is None:
            return self.d.nodes
        left = (self.max_new - len(out)) / len(out)  # tokens still to come per token so far, at most
        return self.budgets.pick(self.d.budget_key(self.prompt + out), left)

    def observe(self, b: int, accepted: list[int], seconds: float):
        """A step verified b nodes and accepted these; seconds: its draft, verification, sync and the
        drafter's update before it, less the one-time set-ups paid inside (a start is paid once; billed to
        one size it would make that size look slow in later requests too)."""
        if self.budgets is not None:
            self.budgets.observe(b, accepted, seconds - self.d.setup_paid())

    def draft_size(self, b: int) -> int | None:
        return None if self.budgets is None else b

    def hold(self, a: Accepted, b: int) -> bool:
        """Keep an autoregressive step back from the drafter when the next one is autoregressive too (a run
        of them costs one update later, not one each)."""
        if a.tree.tokens.shape[0] == 1 and b == 1 and len(self.pending) < self.MAX_PENDING:
            self.pending.append(a)
            return True
        return False

    def catch_up(self, a: Accepted) -> Accepted:
        """a, after the steps held back, as one chain of what the drafter reads."""
        if not self.pending:
            return a
        steps, self.pending = self.pending + [a], []
        return chained(steps, states=self.d.reads_states, top=self.d.reads_top)

    def finish(self) -> dict:
        """The request is over: its sources go to the memory; its budget statistics."""
        if self.budgets is None:
            return {}
        self.budgets.keep()
        self.memory.save()
        return self.budgets.stats()
