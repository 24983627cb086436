"""The engine as a library: one request at a time as the batch engine's step with B = 1 (Engine), on the
static-shape steps of runner.py where a traced or padded batch of one needs them; the target loaded from a
checkpoint (load_target) and an engine with its drafter (build_engine). generate.py is its CLI."""
import time
from pathlib import Path

import torch

import draft_config as dc
import graphs
from batch import BatchEngine
from download import resolve_checkpoint
from errors import UsageError
from exact import PassRows
from planner import Planner
from runner import Runner
from model import Transformer, load_model
from sampling import Sampling
from stats import PHASES, Stats, sync
from tokenizer import Tokenizer

# the default model's EAGLE-3 head, trained by eagle_train.py on ShareGPT
DEFAULT_HEAD = Path(__file__).resolve().parent / "heads" / "SmolLM2-135M-Instruct-eagle3-sharegpt"


class Engine:
    """The target (and optionally a drafter with its draft vocabulary), one request at a time: a batch of one of
    batch.BatchEngine, whose step runs the static-shape halves (runner.Runner) where they are picked."""

    def __init__(self, model: Transformer, sampling: Sampling = Sampling(), compile: bool = False, drafter=None,
                 max_seq: int = 4096, backend: str = "inductor", exact: bool | None = None, budget: bool = False,
                 budget_cache: str | None = None):
        self.model, self.sampling, self.drafter = model, sampling, drafter
        self.device = model.norm.weight.device
        # CUDA graphs need fixed buffer addresses: one KV cache of max_seq slots for every request
        graphed = compile and self.device.type == "cuda"
        self.planner = Planner(model, exact, min(max_seq, model.args.max_position_embeddings) if graphed else None,
                               drafter)
        # budget_cache: the caller's key of its drafter and sampling settings: the budget memory outlives the process
        key = f"exact={exact} compile={compile} {budget_cache}" if budget_cache is not None else None
        # a request is the batch engine's step with B = 1 (batch.py). Its passes are the batch's own on the eager CPU
        # path; the traced steps (compile, CUDA graphs) and exact mode's padded passes on the PyTorch layers run
        # the static-shape halves (runner.py): picked here, once
        padded = self.planner.invariance is not None and model.cpu_pass is None
        picked = compile or self.device.type != "cpu" or padded
        one = None if drafter is None else [drafter]
        # (a prompt's shared prefix is copied where the copies are its prefill's bits: the fused pass throughout)
        self.batch = BatchEngine(model, 1, 64, sampling, drafters=one, budget=budget, exact=exact is not False,
                                 memory_key=key, settle=2 if compile else 1,
                                 prefix=model.cpu_pass is not None and exact is not False and not picked)
        # what its passes return and run on (model.Plan, the batch's): its head's aux layers; --no-exact: passes
        # from cpu_forward.layers_from's size on the PyTorch layers; the budget's memory of earlier requests
        self.plan, self.memory = self.batch.plan, self.batch.memory
        self.runner = Runner(model, sampling, drafter, self.planner, self.plan,
                             fused=compile and drafter is not None and drafter.graphable)
        if compile:
            graphs.compile_steps(self.runner, backend)
        self.batch.runner = self.runner if picked else None

    @torch.no_grad()  # (a compiled step traced with grad on needs an autograd formula the C ops do not have)
    def warmup(self):
        """A two-token pass and a decode step, so one-time kernel set-ups are not billed to the first prompt."""
        m, dev = self.model, self.device
        self.batch.resize(self.planner.plan(2, 2, 1).S)
        m(torch.tensor([[0, 1]], device=dev), torch.arange(2, device=dev), plan=self.plan)
        self.runner.decode_fn(torch.tensor([[1]], device=dev), torch.tensor([2], device=dev), PassRows(1, 1))
        one = torch.tensor([2], device=dev)
        self.batch.decode_step(one, one, one * 0)  # (the batch's own pass: a window mask over the sequence's range)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int, on_tokens=None) -> tuple[list[int], Stats]:
        """The request as a batch of one: its prefill step, then a step per target pass."""
        if not prompt:
            raise UsageError("empty prompt")
        b, d = self.batch, self.drafter
        req = self.planner.plan(len(prompt), max_new_tokens, 1 if d is None else d.nodes)
        st = Stats(phase_s=dict.fromkeys(PHASES, 0.0) if d is not None else {}, extra=dict(exact=req.exact))
        b.phase_s = st.phase_s if d is not None else None
        t0 = time.perf_counter()
        i = b.submit(prompt, max_new_tokens, own_rng=False, req=req)  # (sampled: generate.py's --seed sets the stream)
        try:
            b.step()
            s, t1 = b.stepped[0], time.perf_counter()
            if on_tokens:
                on_tokens(s.new)
            while b.busy():
                b.step()
                if on_tokens and s.new:
                    on_tokens(s.new)
            sync(self.device)
        except BaseException:
            b.abort(i)  # (an interrupted request leaves the engine free for the next)
            raise
        # (until its last token, as step() saw it done: its budget's memory is written after, 1.6 ms to a file)
        st.prefill_s, st.decode_s = t1 - t0, max(s.t_done - t1, 0.0)
        st.new_tokens, st.target_forwards = len(s.out), 1 + len(s.accepted)
        if d is not None:
            for L in s.accepted:
                st.accept_hist[L] = st.accept_hist.get(L, 0) + 1
            st.extra.update(d.stats(), **s.budget_stats)
            lm = st.extra.pop("lm_head_s", 0.0)  # drafting time spent in the LM head (eager only)
            st.phase_s["lm_head"], st.phase_s["draft"] = lm, st.phase_s["draft"] - lm
        return s.out, st

def load_target(checkpoint: str | None, device: str = "cpu", dtype: str = "bfloat16"
                ) -> tuple[Transformer, Tokenizer, Path]:
    """The target model, its tokenizer and folder, from an HF folder or hub id (None: the embedded default model)."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but CUDA is not available")
    path = resolve_checkpoint(checkpoint)
    tok = Tokenizer(path)
    model = load_model(path, dtype=getattr(torch, dtype), device=dev)
    if not model.args.eos_ids:
        raise UsageError(f"no eos_token_id in {path}/generation_config.json or config.json")
    return model, tok, path


def build_engine(model: Transformer, tok: Tokenizer | None, draft: dc.DraftConfig = dc.DraftConfig(),
                 sampling: Sampling = Sampling(), *, compile: bool = False, max_seq: int = 4096,
                 backend: str = "inductor", exact: bool | None = None, head=None, budget: bool = True,
                 budget_cache: bool = False) -> Engine:
    """The engine with its drafter; budget=False verifies the whole tree; budget_cache=True: memory across runs."""
    sampling.validate(model.args.vocab_size)
    drafter = dc.make_drafter(draft, model, sampling, tok, head)
    return Engine(model, sampling, compile=compile, drafter=drafter, max_seq=max_seq, backend=backend, exact=exact,
                  budget=budget, budget_cache=f"{draft} {sampling}" if budget_cache else None)
