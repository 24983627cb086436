"""Decode loops: losslessness of every drafter x vocabulary, exact speculative sampling, the budget in the loop,
CLI errors. (Shared fixtures and helpers of the drafter tests live here too.)"""
import json

import pytest
import torch

import budget as budget_module
import cpu_forward
import cpu_gemm
import draft as dr
import draft_config as dc
import draft_eagle as de
import draft_hybrid as dh
import draft_lookup as dl
from budget import Budget, Policy
from conftest import write_eagle_head, write_tiny_hf
from eagle import load_eagle
from exact import Invariance
import sampling as sampling_rules
import generate as g
from engine import Engine
from generate import main
from sampling import Sampling, accept_greedy, best_path, logits_to_probs, sample_from
from model import load_model
from vocab import make_vocab
from model import Plan


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
        return dl.NgramDrafter(k=4, static=static)
    if kind == "hybrid":  # the EAGLE-3 tree with a prompt-lookup chain merged in
        head = load_eagle(heads["eagle3"], m, torch.float32, "cpu")
        ng = dl.NgramDrafter(k=4)
        vocab = make_vocab(vocab_spec, head.lm_weight(), w_max=w_max, ablation=ablation,
                           max_append=dc.append_width(nodes + ng.k, max(depth, ng.k), 3))
        # late_head: the head's prefill waits until it first drafts (the target's LM head given, as draft.make_drafter)
        return dh.HybridDrafter(de.EagleDrafter(head, vocab, topk, depth, nodes, m.lm_head if late_head else None), ng)
    if kind == "model":
        dm = load_model(dpath, dtype=torch.float32)
        return de.ModelDrafter(dm, make_vocab(vocab_spec, dm.lm_head.weight, w_max=w_max, ablation=ablation,
                                              max_append=5 * 4, fill=fill), k=4, sampling=sampling)
    if kind == "self":  # the target as its own draft model: every greedy proposal is accepted
        dm = load_model(path, dtype=torch.float32)
        return de.ModelDrafter(dm, make_vocab("full", dm.lm_head.weight), k=3, sampling=sampling)
    head = load_eagle(heads[kind], m, torch.float32, "cpu")
    vocab = make_vocab(vocab_spec, head.lm_weight(), w_max=w_max, ablation=ablation,
                       max_append=nodes + (depth + 1) * 3, token_to_row=de.EagleDrafter.token_to_row_map(head),
                       fill=fill)
    return de.EagleDrafter(head, vocab, topk, depth, nodes)


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
    shapes, real = [], dl.lookup_tree_of
    monkeypatch.setattr(dl, "lookup_tree_of",
                        lambda root, tok, par, pad_to=0: shapes.append(par) or real(root, tok, par, pad_to))
    eng = Engine(m, drafter=dl.NgramDrafter(k=4), budget=budget)
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


def _chi2_sf(x, dof):
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


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
        return accept_greedy(tree, torch.nn.functional.one_hot(
            tree.tokens[tree.parents.clamp(min=0)] * 0 + tree.tokens[1], probs.shape[-1]).float())
    monkeypatch.setattr(sampling_rules, "accept_sample", accept_sample_biased)
    with pytest.raises(AssertionError):
        test_speculative_sampling_is_exact(tmp_path, monkeypatch, kind, Sampling(1.0), None)


def accept_sample_biased(tree, probs, generator=None):
    hit = torch.zeros_like(tree.valid)
    hit[1] = True  # the first child is always accepted, whatever the target says
    path, L, best = best_path(tree, hit)
    return path, L, sample_from(probs[best], generator)


def test_cli_errors(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "missing"), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err
    assert main(["--checkpoint", str(tmp_path / "missing"), "--max-new-tokens", "0"]) == 2
    assert "max-new-tokens" in capsys.readouterr().err


def test_warmup_runs_without_autograd(tiny, monkeypatch):
    """Engine.warmup's passes run as a request's do, with grad off: a compiled step traced with grad on needs an
    autograd formula the C ops have none of (`generate.py --compile` on the CPU had failed in its warm-up)."""
    m = target(tiny[0])
    eng = Engine(m, drafter=make_drafter("eagle3", tiny, m, "nanospec"))
    forward, grad = m.forward, []
    monkeypatch.setattr(m, "forward", lambda *a, **k: grad.append(torch.is_grad_enabled()) or forward(*a, **k))
    eng.warmup()
    assert grad and not any(grad)


