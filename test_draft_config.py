"""draft_config.py: draft kinds, drafter construction errors, the head folder's frequency file, and the CLI's
one-line errors for flags a drafter cannot honour."""
import json

import pytest
import torch

import draft_config as dc
from conftest import write_eagle_head, write_tiny_hf
from generate import main
from model import ModelError, load_model
from test_generate import tiny  # noqa: F401 (tiny: a fixture)


def test_draft_kind_errors(draft_env, tmp_path):
    root, path, cfg = draft_env
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="holds no weights"):
        dc.detect_draft_kind(tmp_path / "d")
    with pytest.raises(ModelError, match="not found"):
        dc.detect_draft_kind(tmp_path / "nope")
    assert dc.detect_draft_kind(path) == "model"
    assert dc.detect_draft_kind(write_eagle_head(tmp_path / "e", cfg, version=1)) == "eagle"


def test_head_folder_freq_fills_nanospec(draft_env, tmp_path):
    """A freq.pt in the head folder fills NanoSpec's free slots (most frequent first), through the one place
    drafters are built; "nofill" and the other vocabularies do without it."""
    root, path, cfg = draft_env
    head = write_eagle_head(tmp_path / "h", cfg, version=3)
    m = load_model(path, dtype=torch.float32)
    plain = dc.make_drafter(dc.DraftConfig(str(head), "nanospec", 4, 3, 10, w_max=64), m)
    assert not plain.vocab.has_fill
    torch.save([17, 3, 99, 3, 250], head / "freq.pt")  # (a repeated id keeps its first rank)
    d = dc.make_drafter(dc.DraftConfig(str(head), "nanospec", 4, 3, 10, w_max=64), m)
    assert d.vocab.has_fill and d.vocab.fill_tok[:5].tolist()[:4] == [17, 3, 99, 250]
    assert not dc.make_drafter(dc.DraftConfig(str(head), "nanospec", 4, 3, 10, w_max=64, ablation="nofill"),
                               m).vocab.has_fill
    assert not hasattr(dc.make_drafter(dc.DraftConfig(str(head), "full", 4, 3, 10), m).vocab, "has_fill")


