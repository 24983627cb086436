"""graphs.py: compiled steps equal eager ones; the CUDA-graph plumbing on a CPU (a fake capture), state checked."""
import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import budget_batch
import graphs
from engine import Engine
from sampling import Sampling
from test_generate import PROMPTS, autoregressive, make_drafter, target, tiny  # noqa: F401 (tiny: a fixture)


def _walk(x, path, tensors, values, seen):
    """Every tensor (address) and plain Python value reachable from the engine's persistent state."""
    if torch.is_tensor(x):
        tensors[path] = (x.data_ptr(), tuple(x.shape))
    elif isinstance(x, (bool, int, float, str, type(None))):
        values[path] = x
    elif isinstance(x, dict):
        for k, v in x.items():
            _walk(v, f"{path}.{k}", tensors, values, seen)
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _walk(v, f"{path}[{i}]", tensors, values, seen)
    elif id(x) not in seen and (isinstance(x, torch.nn.Module)
                                or type(x).__module__ in ("draft", "draft_eagle", "vocab", "model")):
        seen.add(id(x))
        for k, v in vars(x).items():
            if k not in ("lm_head_s", "training"):  # a host-side timing metric, not state a step reads
                _walk(v, f"{path}.{k}", tensors, values, seen)


def engine_state(eng):
    tensors, values = {}, {}
    _walk({"model": eng.model, "drafter": eng.drafter}, "", tensors, values, set())
    return tensors, values


class FakeGraph:
    """CPU stand-in for a captured CUDA graph: replay reruns the function on the static inputs and writes
    the results into the captured output tensors, which is what a real replay does to memory.

    It also checks what a real replay silently gets wrong: (1) the graph reads and writes the addresses
    of capture time, so no persistent tensor may be reallocated after capture; (2) a replay runs no Python,
    so the step may not leave host-side state (flags, counters) changed."""

    def __init__(self, fn, static, out, eng):
        self.fn, self.static, self.out, self.eng, self.skip = fn, static, out, eng, True
        self.tensors = engine_state(eng)[0]

    def replay(self):
        tensors, values = engine_state(self.eng)
        assert tensors == self.tensors, "a persistent tensor was reallocated after capture"
        if self.skip:  # the fake capture already executed fn once (a real capture runs nothing)
            self.skip = False
            return
        for o, n in zip(_flat(self.out), _flat(self.fn(*self.static))):
            o.copy_(n)
        assert engine_state(self.eng) == (tensors, values), "the step changed host-side state a replay skips"


def _flat(x):
    return [t for t in pytree.tree_leaves(x) if torch.is_tensor(t)]  # Tree and Accepted are registered pytrees


def test_graph_capture_plumbing_on_cpu(tiny, monkeypatch):
    """Exercise the real Graphed.__call__ (eager first call, capture on the second, replays after) with only
    the CUDA capture itself replaced: static input buffers, outputs reused across replays, persistent
    drafter/vocabulary state at fixed addresses, no host-side state changed by a step, fixed-size caches."""
    m = target(tiny[0])
    for kind, spec in [("eagle3", "nanospec"), ("model", "nanospec"), ("eagle2", "full"), ("eagle3", "freq")]:
        if spec == "freq":
            torch.save(list(range(m.args.vocab_size))[::-1], tiny[3] / "freq.pt")
            spec = f"freq:{tiny[3] / 'freq.pt'}:64"
        eng = Engine(m, drafter=make_drafter(kind, tiny, m, spec))

        def capture(self, static, eng=eng):
            graph = FakeGraph(self.fn, static, self.fn(*static), eng)
            return graph, graph.out

        monkeypatch.setattr(graphs.Graphed, "_capture", capture)
        r = eng.runner  # the halves, as --compile runs them
        r.fused_steps, eng.planner.fixed, eng.batch.runner = True, 160, r
        r.verify_step, r.advance_step = graphs.Graphed(r._spec_verify), graphs.Graphed(r._spec_advance)
        for i, p in enumerate(PROMPTS):
            ref = autoregressive(m, p, 30)
            assert eng.generate(p, 30)[0] == ref, kind
            assert eng.generate(p, 30)[0] == ref, kind  # replays of graphs captured in the first request
            m.setup_caches(1, 300 + 8 * i)  # another engine on this model resizes its caches: re-capture
        assert r.verify_step.graphs and r.advance_step.graphs  # replays really happened


def test_graphed_decode_plumbing_on_cpu(tiny, monkeypatch):
    """The autoregressive decode step as --compile runs it on CUDA (Graphed): each step's output token, the graph's
    own buffer, is the next step's input; replays across requests; capture again after another engine on the model
    resized the caches."""
    m = target(tiny[0])
    eng = Engine(m)

    def capture(self, static, eng=eng):
        graph = FakeGraph(self.fn, static, self.fn(*static), eng)
        return graph, graph.out

    monkeypatch.setattr(graphs.Graphed, "_capture", capture)
    r = eng.runner
    eng.planner.fixed, r.decode_fn, eng.batch.runner = 160, graphs.Graphed(r._decode_one), r
    for i, p in enumerate(PROMPTS):
        ref = autoregressive(m, p, 30)
        assert eng.generate(p, 30)[0] == ref
        assert eng.generate(p, 30)[0] == ref  # replays of the graph captured in the first request
        m.setup_caches(1, 300 + 8 * i)
    assert r.decode_fn.graphs


