"""--compile, applied to the engine's steps from outside them: torch.compile on CPU, CUDA graphs on CUDA."""
import torch
import torch.utils._pytree as pytree


class Graphed:
    """Calls fn through CUDA graphs captured per input signature (pytree structure, tensor shapes/dtypes
    and plain values).

    The first call of a signature runs fn eagerly (it warms up lazily initialised kernels and libraries on
    the real state); the second captures fn (capture records kernels without running them) and replays it,
    so every call executes fn exactly once and state-mutating steps stay correct. Tensor inputs are copied
    into the graph's static buffers; the returned tensors are the graph's own outputs, valid until its next
    replay (callers consume them within the step)."""

    def __init__(self, fn):
        self.fn, self.graphs, self.seen = fn, {}, set()
        self.addresses = None  # of the buffers the graphs read (follow_buffers)

    def reset(self):
        self.graphs.clear()
        self.seen.clear()

    def __call__(self, *args):
        leaves, spec = pytree.tree_flatten(args)
        key = (spec, tuple((tuple(a.shape), a.dtype) if torch.is_tensor(a) else a for a in leaves))
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self.fn(*args)
            static = [a.clone() if torch.is_tensor(a) else a for a in leaves]
            self.graphs[key] = (*self._capture(pytree.tree_unflatten(static, spec)), static)
        graph, out, static = self.graphs[key]
        for buf, a in zip(static, leaves):
            if torch.is_tensor(a):
                buf.copy_(a)
        graph.replay()
        return out

    def _capture(self, static_args):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(*static_args)
        return graph, out


def compile_steps(engine, backend: str):
    """Rebinds the engine's decode step and its two speculative halves (verify; the drafter's update + next
    draft) to compiled ones. reduce-overhead = CUDA graphs on CUDA; on CPU inductor fuses the small per-layer
    ops. The halves are captured explicitly on CUDA (Graphed): robust with the copy-stream fork/join inside."""
    cuda = engine.device.type == "cuda"
    engine.decode_fn = torch.compile(engine._decode_one, mode="reduce-overhead" if cuda else None,
                                     fullgraph=True, dynamic=False, backend=backend)
    for name, fn in (("verify_step", engine._spec_verify), ("advance_step", engine._spec_advance)):
        setattr(engine, name, Graphed(fn) if cuda else
                torch.compile(fn, fullgraph=True, dynamic=False, backend=backend))


def follow_buffers(steps, model, drafter):
    """Before a request: where another engine sharing this model or head resized its caches, the captured
    graphs would read the freed buffers, so they capture again on the new ones. (torch.compile'd CPU steps
    guard on their buffers themselves.)"""
    graphed = [s for s in steps if isinstance(s, Graphed)]
    if graphed:
        mods = [model] + [v for v in vars(drafter).values() if isinstance(v, torch.nn.Module)]
        addresses = tuple(b.data_ptr() for mod in mods for b in mod.buffers())
        for step in graphed:
            if step.addresses != addresses:
                step.reset()
                step.addresses = addresses
