"""Batched decoding: every sequence of a batch is its batch-1 output (bit for bit through the fused CPU pass, and
on the PyTorch layers), with or without per-sequence drafting (prompt lookup, EAGLE-3 + NanoSpec, both merged;
every tree verified, or the load-aware budget), continuous batching (prompts join as others finish), per-sequence
sampling streams, speculative sampling exact in distribution, the decode step traced whole, bad input as one-line
errors."""
import copy
import json

import pytest
import torch

import cpu_forward
import cpu_gemm
import model as M
import batch
from batch import BatchEngine
import draft_config as dc
from conftest import write_eagle_head, write_tiny_hf
from errors import UsageError
from engine import Engine
from sampling import Sampling, logits_to_probs
import test_generate as tg
from test_generate import tiny  # noqa: F401 (tiny: a fixture)

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40], [7, 7, 7, 7, 8], list(range(20, 60)),
           [3, 4], [100, 90, 80, 70]]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """SmolLM2's head size (64) and 3 query heads per KV head."""
    path, _ = write_tiny_hf(tmp_path_factory.mktemp("batch"), hidden_size=192, intermediate_size=256,
                            num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, vocab_size=300,
                            max_position_embeddings=512)
    return path


def load(path, fused: bool, monkeypatch, dtype=torch.bfloat16, gemm: str | None = None):
    monkeypatch.setenv(cpu_gemm.ENV, gemm or ("kernel" if fused else "torch"))
    monkeypatch.setenv(cpu_forward.ENV, "on" if fused else "off")
    m = M.load_model(path, dtype=dtype)
    assert (m.cpu_pass is not None) == fused
    m.args.eos_ids = [batch1(m, PROMPTS[:1], 6)[0][5]]  # a token the model writes: some sequences end early
    return m


def batch1(m, prompts, max_new, sampling=Sampling()):
    eng = Engine(m, sampling)
    return [eng.generate(p, max_new)[0] for p in prompts]


@pytest.mark.parametrize("fused,max_seq,gemm", [(True, 128, None), (True, 100, None), (False, 128, None),
                                               (False, 128, "kernel")])
def test_every_sequence_is_its_batch1_output(target, monkeypatch, fused, max_seq, gemm):
    """Batch 3 over 7 prompts (4 join as others finish), 24 new tokens each: each output equals decoding that
    prompt alone, through the fused pass (row-invariant by construction) and through the PyTorch layers (fp32 with
    torch's GEMM; bf16 with the kernel's, what tensor-parallel ranks run). Ranges of 100 slots start off the
    attention's 16-slot blocks."""
    if (fused or gemm) and cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, fused, monkeypatch, torch.bfloat16 if fused or gemm else torch.float32, gemm)
    ref = batch1(m, PROMPTS, 24)
    eng = BatchEngine(m, batch=3, max_seq=max_seq)
    got = eng.generate_batch(PROMPTS, 24)
    assert got == ref
    assert any(len(r) < 24 for r in ref) and any(len(r) == 24 for r in ref)  # eos and budget endings both seen
    assert eng.steps["prefill"] >= 3  # waiting prompts joined between decode steps
    assert eng.rows > eng.steps["decode"]  # decode steps carried several sequences


def test_ignore_eos_runs_every_sequence_to_its_budget(target, monkeypatch):
    """ignore_eos (llama-batched-bench's shape): every sequence decodes its whole budget, the batch full at every
    decode step, and a sequence that ends at eos otherwise runs on through it with the same tokens before."""
    m = load(target, cpu_forward.kernel() is not None, monkeypatch)
    ref = BatchEngine(m, batch=3, max_seq=128).generate_batch(PROMPTS[:3], 24)
    eng = BatchEngine(m, batch=3, max_seq=128, ignore_eos=True)
    got = eng.generate_batch(PROMPTS[:3], 24)
    assert all(len(g) == 24 for g in got) and any(len(r) < 24 for r in ref)
    assert all(g[:len(r)] == r for g, r in zip(got, ref))
    assert eng.rows == 3 * eng.steps["decode"] and eng.decode_tokens == eng.rows