def test_cli_reads_the_prompt_before_loading_a_model(tmp_path, capsys, monkeypatch):
    """A missing prompt file is a one-line error before any model loads (a 1.5B model's load takes a minute)."""
    import generate
    monkeypatch.setattr(generate, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["--prompt", f"@{tmp_path / 'missing.txt'}", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "prompt file not found" in err and "\n" not in err


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_cpu_verify_equals_the_traced_step(tiny, dtype, monkeypatch):
    """Eager CPU requests on the fused pass run the batch engine's step with B = 1, whose verification takes
    shortcuts the traced step (torch.compile, CUDA graphs) cannot: greedy acceptance walks host lists, and the KV
    moves run in one C call (the bf16 fused cache). It gives the traced step's tokens, path, bonus, states and KV
    cache, on a tree whose accepted path must move (the target's tokens sit at second children), its prefixes and a
    chain. Without the fused pass (fp32: exact mode pads the PyTorch layers' passes) the traced step runs."""
    torch._dynamo.reset()
    m = load_model(tiny[0], dtype=dtype)
    prompt = PROMPTS[2]
    c = autoregressive(m, prompt, 5)  # the first token (the root), then the target's next four
    eng = Engine(m, drafter=dl.NgramDrafter(k=6), budget=False)  # budget off: each step verifies the whole tree
    sampled = Engine(m, Sampling(0.7), drafter=dl.NgramDrafter(k=4))
    # the variant is picked when the engine is built: the batch's own passes on the fused pass, else the halves
    assert (eng.batch.runner is None) == (sampled.batch.runner is None) == (m.cpu_pass is not None)
    assert (m.kv is not None) == (dtype == torch.bfloat16 and cpu_gemm.kernel() is not None)  # bf16: the C moves
    if eng.batch.runner is not None:
        return
    traced = torch.compile(eng.runner._spec_verify, fullgraph=True, backend="eager")
    b, d = eng.batch, eng.drafter
    req = eng.planner.plan(len(prompt), 16, d.nodes)
    n = torch.tensor(len(prompt))
    P = torch.tensor([-1, 0, 0, 2, 2, 4, 5])  # root -> (wrong, c1); c1 -> (wrong, c2); c2 -> c3 -> c4
    w = (c[1] + 1) % m.args.vocab_size
    tree = dr.Tree(torch.tensor([c[0], w, c[1], w, c[2], c[3], c[4]]), P, torch.tensor([0, 1, 1, 2, 2, 3, 4]),
                   dr.ancestor_mask(P, 4), torch.ones(7, dtype=torch.bool), None, 4)
    kv = lambda: [(name.split(".")[-1], x) for name, x in m.named_buffers()
                  if name.split(".")[-1] in ("k", "v", "kv", "kt")]
    caches = lambda: [x for _, x in kv()]
    Ls = []
    for t in (tree, tree.prefix(5), tree.prefix(3), tree.prefix(1), dr.chain_tree(torch.tensor(c[:3]))):
        b.resize(req.S)
        i = b.submit(prompt, 16)
        b.step()  # the prefill: its first token is the root, c[0]
        s = b.running[0]
        before = [x.clone() for x in caches()]
        monkeypatch.setattr(d, "draft", lambda root, n, budget=None, t=t: t)
        b.step()
        a1 = s.behind.steps[-1]  # the step as its drafter will read it
        after = [x.clone() for x in caches()]
        for x, old in zip(caches(), before):
            x.copy_(old)
        h2, a2 = traced(t, n, eng.planner.pass_rows(req, t.tokens.shape[0]))
        L = int(a2.L)
        assert s.new == h2.tolist()[3:2 + L] + [int(a2.bonus)] and int(a1.L) == L
        for x, y in zip((a1.path[:L], a1.bonus, a1.hidden), (a2.path[:L], a2.bonus, a2.hidden)):
            assert torch.equal(x, y)
        kept = torch.arange(len(prompt) + L)  # the slots a later step reads (past them: scratch either moves)
        for (name, x), y in zip(kv(), after):
            assert torch.equal(*((z[:, :, kept // 16, :, kept % 16] if name == "kt" else z[..., kept, :])
                                 for z in (x, y))), name
        Ls.append((L, a1.path[:L].tolist()))
        b.abort(i)
    assert Ls[:3] == [(5, [0, 2, 4, 5, 6]), (3, [0, 2, 4]), (2, [0, 2])] and Ls[3][0] == 1 and Ls[4][0] == 3


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


class Cycle(Budget):
    """Every size in turn, autoregressive steps included: each prefix of the drafted tree gets verified."""

    def pick(self):
        k = self.sizes[self.steps % len(self.sizes)]
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k


class Turns(Policy):
    """Every source the drafter offers in turn, never a trial: the sizes are the (stubbed) Budget's alone."""

    def choose(self, sources, ar_rate=0.0, may_try=None):
        self.steps, self.trying = self.steps + 1, False
        return sources[self.steps % len(sources)]


def recorded_budgets(monkeypatch) -> list:
    """Every budget.Budgets the engine makes from now on, in order: the tests read a request's budget here."""
    made = []

    class Recorded(budget_module.Budgets):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(budget_module, "Budgets", Recorded)
    return made


@pytest.mark.parametrize("kind,vocab", [("eagle3", "nanospec"), ("eagle2", "full"), ("eagle3_pruned", "full"),
                                        ("model", "nanospec"), ("ngram", "full"), ("hybrid", "nanospec")])
def test_greedy_lossless_with_every_budget(tiny, monkeypatch, kind, vocab):
    monkeypatch.setattr(budget_module, "Budget", Cycle)  # every source's budget cycles (budget.Budgets)
    monkeypatch.setattr(budget_module, "Policy", Turns)
    m = target(tiny[0])
    w_max = 48 if kind == "eagle3_pruned" else 64
    eng = Engine(m, drafter=make_drafter(kind, tiny, m, vocab, w_max=w_max), budget=True)
    for p in PROMPTS:
        out, st = eng.generate(p, 40)
        assert out == autoregressive(m, p, 40), (kind, p)
        hist = st.extra["budget_hist"]
        if len(out) == 40:
            assert len(hist) >= 3 and "1" in hist and 0 < st.extra["speculated_share"] < 1, hist


def test_real_budget_generates_and_reports(tiny, monkeypatch):
    m = target(tiny[0])
    budgets = recorded_budgets(monkeypatch)
    eng = Engine(m, drafter=make_drafter("eagle3", tiny, m, "nanospec"), budget=True)
    out, st = eng.generate(PROMPTS[2], 30)
    assert out == autoregressive(m, PROMPTS[2], 30)
    d = st.as_dict()
    # one choice per step after the prefill (the step picks its size as it starts: no choice for a step never run)
    assert sum(d["budget_hist"].values()) == st.target_forwards - 1 and "speculated_share" in d
    line = g.stats_line(st, m)
    assert "speculated on" in line and "verified nodes" in line
    assert budgets[-1].settle == 1  # eager CPU steps: one timing step per end of the range (budget.py)


def prefilled(m, drafters, prompt):
    """The target's prefill of prompt, handed to each drafter (set up for it) -> (first token [1], n)."""
    p = torch.tensor(prompt)
    S = Engine(m, drafter=drafters[0]).planner.plan(len(p), 8, max(d.nodes for d in drafters)).S
    m.setup_caches(1, S)
    with torch.no_grad():
        logits, hid, aux = m(p[None], torch.arange(len(p)), return_hidden=True, plan=Plan(drafters[0].aux_layers))
        tok = logits[0, -1].argmax().view(1)
        for d in drafters:
            d.setup(S)
            d.prefill(dr.Prefill(p, tok, logits[0], hid, aux))
    return tok, torch.tensor(len(p))


class Autoregressive(Budget):
    """Never speculates: every step is a one-row pass."""

    def pick(self):
        self.chosen[1] = self.chosen.get(1, 0) + 1
        return 1


@pytest.mark.parametrize("kind", ["eagle3", "hybrid"])
def test_budget_sizes_compile_once_each(tiny, monkeypatch, kind):
    """--compile with the fitted budget: each size of its set is one traced verify shape (the hybrid's trees
    are padded to one size under --compile), so a second request that moves through the same sizes traces
    nothing new, and its tokens are still autoregressive decoding's."""
    from torch._dynamo.testing import CompileCounter
    monkeypatch.setattr(budget_module, "Budget", Cycle)  # every source's budget cycles (budget.Budgets)
    monkeypatch.setattr(budget_module, "Policy", Turns)
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
