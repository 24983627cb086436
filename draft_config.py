"""How to draft (`DraftConfig`), its CLI flags, and `make_drafter`, which builds a drafter and its vocabulary."""
import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from download import default_draft, resolve_checkpoint, shipped_fill
from draft import check_tree_budget
from draft_eagle import EagleDrafter
from draft_hybrid import HybridDrafter
from draft_lookup import NgramDrafter
from draft_model import ModelDrafter
from eagle import EagleHead, load_eagle, read_keys
from model import ModelError, Transformer, load_model
from sampling import Sampling
from tokenizer import Tokenizer
from qlinear import QLinear
from vocab import make_vocab


def detect_draft_kind(path: Path) -> str:
    """'eagle' (fc.weight present) or 'model' (a checkpoint model.py loads)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"draft folder not found: {path}")
    if (path / "model.safetensors.index.json").is_file():
        return "model"
    try:
        keys, _ = read_keys(path)
    except ModelError:
        raise ModelError(f"draft folder {path} holds no weights (model.safetensors or pytorch_model.bin)") from None
    if "fc.weight" in keys:
        return "eagle"
    if any(k.startswith("layers.") for k in keys) and keys.keys() & {"embed_tokens.weight", "embed_tokens.qweight"}:
        return "model"
    raise ModelError(f"draft folder {path} is neither an EAGLE head nor a causal LM checkpoint")


# EAGLE-2 tree (top-k, depth, nodes): the papers' on GPUs; on CPU 16 nodes beat 60 at nearly the same acceptance
TREE_GPU, TREE_CPU = (10, 5, 60), (8, 5, 16)
# a draft model's largest tree; its budget also drafts chains of 2-6 tokens (draft_model.CHAIN_MAX): a level is a
# pass of the model, so depth costs what width does not (the GPU tree is not measured yet)
MODEL_TREE_GPU, MODEL_TREE_CPU = (10, 6, 60), (4, 6, 16)
NGRAM_K = 10  # prompt lookup's chain, alone or in a hybrid (--spec-k where it is prompt lookup's)
# NanoSpec's window per drafter kind (w_max, k_pre, k_ver, k_ver_at): the paper's for EAGLE heads; a draft model's
# proposals run as deep as its text is predictable, so its window must hold what comes next (README, Draft models)
HEAD_WINDOW = dict(w_max=3072, k_pre=3, k_ver=3, k_ver_at="accepted")
# a draft model: 8192 slots, all scored (free ones score fill tokens): on the real pair 94% of the full head's tau
# at 11-13x less LM-head time (16384: 96% at 7x; BENCHMARKS.md); the window's own tokens take under 2,100 slots
MODEL_WINDOW = dict(w_max=8192, k_pre=16, k_ver=16, k_ver_at="verified")
DRAFT_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "*.safetensors", "model.safetensors.index.json", "pytorch_model.bin"]


@dataclass
class DraftConfig:
    """How to draft; each field is a flag of generate.py and bench.py."""
    draft: str = "none"  # none | ngram | an EAGLE-1/2 or EAGLE-3 head, or a draft model (folder or hub id)
    vocab: str = "full"  # full | freq:PATH[:K] | nanospec (drafters with an LM head)
    tree_topk: int | None = None  # EAGLE-2 tree; None: TREE_CPU or TREE_GPU by device
    tree_depth: int | None = None
    tree_nodes: int | None = None
    spec_k: int | None = None  # chain length: a draft model's chain (None: its trees), n-grams 10
    ngram_min: int = 1
    ngram_max: int = 3
    w_max: int | None = None  # NanoSpec window (None here and below: HEAD_WINDOW's or MODEL_WINDOW's)
    k_pre: int | None = None  # NanoSpec: target top-K per prompt position
    k_ver: int | None = None  # NanoSpec: target top-K per verified position
    ablation: str | None = None  # NanoSpec ablation: ctx | ext | noasync | nofill
    k_ver_at: str | None = None  # NanoSpec: accepted | verified (every verified node)
    fill: str | None = None  # NanoSpec's free slots: a frequency file or "ids"; None: the draft folder's freq.pt (else
    # "ids" for draft models)
    static: bool = False  # n-gram chains padded to spec_k + 1 nodes: one compiled verify shape
    ngram: bool | None = False  # merge a prompt-lookup chain into a head's or model's tree; None: on for them
    ngram_occurrences: int = 8  # prompt lookup's tree: continuations of this many earlier occurrences
    # the CLI's flags given: one the chosen drafter would ignore is an error; not in repr (keys budget memory)
    given: frozenset = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self):
        for flag, v in (("spec-k", self.spec_k), ("k-pre", self.k_pre), ("k-ver", self.k_ver), ("w-max", self.w_max)):
            if v is not None and v < 1:
                raise ValueError(f"--{flag} must be >= 1, got {v}")
        if self.k_ver_at not in (None, "accepted", "verified"):
            raise ValueError(f"--k-ver-at must be accepted or verified, got {self.k_ver_at}")

    def tree(self, device, cpu=TREE_CPU, gpu=TREE_GPU) -> tuple[int, int, int]:
        """(top-k, depth, nodes) with this device's defaults filled in."""
        dflt = cpu if torch.device(device).type == "cpu" else gpu
        return tuple(d if v is None else v for v, d in zip((self.tree_topk, self.tree_depth, self.tree_nodes), dflt))

    def window(self, defaults: dict) -> dict:
        """NanoSpec's w_max, k_pre, k_ver and k_ver_at, with a kind's defaults (HEAD_WINDOW, MODEL_WINDOW) filled in."""
        return {k: d if getattr(self, k) is None else getattr(self, k) for k, d in defaults.items()}

    def model_tree(self, device) -> tuple[int, int, int]:
        """A draft model's (top-k, depth, nodes): --spec-k alone is a chain of that length, else its tree."""
        if self.spec_k is None:
            return self.tree(device, MODEL_TREE_CPU, MODEL_TREE_GPU)
        if any(v is not None for v in (self.tree_topk, self.tree_depth, self.tree_nodes)):
            raise ValueError("--spec-k is a draft model's chain and --tree-* its tree: give one or the other")
        return 1, self.spec_k, self.spec_k + 1