def drafting(kind: str, target, tmp_path) -> dc.DraftConfig:
    """prompt lookup, an EAGLE-3 head with NanoSpec, or both merged (the default model's configuration)."""
    if kind == "ngram":
        return dc.DraftConfig("ngram", spec_k=4)
    head = tmp_path / "head"
    if not head.is_dir():
        write_eagle_head(head, json.loads((target / "config.json").read_text()), version=3, seed=1)
    return dc.DraftConfig(str(head), "nanospec", 4, 3, 10, spec_k=4, w_max=64, ngram=kind == "hybrid")


@pytest.mark.parametrize("kind,budget", [("ngram", False), ("eagle", False), ("hybrid", False), ("hybrid", True)])
def test_speculative_sequences_are_their_batch1_output(target, tmp_path, monkeypatch, kind, budget):
    """Each sequence drafts with its own drafter (its own head cache, NanoSpec window, lookup index), one pass
    verifies every tree: batch 3 over 7 prompts (ending at eos or their budget, joining as others finish), every
    output equal to the autoregressive batch-1 output. With the budget, trees of any size or none, per sequence."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, True, monkeypatch)
    ref = batch1(m, PROMPTS, 24)
    ds = dc.make_drafters(drafting(kind, target, tmp_path), m, 3)
    assert len({id(d) for d in ds}) == 3
    eng = BatchEngine(m, batch=3, max_seq=128, drafters=ds, budget=budget)
    got = eng.generate_batch(PROMPTS, 24)
    assert got == ref
    assert any(len(r) < 24 for r in ref) and eng.steps["prefill"] >= 3
    if not budget:  # every step verified every tree: drafts were accepted
        assert eng.decode_tokens > eng.rows
    else:
        assert 0 < eng.budget.stats()["speculated_share"] < 1, eng.budget.stats()


def test_a_step_verifies_the_sizes_the_budget_chose(target, tmp_path, monkeypatch):
    """The budget prices b rows for a sequence's tree; the pass carries its first b nodes, as at batch 1, though a
    lookup tree holds up to k whatever b (a 2-node trial had verified 11-node trees at batch 16: 26-row passes
    priced as 17). Sizes of 2 for every sequence: no pass carries more than twice the sequences."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, True, monkeypatch)
    ref = batch1(m, PROMPTS, 24)
    choose, draft_of, rows, drafted = batch.BatchBudget.choose, BatchEngine._draft, [], []
    monkeypatch.setattr(batch.BatchBudget, "choose", lambda self, seqs, key_of: [2] * len(choose(self, seqs, key_of)))

    def traced(self, s, b):
        t, sec = draft_of(self, s, b)
        drafted.append(0 if t is None else t.tokens.shape[0])
        return t, sec
    monkeypatch.setattr(BatchEngine, "_draft", traced)
    eng = BatchEngine(m, batch=3, max_seq=128, drafters=dc.make_drafters(drafting("hybrid", target, tmp_path), m, 3))
    forward = m.forward

    def counted(tokens, *a, **k):
        if k.get("return_hidden") and k.get("compute_logits", True):  # a verification (prefills compute none)
            rows.append((tokens.shape[1], len(eng.running)))
        return forward(tokens, *a, **k)
    monkeypatch.setattr(m, "forward", counted)
    assert eng.generate_batch(PROMPTS, 24) == ref
    assert max(drafted) > 2  # lookup trees larger than their size were drafted
    rows = [(r, n) for r, n in rows if n > 1]  # (a sequence alone takes the batch-1 budget's sizes)
    assert rows and all(r <= 2 * n for r, n in rows), rows

