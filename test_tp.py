"""tp.py: two ranks over gloo (torch.multiprocessing.spawn) on a tiny random model, against one process on the same
pass (the fused CPU pass, or the PyTorch layers): the same logits bit for bit, the same greedy tokens for AR and each
drafter (prompt lookup, EAGLE-3 with NanoSpec and with FR-Spec, the hybrid under the budget whose choices rank 0
broadcasts, a draft model), the same sampled tokens from the same seed (AR, prompt lookup, EAGLE-3, a draft model:
the whole tree every step), the batch engine's outputs one process's;
int8 and int4 targets too (their codes split with their scales);
a layer on the draft models' integer GEMM and a world size that does not divide a layer's outputs are one-line
errors; serve.py under torchrun serves one process's outputs."""
import concurrent.futures as cf
import datetime
import json
import os
import signal
import sys
import time
import urllib.error

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cpu_forward
import cpu_gemm
import draft_config as dc
import model as M
import qlinear
import quant
import quantize
import tp
from conftest import write_eagle_head, write_tiny_hf
from batch import BatchEngine
from engine import Engine, build_engine
from errors import UsageError
from sampling import Sampling
from test_serve import QUESTIONS, Served, chat_ids, folders, http, streamed  # noqa: F401 (folders: a fixture)
from tokenizer import Tokenizer

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6, 7]
LIMIT = datetime.timedelta(seconds=300)  # a rank left waiting on a failed one fails too, not the suite hanging
BATCH = [PROMPT, [40, 41, 40, 41, 40], [3, 4], list(range(20, 50))]
ENV = {cpu_gemm.ENV: "kernel", cpu_forward.ENV: "on"}  # the ranks load the model with the fused pass, as the CLI


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    path, _ = write_tiny_hf(root / "target", hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=3, num_key_value_heads=1, vocab_size=300, max_position_embeddings=256)
    write_eagle_head(root / "head", json.loads((path / "config.json").read_text()), version=3, seed=1)
    torch.save(list(range(299, -1, -2)), root / "freq.pt")
    write_tiny_hf(root / "draft", seed=2, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, vocab_size=300, max_position_embeddings=256)
    for mode in ("int8", "int4"):
        assert quantize.main(["--checkpoint", str(path), "--mode", mode, "--groupsize", "32",
                              "--out", str(root / mode)]) == 0
    return path, root / "head"


def run_all(path, head) -> dict:
    """What a rank (or one process) computes: a prompt's logits, each drafter's greedy tokens, sampled tokens."""
    m = tp.shard(M.load_model(path, dtype=torch.bfloat16))
    fused = "layers" if m.cpu_pass is None else "gathered" if m.cpu_pass.gather else "fused"
    tp.sync_budget()
    m.setup_caches(1, 64)
    gathers, real = [], dist.all_gather
    dist.all_gather = lambda *a, **k: gathers.append(1) or real(*a, **k)
    try:
        with torch.no_grad():
            out = {"logits": m(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0], "fused": fused}
    finally:
        dist.all_gather = real
    out["gathers"] = len(gathers)  # a pass's: q | k | v, o, gate | up and down each in one, per layer
    # every slice on the kernel, as one process's layers (the fused pass had taken the layers' packed copies)
    out["packed"] = [x.packed is not None for x in m.modules() if isinstance(x, M.Linear)]
    configs = {"ar": dc.DraftConfig("none"), "ngram": dc.DraftConfig("ngram", spec_k=4),
               "eagle": dc.DraftConfig(str(head), "nanospec", 4, 3, 10, w_max=64, ngram=False),
               "frspec": dc.DraftConfig(str(head), f"freq:{head.parent / 'freq.pt'}:40", 4, 3, 10, ngram=False),
               "model": dc.DraftConfig(str(head.parent / "draft"), "nanospec", 2, 3, 6, w_max=256, ngram=False),
               "hybrid": dc.DraftConfig(str(head), "nanospec", 4, 3, 10, spec_k=4, w_max=64, ngram=True)}
    for name, c in configs.items():
        e = build_engine(m, None, c, exact=True, budget=name == "hybrid")
        out[name] = e.generate(PROMPT, 24)[0]
    for name in ("ngram", "ar", "eagle", "model"):  # sampled, each from the same seed, the whole tree every step
        e = build_engine(m, None, configs[name], Sampling(0.8), exact=True, budget=False)
        torch.manual_seed(3)
        out["sampled" + ("" if name == "ngram" else " " + name)] = e.generate(PROMPT, 24)[0]
    # the batch engine, its budget's sizes rank 0's (the hybrid: a tree, a chain or none per sequence and step)
    b = BatchEngine(m, batch=2, max_seq=128, drafters=dc.make_drafters(configs["hybrid"], m, 2))
    out["batch"] = b.generate_batch(BATCH, 16)
    return out