@pytest.mark.parametrize("kind", ["eagle3", "hybrid"])
def test_held_steps_outlive_replays(tiny, monkeypatch, kind):
    """A Graphed step's outputs are rewritten by its next replay (the fake capture's replays write the captured
    outputs, as a real one does): the autoregressive steps held back for one later update, and the hybrid's pending
    steps, must be copies. With a fixed pattern of sizes (two autoregressive steps, three of 3 nodes: the hybrid's
    chain alone, its head waiting, then a whole tree) the drafter sees what it sees eagerly: the same trees, so the
    same acceptance."""
    m = target(tiny[0])
    sizes = [1, 1, 3, 3, 3, None]

    def run(graphed):
        calls = iter(range(10 ** 6))
        monkeypatch.setattr(budget_batch.BatchBudget, "pick",
                            lambda self, seqs: [sizes[next(calls) % 6] or seqs[0].drafter.nodes])
        eng = Engine(m, drafter=make_drafter(kind, tiny, m, "nanospec"))
        if graphed:
            def capture(self, static, eng=eng):
                graph = FakeGraph(self.fn, static, self.fn(*static), eng)
                return graph, graph.out

            monkeypatch.setattr(graphs.Graphed, "_capture", capture)
            r = eng.runner
            eng.planner.fixed, eng.batch.runner = 160, r
            r.verify_step, r.advance_step = graphs.Graphed(r._spec_verify), graphs.Graphed(r._spec_advance)
        res = [eng.generate(p, 30) for p in PROMPTS]
        monkeypatch.undo()
        return [o for o, _ in res], [st.accept_hist for _, st in res]

    eager, graphed = run(False), run(True)
    assert graphed[0] == eager[0] == [autoregressive(m, p, 30) for p in PROMPTS]
    assert graphed[1] == eager[1]
    assert any(sum(h.values()) > 12 for h in eager[1])  # steps were verified (and held: 2 of every 6)


class CaptureSafety(TorchDispatchMode):
    """Records what a CUDA graph cannot capture: tensors made from Python data (a host-to-device copy on CUDA:
    torch.tensor, x[i] = value), host reads of a value (item, int(), bool()), data-dependent shapes (nonzero,
    boolean-mask indexing)."""

    def __init__(self):
        super().__init__()
        self.bad = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in ("aten.lift_fresh.default", "aten._local_scalar_dense.default", "aten.nonzero.default") or (
                name == "aten.index.Tensor" and any(i is not None and i.dtype == torch.bool for i in args[1])):
            self.bad.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind,vocab_spec,temperature", [("none", "full", 0.0), ("eagle3", "nanospec", 0.0),
                                                         ("eagle3", "freq", 0.0), ("eagle2", "full", 0.0),
                                                         ("model", "nanospec", 0.0), ("none", "full", 0.8),
                                                         ("eagle3", "nanospec", 0.8), ("model", "full", 0.8)])
def test_captured_steps_are_capture_safe(tiny, monkeypatch, kind, vocab_spec, temperature):
    """The steps CUDA graphs capture (the decode step, verify, the fused advance) take their traced paths here
    (is_compiling: the CPU shortcuts off) under a dispatch mode that records every op a capture rejects: none
    may run (torch.compile's fullgraph tests cannot see a host-to-device copy; a real capture fails on one)."""
    m = target(tiny[0])
    if vocab_spec == "freq":
        torch.save(list(range(m.args.vocab_size))[::-1], tiny[3] / "freq.pt")
        vocab_spec = f"freq:{tiny[3] / 'freq.pt'}:64"
    s = Sampling(temperature, top_k=50 if temperature else 0)
    eng = Engine(m, s, drafter=None if kind == "none" else make_drafter(kind, tiny, m, vocab_spec, sampling=s))
    r = eng.runner
    r.fused_steps, eng.planner.fixed, eng.batch.runner = kind != "none", 160, r
    seen = []

    def guarded(fn):
        def step(*args):
            with monkeypatch.context() as mp, CaptureSafety() as mode:
                mp.setattr(torch.compiler, "is_compiling", lambda: True)
                out = fn(*args)
            seen.append(fn.__name__)
            assert not mode.bad, (fn.__name__, mode.bad)
            return out
        return step

    r.decode_fn, r.verify_step, r.advance_step = (guarded(r._decode_one), guarded(r._spec_verify),
                                                  guarded(r._spec_advance))
    for p in PROMPTS:
        out = eng.generate(p, 20)[0]
        assert out == autoregressive(m, p, 20) if not temperature else len(out) > 1
    assert set(seen) == ({"_decode_one"} if kind == "none" else {"_spec_verify", "_spec_advance"})


@pytest.mark.parametrize("kind,vocab_spec", [("eagle3", "nanospec"), ("eagle2", "full"), ("model", "nanospec"),
                                             ("ngram", "full")])
def test_compiled_steps_equal_eager(tiny, kind, vocab_spec):
    """--compile on CPU: the fused verify and advance steps under torch.compile(fullgraph=True) give the
    eager tokens (backend 'eager' here for speed; the CLI uses inductor)."""
    torch._dynamo.reset()
    m = target(tiny[0])
    ref = [autoregressive(m, p, 24) for p in PROMPTS]
    # static n-gram chains: what build_drafter and bench pass under --compile
    eng = Engine(m, compile=True, backend="eager", drafter=make_drafter(kind, tiny, m, vocab_spec, static=True))
    for p, r in zip(PROMPTS, ref):
        assert eng.generate(p, 24)[0] == r
    if kind == "ngram":  # padded to k + 1 nodes: one traced verify shape whatever the proposal length
        assert (eng.drafter.static
                and eng.drafter.draft(torch.tensor([5]), torch.tensor(3)).tokens.shape[0] == eng.drafter.k + 1)