def test_a_sequence_alone_steps_on_the_batch1_budget(target, tmp_path, monkeypatch):
    """While one sequence runs alone, its sizes come from its own budget (BatchBudget.lone: budget.Budgets' probes,
    the per-source policy, the engine's memory of earlier requests), not the batch's rule; with two or more, from
    the batch's (BatchBudget.choose); each finished lone budget leaves its sources and length to the next request;
    every output its batch-1 output."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, True, monkeypatch)
    prompts = [PROMPTS[4], PROMPTS[0], PROMPTS[1]]
    ref = batch1(m, prompts, 24)
    alone, together = [], []
    pick, choose = batch.BatchBudget.lone, batch.BatchBudget.choose
    monkeypatch.setattr(batch.BatchBudget, "lone", lambda self, s: alone.append(len(s.out)) or pick(self, s))
    monkeypatch.setattr(batch.BatchBudget, "choose", lambda self, seqs, key_of: together.append(len(seqs))
                        or choose(self, seqs, key_of))
    eng = BatchEngine(m, batch=2, max_seq=128, drafters=dc.make_drafters(drafting("hybrid", target, tmp_path), m, 2))
    assert eng.generate_batch(prompts, 24) == ref
    assert alone and together and set(together) == {2}
    assert eng.memory.sources and eng.memory.length > 0


def test_a_prompt_that_fills_its_range_and_a_batch_of_one(target, tmp_path, monkeypatch):
    """A sequence whose prompt, new tokens and tree fill its range exactly, in a batch of one, and a prompt one
    token longer refused before it runs."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, True, monkeypatch)
    ds = dc.make_drafters(drafting("hybrid", target, tmp_path), m, 1)
    spare = ds[0].nodes
    p = PROMPTS[4] + PROMPTS[1]
    eng = BatchEngine(m, batch=1, max_seq=len(p) + 20 + spare, drafters=ds, budget=False)
    assert eng.generate_batch([p], 20) == batch1(m, [p], 20)
    with pytest.raises(UsageError, match="draft nodes exceed"):
        eng.submit(p + [1], 20)


