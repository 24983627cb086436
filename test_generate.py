"""Decode loops: losslessness of every drafter x vocabulary, exact speculative sampling, CLI errors."""
import json
import subprocess
import sys

import pytest
import torch
import torch.utils._pytree as pytree

import cpu_forward
import cpu_gemm
import draft as dr
import budget as budget_module
from budget import Budget
from conftest import write_eagle_head, write_tiny_hf
from eagle import load_eagle
from exact import LADDER, Invariance, PassRows
import generate as g
from generate import Engine, main
from sampling import Sampling, accept_greedy, accept_sample, best_path, logits_to_probs, sample_from
from model import causal_recent, load_model
from test_exact import fault_small_passes
from vocab import make_vocab

PROMPTS = [[5, 17, 99, 3, 42, 42, 8], [200, 201, 202, 203, 200, 201, 202], list(range(30, 60))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    path, hf = write_tiny_hf(root / "target")
    cfg = json.loads((path / "config.json").read_text())
    heads = {
        "eagle2": write_eagle_head(root / "e2", cfg, version=1, fc_bias=True, fmt="bin"),
        "eagle3": write_eagle_head(root / "e3", cfg, version=3),
        "eagle3_pruned": write_eagle_head(root / "e3p", cfg, version=3, draft_vocab=96, prefix="layers.0."),
    }
    dpath, _ = write_tiny_hf(root / "draftmodel", seed=7, num_hidden_layers=2)
    return path, heads, dpath, root


def target(path):
    return load_model(path, dtype=torch.float32)


def make_drafter(kind, tiny, m, vocab_spec="full", topk=4, depth=3, nodes=10, ablation=None, w_max=64, sampling=None,
                 static=False, fill=None, late_head=True):
    path, heads, dpath, root = tiny
    if kind == "ngram":
        return dr.NgramDrafter(k=4, static=static)
    if kind == "hybrid":  # the EAGLE-3 tree with a prompt-lookup chain merged in
        head = load_eagle(heads["eagle3"], m, torch.float32, "cpu")
        m.aux_layers = head.c.aux_layers
        ng = dr.NgramDrafter(k=4)
        vocab = make_vocab(vocab_spec, head.lm_weight(), w_max=w_max, ablation=ablation,
                           max_append=dr.append_width(nodes + ng.k, max(depth, ng.k), 3))
        # late_head: the head's prefill waits until it first drafts (the target's LM head given, as draft.make_drafter)
        return dr.HybridDrafter(dr.EagleDrafter(head, vocab, topk, depth, nodes, m.lm_head if late_head else None), ng)
    if kind == "model":
        dm = load_model(dpath, dtype=torch.float32)
        return dr.ModelDrafter(dm, make_vocab(vocab_spec, dm.lm_head.weight, w_max=w_max, ablation=ablation,
                                              max_append=5 * 4, fill=fill), k=4, sampling=sampling)
    if kind == "self":  # the target as its own draft model: every greedy proposal is accepted
        dm = load_model(path, dtype=torch.float32)
        return dr.ModelDrafter(dm, make_vocab("full", dm.lm_head.weight), k=3, sampling=sampling)
    head = load_eagle(heads[kind], m, torch.float32, "cpu")
    if head.c.version == 3:
        m.aux_layers = head.c.aux_layers
    vocab = make_vocab(vocab_spec, head.lm_weight(), w_max=w_max, ablation=ablation,
                       max_append=nodes + (depth + 1) * 3, token_to_row=dr.EagleDrafter.token_to_row_map(head),
                       fill=fill)
    return dr.EagleDrafter(head, vocab, topk, depth, nodes)


def autoregressive(m, prompt, n):
    return Engine(m).generate(prompt, n)[0]


@pytest.mark.parametrize("kind", ["eagle2", "eagle3", "eagle3_pruned", "model", "self", "ngram", "hybrid"])
@pytest.mark.parametrize("max_new", [1, 13, 40])
def test_greedy_lossless_every_drafter(tiny, kind, max_new):
    m = target(tiny[0])
    eng = Engine(m, drafter=make_drafter(kind, tiny, m))
    for p in PROMPTS:
        ref = autoregressive(m, p, max_new)
        out, st = eng.generate(p, max_new)
        assert out == ref, (kind, p)
        assert st.new_tokens == len(ref)
        if kind == "self" and len(ref) == max_new and max_new > 4:
            assert st.mean_accepted_length > 3.0  # the self-draft is always right


@pytest.mark.parametrize("budget", [False, True])
def test_greedy_lossless_with_lookup_trees(tiny, monkeypatch, budget):
    """Prompt lookup's trees with siblings (earlier occurrences continued differently) verify to the target's
    own greedy output, whole or as the budget's prefixes."""
    m = target(tiny[0])
    shapes, real = [], dr.lookup_tree_of
    monkeypatch.setattr(dr, "lookup_tree_of", lambda root, tok, par, pad_to=0: shapes.append(par) or real(root, tok, par, pad_to))
    eng = Engine(m, drafter=dr.NgramDrafter(k=4), budget=budget)
    for p in PROMPTS + [LOOKUP_PROMPT]:
        assert eng.generate(p, 40)[0] == autoregressive(m, p, 40), p
    assert sum(len(set(par)) < len(par) for par in shapes) >= 2  # trees with siblings were verified


@pytest.mark.parametrize("topk,depth,nodes", [(1, 1, 2), (2, 4, 9), (4, 3, 37), (5, 2, 12)])
def test_greedy_lossless_tree_shapes(tiny, topk, depth, nodes):
    m = target(tiny[0])
    eng = Engine(m, drafter=make_drafter("eagle3", tiny, m, topk=topk, depth=depth, nodes=nodes))
    for p in PROMPTS:
        assert eng.generate(p, 30)[0] == autoregressive(m, p, 30)


def test_greedy_lossless_across_eos(tiny):
    m = target(tiny[0])
    ref = autoregressive(m, PROMPTS[0], 60)
    # make a token that autoregressive decoding emits mid-way an eos token: both must stop right there
    stop = ref[10]
    m.args.eos_ids = [stop]
    ref = autoregressive(m, PROMPTS[0], 60)
    assert ref[-1] == stop and len(ref) <= 11
    for kind in ["eagle3", "self", "ngram"]:
        assert Engine(m, drafter=make_drafter(kind, tiny, m)).generate(PROMPTS[0], 60)[0] == ref, kind


@pytest.mark.parametrize("vocab_spec,ablation", [("nanospec", None), ("nanospec", "ctx"), ("nanospec", "ext"),
                                                 ("nanospec", "noasync"), ("nanospec+fill", None), ("freq", None)])
@pytest.mark.parametrize("kind", ["eagle2", "eagle3", "eagle3_pruned", "model"])
def test_greedy_lossless_every_vocab(tiny, tmp_path, vocab_spec, ablation, kind):
    m = target(tiny[0])
    if vocab_spec == "freq":
        torch.save(list(range(255, -1, -3)), tmp_path / "freq.pt")
        vocab_spec = f"freq:{tmp_path / 'freq.pt'}:40"
    fill = None
    if vocab_spec == "nanospec+fill":  # free slots score 30 fixed ids (rows of the pruned head too)
        vocab_spec, fill = "nanospec", list(range(0, 90, 3))
    w_max = 48 if kind == "eagle3_pruned" else 64  # the pruned head has 96 rows
    eng = Engine(m, drafter=make_drafter(kind, tiny, m, vocab_spec, ablation=ablation, w_max=w_max, fill=fill))
    for p in PROMPTS:
        out, st = eng.generate(p, 30)
        assert out == autoregressive(m, p, 30)
        assert st.extra["vocab_active_max"] <= (40 if vocab_spec.startswith("freq") else w_max)
        assert 0.0 <= st.extra["vocab_coverage"] <= 1.0


def test_ancestor_mask_and_tree_invariants(tiny):
    m = target(tiny[0])
    d = make_drafter("eagle3", tiny, m, topk=4, depth=4, nodes=25)
    d.setup(128)
    m.setup_caches(1, 128)
    p = torch.tensor(PROMPTS[2])
    logits, h, aux = m(p[None], torch.arange(len(p)), return_hidden=True)
    d.prefill(dr.Prefill(p, torch.tensor([3]), logits[0], h, aux))
    tree = d.draft(torch.tensor([3]), torch.tensor(len(p)))
    N = tree.tokens.shape[0]
    assert N == 25 and int(tree.parents[0]) == -1
    for i in range(1, N):
        par = int(tree.parents[i])
        assert 0 <= par < i  # parents before children
        assert int(tree.depth[i]) == int(tree.depth[par]) + 1
        slow = {i}
        j = par
        while j >= 0:
            slow.add(j)
            j = int(tree.parents[j])
        assert set(torch.nonzero(tree.anc[i]).flatten().tolist()) == slow
    # siblings are distinct tokens
    for i in range(N):
        kids = tree.tokens[tree.parents == i].tolist()
        assert len(kids) == len(set(kids))


def test_tree_budget_errors():
    with pytest.raises(ValueError, match="depth"):
        dr.check_tree_budget(4, 0, 5)
    with pytest.raises(ValueError, match="cannot fit"):
        dr.check_tree_budget(2, 2, 8)  # at most 1 + 2 + 4 = 7
    dr.check_tree_budget(10, 5, 60)


def _chi2_sf(x, dof):
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)))