def run_quantized(path) -> dict:
    """The int8 and int4 checkpoints beside path: each one's logits and greedy tokens."""
    out = {}
    for mode in ("int8", "int4"):
        m = tp.shard(M.load_model(path.parent / mode, dtype=torch.bfloat16))
        assert isinstance(getattr(m.layers[0].mlp.up_proj, "part", m.layers[0].mlp.up_proj), qlinear.QLinear)
        m.setup_caches(1, 64)
        with torch.no_grad():
            out[mode] = m(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0]
        out[mode + " tokens"] = build_engine(m, None, dc.DraftConfig("none"), exact=True).generate(PROMPT, 24)[0]
    return out


def leave():
    """A rank whose work is done and saved exits at once: a rank left to the interpreter's teardown of gloo's
    threads aborted once in a full CI run ("terminate called without an active exception", SIGABRT) after 4 clean
    runs of the same test alone. Reached only after the try block ends without an exception."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank(r: int, world: int, init: str, path, head, out: str, env: dict):
    os.environ.update(env)
    torch.set_num_threads(1)  # (two ranks on two cores)
    os.environ["NANOSPEC_BUDGET_CACHE"] = "off"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=r, world_size=world, timeout=LIMIT)
    try:
        res = run_all(path, head) | run_quantized(path)
        if r == 0:
            torch.save(res, out)
    finally:
        dist.barrier()  # (no rank closes its connections while the other still sends)
        dist.destroy_process_group()
    leave()


@pytest.mark.skipif(cpu_gemm.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")
@pytest.mark.parametrize("fused", ["on", "off"])
def test_two_ranks_are_one_process(files, tmp_path, monkeypatch, fused):
    """The ranks and one process load the model alike: with the fused CPU pass (the ranks' passes gather their GEMMs'
    slices through its callback), or with the PyTorch layers (Gathered linears)."""
    env = {cpu_gemm.ENV: "kernel", cpu_forward.ENV: fused, "NANOSPEC_BUDGET_CACHE": "off"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path, head = files
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), path, head, str(tmp_path / "out.pt"), env), nprocs=2)
    got, ref = torch.load(tmp_path / "out.pt"), run_all(path, head) | run_quantized(path)
    assert (got["fused"], ref["fused"]) == (("gathered", "fused") if fused == "on" else ("layers", "layers"))
    assert len(got["packed"]) == 3 * 7 + 1
    # the layers' slices on the kernel as one process's linears (whose q, k, v, gate, up the fused pass serves)
    assert got["packed"] == ref["packed"] and all(got["packed"]) == (fused == "off")
    assert got["gathers"] == 3 * 4 and ref["gathers"] == 0
    assert torch.equal(got["logits"], ref["logits"])
    assert got["batch"] == ref["batch"]
    for name in ("ar", "ngram", "eagle", "frspec", "model", "hybrid", "sampled", "sampled ar", "sampled eagle",
                 "sampled model", "int8 tokens", "int4 tokens"):
        assert got[name] == ref[name], name
    assert torch.equal(got["int8"], ref["int8"]) and torch.equal(got["int4"], ref["int4"])
    assert ref["ngram"] == ref["ar"] == ref["eagle"] == ref["frspec"] == ref["model"] == ref["hybrid"]
    assert ref["sampled"] != ref["ar"]


def run_summed(path, dtype, fused="off") -> dict:
    """--no-exact's all-reduce layout (the PyTorch layers; fused "on": the fused pass, which keeps its gathers): per
    pass, each collective's count; the logits; AR's greedy tokens."""
    os.environ[cpu_forward.ENV] = fused
    m = tp.shard(M.load_model(path, dtype=dtype), exact=False)
    m.setup_caches(1, 64)
    calls, real = {"all_gather": 0, "all_reduce": 0}, {k: getattr(dist, k) for k in ("all_gather", "all_reduce")}
    for k in calls:
        setattr(dist, k, lambda *a, k=k, **kw: calls.__setitem__(k, calls[k] + 1) or real[k](*a, **kw))
    try:
        with torch.no_grad():
            logits = m(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0]
    finally:
        for k, f in real.items():
            setattr(dist, k, f)
    return dict(logits=logits, calls=calls, heads=[m.layers[0].self_attn.n_heads, m.layers[0].self_attn.n_kv_heads],
                tokens=build_engine(m, None, dc.DraftConfig("none"), exact=False).generate(PROMPT, 24)[0],
                summed=sum(isinstance(x, tp.Summed) for x in m.modules()))


def _summed(r: int, world: int, init: str, paths, out: str):
    os.environ.update(ENV)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=r, world_size=world, timeout=LIMIT)
    try:
        res = [run_summed(*p) for p in paths]
        if r == 0:
            torch.save(res, out)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    leave()


@pytest.mark.skipif(cpu_gemm.kernel() is None, reason="needs x86-64 with AVX2+FMA and a C compiler")
def test_no_exact_sums_partial_products(files, tmp_path, monkeypatch):
    """--no-exact: each rank holds its heads (4 query, 2 key/value heads: 2 and 1 a rank) and its columns of the MLP,
    and a layer sums o_proj's and down_proj's partial products (2 all_reduces, no gather); where the heads do not
    divide (3 and 1) attention keeps its 2 gathers; a quantized model (int4) keeps every gather. The logits are one
    process's up to the sums' order (bf16 partial products; fp32: to 1e-5), and in fp32 the greedy tokens are one
    process's (in bf16 a tiny random model's near ties part them: at token 15 here). Where the fused pass runs,
    --no-exact keeps its gathers (4 a layer), and one process's logits bit for bit."""
    monkeypatch.setenv(cpu_gemm.ENV, "kernel")
    path, _ = files
    even, _ = write_tiny_hf(tmp_path / "even", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    bf16 = torch.bfloat16
    paths = [(even, torch.float32), (even, bf16), (path, bf16), (path.parent / "int4", bf16), (even, bf16, "on")]
    mp.spawn(_summed, args=(2, str(tmp_path / "init"), paths, str(tmp_path / "out.pt")), nprocs=2)
    got = torch.load(tmp_path / "out.pt")
    assert [g["calls"] for g in got] == [dict(all_gather=0, all_reduce=6)] * 2 + [
        dict(all_gather=6, all_reduce=3), dict(all_gather=12, all_reduce=0), dict(all_gather=12, all_reduce=0)]
    assert [g["heads"] for g in got] == [[2, 1], [2, 1], [3, 1], [3, 1], [4, 2]]
    assert [g["summed"] for g in got] == [6, 6, 3, 0, 0]
    for g, (p, dt, *fused) in zip(got, paths):
        monkeypatch.setenv(cpu_forward.ENV, fused[0] if fused else "off")
        m = M.load_model(p, dtype=dt)
        m.setup_caches(1, 64)
        with torch.no_grad():
            ref = m(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0]
        if g["summed"] == 0:  # gathered: one process's bits
            assert torch.equal(g["logits"], ref)
        else:
            assert (g["logits"] - ref).abs().max() <= (1e-5 if dt == torch.float32 else 0.02) * ref.abs().max()
        if dt == torch.float32 or g["summed"] == 0:
            assert g["tokens"] == build_engine(m, None, dc.DraftConfig("none"), exact=False).generate(PROMPT, 24)[0]


def _errors(r: int, world: int, init: str, path, out: str):
    os.environ.update(ENV)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=r, world_size=world, timeout=LIMIT)
    try:
        msgs = []
        m = M.load_model(path, dtype=torch.bfloat16)
        up = m.layers[0].mlp.up_proj = qlinear.QLinear(quant.quantize(m.layers[0].mlp.up_proj.weight.float(),
                                                                    quant.Scheme(4, 32)))
        fast = up.make_fast()  # (AVX-512 VNNI builds)
        for fn in (lambda: tp.shard(m), lambda: tp.split(torch.nn.Linear(8, 5), "odd", r, world)):
            try:
                fn()
                msgs.append(None)
            except UsageError as e:
                msgs.append(str(e))
        if r == 0:
            torch.save((fast, *msgs), out)
    finally:
        dist.barrier()  # (no rank closes its connections while the other still sends)
        dist.destroy_process_group()
    leave()


