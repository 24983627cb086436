"""--compile, applied to the engine's steps from outside them: torch.compile on CPU, CUDA graphs on CUDA."""
import torch
import torch.utils._pytree as pytree


class Graphed:
    """Calls fn through CUDA graphs captured per input signature (pytree structure, tensor shapes and dtypes,
    plain values). A signature's first call runs eagerly (warm-up); the second captures (which runs nothing)
    and replays, so fn runs exactly once per call. Outputs are the graph's own, valid until its next replay."""

    def __init__(self, fn):
        self.fn, self.graphs, self.seen = fn, {}, set()
        self.addresses = None  # of the buffers the graphs read (follow_buffers)

    def __call__(self, *args):
        leaves, spec = pytree.tree_flatten(args)
        key = (spec, tuple((tuple(a.shape), a.dtype) if torch.is_tensor(a) else a for a in leaves))
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self._warm_up(args, leaves)
            static = [a.clone() if torch.is_tensor(a) else a for a in leaves]
            self.graphs[key] = (*self._capture(pytree.tree_unflatten(static, spec)), static)
        graph, out, static = self.graphs[key]
        for buf, a in zip(static, leaves):
            if torch.is_tensor(a):
                buf.copy_(a)
        graph.replay()
        return out

    def _warm_up(self, args, leaves):
        """The eager first call, on a side stream where the inputs are CUDA tensors (as torch.cuda.graph's capture
        runs): per-stream set-ups (cuBLAS workspaces) happen here, not inside the capture."""
        if not any(torch.is_tensor(a) and a.is_cuda for a in leaves):
            return self.fn(*args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, static_args):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(*static_args)
        return graph, out


def owned(x):
    """x with its tensors copied: what a Graphed step returns is the graph's own memory, rewritten by its next
    replay, so a result kept past it (a held step, a drafter's pending steps) needs its own copy."""
    return pytree.tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, x)


def compile_steps(runner, backend: str):
    """Rebinds the runner's decode step and its two speculative halves (runner.Runner) to compiled ones; on CUDA each
    is captured explicitly (Graphed): robust with the copy-stream fork/join inside, and the decode loop feeds each
    step's output token back in (inductor's own graphs reject an input their previous replay overwrote)."""
    cuda = runner.device.type == "cuda"
    for name, fn in (("decode_fn", runner._decode_one), ("verify_step", runner._spec_verify),
                     ("advance_step", runner._spec_advance)):
        setattr(runner, name, Graphed(fn) if cuda else
                torch.compile(fn, fullgraph=True, dynamic=False, backend=backend))


def follow_buffers(steps, model, drafter):
    """Before a request: where another engine sharing this model or head resized its caches, capture again."""
    graphed = [s for s in steps if isinstance(s, Graphed)]
    if graphed:
        mods = [model] + [v for v in (vars(drafter) if drafter is not None else {}).values()
                          if isinstance(v, torch.nn.Module)]
        addresses = tuple(b.data_ptr() for mod in mods for b in mod.buffers())
        for step in graphed:
            if step.addresses != addresses:
                step.graphs.clear()
                step.seen.clear()
                step.addresses = addresses