def test_cli_draft_mismatch_errors(draft_env, tmp_path, capsys):
    root, path, cfg = draft_env
    other, _ = write_tiny_hf(tmp_path / "other", vocab_size=300)
    for argv in (["--draft", str(other)],
                 ["--tree-nodes", "500", "--draft", str(write_eagle_head(tmp_path / "h", cfg, version=3))],
                 ["--vocab", "nanospec"], ["--draft", "ngram", "--ngram-min", "4", "--ngram-max", "2"],
                 ["--draft", "ngram", "--ngram-occurrences", "0"],
                 ["--draft", str(tmp_path / "missing")]):
        assert main(["--checkpoint", str(path), "--raw", "--prompt", "x", "--max-new-tokens", "2", *argv]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Writing model shards" not in ln]
        assert len(err) == 1 and err[0].startswith("error:"), (argv, err)


def test_cli_ngram_needs_a_tree_drafter(tiny, capsys):
    """--ngram merges prompt lookup into an EAGLE head's or a draft model's tree: with no drafter it is a one-line
    error; with a draft model it runs (the hybrid, draft_hybrid.py: its stats)."""
    base = ["--checkpoint", str(tiny[0]), "--ngram", "--max-new-tokens", "6", "--raw", "--prompt", "abab",
            "--dtype", "float32"]
    rc = main(base + ["--draft", "none"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and "\n" not in err and "--ngram" in err, err
    assert main(base + ["--draft", str(tiny[2]), "--json"]) == 0
    assert "chain_only_steps" in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv,msg", [
    (["--draft", "ngram", "--spec-k", "0"], "--spec-k must be >= 1, got 0"),
    (["--draft", "MODEL", "--spec-k", "-3"], "--spec-k must be >= 1, got -3"),
    (["--k-pre", "-1"], "--k-pre must be >= 1, got -1"),
    (["--draft", "HEAD", "--vocab", "nanospec", "--k-ver", "-2"], "--k-ver must be >= 1, got -2"),
    (["--draft", "ngram", "--tree-topk", "4"], "--tree-topk does not apply to prompt lookup"),
    (["--spec-k", "3"], "--spec-k does not apply to --draft none"),
    (["--draft", "HEAD", "--no-ngram", "--spec-k", "3"], "--spec-k does not apply to an EAGLE head without --ngram"),
    (["--draft", "HEAD", "--no-ngram", "--ngram-min", "2"], "--ngram-min does not apply to an EAGLE head without"),
    (["--draft", "ngram", "--tree-dep", "3"], "--tree-depth does not apply to prompt lookup"),  # (an abbreviation)
    (["--draft", "MODEL", "--no-ngram", "--ngram-min", "2"], "--ngram-min does not apply to a draft model without"),
    (["--draft", "MODEL", "--spec-k", "3", "--tree-topk", "2"], "--spec-k is a draft model's chain and --tree-* its"),
    (["--draft", "MODEL", "--vocab", "full", "--k-ver-at", "accepted"], "--k-ver-at applies to the nanospec vocab"),
    (["--draft", "HEAD", "--vocab", "full", "--k-pre", "2"], "--k-pre applies to the nanospec vocabulary only"),
    (["--draft", "ngram", "--w-max", "64"], "--w-max applies to the nanospec vocabulary only (--vocab full)"),
])
def test_cli_flags_a_drafter_cannot_honour_are_one_line_errors(tiny, capsys, argv, msg):
    """Out-of-range values and flags the chosen drafter would ignore: `error: ...` and exit code 2, not a run
    with other settings (--spec-k 0 once drafted 11-node trees, --k-pre -1 ran silently)."""
    sub = {"HEAD": str(tiny[1]["eagle3"]), "MODEL": str(tiny[2])}
    rc = main(["--checkpoint", str(tiny[0]), "--max-new-tokens", "2", "--raw", "--prompt", "ab", "--dtype", "float32",
               *[sub.get(a, a) for a in argv]])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(err) == 1 and msg in err[0], (argv, err)


def test_flags_a_drafter_honours_still_run(tiny, capsys):
    """The same checks let through what the drafter reads, and a library caller's unused fields (bench sets the
    tree for every method)."""
    base = ["--checkpoint", str(tiny[0]), "--max-new-tokens", "3", "--raw", "--prompt", "ab", "--dtype", "float32"]
    for argv in (["--draft", "ngram", "--spec-k", "3", "--ngram-min", "2", "--ngram-max", "2"],
                 ["--draft", str(tiny[1]["eagle3"]), "--tree-topk", "3", "--spec-k", "4", "--vocab", "nanospec",
                  "--w-max", "64", "--k-pre", "2"],
                 ["--draft", str(tiny[2]), "--spec-k", "2", "--vocab", "full"]):
        assert main(base + argv) == 0, (argv, capsys.readouterr().err)
    capsys.readouterr()
    m = load_model(tiny[0], dtype=torch.float32)
    assert dc.make_drafter(dc.DraftConfig("ngram", tree_topk=4, tree_depth=3, tree_nodes=10, spec_k=3), m).k == 3
    with pytest.raises(ValueError, match="--spec-k must be >= 1"):
        dc.DraftConfig("ngram", spec_k=0)


def test_make_drafters_share_weights_not_state(draft_env, tmp_path):
    """A batch's drafters: one EAGLE head loaded once, each drafter with a twin that shares its weight tensors (and
    packed copies) but holds its own KV cache and its own NanoSpec window; prompt lookup and "none" likewise."""
    root, path, cfg = draft_env
    head = write_eagle_head(tmp_path / "h", cfg, version=3)
    m = load_model(path, dtype=torch.float32)
    ds = dc.make_drafters(dc.DraftConfig(str(head), "nanospec", 4, 3, 10, w_max=64, ngram=True), m, 3)
    heads = [d.tree.head for d in ds]
    assert len({id(h) for h in heads}) == 3 and len({id(d.vocab) for d in ds}) == 3
    for h in heads[1:]:
        for (k, a), (_, b) in zip(heads[0].named_parameters(), h.named_parameters()):
            assert a.data_ptr() == b.data_ptr(), k
        assert h.embed_tokens is heads[0].embed_tokens and h.cpu_pass is heads[0].cpu_pass
    for d in ds:
        d.setup(32)
    assert len({h.layer.self_attn.kv_cache.k.data_ptr() for h in heads}) == 3
    assert len({d.vocab.ring.data_ptr() for d in ds}) == 3
    assert len({id(d) for d in dc.make_drafters(dc.DraftConfig("ngram"), m, 2)}) == 2
    assert dc.make_drafters(dc.DraftConfig("none"), m, 2) == []
    dm, _ = write_tiny_hf(tmp_path / "dm", num_hidden_layers=1)
    with pytest.raises(ValueError, match="draft model"):
        dc.make_drafters(dc.DraftConfig(str(dm)), m, 2)
