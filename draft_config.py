"""How to draft (`DraftConfig`), its CLI flags, and `make_drafter`, which builds a drafter and its vocabulary."""
import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from download import resolve_checkpoint
from draft import check_tree_budget
from draft_eagle import EagleDrafter, ModelDrafter
from draft_hybrid import HybridDrafter
from draft_lookup import NgramDrafter
from eagle import EagleHead, load_eagle, read_keys
from model import ModelError, Transformer, load_model
from sampling import Sampling
from tokenizer import Tokenizer
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
    spec_k: int | None = None  # chain length: draft models 5, n-grams 10
    ngram_min: int = 1
    ngram_max: int = 3
    w_max: int = 3072  # NanoSpec window
    k_pre: int = 3  # NanoSpec: target top-K per prompt position
    k_ver: int = 3  # NanoSpec: target top-K per accepted position
    ablation: str | None = None  # NanoSpec ablation: ctx | ext | noasync | nofill
    static: bool = False  # n-gram chains padded to spec_k + 1 nodes: one compiled verify shape
    ngram: bool | None = False  # EAGLE heads: merge a prompt-lookup chain into the tree; None: on for EAGLE heads
    ngram_occurrences: int = 8  # prompt lookup's tree: continuations of this many earlier occurrences
    # the CLI's flags given: one the chosen drafter would ignore is an error; not in repr (keys budget memory)
    given: frozenset = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self):
        for flag, v in (("spec-k", self.spec_k), ("k-pre", self.k_pre), ("k-ver", self.k_ver), ("w-max", self.w_max)):
            if v is not None and v < 1:
                raise ValueError(f"--{flag} must be >= 1, got {v}")

    def tree(self, device) -> tuple[int, int, int]:
        """(top-k, depth, nodes) with this device's defaults filled in."""
        dflt = TREE_CPU if torch.device(device).type == "cpu" else TREE_GPU
        return tuple(d if v is None else v for v, d in zip((self.tree_topk, self.tree_depth, self.tree_nodes), dflt))


# the flags of each part of drafting: each drafter kind honours only its own parts' flags
TREE_FLAGS = ("tree_topk", "tree_depth", "tree_nodes")
LOOKUP_FLAGS = ("ngram_min", "ngram_max", "ngram_occurrences")
WINDOW_FLAGS = ("w_max", "k_pre", "k_ver", "vocab_ablation")  # NanoSpec's
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
    g.add_argument("--tree-topk", type=int, default=None, help="EAGLE-2 children per frontier node (10 CUDA, 8 CPU)")
    g.add_argument("--tree-depth", type=int, default=None, help="EAGLE-2 tree depth (5)")
    g.add_argument("--tree-nodes", type=int, default=None, help="EAGLE-2 nodes verified per step, root included "
                   "(60 CUDA, 16 CPU)")
    g.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=None,
                   help="with an EAGLE head: merge a prompt-lookup chain (longest suffix match in prompt + output) "
                        "into the tree, verified together (default on with EAGLE heads)")
    g.add_argument("--spec-k", type=int, default=None, help="chain length for draft models (5) and n-grams (10)")
    g.add_argument("--ngram-min", type=int, default=1)
    g.add_argument("--ngram-max", type=int, default=3)
    g.add_argument("--ngram-occurrences", type=int, default=8, help="prompt lookup: merge the continuations of this "
                   "many earlier occurrences of the matched suffix into one tree (1: the most recent one's chain)")
    v = p.add_argument_group("draft vocabulary")
    v.add_argument("--vocab", default=None, help="full | freq:PATH[:K] | nanospec (default: nanospec with the shipped "
                   "head, else full)")
    v.add_argument("--w-max", type=int, default=3072, help="NanoSpec window size (slots)")
    v.add_argument("--k-pre", type=int, default=3, help="NanoSpec target top-K per prompt position")
    v.add_argument("--k-ver", type=int, default=3, help="NanoSpec target top-K per accepted position")
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
    """The CLI's drafting flags; out of the box the default model drafts with its shipped EAGLE-3 head + NanoSpec."""
    shipped = args.checkpoint is None and (default_head / "config.json").is_file()
    draft = args.draft or (str(default_head) if shipped else "none")
    vocab = args.vocab or ("nanospec" if args.draft is None and shipped else "full")
    return DraftConfig(draft, vocab, args.tree_topk, args.tree_depth, args.tree_nodes, args.spec_k, args.ngram_min,
                       args.ngram_max, args.w_max, args.k_pre, args.k_ver, args.vocab_ablation, static=args.compile,
                       ngram=args.ngram, ngram_occurrences=args.ngram_occurrences, given=args.given)