def test_what_does_not_shard_is_a_one_line_error(files, tmp_path):
    path, _ = files
    mp.spawn(_errors, args=(2, str(tmp_path / "init"), path, str(tmp_path / "out.pt")), nprocs=2)
    fast, draft_gemm, odd = torch.load(tmp_path / "out.pt")
    assert draft_gemm == ("tensor parallelism: layers.0.mlp.up_proj is on the draft models' integer GEMM, not a "
                          "target's") if fast else draft_gemm is None
    assert odd == "tensor parallelism: odd has 5 outputs, which 2 ranks do not divide"


def test_one_process_is_unchanged(files):
    path, _ = files
    m = M.load_model(path, dtype=torch.bfloat16)
    q = m.layers[0].self_attn.q_proj
    assert tp.world() == 1 and tp.shard(m) is m and m.layers[0].self_attn.q_proj is q and not tp.launched()


def test_what_tp_does_not_run_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """Under a launcher (WORLD_SIZE > 1) chat and --compile refuse before joining. (serve.py under TP:
    test_serve.py.)"""
    import generate
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv in (["--chat"], ["--compile"]):
        assert generate.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["error: tensor parallelism runs eager, without --chat: drop --chat and --compile"], argv


def test_two_tensor_parallel_ranks_serve_one_process_outputs(folders, tmp_path):
    """torchrun --nproc_per_node 2 serve.py: rank 0 serves HTTP and sends each turn's submits, aborts and steps to
    rank 1, whose engine follows; 6 concurrent greedy requests with the hybrid drafter (budget on) each equal the
    batch-1 output of one process (the fused CPU pass, as the ranks run it). SIGTERM to the launcher: rank 1 keeps
    following until rank 0 stops, so the request in flight streams to its end."""
    if cpu_forward.kernel() is None:
        pytest.skip("needs x86-64 with AVX2+FMA and a C compiler")
    env = os.environ | {"NANOSPEC_CPU_GEMM": "kernel", "OMP_NUM_THREADS": "1"}
    s = Served(tmp_path, "--checkpoint", str(folders / "tiny"), "--draft", str(folders / "head"), "--vocab",
               "nanospec", "--w-max", "64", "--tree-topk", "4", "--tree-depth", "3", "--tree-nodes", "10",
               "--spec-k", "4", "--batch", "4", "--max-seq", "256",
               launch=("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"), env=env)
    try:
        end = time.time() + 180
        while not s.ready() and time.time() < end:
            time.sleep(0.05)
        assert s.seen and s.seen[-1] == 200, s.log.read_text()
        os.environ[cpu_gemm.ENV] = "kernel"
        try:
            m = M.load_model(folders / "tiny", dtype=torch.bfloat16)
        finally:
            del os.environ[cpu_gemm.ENV]
        assert m.cpu_pass is not None
        eng, tok = Engine(m, exact=None), Tokenizer(folders / "tiny")
        jobs = [(QUESTIONS[i], 12 + 4 * i) for i in range(6)]
        want = []
        for q, n in jobs:
            out = eng.generate(chat_ids(tok, q), n)[0]
            want.append(out[:-1] if out[-1] in m.args.eos_ids else out)

        def run(job):
            q, n = job
            return streamed(s.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": q}], max_tokens=n, stream=True))

        with cf.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(run, jobs))
        assert [g[1] for g in got] == want
        it = iter(s.client().completions.create(model="tiny", prompt="abc", max_tokens=200, stream=True))
        first = next(it)
        s.proc.send_signal(signal.SIGTERM)
        _, ids, _, end = streamed(it)
        out = eng.generate(tok.encode("abc"), 200)[0]
        assert first.model_extra["nanospec"]["tokens"] and end["finish"] in ("stop", "length")
        head = [t["id"] for t in first.model_extra["nanospec"]["tokens"]]
        assert head + ids == [t for t in out if t not in m.args.eos_ids]
        s.proc.wait(timeout=60)  # (torchrun exits 1 on a signal, after its ranks)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            http(s.url + "/health")
    finally:
        s.stop()