# the flags of each part of drafting: each drafter kind honours only its own parts' flags
TREE_FLAGS = ("tree_topk", "tree_depth", "tree_nodes")
LOOKUP_FLAGS = ("ngram_min", "ngram_max", "ngram_occurrences")
WINDOW_FLAGS = ("w_max", "k_pre", "k_ver", "vocab_ablation", "k_ver_at", "vocab_fill")  # NanoSpec's
FLAGS = TREE_FLAGS + LOOKUP_FLAGS + WINDOW_FLAGS + ("spec_k",)


def check_given(c: DraftConfig, kind: str, *uses: tuple[str, ...]):
    """A flag given on the command line that a drafter of this kind does not read is an error, not ignored."""
    used = set(sum(uses, ())) | (set(WINDOW_FLAGS) if c.vocab == "nanospec" else set())
    unused = sorted(set(c.given) & set(FLAGS) - used)
    if unused:
        flag = "--" + unused[0].replace("_", "-")
        raise ValueError(f"{flag} applies to the nanospec vocabulary only (--vocab {c.vocab})"
                         if unused[0] in WINDOW_FLAGS else f"{flag} does not apply to {kind}")


def add_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The drafting flags (generate.py's); returns the speculative-decoding group."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", default=None, help="EAGLE head or draft-model folder/hub id, 'ngram', or 'none' "
                   "(default: the shipped EAGLE-3 head with the default model, else none)")
    g.add_argument("--tree-topk", type=int, default=None, help="EAGLE-2 children per frontier node (EAGLE heads: 10 "
                   "CUDA, 8 CPU; draft models: 10 CUDA, 4 CPU)")
    g.add_argument("--tree-depth", type=int, default=None, help="EAGLE-2 tree depth (EAGLE heads 5, draft models 6)")
    g.add_argument("--tree-nodes", type=int, default=None, help="EAGLE-2 nodes verified per step, root included "
                   "(60 CUDA, 16 CPU)")
    g.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=None,
                   help="with an EAGLE head or a draft model: merge a prompt-lookup chain (longest suffix match in "
                        "prompt + output) into the tree, verified together (default on)")
    g.add_argument("--spec-k", type=int, default=None, help="chain length: a draft model's (instead of its trees) "
                   "or prompt lookup's (10)")
    g.add_argument("--ngram-min", type=int, default=1)
    g.add_argument("--ngram-max", type=int, default=3)
    g.add_argument("--ngram-occurrences", type=int, default=8, help="prompt lookup: merge the continuations of this "
                   "many earlier occurrences of the matched suffix into one tree (1: the most recent one's chain)")
    v = p.add_argument_group("draft vocabulary")
    v.add_argument("--vocab", default=None, help="full | freq:PATH[:K] | nanospec (default: nanospec with the shipped "
                   "head, else full)")
    v.add_argument("--w-max", type=int, default=None, help="NanoSpec window size (slots; EAGLE heads 3072, draft "
                   "models 8192)")
    v.add_argument("--k-pre", type=int, default=None, help="NanoSpec target top-K per prompt position (EAGLE heads 3, "
                   "draft models 16)")
    v.add_argument("--k-ver", type=int, default=None, help="NanoSpec target top-K per verified position (EAGLE heads "
                   "3, draft models 16)")
    v.add_argument("--k-ver-at", choices=["accepted", "verified"], default=None, help="NanoSpec: the target's "
                   "top-K at the accepted positions (EAGLE heads' default) or at every verified node (draft models')")
    v.add_argument("--vocab-fill", default=None, help="NanoSpec's free slots score these tokens: a frequency file "
                   "(FR-Spec's), or 'ids' (the lowest token ids: a BPE vocabulary's merge order). Default: the draft "
                   "folder's freq.pt, else 'ids' for draft models")
    v.add_argument("--vocab-ablation", default=None, choices=["ctx", "ext", "noasync", "nofill"],
                   help="NanoSpec without: prompt tokens (ctx), appends (ext), the packed copy (noasync), the head "
                        "folder's freq.pt in free slots (nofill)")
    return g