def append_width(nodes: int, depth: int, k_ver: int) -> int:
    """Most ids one step appends to a NanoSpec window: the tree's nodes + the target's top-k_ver per path node."""
    return nodes + (depth + 1) * k_ver


def eagle_vocab(c: DraftConfig, head: EagleHead, target: Transformer, chain: int = 0):
    """The draft vocabulary of an EAGLE head, sized for one step's append (with a merged chain of `chain` tokens)."""
    topk, depth, nodes = c.tree(head.fc.weight.device)
    check_tree_budget(topk, depth, nodes)
    rows = EagleDrafter.token_to_row_map(head)
    return make_vocab(c.vocab, head.lm_weight(), w_max=c.w_max, k_pre=c.k_pre, k_ver=c.k_ver, ablation=c.ablation,
                      eos_ids=target.args.eos_ids, max_append=append_width(nodes + chain, max(depth, chain), c.k_ver),
                      token_to_row=rows, fill=getattr(head, "fill_path", None) if rows is None else None)


def make_drafter(c: DraftConfig, target: Transformer, sampling: Sampling | None = None,
                 tokenizer: Tokenizer | None = None, head: EagleHead | None = None):
    """A drafter with its vocabulary (None for "none"); head: already loaded from c.draft (bench shares it)."""
    if c.draft == "none":
        if c.vocab != "full":
            raise ValueError("--vocab needs a drafter with an LM head (--draft PATH)")
        if c.ngram:
            raise ValueError("--ngram merges prompt lookup into an EAGLE head's tree: give --draft HEAD "
                             "(or --draft ngram)")
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
    if head is not None:
        if head.c.version == 3:
            target.aux_layers = head.c.aux_layers
        topk, depth, nodes = c.tree(dev)
        # the head gets the target's LM head (project) for its prompt rows, so the hybrid can start it late
        if c.ngram is False:
            check_given(c, "an EAGLE head without --ngram", TREE_FLAGS)
            return EagleDrafter(head, eagle_vocab(c, head, target), topk, depth, nodes, target.lm_head)
        check_given(c, "an EAGLE head with --ngram", TREE_FLAGS, LOOKUP_FLAGS, ("spec_k",))
        ngram = lookup(c)
        return HybridDrafter(EagleDrafter(head, eagle_vocab(c, head, target, ngram.k), topk, depth, nodes,
                                          target.lm_head), ngram)
    if c.ngram:
        raise ValueError("--ngram merges prompt lookup into an EAGLE head's tree; this --draft is a draft model")
    check_given(c, "a draft model", ("spec_k",))
    dm = load_model(path, dtype=dtype, device=dev)
    if dm.args.vocab_size != target.args.vocab_size:
        raise ModelError(f"draft model vocabulary ({dm.args.vocab_size}) differs from the target's "
                         f"({target.args.vocab_size})")
    if (tokenizer is not None and (path / "tokenizer.json").is_file()
            and Tokenizer(path).tok.get_vocab() != tokenizer.tok.get_vocab()):
        raise ModelError("draft model tokenizer differs from the target's")
    k = 5 if c.spec_k is None else c.spec_k
    vocab = make_vocab(c.vocab, dm.lm_head.weight, w_max=c.w_max, k_pre=c.k_pre, k_ver=c.k_ver, ablation=c.ablation,
                       eos_ids=target.args.eos_ids, max_append=append_width(k + 1, k, c.k_ver))  # a chain: k + 1 nodes
    return ModelDrafter(dm, vocab, k, sampling)


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


def lookup(c: DraftConfig) -> NgramDrafter:
    """Prompt lookup as c configures it, alone or as the hybrid's chain (k: spec_k, else 10)."""
    return NgramDrafter(10 if c.spec_k is None else c.spec_k, c.ngram_min, c.ngram_max, static=c.static,
                        occurrences=c.ngram_occurrences)