def test_speculative_batch_sampling_is_exact(tmp_path, monkeypatch):
    """Sampled sequences in a speculative batch (each its own drafter; tokens 2 and 3 from its first tree): the
    joint law of tokens 2 and 3 over 1,500 sequences equals the target's (chi-square, cells under 5 pooled,
    p > 1e-4), as test_generate's test does for one sequence at a time."""
    from test_generate import _chi2_sf
    V = 12
    path, _ = write_tiny_hf(tmp_path / "t", vocab_size=V, seed=3)
    m = M.load_model(path, dtype=torch.float32)
    m.args.eos_ids = []
    write_eagle_head(tmp_path / "h", json.loads((path / "config.json").read_text()), version=3, seed=1)
    samp, prompt = Sampling(1.0), [1, 4, 7]
    ds = dc.make_drafters(dc.DraftConfig(str(tmp_path / "h"), "full", 3, 2, 6, ngram=False), m, 8, samp)
    eng = BatchEngine(m, batch=8, max_seq=16, sampling=samp, drafters=ds, budget=False)
    n = 1500
    torch.manual_seed(0)
    for i in range(n):
        eng.submit(prompt, 3, seed=i)
    counts = torch.zeros(V * V, dtype=torch.float64)
    while eng.busy():
        for s in eng.step():
            counts[s.out[1] * V + s.out[2]] += 1
    T = len(prompt)
    m.setup_caches(V * V, T + 2)
    seqs = torch.tensor([[*prompt, a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        probs = logits_to_probs(m(seqs, torch.arange(T + 2)), samp).double()
    joint = (probs[0, T - 1][:, None, None] * probs[::V, T][:, :, None] * probs[:, T + 1].view(V, V, V)).sum(0)
    exp = joint.flatten() * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp_c = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp_c > 0
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    assert _chi2_sf(stat, int(keep.sum()) - 1) > 1e-4, stat
    assert eng.decode_tokens > eng.rows  # the trees were verified and drafts accepted


def test_batch_sampler_catches_a_biased_acceptance(tmp_path, monkeypatch):
    """Guard for the test above: a wrong acceptance rule (the first child always accepted) fails it."""
    import sampling
    from test_generate import accept_sample_biased
    monkeypatch.setattr(sampling, "accept_sample", accept_sample_biased)
    with pytest.raises(AssertionError):
        test_speculative_batch_sampling_is_exact(tmp_path, monkeypatch)


def test_streaming_submit_and_step(target, monkeypatch):
    """submit / step: finished sequences come back as they finish, each with its own budget; a range freed by a
    finished sequence is reused, and its old keys are never read."""
    m = load(target, cpu_forward.kernel() is not None, monkeypatch)
    budgets = [3, 30, 5, 30, 1]
    ref = [batch1(m, [p], n)[0] for p, n in zip(PROMPTS, budgets)]
    eng = BatchEngine(m, batch=2, max_seq=96)
    for p, n in zip(PROMPTS, budgets):
        eng.submit(p, n)
    order, got = [], {}
    while eng.busy():
        for s in eng.step():
            order.append(s.index)
            got[s.index] = s.out
    assert [got[i] for i in range(len(budgets))] == ref
    assert order != sorted(order)  # a later, shorter request finished first
    assert eng.step() == []


def test_stepped_tokens_their_sources_and_abort(target, tmp_path, monkeypatch):
    """A server's view: after each step, engine.stepped holds the sequences it advanced, each with the tokens it
    emitted (new) and who proposed each (new_from: the target itself, or the drafter whose accepted draft token
    it was); they add up to every output. abort drops a running or a waiting sequence, frees its range at once,
    and every other output is still its batch-1 output."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, True, monkeypatch)
    ref = batch1(m, PROMPTS, 24)
    eng = BatchEngine(m, batch=3, max_seq=128, drafters=dc.make_drafters(drafting("hybrid", target, tmp_path), m, 3),
                      budget=False)
    for p in PROMPTS:
        eng.submit(p, 24)
    toks, srcs, done = {}, {}, {}
    eng.step()  # the prefill of 0, 1, 2
    assert {s.index for s in eng.stepped} == {0, 1, 2} and all(len(s.new) == 1 for s in eng.stepped)
    for s in eng.stepped:
        toks[s.index], srcs[s.index] = list(s.new), list(s.new_from)
    assert eng.abort(1).index == 1 and eng.free == [1]  # running: its range is free
    assert eng.abort(5).index == 5 and [s.index for s in eng.waiting] == [3, 4, 6]  # waiting
    assert eng.abort(1) is None and eng.abort(99) is None
    while eng.busy():
        finished = eng.step()
        for s in eng.stepped:
            assert len(s.new) == len(s.new_from)
            toks.setdefault(s.index, []).extend(s.new)
            srcs.setdefault(s.index, []).extend(s.new_from)
        done.update((s.index, s.out) for s in finished)
    assert sorted(done) == [0, 2, 3, 4, 6] and all(done[i] == ref[i] == toks[i] for i in done)
    every = [x for i in done for x in srcs[i]]
    assert set(every) <= {"target", "eagle", "ngram", "both"} and "target" in every and set(every) - {"target"}
    assert eng.steps["decode"] > 0 and all(s.drafted > 0 for s in finished)


def test_sampled_sequences_have_their_own_streams(target, monkeypatch):
    """A sampled sequence with a given seed draws the same tokens alone or beside others (its own generator, its
    logits the same bits); different seeds draw differently."""
    m = load(target, cpu_forward.kernel() is not None, monkeypatch)
    s = Sampling(temperature=1.0)
    alone = BatchEngine(m, batch=1, max_seq=96)
    alone.submit(PROMPTS[1], 20, s, seed=7)
    (a,) = alone.step() + [x for _ in range(40) for x in alone.step()]
    crowd = BatchEngine(m, batch=4, max_seq=96)
    idx = [crowd.submit(p, 20, s, seed=7 if i == 1 else i) for i, p in enumerate(PROMPTS[:4])]
    done = {}
    while crowd.busy():
        done.update((x.index, x.out) for x in crowd.step())
    assert done[idx[1]] == a.out
    other = BatchEngine(m, batch=1, max_seq=96)
    other.submit(PROMPTS[1], 20, s, seed=8)
    b = [x for _ in range(41) for x in other.step()][0]
    assert b.out != a.out


def test_decode_step_traces_whole(target, monkeypatch):
    """The decode step is one graph (torch.compile fullgraph, eager backend), with the same logits."""
    m = load(target, False, monkeypatch, torch.float32)
    eng = BatchEngine(m, batch=2, max_seq=64)
    for p in PROMPTS[:2]:
        eng.submit(p, 8)
    eng.step()  # the prefill
    args = (torch.tensor([5, 6]), torch.tensor([3, 11]), torch.tensor([0, 64]))
    want = eng.decode_step(*args)
    got = torch.compile(eng.decode_step, fullgraph=True, backend="eager")(*args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [False, True])
def test_cuda_graph_buckets_plumbing_on_cpu(target, monkeypatch, fused):
    """cuda_graphs=True as it runs on CUDA, only the capture faked (test_graphs.FakeGraph: a replay reruns the step on
    its static inputs and fails if a persistent tensor moved): decode steps padded to 1, 2 or 4 rows give every
    sequence its batch-1 output, so the pad rows' KV stays in the scratch range past the batch's."""
    from types import SimpleNamespace

    import graphs
    from test_graphs import FakeGraph
    if fused and cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, fused, monkeypatch, torch.bfloat16 if fused else torch.float32)
    ref = batch1(m, PROMPTS, 24)

    def capture(self, static):
        graph = FakeGraph(self.fn, static, self.fn(*static), SimpleNamespace(model=m, drafter=None))
        return graph, graph.out

    monkeypatch.setattr(graphs.Graphed, "_capture", capture)
    eng = BatchEngine(m, batch=4, max_seq=128, cuda_graphs=True)
    assert eng.buckets == [1, 2, 4] and m.slots == 5 * 128
    assert eng.generate_batch(PROMPTS, 24) == ref
    sizes = {key[1][0][0][0] for key in eng.decode_fn.graphs}  # the first input's length: the padded rows
    assert 4 in sizes and sizes <= {1, 2, 4}  # graphs captured (a size's second call) at bucket sizes only
    three = BatchEngine(m, batch=4, max_seq=128, cuda_graphs=True)  # a pad row beside live sequences every step
    assert three.generate_batch(PROMPTS[1:4], 24) == ref[1:4]


def test_decode_step_is_capture_safe(target, monkeypatch):
    """The decode step cuda_graphs captures, on the PyTorch layers (CUDA's path), runs none of the ops a CUDA graph
    capture rejects (test_graphs.CaptureSafety: tensors from Python data, host reads, data-dependent shapes)."""
    from test_graphs import CaptureSafety
    m = load(target, False, monkeypatch, torch.float32)
    eng, bad = BatchEngine(m, batch=3, max_seq=128), []

    def step(*args):
        with CaptureSafety() as mode:
            out = eng.decode_step(*args)
        bad.extend(mode.bad)
        return out

    eng.decode_fn = step
    assert eng.generate_batch(PROMPTS, 12) == batch1(m, PROMPTS, 12) and not bad


def test_bad_input(target, monkeypatch):
    m = load(target, False, monkeypatch, torch.float32)
    with pytest.raises(UsageError, match="--batch"):
        BatchEngine(m, batch=0, max_seq=64)
    eng = BatchEngine(m, batch=2, max_seq=64)
    with pytest.raises(UsageError, match="prompt 0 is empty"):
        eng.submit([], 4)
    with pytest.raises(UsageError, match="exceed the 64 positions"):
        eng.submit(list(range(60)), 8)
    with pytest.raises(UsageError, match="max_new_tokens"):
        eng.submit([1, 2], 0)
    with pytest.raises(ValueError, match="temperature"):
        eng.submit([1, 2], 4, Sampling(temperature=-1.0))


def test_no_exact_batches_run_large_passes_on_the_layers(target, monkeypatch):
    """exact=False: the engine asks cpu_forward.layers_from for the size from which passes run the PyTorch layers,
    and they do (the prefill, and decode steps of as many sequences); exact leaves every pass to the fused pass."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    m = load(target, True, monkeypatch)
    monkeypatch.setattr(cpu_forward, "layers_from", lambda model: 3)
    rows, real = [], M.Transformer._layers
    monkeypatch.setattr(M.Transformer, "_layers", lambda self, x, *a: rows.append(x.shape[1]) or real(self, x, *a))
    exact, eng = BatchEngine(m, batch=3, max_seq=128), BatchEngine(m, batch=3, max_seq=128, exact=False)
    exact.generate_batch(PROMPTS[:3], 12)
    assert exact.plan.layers_from is None and rows == []  # the later engine's setting does not reach this one's passes
    got = eng.generate_batch(PROMPTS[:3], 12)
    assert eng.plan.layers_from == 3 and min(rows) == 3 and max(rows) > 3  # decode steps of 3 and the prefill
    assert all(len(g) == 12 or (len(g) < 12 and g[-1] in m.args.eos_ids) for g in got)  # eos or budget


@pytest.mark.parametrize("runner", [False, True])
def test_autoregressive_steps_wait_for_one_catch_up(tiny, monkeypatch, runner):
    """Steps without a draft are held back from the drafter; the next step that drafts brings the run to it as
    one chain of their accepted tokens, and at most BatchEngine.HELD wait (on the batch's own passes and on the
    runner's static-shape halves alike)."""
    m = tg.target(tiny[0])
    d, seen = tg.dl.NgramDrafter(k=4), []
    real = d.update
    monkeypatch.setattr(d, "update", lambda a: (seen.append(a.tree.tokens[a.path[:int(a.L)]].tolist()), real(a)))
    eng = Engine(m, drafter=d, budget=True)
    if runner:
        eng.batch.runner = eng.runner
    def pick(self, keys, left=0):  # the budget's choice, replaced by the sizes below
        self.key, self.chosen = (keys if isinstance(keys, str) else keys[0]), None
        self.budget(self.key)
        return next(sizes)
    sizes = iter([1, 1, 1, 3] + [1] * 100)
    monkeypatch.setattr(tg.budget_module.Budgets, "pick", pick)
    out, _ = eng.generate(tg.PROMPTS[0], 12)
    assert out == tg.autoregressive(m, tg.PROMPTS[0], 12)
    assert seen == [out[:3]]  # three held steps, their roots in one chain; none since (no step drafted)
    seen.clear()
    monkeypatch.setattr(type(eng.batch), "HELD", 2)
    sizes = iter([1] * 100)
    out, _ = eng.generate(tg.PROMPTS[1], 12)
    assert out == tg.autoregressive(m, tg.PROMPTS[1], 12)
    assert seen and all(len(x) == 2 for x in seen) and sum(seen, []) == out[:2 * len(seen)]


@pytest.mark.parametrize("at", ["accepted", "verified"])
def test_a_kept_step_updates_the_window_as_its_logits_do(tiny, monkeypatch, at):
    """The batch engine keeps a step for its drafter as the target's top-k rows instead of its logits: NanoSpec's
    window takes the same tokens from it, at the accepted positions or at every verified node (k_ver_at "verified",
    a draft model's: a top-k of the path alone had left the other nodes' out)."""
    m = tg.target(tiny[0])
    d = tg.make_drafter("eagle3", tiny, m, "nanospec", w_max=32)
    d.k_ver_at = at
    seen, real = [], BatchEngine._kept
    monkeypatch.setattr(BatchEngine, "_kept", lambda self, a, dd: seen.append((self, a, copy.deepcopy(dd)))
                        or real(self, a, dd))
    eng = Engine(m, drafter=d, budget=False)
    assert eng.generate(tg.PROMPTS[2], 24)[0] == tg.autoregressive(m, tg.PROMPTS[2], 24)
    window = lambda x: [t.clone() for t in (x.vocab.ring, x.vocab.count_, x.vocab.slot_of_, x.vocab.token_of_)]
    moved = 0
    for b, a, snap in seen:
        x, y = copy.deepcopy(snap), copy.deepcopy(snap)
        before = window(snap)
        x.update(a)
        y.update(real(b, a, snap))
        assert all(torch.equal(u, v) for u, v in zip(window(x), window(y)))
        moved += not all(torch.equal(u, v) for u, v in zip(window(x), before))
    assert len(seen) > 3 and moved


def test_readme_shows_the_step_as_it_is():
    """README's "One speculative step" shows BatchEngine.step's body line for line."""
    import inspect
    import textwrap
    from pathlib import Path
    readme = (Path(__file__).resolve().parent / "README.md").read_text()
    block = readme.split("The step:\n\n```python\n", 1)[1].split("```", 1)[0]
    body = textwrap.dedent(inspect.getsource(BatchEngine.step)).split('"""', 2)[2].lstrip("\n")
    assert textwrap.dedent(body) == block