def given_flags(p: argparse.ArgumentParser, argv) -> frozenset:
    """The drafting flags argv gives, as argparse reads them (abbreviations, --flag=value): a second parse."""
    for action in p._actions:  # parsed again without their defaults: only the given ones are set
        if action.dest in FLAGS:
            action.default = argparse.SUPPRESS
    return frozenset(vars(p.parse_args(argv))) & frozenset(FLAGS)


def from_flags(args, default_head: Path) -> DraftConfig:
    """The CLI's drafting flags; out of the box the default model drafts with its shipped EAGLE-3 head + NanoSpec, and
    a named model with its named draft model (download.default_draft) + NanoSpec, one prompt at a time."""
    shipped = args.checkpoint is None and (default_head / "config.json").is_file()
    named = None if args.draft or getattr(args, "prompts", None) else default_draft(args.checkpoint)
    draft = args.draft or (str(default_head) if shipped else named or "none")
    vocab = args.vocab or ("nanospec" if args.draft is None and (shipped or named) else "full")
    return DraftConfig(draft, vocab, args.tree_topk, args.tree_depth, args.tree_nodes, args.spec_k, args.ngram_min,
                       args.ngram_max, args.w_max, args.k_pre, args.k_ver, args.vocab_ablation, args.k_ver_at,
                       args.vocab_fill, static=args.compile, ngram=args.ngram, ngram_occurrences=args.ngram_occurrences,
                       given=args.given)


def append_width(nodes: int, depth: int, k_ver: int, every: bool = False) -> int:
    """Most ids one step appends to a NanoSpec window: the tree's nodes + the target's top-k_ver per path node (every:
    per verified node)."""
    return nodes + (nodes if every else depth + 1) * k_ver