# a prompt whose last token, 0, was followed twice by each token a and then by two different tokens: prompt
# lookup's first tree (root = the first sampled token) has siblings below the root whatever that token is
LOOKUP_PROMPT = [t for a in range(12) for t in (0, a, 1 + a % 10, 0, a, 1 + (a + 3) % 10)] + [11, 0]


@pytest.mark.parametrize("kind,samp,prefix", [("eagle3", Sampling(1.0), None), ("model", Sampling(1.0), None),
                                              ("eagle2", Sampling(0.8, top_k=6, top_p=0.9), None),
                                              ("eagle3", Sampling(1.0), 3), ("ngram", Sampling(1.0), None)])
def test_speculative_sampling_is_exact(tmp_path, monkeypatch, kind, samp, prefix):
    """The joint law of generated tokens 2 and 3 (both come from the first speculative step) must equal the
    target's. Exact probabilities come from teacher forcing; chi-square goodness of fit over 1500 seeded runs
    with cells of expected count < 5 pooled. Threshold p < 1e-4: for a correct sampler the false-failure
    rate over random seeds is 1e-4 per case (the seeds are fixed, so the test is deterministic).
    prefix: the budget verifies only the first 3 of the 6 drafted nodes (budget.py)."""
    if prefix:
        class Prefix(Budget):
            def pick(self):
                return prefix
        monkeypatch.setattr(budget_module, "Budget", Prefix)
    V = 12
    path, _ = write_tiny_hf(tmp_path / "t", vocab_size=V, seed=3)
    cfg = json.loads((path / "config.json").read_text())
    m = load_model(path, dtype=torch.float32)
    m.args.eos_ids = []
    root = tmp_path
    heads = {"eagle3": write_eagle_head(root / "e3", cfg, version=3, seed=1),
             "eagle2": write_eagle_head(root / "e2", cfg, version=1, seed=1)}
    dpath, _ = write_tiny_hf(root / "dm", vocab_size=V, num_hidden_layers=1, seed=9)
    tiny = (path, heads, dpath, root)
    eng = Engine(m, samp, drafter=make_drafter(kind, tiny, m, topk=3, depth=2, nodes=6, w_max=8, sampling=samp),
                 budget=prefix is not None)
    prompt = LOOKUP_PROMPT if kind == "ngram" else [1, 4, 7]  # prompt lookup: a first tree with siblings
    if kind == "ngram":
        d = eng.drafter
        branched = [len(set(d.lookup_tree(prompt + [t])[1])) < len(d.lookup_tree(prompt + [t])[1]) for t in range(V)]
        assert all(branched)
    # exact P(t2, t3) = sum_t1 P(t1) P(t2|t1) P(t3|t1,t2)
    T = len(prompt)
    m.setup_caches(V * V, T + 2)
    seqs = torch.tensor([[*prompt, a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        probs = logits_to_probs(m(seqs, torch.arange(T + 2)), samp).double()  # [V*V, T + 2, V]
    p1 = probs[0, T - 1]  # [V] (same prefix for every row)
    p2 = probs[::V, T]  # [V(t1), V(t2)]
    p3 = probs[:, T + 1].view(V, V, V)  # [t1, t2, t3]
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0).flatten()  # [V*V]
    n = 1500
    counts = torch.zeros(V * V, dtype=torch.float64)
    for seed in range(n):
        torch.manual_seed(seed)
        out, _ = eng.generate(prompt, 3)
        counts[out[1] * V + out[2]] += 1
    exp = joint * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp_c = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp_c > 0
    stat = float(((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum())
    pval = _chi2_sf(stat, int(keep.sum()) - 1)
    assert pval > 1e-4, (stat, pval)


@pytest.mark.parametrize("kind", ["eagle3", "ngram"])
def test_sampler_catches_a_biased_acceptance(tmp_path, monkeypatch, kind):
    """Guard for the test above: a deliberately wrong acceptance rule (always accept the first child)
    must fail the same chi-square check (prompt lookup's case too: its first tree, with siblings)."""

    def wrong(tree, probs):
        return accept_greedy(tree, torch.nn.functional.one_hot(tree.tokens[tree.parents.clamp(min=0)] * 0 + tree.tokens[1], probs.shape[-1]).float())
    monkeypatch.setattr(g, "accept_sample", lambda tree, probs: accept_sample_biased(tree, probs))
    with pytest.raises(AssertionError):
        test_speculative_sampling_is_exact(tmp_path, monkeypatch, kind, Sampling(1.0), None)


def accept_sample_biased(tree, probs):
    hit = torch.zeros_like(tree.valid)
    hit[1] = True  # the first child is always accepted, whatever the target says
    path, L, best = best_path(tree, hit)
    return path, L, sample_from(probs[best])


def test_cli_errors(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "missing"), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
    assert main(["--checkpoint", str(tmp_path / "missing"), "--max-new-tokens", "0"]) == 2
    assert "max-new-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("draft", ["none", "model"])
def test_cli_ngram_needs_an_eagle_head(tiny, capsys, draft):
    """--ngram merges prompt lookup into an EAGLE tree: with no drafter or a draft model it is a one-line error."""
    d = "none" if draft == "none" else str(tiny[2])
    rc = main(["--checkpoint", str(tiny[0]), "--draft", d, "--ngram", "--max-new-tokens", "2", "--raw", "--prompt", "ab",
               "--dtype", "float32"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and "\n" not in err and "--ngram" in err, err


def test_cli_default_eagle_drafting_is_hybrid_and_fitted(tiny, capsys):
    """With an EAGLE head the CLI merges a prompt-lookup chain (--ngram is on by default) and fits the budget;
    --no-ngram --budget fixed is the plain EAGLE tree verified whole."""
    base = ["--checkpoint", str(tiny[0]), "--draft", str(tiny[1]["eagle3"]), "--max-new-tokens", "12", "--raw",
            "--prompt", "abcabcabc", "--dtype", "float32", "--json"]
    assert main(base) == 0
    d = json.loads(capsys.readouterr().out)
    assert "accepted_from" in d and "budget_hist" in d
    assert main(base + ["--no-ngram", "--budget", "fixed"]) == 0
    d2 = json.loads(capsys.readouterr().out)
    assert "accepted_from" not in d2 and "budget_hist" not in d2 and d2["text"] == d["text"]


def test_cli_says_whether_it_is_exact(tiny, capsys, monkeypatch):
    """--json says exact true/false (the default is exact where that is free, the fused CPU pass of bf16
    models, else the fastest arithmetic); --exact where this CPU's check fails is a one-line error."""
    base = ["--checkpoint", str(tiny[0]), "--max-new-tokens", "4", "--raw", "--prompt", "ab", "--dtype", "float32",
            "--json"]
    for flags, exact in (([], False), (["--exact"], True), (["--no-exact"], False)):
        assert main(base + flags) == 0
        assert json.loads(capsys.readouterr().out)["exact"] is exact, flags
    if cpu_forward.kernel() is not None:
        monkeypatch.setenv("NANOSPEC_CPU_GEMM", "kernel")
        bf16 = base[:-2] + ["bfloat16", "--json"]
        for flags, exact in (([], True), (["--no-exact"], False)):
            assert main(bf16 + flags) == 0
            assert json.loads(capsys.readouterr().out)["exact"] is exact, flags
    monkeypatch.setattr(Invariance, "gemm_agrees", lambda self, r: False)  # a CPU whose kernels fail the check
    assert main(base + ["--exact"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --exact") and "\n" not in err
    assert Engine(target(tiny[0])).generate([5, 6], 3)[1].extra["exact"] is False  # the library default falls back


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
        assert eng.drafter.static and eng.drafter.draft(torch.tensor([5]), torch.tensor(3)).tokens.shape[0] == eng.drafter.k + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_cpu_verify_equals_the_traced_step(tiny, dtype):
    """Eager CPU verify steps take shortcuts the traced step (torch.compile, CUDA graphs) cannot: a one-node
    tree runs the decode step's pass, greedy acceptance walks host lists, and the KV moves run in one C call
    (the bf16 fused cache). Each gives the traced step's host values, path, bonus, logits and KV cache, on a
    tree whose accepted path must move (the target's tokens sit at second children), its prefixes and a chain."""
    torch._dynamo.reset()
    m = load_model(tiny[0], dtype=dtype)
    prompt = PROMPTS[2]
    c = autoregressive(m, prompt, 5)  # the first token (the root), then the target's next four
    eng = Engine(m, drafter=dr.NgramDrafter(k=4), budget=True)
    traced = torch.compile(eng._spec_verify, fullgraph=True, backend="eager")
    S, eng.R_ver = eng.plan(len(prompt), 16, 8)
    m.setup_caches(1, S)
    eng._prefill(torch.tensor(prompt), 1)
    n = torch.tensor(len(prompt))
    P = torch.tensor([-1, 0, 0, 2, 2, 4, 5])  # root -> (wrong, c1); c1 -> (wrong, c2); c2 -> c3 -> c4
    w = (c[1] + 1) % m.args.vocab_size
    tree = dr.Tree(torch.tensor([c[0], w, c[1], w, c[2], c[3], c[4]]), P, torch.tensor([0, 1, 1, 2, 2, 3, 4]),
                   dr.ancestor_mask(P, 4), torch.ones(7, dtype=torch.bool), None, 4)
    caches = lambda: [b for name, b in m.named_buffers() if name.split(".")[-1] in ("k", "v", "kv", "kt")]
    Ls = []
    for t in (tree, tree.prefix(5), tree.prefix(3), tree.prefix(1), dr.chain_tree(torch.tensor(c[:3]))):
        eng.R_ver = eng.pass_rows(t.tokens.shape[0], S)
        before = [x.clone() for x in caches()]
        h1, a1 = eng._spec_verify(t, n)
        after = [x.clone() for x in caches()]
        for x, old in zip(caches(), before):
            x.copy_(old)
        h2, a2 = traced(t, n)
        assert torch.equal(h1, h2)
        for x, y in zip((a1.path, a1.L, a1.bonus, a1.logits, a1.hidden), (a2.path, a2.L, a2.bonus, a2.logits, a2.hidden)):
            assert torch.equal(x, y)
        assert all(torch.equal(x, y) for x, y in zip(after, caches()))
        Ls.append((int(a1.L), a1.path[:int(a1.L)].tolist()))
        for x, old in zip(caches(), before):
            x.copy_(old)
    assert Ls[:3] == [(5, [0, 2, 4, 5, 6]), (3, [0, 2, 4]), (2, [0, 2])] and Ls[3][0] == 1 and Ls[4][0] == 3
    assert (m.kv is not None) == (dtype == torch.bfloat16 and cpu_gemm.kernel() is not None)  # bf16: the C moves


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
    elif id(x) not in seen and (isinstance(x, torch.nn.Module) or type(x).__module__ in ("draft", "vocab", "model")):
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

        monkeypatch.setattr(g.Graphed, "_capture", capture)
        eng.graphs, eng.fused_steps, eng.max_seq = True, True, 160
        eng.verify_step, eng.advance_step = g.Graphed(eng._spec_verify), g.Graphed(eng._spec_advance)
        for i, p in enumerate(PROMPTS):
            ref = autoregressive(m, p, 30)
            assert eng.generate(p, 30)[0] == ref, kind
            assert eng.generate(p, 30)[0] == ref, kind  # replays of graphs captured in the first request
            m.setup_caches(1, 300 + 8 * i)  # another engine on this model resizes its caches: re-capture
        assert eng.verify_step.graphs and eng.advance_step.graphs  # replays really happened


def verify_matches_decode(tiny, dtype, nodes, plain_sdpa=False, fault=None, trust_all=False, cache=None, kernel=False,
                          fused=False):
    """For one EAGLE-3 tree on the tiny target: per node, do its verify logits equal, bit for bit, the logits
    autoregressive decoding computes for the same token sequence (as Engine._decode_one runs it)?"""
    path, heads, _, _ = tiny
    m = load_model(path, dtype=dtype)
    if fault:
        fault(m)
    head = load_eagle(heads["eagle3"], m, dtype, "cpu")
    m.aux_layers = head.c.aux_layers
    d = dr.EagleDrafter(head, make_vocab("full", head.lm_weight()), topk=4, depth=4, nodes=nodes)
    e = Engine(m, drafter=d)
    if cache:  # a faulty model must not share the machine's answers for healthy kernels of its shapes
        e.invariance = Invariance(m, cache)
    if trust_all:  # the control: take every pass size as row-invariant without asking the machine
        e.invariance.gemm_agrees = e.invariance.attn_agrees = lambda r, S=None: True
    p = torch.tensor(PROMPTS[2] * 3)
    T = len(p)
    S, e.R_ver = e.plan(T, 8, nodes)
    e.R_dec = e.pass_rows(1, S)
    assert e.exact
    assert (cpu_gemm.enabled() and m.lm_head.packed is not None) == kernel
    assert (m.cpu_pass is not None) == fused
    if fused:  # the fused CPU pass: row-invariant by construction, no padding at all
        assert e.R_dec == PassRows(1, 1) and e.R_ver == PassRows(nodes, nodes), (e.R_dec, e.R_ver)
    elif kernel:  # row-invariant GEMMs by construction: no padding rows past the ladder's next size
        assert e.R_dec.gemm == 1 and e.R_ver.gemm == next(r for r in LADDER if r >= nodes), (e.R_dec, e.R_ver)
    if plain_sdpa:
        e.exact, e.R_ver, e.R_dec = False, PassRows(nodes, nodes), PassRows(1, 1)
    m.setup_caches(1, S)
    d.setup(S)
    with torch.no_grad():
        logits, hid, aux = m(p[None], torch.arange(T), return_hidden=True)
        tok = logits[0, -1].argmax().view(1)
        d.prefill(dr.Prefill(p, tok, logits[0], hid, aux))
        tree = d.draft(tok, torch.tensor(T))
        assert bool((tree.depth != torch.arange(len(tree.depth))).any())  # some nodes are off the spine
        tree_logits = e._verify(tree.tokens, tree.depth, tree.anc, torch.tensor(T))[0]
        same = []
        for i in range(len(tree.tokens)):
            chain = sorted(torch.nonzero(tree.anc[i])[:, 0].tolist(), key=lambda j: int(tree.depth[j]))
            m(p[None], torch.arange(T))  # same prefix KV; later slots are rewritten before being read
            for t, j in enumerate(chain):  # autoregressive decode steps, as Engine._decode_one runs them
                pos = T + t + torch.arange(e.R_dec.gemm)
                out = m(tree.tokens[j].view(1, 1).expand(1, e.R_dec.gemm), pos,
                        recent=causal_recent(pos) if e.exact else None, attn_rows=e.R_dec.attn)[0, 0]
            same.append(torch.equal(out, tree_logits[i]))
    return same


@pytest.mark.parametrize("dtype,plain_sdpa,nodes,gemm", [
    (torch.bfloat16, False, 14, "torch"), (torch.bfloat16, False, 14, "kernel"), (torch.float32, False, 14, "torch"),
    (torch.float32, True, 14, "torch"), (torch.float32, False, 17, "torch"), (torch.bfloat16, False, 50, "torch"),
    (torch.bfloat16, False, 50, "kernel"), (torch.float32, False, 50, "torch"), (torch.bfloat16, False, 14, "fused"),
    (torch.bfloat16, False, 50, "fused")])
def test_tree_verify_is_bitwise_autoregressive(tiny, dtype, plain_sdpa, nodes, gemm, monkeypatch):
    """CPU: every tree node's verify logits equal, bit for bit, the logits autoregressive decoding
    computes for the same token sequence (exact attention + the pass sizes exact.py finds on this machine).
    This is what makes greedy speculative output identical to autoregressive output even at near-ties.
    The plain-SDPA variant is the control (fp32, where attention's rounding differences reach the logits
    directly): a tree node off the spine sees its ancestors at scattered KV slots and rounds differently,
    so the assertion must fail there for at least one node (it shows the test can fail). gemm: torch's bf16
    GEMM, cpu_gemm's kernel in the PyTorch layers (row-invariant by construction, so no pass needs padding),
    or the fused CPU pass (cpu_forward.py: no exact attention, no padding)."""
    monkeypatch.setenv("NANOSPEC_CPU_GEMM", "torch" if gemm == "torch" else "kernel")
    monkeypatch.setenv("NANOSPEC_CPU_FORWARD", "on" if gemm == "fused" else "off")
    if gemm != "torch" and cpu_gemm.kernel() is None:
        pytest.skip("cpu_gemm's kernel needs x86-64 with AVX2+FMA and a C compiler")
    same = verify_matches_decode(tiny, dtype, nodes, plain_sdpa, kernel=gemm != "torch", fused=gemm == "fused")
    if plain_sdpa:
        assert not all(same)
    else:
        assert all(same), same


def test_exact_mode_pads_past_a_faulty_kernel(tiny, tmp_path):
    """The control for exact.py: a GEMM that rounds short passes differently (as a GEMV or partial-block path
    does on some CPUs) breaks bit-exactness when every pass size is trusted, and the machine check finds
    the sizes that keep it."""
    fault = lambda m: fault_small_passes(m, below=8)
    assert not all(verify_matches_decode(tiny, torch.float32, 14, fault=fault, trust_all=True, cache=tmp_path / "a"))
    assert all(verify_matches_decode(tiny, torch.float32, 14, fault=fault, cache=tmp_path / "b"))


@pytest.mark.parametrize("bad", ["missing", "corrupt"])
def test_cli_freq_file_errors_are_one_line(tiny, tmp_path, capsys, bad):
    """--vocab freq:FILE with a missing or corrupt file: one-line error, exit code 2 (no traceback)."""
    f = tmp_path / "freq.pt"
    if bad == "corrupt":
        f.write_bytes(b"\x80\x04not a pickle at all")
    rc = main(["--checkpoint", str(tiny[0]), "--draft", str(tiny[1]["eagle3"]), "--vocab", f"freq:{f}",
               "--max-new-tokens", "2", "--raw", "--prompt", "ab", "--dtype", "float32"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and "\n" not in err and str(f) in err, err


# ---------------------------------------------------------------- the speculative budget (budget.py)

class Cycle(Budget):
    """Every size in turn, autoregressive steps included: each prefix of the drafted tree gets verified."""

    def pick(self):
        k = self.sizes[self.steps % len(self.sizes)]
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k


@pytest.mark.parametrize("kind,vocab", [("eagle3", "nanospec"), ("eagle2", "full"), ("eagle3_pruned", "full"),
                                        ("model", "nanospec"), ("ngram", "full"), ("hybrid", "nanospec")])
def test_greedy_lossless_with_every_budget(tiny, monkeypatch, kind, vocab):
    monkeypatch.setattr(budget_module, "Budget", Cycle)  # every source's budget cycles (budget.Budgets)
    m = target(tiny[0])
    w_max = 48 if kind == "eagle3_pruned" else 64
    eng = Engine(m, drafter=make_drafter(kind, tiny, m, vocab, w_max=w_max), budget=True)
    for p in PROMPTS:
        out, st = eng.generate(p, 40)
        assert out == autoregressive(m, p, 40), (kind, p)
        hist = st.extra["budget_hist"]
        if len(out) == 40:
            assert len(hist) >= 3 and "1" in hist and 0 < st.extra["speculated_share"] < 1, hist


def test_real_budget_generates_and_reports(tiny):
    m = target(tiny[0])
    eng = Engine(m, drafter=make_drafter("eagle3", tiny, m, "nanospec"), budget=True)
    out, st = eng.generate(PROMPTS[2], 30)
    assert out == autoregressive(m, PROMPTS[2], 30)
    d = st.as_dict()
    assert sum(d["budget_hist"].values()) == st.target_forwards - 1 + 1 and "speculated_share" in d
    line = g.stats_line(st, m)
    assert "speculated on" in line and "verified nodes" in line
    assert eng.last_budget.settle == 1  # eager CPU steps: one timing step per end of the range (budget.py)


def prefilled(m, drafters, prompt):
    """The target's prefill of prompt, handed to each drafter (set up for it) -> (first token [1], n)."""
    p = torch.tensor(prompt)
    S, _ = Engine(m, drafter=drafters[0]).plan(len(p), 8, max(d.nodes for d in drafters))
    m.setup_caches(1, S)
    with torch.no_grad():
        logits, hid, aux = m(p[None], torch.arange(len(p)), return_hidden=True)
        tok = logits[0, -1].argmax().view(1)
        for d in drafters:
            d.setup(S)
            d.prefill(dr.Prefill(p, tok, logits[0], hid, aux))
    return tok, torch.tensor(len(p))


def test_pass_costs_are_measured_once_per_machine(tiny, monkeypatch, tmp_path):
    """The budget's pass-cost table: every size of the budget range, timed on the first request with the
    budget and read from the cache afterwards (a second engine too), and the request is still lossless."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    calls, real = [], cpu_forward.pass_seconds
    monkeypatch.setattr(cpu_forward, "pass_seconds", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    m = target(tiny[0])
    for _ in range(2):
        eng = Engine(m, drafter=make_drafter("eagle3", tiny, m, "nanospec"), budget=True)
        assert eng.generate(PROMPTS[0], 12)[0] == autoregressive(m, PROMPTS[0], 12)
    assert calls == [[1, 2, 4, 8, 10]]
    costs = eng.pass_costs(10)
    assert sorted(costs) == [1, 2, 4, 8, 10] and all(v > 0 for v in costs.values()) and len(calls) == 1
    assert eng.last_budget.of["eagle"].pass_s == costs


def test_prefix_is_the_smaller_budgets_tree(tiny):
    """EAGLE-2 nodes come best first with parents before children: every prefix is ancestor-closed and is
    what the drafter keeps with that node budget."""
    m = target(tiny[0])
    d = make_drafter("eagle3", tiny, m, topk=4, depth=3, nodes=12)
    small = make_drafter("eagle3", tiny, m, topk=4, depth=3, nodes=5)
    tok, n = prefilled(m, [d, small], PROMPTS[2])
    with torch.no_grad():
        tree, tree5 = d.draft(tok, n), small.draft(tok, n)
    assert (tree.parents[1:] < torch.arange(1, 12)).all()  # parents first
    for b in range(1, 13):
        sub = tree.prefix(b)
        assert sub.tokens.shape[0] == b and (sub.parents < b).all()
        assert torch.equal(sub.anc, tree.anc[:b, :b])
    assert torch.equal(tree.prefix(5).tokens, tree5.tokens) and torch.equal(tree.prefix(5).parents, tree5.parents)


def test_hybrid_tree_merges_the_chain(tiny):
    """The prompt-lookup chain follows the EAGLE tree where they agree and hangs its rest below: every tree
    node is kept once, the chain is one root-to-leaf path, parents come first, masks are the closure."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec", late_head=False)  # (its head drafts alone first)
    tok, n = prefilled(m, [d], PROMPTS[2])
    with torch.no_grad():
        t = d.eagle.draft(tok, n)
        first = int(torch.nonzero(t.parents == 0)[0])  # a first-level tree node
        absent = [v for v in range(256) if v not in set(t.tokens.tolist())][:2]  # tokens the tree lacks
        for chain in ([int(t.tokens[first]), *absent], [], absent):
            d.ngram.propose = lambda hist, c=chain: c
            h = d.draft(tok, n)
            N = h.tokens.shape[0]
            assert sorted(h.tokens.tolist()) == sorted(t.tokens.tolist() + chain[1 if chain and chain[0] ==
                                                                                 int(t.tokens[first]) else 0:])
            assert (h.parents[1:] < torch.arange(1, N)).all() and int(h.parents[0]) == -1
            assert torch.equal(h.anc, dr.ancestor_mask(h.parents, h.max_depth))
            if chain:  # the chain is the path from the root through nodes 1..len(chain)
                assert h.tokens[1:1 + len(chain)].tolist() == chain
                assert h.parents[1:1 + len(chain)].tolist() == list(range(len(chain)))
                assert d.source[1:1 + len(chain)] == (["both"] + ["ngram"] * 2 if chain[0] == int(t.tokens[first])
                                                      else ["ngram"] * 2)
            else:
                assert torch.equal(h.tokens, t.tokens)


def test_hybrid_skips_the_eagle_tree_when_the_budget_verifies_only_the_chain(tiny):
    """A budget below the whole tree gets the root + chain without the EAGLE tree being drafted (where the
    budget reaches no further than the chain, that is the merged tree's prefix of the same size), or where
    there is no chain an EAGLE tree drafted for that budget; the whole tree's budget (or none) drafts the
    whole tree."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec")
    tok, n = prefilled(m, [d], PROMPTS[2])
    chain = [7, 8, 9]
    d.ngram.propose = lambda hist: chain
    d.ngram.lookup_tree = lambda hist: (chain, [0, 1, 2])  # the continuations agree: the lookup tree is the chain
    with torch.no_grad():
        full = d.draft(tok, n)
        calls = []
        real = d.eagle.draft
        d.eagle.draft = lambda *a, **k: calls.append(1) or real(*a, **k)
        for b in (2, 3, 4):
            t = d.draft(tok, n, b)
            assert not calls and t.tokens.tolist() == [int(tok)] + chain and t.parents.tolist() == [-1, 0, 1, 2]
            assert torch.equal(t.prefix(b).tokens, full.prefix(b).tokens), b
            assert torch.equal(t.prefix(b).anc, full.prefix(b).anc), b
        assert d.draft(tok, n, 9).tokens.tolist() == [int(tok)] + chain and not calls
        d.ngram.lookup_tree = lambda hist: ([7, 8, 5], [0, 1, 0])  # they differ: siblings below the root
        t = d.draft(tok, n, 4)
        assert not calls and t.tokens.tolist() == [int(tok), 7, 8, 5] and t.parents.tolist() == [-1, 0, 1, 0]
        assert t.anc.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]] and t.max_depth == 2
        assert d.source == ["eagle", "ngram", "ngram", "ngram"]
        d.ngram.lookup_tree = lambda hist: (chain, [0, 1, 2])
        assert torch.equal(d.draft(tok, n, d.nodes).tokens, full.tokens) and len(calls) == 1
        assert torch.equal(d.draft(tok, n).tokens, full.tokens) and len(calls) == 2
        d.ngram.propose = lambda hist: []
        t4 = d.draft(tok, n, 4)
        assert torch.equal(t4.tokens, real(tok, n, 4).tokens) and t4.tokens.shape[0] == 4 and len(calls) == 3
        assert d.source == ["eagle"] * 4
        assert d.draft(tok, n, d.nodes).tokens.shape[0] == d.eagle.nodes and len(calls) == 4
    assert d.stats()["chain_only_steps"] == 5  # the 5 lookup steps above (b = 2, 3, 4, 9, and 4 with siblings)


def test_eagle_tree_for_a_small_budget_is_drafted_at_its_size(tiny):
    """A budget below the configured tree drafts a search scaled to it (EagleDrafter.shape_for): b nodes, parents
    first, the ancestor masks their closure, depth below b; 2 nodes are the root's best child, found without a
    single head forward; the whole budget (or none) drafts the configured tree."""
    m = target(tiny[0])
    d = make_drafter("eagle3", tiny, m, topk=4, depth=3, nodes=12)
    tok, n = prefilled(m, [d], PROMPTS[2])
    forwards = []
    real = d.head.forward
    d.head.forward = lambda *a, **k: forwards.append(1) or real(*a, **k)
    with torch.no_grad():
        for b, fw in ((2, 0), (4, 2), (8, 2)):
            forwards.clear()
            t = d.draft(tok, n, b)
            N = t.tokens.shape[0]
            assert N == b and len(forwards) == fw and d.shape_for(b) == (min(4, b // 2), min(3, b - 1), b), b
            assert int(t.parents[0]) == -1 and (t.parents[1:] < torch.arange(1, N)).all()
            assert torch.equal(t.anc, dr.ancestor_mask(t.parents, t.max_depth)) and int(t.depth.max()) < b
        logp, ids = d._logp(d.last_lm_in[None])
        assert d.draft(tok, n, 2).tokens.tolist() == [int(tok), int(d.tokens_of(ids[logp[0].argmax()]))]
        assert torch.equal(d.draft(tok, n, 12).tokens, d.draft(tok, n).tokens) and d.shape_for(12) == (4, 3, 12)


def test_hybrid_budgets_chain_and_tree_steps_apart(tiny):
    """With the fitted budget the hybrid's steps with a prompt-lookup chain and those without keep separate
    statistics (budget.Budgets, keyed by budget_key), the draft reuses the key's proposal, and the output is
    still autoregressive decoding's."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec")
    real, calls = d.ngram.match, []
    d.ngram.match = lambda hist: calls.append(len(hist)) or (real(hist) if len(hist) % 2 else (0, []))
    eng = Engine(m, drafter=d, budget=True)
    out, st = eng.generate(PROMPTS[1] * 3, 40)
    assert out == autoregressive(m, PROMPTS[1] * 3, 40)
    srcs = st.extra["budget_sources"]
    chains = [s for s in srcs if s != "eagle"]  # one source per suffix-match length (draft.match_key)
    assert "eagle" in srcs and chains and set(chains) <= {"ngram1", "ngram2", "ngram3"}
    assert abs(sum(x["share"] for x in srcs.values()) - 1) < 1e-3
    assert sum(st.extra["budget_hist"].values()) == sum(sum(x["budget_hist"].values()) for x in srcs.values())
    assert len(calls) == len(set(calls))  # one proposal per step: the draft took budget_key's
    # each source picks from the drafter's sizes for it: the chain steps stop at the whole chain, then the
    # merged tree; the engine timed the passes of both sets
    k = d.ngram.k
    chain_sizes = [s for s in (1, 2, 4, 8) if s <= k] + [1 + k, d.nodes]
    for c in chains:
        assert eng.last_budget.of[c].sizes == d.budget_sizes(c) == chain_sizes
        assert eng.last_budget.of[c].start == 1 + k and str(1 + k) in srcs[c]["budget_curve"]
    assert eng.last_budget.of["eagle"].sizes == d.budget_sizes("eagle") and 1 + k not in d.budget_sizes("eagle")
    assert d.budget_sizes("eagle")[-1] == d.eagle.nodes  # (no chain: sizes past the EAGLE tree draft the same)
    assert eng.last_budget.of["eagle"].start == d.eagle.nodes
    assert set(d.budget_sizes()) == set(d.budget_sizes("ngram1") + d.budget_sizes("eagle"))


def test_hybrid_head_catches_up_only_when_it_drafts(tiny):
    """The hybrid's head sees the accepted steps only when it drafts next (or at 64 pending): every head update
    comes right before an EAGLE draft, chain-alone and autoregressive steps never pay one, and the output is
    still autoregressive decoding's."""
    m = target(tiny[0])
    d = make_drafter("hybrid", tiny, m, "nanospec")
    events, real_update, real_draft = [], d.eagle.update, d.eagle.draft
    d.eagle.update = lambda a: events.append("update") or real_update(a)
    d.eagle.draft = lambda *a, **k: events.append("draft") or real_draft(*a, **k)
    eng = Engine(m, drafter=d, budget=True)
    prompt = PROMPTS[1] * 3
    out, st = eng.generate(prompt, 40)
    assert out == autoregressive(m, prompt, 40)
    assert st.extra["chain_only_steps"] > 0 and events.count("draft") > 0
    assert all(e == "draft" for prev, e in zip(events, events[1:]) if prev == "update"), events
    assert events.count("update") <= events.count("draft")


class Autoregressive(Budget):
    """Never speculates: every step is a one-row pass."""

    def pick(self):
        self.chosen[1] = self.chosen.get(1, 0) + 1
        return 1


def test_hybrid_head_starts_late_and_drafts_as_if_it_had_not(tiny, monkeypatch):
    """The hybrid's head waits for its first draft (its pass over the prompt, the prompt logits NanoSpec's
    window starts from, the window's reset), then catches up: under a budget that mixes chain-alone,
    autoregressive and whole-tree steps every EAGLE tree it drafts equals an eagerly prefilled head's, and the
    engine's prefill projects one logit row for it, not the window's. A request that never drafts with the head
    never runs it. Outputs are autoregressive decoding's."""
    monkeypatch.setattr(budget_module, "Budget", Cycle)
    monkeypatch.setattr(dr.VocabDrafter, "PROJECT_ROWS", 3)
    m = target(tiny[0])
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 40)
    trees, prefills = {}, {}
    for late in (True, False):
        d = make_drafter("hybrid", tiny, m, "nanospec", late_head=late)
        got, pre = trees.setdefault(late, []), prefills.setdefault(late, [])
        draft = d.eagle.draft
        d.eagle.draft = lambda *a, f=draft, got=got, **k: (t := f(*a, **k), got.append(t.tokens.tolist()))[0]
        reset = d.eagle.vocab.reset  # the prompt's top-k the window starts from (late: projected in 3-row chunks)
        d.eagle.vocab.reset = lambda rows, top, f=reset, pre=pre: (pre.append(top.clone()), f(rows, top))[1]
        assert d.prompt_logits == (0 if late else d.eagle.prompt_logits)
        out, st = Engine(m, drafter=d, budget=True).generate(prompt, 40)
        assert out == ref and st.extra["head_started"]
    assert trees[True] == trees[False] and len(trees[True]) > 2
    assert len(prefills[True]) == len(prefills[False]) == 1
    assert prefills[True][0].shape[0] > 6 and torch.equal(prefills[True][0], prefills[False][0])  # projected later
    monkeypatch.setattr(budget_module, "Budget", Autoregressive)
    d = make_drafter("hybrid", tiny, m, "nanospec")
    d.eagle.prefill = lambda p: pytest.fail("the head ran without drafting")
    out, st = Engine(m, drafter=d, budget=True).generate(prompt, 40)
    assert out == ref and not st.extra["head_started"] and "vocab_coverage" not in st.extra


def test_eagle_takes_the_prompts_top_k_itself_as_from_the_engines_logits(tiny, monkeypatch):
    """An EAGLE drafter given the target's LM head (as make_drafter gives it) projects the prompt rows NanoSpec's
    window starts from itself, in chunks each reduced to its top-k, from the prefill's hidden states: the
    engine's prefill then projects one row, and the window, the trees and the output are those from the
    engine's [R, V] prompt logits."""
    monkeypatch.setattr(dr.VocabDrafter, "PROJECT_ROWS", 3)
    m = target(tiny[0])
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 24)
    tops, trees = [], []
    for project in (m.lm_head, None):
        d = make_drafter("eagle3", tiny, m, "nanospec")
        d.project = project
        assert d.prompt_logits == (0 if project is not None else d.window_rows) and d.window_rows > 6
        reset, draft, got = d.vocab.reset, d.draft, []
        d.vocab.reset = lambda rows, top, f=reset: (tops.append(top.clone()), f(rows, top))[1]
        d.draft = lambda *a, f=draft, **k: (t := f(*a, **k), got.append(t.tokens.tolist()))[0]
        out, _ = Engine(m, drafter=d).generate(prompt, 24)
        assert out == ref
        trees.append(got)
    assert tops[0].shape[0] == min(len(prompt), d.window_rows) and torch.equal(tops[0], tops[1])
    assert trees[0] == trees[1] and len(trees[0]) > 2


def test_hybrid_head_starts_where_the_budget_says_it_pays(tiny, monkeypatch):
    """The late head's start is priced by the last one (its seconds per waiting token) and budget.Budgets
    holds EAGLE drafts back until waiting would have cost as much (ski rental): a first start measures the
    price, a start priced far above what the head saves never comes, one priced near zero does. The start's
    seconds are reported and taken out of the step times (setup_paid); outputs are autoregressive decoding's."""
    monkeypatch.setattr(budget_module, "Budget", Cycle)  # every size in turn: the head's drafts are asked for
    m = target(tiny[0])
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 40)
    d = make_drafter("hybrid", tiny, m, "nanospec")
    eng = Engine(m, drafter=d, budget=True)
    out, st = eng.generate(prompt, 40)
    assert out == ref and st.extra["head_started"] and st.extra["head_start_s"] > 0
    assert d.start_rate > 0 and d.start_s == 0.0  # measured, and the engine took it out of the steps' times
    d.start_rate = 1e6
    out, st = eng.generate(prompt, 40)
    assert out == ref and not st.extra["head_started"] and st.extra["budget_hist"].get("1", 0) > 0
    monkeypatch.setattr(budget_module.Budget, "saving", lambda self, sizes: 1.0)
    d.start_rate = 1e-9
    out, st = eng.generate(prompt, 40)
    assert out == ref and st.extra["head_started"]


def test_budget_memory_outlives_the_process_where_asked(tiny, tmp_path, monkeypatch):
    """build_engine(budget_cache=True) (the CLI): a request's budget memory and the hybrid head's start price
    are stored under a key of the machine, model and settings; a new engine of the same settings (the next
    `python generate.py`) starts from them, one of other settings (sampling) from nothing, and an unreadable
    file leaves the memory empty. Outputs stay autoregressive decoding's."""
    monkeypatch.setenv("NANOSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("NANOSPEC_BUDGET_CACHE", "on")
    m = target(tiny[0])
    m.aux_layers = load_eagle(tiny[1]["eagle3"], m, torch.float32, "cpu").c.aux_layers
    prompt = PROMPTS[1] * 3
    ref = autoregressive(m, prompt, 40)
    c = dr.DraftConfig(str(tiny[1]["eagle3"]), "nanospec", 4, 3, 10, spec_k=4, w_max=64, ngram=None)
    new = lambda sampling=Sampling(): g.build_engine(m, None, c, sampling, budget_cache=True)
    first = new()
    assert first.budget_memory == {}
    out, _ = first.generate(prompt, 40)
    assert out == ref and first.budget_memory
    stored = json.loads((tmp_path / "budget.json").read_text())
    assert len(stored) == 1 and set(next(iter(stored.values()))["sources"]) == set(first.budget_memory)
    second = new()
    assert {k: b.state() for k, b in second.budget_memory.items()} == {k: b.state() for k, b in first.budget_memory.items()}
    assert second.drafter.start_rate == first.drafter.start_rate
    out, _ = second.generate(prompt, 40)
    assert out == ref
    assert new(Sampling(temperature=0.7)).budget_memory == {}  # another key
    assert g.build_engine(m, None, c, Sampling()).budget_memory == {}  # no budget_cache: benchmarks start afresh
    (tmp_path / "budget.json").write_text("{not json")
    assert new().budget_memory == {}
    monkeypatch.setenv("NANOSPEC_BUDGET_CACHE", "off")
    (tmp_path / "budget.json").unlink()
    new().generate(prompt, 8)
    assert not (tmp_path / "budget.json").exists()


def test_hybrid_head_waiting_keeps_only_the_accepted_positions(tiny):
    """While the head waits, the steps it has not seen are folded every 64 into one chain of their accepted
    positions (draft.chained: the target logits of the path rows, not of whole trees), each run once (a later
    run is a chunk of its own, not the earlier ones copied again); its first draft then equals an eagerly
    prefilled head's that caught up at 64 and 128."""
    m = target(tiny[0])
    late, eager = (make_drafter("hybrid", tiny, m, "nanospec", late_head=f) for f in (True, False))
    tok, n = prefilled(m, [late, eager], PROMPTS[0])
    with torch.no_grad():
        for _ in range(134):  # one-token steps, as the engine hands autoregressive runs over
            logits, hid, aux = m(tok[None], n.view(1), return_hidden=True)
            nxt = logits[0, -1].argmax()
            acc = dr.Accepted(dr.chain_tree(tok), torch.zeros(1, dtype=torch.long), torch.tensor(1), nxt, logits[0],
                              hid, aux, n)
            for d in (late, eager):
                d.update(acc)
            tok, n = nxt.view(1), n + 1
        assert len(late.pending) == 6 and len(late.chunks) == 2 and sum(int(c.L) for c in late.chunks) == 128
        k = late.eagle.vocab.k_ver  # (each chunk keeps the target's top-k_ver per position, not its logits)
        assert all(int(c.L) == 64 and c.top.shape == (64, k) and c.logits.shape[0] == 0 for c in late.chunks)
        assert len(eager.pending) == 6 and not eager.chunks and late.deferred is not None
        assert torch.equal(late.draft(tok, n).tokens, eager.draft(tok, n).tokens)
    assert late.deferred is None and not late.pending and not late.chunks


def test_hybrid_reports_where_accepted_tokens_came_from(tiny):
    m = target(tiny[0])
    eng = Engine(m, drafter=make_drafter("hybrid", tiny, m, "nanospec"))
    out, st = eng.generate(PROMPTS[1] * 3, 40)  # repetitive: prompt lookup finds continuations
    assert out == autoregressive(m, PROMPTS[1] * 3, 40)
    share = st.extra["accepted_from"]
    assert set(share) == {"ngram", "eagle", "both"} and abs(sum(share.values()) - 1) < 1e-3
    assert "accepted draft tokens from" in g.stats_line(st, m)


@pytest.mark.parametrize("kind", ["eagle3", "hybrid"])
def test_budget_sizes_compile_once_each(tiny, monkeypatch, kind):
    """--compile with the fitted budget: each size of its set is one traced verify shape (the hybrid's trees
    are padded to one size under --compile), so a second request that moves through the same sizes traces
    nothing new, and its tokens are still autoregressive decoding's."""
    from torch._dynamo.testing import CompileCounter
    monkeypatch.setattr(budget_module, "Budget", Cycle)  # every source's budget cycles (budget.Budgets)
    torch._dynamo.reset()
    m = target(tiny[0])
    d = make_drafter(kind, tiny, m, "nanospec")
    if kind == "hybrid":
        d.ngram.static = True
    cnt = CompileCounter()
    eng = Engine(m, compile=True, backend=cnt, drafter=d, budget=True)
    p = PROMPTS[1] * 2
    ref = autoregressive(m, p, 40)
    assert eng.generate(p, 40)[0] == ref
    traced = cnt.frame_count
    assert traced >= 2
    out, st = eng.generate(p, 40)
    assert out == ref and cnt.frame_count == traced, (traced, cnt.frame_count)
    assert len(st.extra["budget_hist"]) >= 3