def window_vocab(c: DraftConfig, weight, target: Transformer, nodes: int, depth: int, defaults: dict, fill=None,
                 token_to_row=None):
    """A drafter's vocabulary (c.vocab over LM-head rows weight), NanoSpec's window sized for one step's append of a
    tree of nodes and depth; -> (vocab, k_ver_at)."""
    w = c.window(defaults)
    every = w["k_ver_at"] == "verified"
    vocab = make_vocab(c.vocab, weight, w_max=w["w_max"], k_pre=w["k_pre"], k_ver=w["k_ver"], ablation=c.ablation,
                       eos_ids=target.args.eos_ids, max_append=append_width(nodes, depth, w["k_ver"], every),
                       token_to_row=token_to_row, fill=fill_of(c.fill, fill, w["w_max"]))
    return vocab, w["k_ver_at"]


def fill_of(spec: str | None, default, W: int):
    """NanoSpec's fill: a frequency file, the lowest W token ids ("ids"), or default where spec is None."""
    spec = default if spec is None else spec
    return torch.arange(W) if spec == "ids" else spec


def eagle_vocab(c: DraftConfig, head: EagleHead, target: Transformer, chain: int = 0):
    """The draft vocabulary of an EAGLE head, sized for one step's append (with a merged chain of `chain` tokens)."""
    topk, depth, nodes = c.tree(head.fc.weight.device)
    check_tree_budget(topk, depth, nodes)
    rows = EagleDrafter.token_to_row_map(head)
    if rows is not None and c.fill is not None:
        raise ValueError("--vocab-fill needs an EAGLE head with the target's whole vocabulary (this one is pruned)")
    return window_vocab(c, head.lm_weight(), target, nodes + chain, max(depth, chain), HEAD_WINDOW,
                        getattr(head, "fill_path", None) if rows is None else None, rows)


def make_drafter(c: DraftConfig, target: Transformer, sampling: Sampling | None = None,
                 tokenizer: Tokenizer | None = None, head: EagleHead | None = None):
    """A drafter with its vocabulary (None for "none"); head: already loaded from c.draft (bench shares it)."""
    if c.draft == "none":
        if c.vocab != "full":
            raise ValueError("--vocab needs a drafter with an LM head (--draft PATH)")
        if c.ngram:
            raise ValueError("--ngram merges prompt lookup into an EAGLE head's or a draft model's tree: give --draft "
                             "HEAD|MODEL (or --draft ngram)")
        check_given(c, "--draft none")
        return None
    if c.draft == "ngram":
        if c.vocab != "full":
            raise ValueError("--vocab does not apply to --draft ngram (it has no LM head)")
        check_given(c, "prompt lookup", LOOKUP_FLAGS, ("spec_k",))
        return lookup(c)
    dev, dtype = target.norm.weight.device, target.norm.weight.dtype  # (a quantized LM head has codes)
    if head is None:
        path = resolve_checkpoint(c.draft, patterns=DRAFT_PATTERNS)
        if detect_draft_kind(path) == "eagle":
            head = load_eagle(path, target, dtype, dev)
    if head is None:
        return model_drafter(c, path, target, sampling, tokenizer)
    if c.ngram is False:
        check_given(c, "an EAGLE head without --ngram", TREE_FLAGS)
        return eagle_drafter(c, head, target)
    check_given(c, "an EAGLE head with --ngram", TREE_FLAGS, LOOKUP_FLAGS, ("spec_k",))
    ngram = lookup(c)
    return HybridDrafter(eagle_drafter(c, head, target, ngram.k), ngram)


def eagle_drafter(c: DraftConfig, head: EagleHead, target: Transformer, chain: int = 0) -> EagleDrafter:
    # the head gets the target's LM head (project) for its prompt rows, so the hybrid can start it late
    vocab, at = eagle_vocab(c, head, target, chain)
    d = EagleDrafter(head, vocab, *c.tree(target.norm.weight.device), target.lm_head)
    d.k_ver_at = at
    return d


def model_drafter(c: DraftConfig, path: Path, target: Transformer, sampling: Sampling | None,
                  tokenizer: Tokenizer | None):
    """A draft model's drafter (its trees, or a chain of --spec-k), merged with prompt lookup unless --no-ngram."""
    hybrid = c.ngram is not False
    check_given(c, f"a draft model {'with' if hybrid else 'without'} --ngram", TREE_FLAGS, ("spec_k",),
                LOOKUP_FLAGS if hybrid else ())
    dev, dtype = target.norm.weight.device, target.norm.weight.dtype
    dm = load_model(path, dtype=dtype, device=dev, fast=True)  # (a draft only proposes: the integer GEMM)
    if dm.args.vocab_size != target.args.vocab_size:
        raise ModelError(f"draft model vocabulary ({dm.args.vocab_size}) differs from the target's "
                         f"({target.args.vocab_size})")
    if (tokenizer is not None and (path / "tokenizer.json").is_file()
            and Tokenizer(path).tok.get_vocab() != tokenizer.tok.get_vocab()):
        raise ModelError("draft model tokenizer differs from the target's")
    topk, depth, nodes = tree = c.model_tree(dev)
    check_tree_budget(topk, depth, nodes)
    chain = NGRAM_K if hybrid else 0  # (--spec-k is the draft model's chain)
    # a quantized head: scored as it is with the full vocabulary; the window's and FR-Spec's rows widened once
    weight = dm.lm_head if isinstance(dm.lm_head, QLinear) else dm.lm_head.weight
    # a small vocabulary: the window no wider than it, the default top-k per node as one step's append allows
    w_max = min(MODEL_WINDOW["w_max"], dm.args.vocab_size)
    k_ver = max(1, min(MODEL_WINDOW["k_ver"], (w_max - nodes - chain) // (nodes + chain)))
    window = dict(MODEL_WINDOW, w_max=w_max, k_ver=k_ver)
    fill = path / "freq.pt" if (path / "freq.pt").is_file() else shipped_fill(c.draft) or "ids"
    vocab, at = window_vocab(c, weight, target, nodes + chain, max(depth, chain), window, fill)
    d = ModelDrafter(dm, vocab, sampling=sampling, tree=tree, project=target.lm_head)
    d.k_ver_at = at
    return HybridDrafter(d, lookup(c, NGRAM_K)) if hybrid else d


def make_drafters(c: DraftConfig, target: Transformer, n: int, sampling: Sampling | None = None,
                  tokenizer: Tokenizer | None = None) -> list:
    """n drafters as make_drafter builds them, each with its own state (a batch's sequences: batch.py), an EAGLE
    head loaded once and shared by its twins; [] for "none". A draft model drafts at batch 1 only."""
    if c.draft in ("none", "ngram"):
        d = make_drafter(c, target, sampling, tokenizer)
        return [] if d is None else [d] + [make_drafter(c, target, sampling, tokenizer) for _ in range(n - 1)]
    path = resolve_checkpoint(c.draft, patterns=DRAFT_PATTERNS)
    if detect_draft_kind(path) != "eagle":
        raise ValueError("batched decoding drafts with EAGLE heads and prompt lookup; a draft model (--draft "
                         f"{c.draft}) drafts one prompt at a time")
    w = target.norm.weight
    head = load_eagle(path, target, w.dtype, w.device)
    return [make_drafter(c, target, sampling, tokenizer, head=head if i == 0 else head.twin()) for i in range(n)]


def lookup(c: DraftConfig, k: int | None = None) -> NgramDrafter:
    """Prompt lookup as c configures it, alone or as the hybrid's chain (k: given, else spec_k, else NGRAM_K)."""
    return NgramDrafter(k or (NGRAM_K if c.spec_k is None else c.spec_k), c.ngram_min, c.ngram_max, static=c.static,
                        occurrences=c.ngram_occurrences)
