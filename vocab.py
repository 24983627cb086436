"""Draft-vocabulary strategies, which LM-head rows the draft scores: FullVocab (every row), FreqVocab (FR-Spec's fixed
top-K), NanoSpecVocab (the dynamic window, README). One duck-typed interface:

    logits(h [..., d]) -> (scores [..., N], ids [N] long)   score column j is token ids[j]
    reset(prompt_ids [T], prompt_topk [T, K] | None); update(draft_ids [N], draft_valid [N], ver_ids [A, K], ver_valid)
    contains(ids) -> bool; active_size() -> 0-dim; state_bytes() -> int; width: N (static); wait(): async update

CLI:  python vocab.py build-freq --tokenizer tokenizer.json --corpus FILE --out freq.pt   (vocab_freq.py)
"""
import os
import sys

import torch
import torch.nn.functional as F

import cbuild
import cpu_draft
import cpu_gemm
import cuda_gather
import qlinear
import vocab_freq


def packed_copy(rows):
    """cpu_gemm's packed copy of LM-head rows [N, d] where this machine chose its kernel, else None. Why: a drafting
    level scores top-k rows at once (measured: 8 rows x 3072 NanoSpec rows, 1.9 ms with torch, 0.3 ms packed)."""
    return cpu_gemm.pack(rows) if cpu_gemm.enabled() and cpu_gemm.usable(rows) else None


def fast_rows(weight) -> bool:
    """weight is a draft model's 4-bit LM head on the integer GEMM (qlinear.QLinear.make_fast) and the C row writer is
    built: NanoSpec's window copies its rows as they are. Why: widened, the 0.5B Qwen's 16,384-row window is 29 MB
    of bf16 a draft step, against 9 MB of codes and scales (and the head's 272 MB widened copy is never made)."""
    return (isinstance(weight, torch.nn.Module) and getattr(weight, "fast", False) and weight.codes.is_cpu
            and cpu_gemm.c_function("write_rows") is not None)


def nbytes(*ts):
    return sum(t.nbytes for t in ts if t is not None)


class StaticVocab:
    """What the static vocabularies (full, FR-Spec) share: no window to reset or update, no target top-K."""
    k_pre = k_ver = 0

    def reset(self, prompt_ids, prompt_topk=None):
        pass

    def update(self, draft_ids, draft_valid, ver_ids, ver_valid):
        pass

    def wait(self):
        pass

    def active_size(self):
        return torch.full((), self.width, dtype=torch.long, device=self.ids.device)  # no host copy (CUDA graphs)


class FullVocab(StaticVocab):
    def __init__(self, weight):
        """weight: the LM head's [V, d] matrix, or a quantized LM head (qlinear.QLinear), scored as it is"""
        self.head = weight if isinstance(weight, torch.nn.Module) else None
        self.weight = None if self.head is not None else weight
        q = self.head is not None
        V, dev = (weight.out_features, weight.codes.device) if q else (weight.shape[0], weight.device)
        self.ids = torch.arange(V, device=dev)  # [V], built once
        self.width = V
        # a second copy: memory for speed
        self.packed = None if self.head is not None else packed_copy(weight.detach())

    def logits(self, h):
        if self.head is not None:
            return self.head(h), self.ids
        return cpu_gemm.linear(h, self.weight, None, self.packed), self.ids

    def contains(self, ids):
        return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)

    def state_bytes(self):
        return nbytes(self.ids, self.packed)


class FreqVocab(StaticVocab):
    def __init__(self, weight, ids):
        V = weight.shape[0]
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("FreqVocab needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"FreqVocab: token ids must lie in [0, {V}), got [{int(ids.min())}, {int(ids.max())}]")
        self.weight = weight
        self.ids = ids.to(weight.device)
        self.rows = weight.index_select(0, self.ids).contiguous()    # [K, d] once: no gather per step
        self.packed = packed_copy(self.rows)
        self.mask = torch.zeros(V, dtype=torch.bool, device=weight.device)
        self.mask[self.ids] = True                                    # [V] for contains()
        self.width = self.ids.numel()

    def logits(self, h):
        return cpu_gemm.linear(h, self.rows, None, self.packed), self.ids

    def contains(self, ids):
        return self.mask[ids]

    def state_bytes(self):
        return nbytes(self.rows, self.ids, self.mask, self.packed)


ABLATIONS = (None, "ctx", "ext", "noasync", "nofill")


class NanoSpecVocab:
    """Active rows = distinct tokens among the last w_max entries of the candidate stream (ring, with count_ per
    token and the slot map slot_of_ / token_of_). The last entry of each V- and W-sized tensor is a sink for masked
    writes, so every scatter has a static width and no host sync. Fill (a frequency file's ids): a free slot scores
    its fill token unless the window holds it, so the W-row GEMM scores frequent tokens in the slots left free.
    On CUDA, update() runs on the copy stream: index the `ids` logits() returned before the next update()."""

    def __init__(self, weight, w_max=3072, k_pre=3, k_ver=3, ablation=None, max_append=None, fill=None):
        # a fast 4-bit head (fast_rows): the window's rows in its layout; other quantized heads arrive widened
        self.src = weight if ablation != "noasync" and fast_rows(weight) else None
        V, d = (weight.out_features, weight.in_features) if self.src is not None else weight.shape
        if ablation not in ABLATIONS:
            raise ValueError(f"unknown ablation {ablation!r}; choose from {ABLATIONS}")
        if w_max < 1:
            raise ValueError(f"w_max must be >= 1, got {w_max}")
        if w_max > V:
            raise ValueError(f"w_max ({w_max}) larger than the vocabulary ({V})")
        if k_pre < 1 or k_ver < 1:
            raise ValueError(f"k_pre and k_ver must be >= 1, got {k_pre}, {k_ver}")
        if max_append is not None and max_append > w_max:
            raise ValueError(f"w_max ({w_max}) smaller than one step's append width ({max_append})")
        self.weight = None if self.src is not None else weight
        self.V, self.W, self.width = V, w_max, w_max
        self.k_pre, self.k_ver, self.ablation = k_pre, k_ver, ablation
        dev, dtype = (weight.codes.device, torch.bfloat16) if self.src is not None else (weight.device, weight.dtype)
        self.device, self.copies = dev, ablation != "noasync"  # copies: the active rows kept contiguous
        self.ring = torch.full((w_max + 1,), -1, dtype=torch.long, device=dev)
        self.head = torch.zeros((), dtype=torch.long, device=dev)
        self.count_ = torch.zeros(V + 1, dtype=torch.int32, device=dev)
        self.slot_of_ = torch.full((V + 1,), -1, dtype=torch.int32, device=dev)
        self.token_of_ = torch.full((w_max + 1,), -1, dtype=torch.long, device=dev)
        self.winner = torch.zeros(V + 1, dtype=torch.int32, device=dev)
        self.ids = torch.zeros(w_max, dtype=torch.long, device=dev)
        self.bias = torch.full((w_max,), float("-inf"), dtype=dtype, device=dev)
        self.rows = self.packed = self.kw = self.dst = None
        self.c_rows = False
        if self.src is not None:  # the window's codes, scales and offsets (panels of 64), written by C only
            P, s = -(-w_max // 64), self.src
            self.codes = torch.zeros(P, d // 4, 128, dtype=torch.uint8)
            self.scales, self.offsets = (torch.zeros(P, d // 32, 64, dtype=torch.float16) for _ in range(2))
            self.kw = qlinear.KernelWeight(self.codes, self.scales, self.offsets, 4, 32, fast=True)
            self.src_tensors = (s.codes, s.scales, s.offsets)  # what dst points into, kept alive with it
            self.dst = cbuild.RowsDst(0, self.codes.data_ptr(), s.codes.data_ptr(), V, w_max, d, 64, 0, None, 1,
                                      s.scales.data_ptr(), s.offsets.data_ptr(), self.scales.data_ptr(),
                                      self.offsets.data_ptr())
        elif self.copies:
            self.rows = torch.zeros(w_max, d, dtype=dtype, device=dev)
            # cpu_gemm's layout of rows, plus row W: the sink masked writes go to, never scored
            self.packed = packed_copy(weight.new_zeros(w_max + 1, d))
            self.c_rows = cpu_gemm.writes_rows(self.rows, self.packed, weight)
        self._arange_w = torch.arange(w_max, device=dev)
        self._inf = torch.tensor(float("-inf"), dtype=dtype, device=dev)
        self.fill_tok = torch.full((w_max + 1,), -1, dtype=torch.long, device=dev)
        self.fill_slot_ = None  # [V+1] with fill only
        fill = None if ablation == "nofill" or fill is None else torch.as_tensor(fill, dtype=torch.long).reshape(-1)
        if fill is not None and fill.numel():
            self.fill_slot_ = torch.full((V + 1,), -1, dtype=torch.int32, device=dev)
            if int(fill.min()) < 0 or int(fill.max()) >= V or fill.unique().numel() != fill.numel():
                raise ValueError(f"fill ids must be distinct ids in [0, {V})")
            fill = fill[:w_max].to(dev)
            self.fill_tok[: fill.numel()] = fill
            self.fill_slot_[fill] = torch.arange(fill.numel(), dtype=torch.int32, device=dev)
        self.has_fill = fill is not None and fill.numel() > 0
        # Async gather only where it can overlap (CUDA); "noasync" is synchronous by definition.
        self._stream = None if ablation == "noasync" else cuda_gather.copy_stream(dev)
        self._ready = cuda_gather.new_event(dev) if self._stream is not None else None
        self._pending = False
        if self.has_fill:
            self._clear()  # fill rows and outputs from the start (before any reset)

    # public views without the sink entries
    @property
    def count(self):
        return self.count_[: self.V]

    @property
    def slot_of(self):
        return self.slot_of_[: self.V]

    @property
    def token_of(self):
        return self.token_of_[: self.W]

    def logits(self, h):
        self.wait()
        if self.kw is not None:
            if torch.compiler.is_compiling():
                return torch.ops.nanospec.linear_packed(h, self.kw.address(), self.W, self.bias), self.ids
            return qlinear.kernel_linear(h, self.kw, self.W, self.bias), self.ids
        if not self.copies:  # "noasync": indexed GEMM over non-contiguous weight rows
            return F.linear(h, self.weight.index_select(0, self.ids), self.bias), self.ids
        # bias is 0 for active slots, -inf for free ones: the mask rides in the GEMM epilogue
        return cpu_gemm.linear(h, self.rows, self.bias, self.packed), self.ids  # [..., W], [W]

    def update(self, draft_ids, draft_valid, ver_ids, ver_valid):
        """Append the valid draft tokens and the top-k_ver ids of the valid accepted positions (no host syncs)."""
        if self.ablation == "ctx":
            return
        ver_ids = ver_ids[:, : self.k_ver]
        width = draft_ids.shape[0] + ver_ids.shape[0] * ver_ids.shape[1]
        if width > self.W:
            raise ValueError(f"w_max ({self.W}) smaller than one step's append width ({width})")
        new = torch.cat([draft_ids.reshape(-1).long(), ver_ids.reshape(-1).long()])        # [n]
        # ver_valid is per position [A] or per entry [A, K] (a pruned draft vocabulary lacks some ids)
        vv = ver_valid[:, : self.k_ver] if ver_valid.dim() == 2 else ver_valid[:, None]
        valid = torch.cat([draft_valid.reshape(-1), vv.expand(ver_ids.shape).reshape(-1)])  # [n]
        if self._stream is None:
            self._append(new, valid)
        else:
            with cuda_gather.on_copy_stream(self._stream, self._ready, new, valid):
                self._append(new, valid)
            # host-side flag: a CUDA graph without the update never waits on an event recorded outside its capture
            self._pending = True

    def _append(self, new, valid):
        if cpu_draft.append(self, new, valid):  # bf16 CPU: the same steps in one C call (cpu_draft.py)
            return
        V, W = self.V, self.W
        valid = valid & (new >= 0) & (new < V)                       # [n] out-of-range ids drop
        new = torch.where(valid, new, V)                             # [n] invalid -> sink token
        n = new.shape[0]
        # the r-th valid entry goes to ring position (head + r) % W (distinct: n <= W), invalid ones to the sink W
        rank = torch.cumsum(valid, 0) - 1
        pos = torch.where(valid, (self.head + rank) % W, W)
        old = self.ring[pos]                                         # [n] evicted (-1 empty)
        old = torch.where(valid & (old >= 0), old, V)
        self.ring.index_copy_(0, pos, new)                           # sink gets junk, harmless
        self.head.copy_((self.head + valid.sum()) % W)
        # Window counts: +1 per appended, -1 per evicted, in one scatter_add.
        cand = torch.cat([new, old])                                 # [2n]
        delta = torch.cat([torch.ones_like(new), -torch.ones_like(old)]).to(torch.int32)
        before = self.count_[cand]
        self.count_.scatter_add_(0, cand, delta)
        after = self.count_[cand]
        self.count_[V:].zero_()                                      # keep the sink clean
        # De-duplicate: per token exactly one candidate (the highest index) decides.
        j = torch.arange(2 * n, device=new.device, dtype=torch.int32)
        self.winner.scatter_reduce_(0, cand, j, reduce="amax", include_self=False)
        win = (self.winner[cand] == j) & (cand < V)
        born = win & (before == 0) & (after > 0)                     # 0 -> >0 (only in `new`)
        died = win & (before > 0) & (after == 0)                     # >0 -> 0 (only in `old`)
        # Free the slots of tokens that left the window.
        dead_slot = torch.where(died, self.slot_of_[cand].long(), W)
        self.token_of_.index_fill_(0, dead_slot, -1)
        self.slot_of_.index_fill_(0, torch.where(died, cand, V), -1)
        if self.has_fill and self.copies:  # a freed slot's fill row back, before born rows take it
            back = self.fill_tok[dead_slot]                           # [2n] (-1: none, or the sink)
            self._write_rows(back.clamp(min=0), torch.where(back >= 0, dead_slot, W))
        # Slots for born tokens, so a fill token leaves the GEMM only when the window's own tokens need its slot,
        # the least frequent first: a fill token takes its own slot where free (its fill row already scores it),
        # the k-th other born token the k-th free slot from the top (cumsum ranks, no sort; a W-long window never
        # needs more). Why: taking free slots from the bottom displaced the most frequent fill tokens (' is', ' =')
        # and cost a draft model 2-5% of its tau (BENCHMARKS.md).
        free = self.token_of_ < 0                                     # [W+1]
        rest = born  # the born tokens without a free fill slot of their own
        if self.has_fill:
            free[W:].fill_(False)                                    # (the sink is never free)
            own_slot = self.fill_slot_[cand].long()
            own = born & (own_slot >= 0) & free[own_slot.clamp(min=0)]
            free.index_fill_(0, torch.where(own, own_slot, W), False)  # own slots taken
            rest = born & ~own
        free = free[:W]
        free_rank = torch.where(free, free.flip(0).cumsum(0).flip(0) - 1, W)  # 0 = the highest free slot
        free_list = torch.empty(W + 1, dtype=torch.long, device=new.device)
        free_list.index_copy_(0, free_rank, self._arange_w)          # free_list[r] = r-th free slot from the top
        born_rank = torch.where(rest, torch.cumsum(rest, 0) - 1, W)
        slot = torch.where(rest, free_list[born_rank], W)            # [2n], W = no slot
        if self.has_fill:
            slot = torch.where(own, own_slot, slot)
        self.token_of_.index_copy_(0, slot, torch.where(born, cand, -1))
        self.slot_of_.index_copy_(0, torch.where(born, cand, V), slot.to(torch.int32))
        self.slot_of_[V:].fill_(-1)  # (fill_, not x[V] = -1: that copies from the host, illegal in a CUDA graph)
        self.token_of_[W:].fill_(-1)
        self._outputs()
        if self.copies:  # only the newly active rows (born tokens are all in `new`)
            self._write_rows(new, slot[:n])

    def _write_rows(self, tok, slot):
        """rows[slot[i]] = weight[tok[i]] (and the packed copy) where slot[i] < W; static shapes."""
        if self.dst is not None:
            tok, slot = tok.long().contiguous(), slot.long().contiguous()
            cpu_gemm.c_function("write_rows")(cbuild.ptr(self.dst), tok.data_ptr(), slot.data_ptr(), tok.numel())
            return
        if self.c_rows and self.packed is not None:  # (reset() rebuilds the packed copy once, after)
            cpu_gemm.write_rows_(self.rows, self.packed, self.weight, tok, slot)
            return
        cuda_gather.gather_rows_(self.rows, self.weight, tok, torch.where(slot < self.W, slot, -1))
        if self.packed is not None:  # the same rows into the packed copy (slot W: its sink)
            cpu_gemm.pack_rows_(self.packed, self.weight.index_select(0, tok.clamp(max=self.V - 1)), slot)

    def _outputs(self):
        # logits() outputs, refreshed in place (stable addresses for CUDA graphs).
        tok = self.token_of_[: self.W]
        if not self.has_fill:
            self.ids.copy_(tok.clamp(min=0))
            self.bias.copy_(torch.where(tok >= 0, 0.0, self._inf))
            return
        ft = self.fill_tok[: self.W]
        # a free slot scores its fill token unless the window holds it (then its own slot does: no duplicates)
        fill_on = (tok < 0) & (ft >= 0) & (self.count_[ft.clamp(min=0)] == 0)
        self.ids.copy_(torch.where(tok >= 0, tok, ft.clamp(min=0)))
        self.bias.copy_(torch.where((tok >= 0) | fill_on, 0.0, self._inf))

    def _clear(self):
        self.ring.fill_(-1)
        self.head.zero_()
        self.count_.zero_()
        self.slot_of_.fill_(-1)
        self.token_of_.fill_(-1)
        self.ids.zero_()
        self.bias.fill_(float("-inf"))
        if self.has_fill:  # every slot is free: all score their fill tokens
            if self.copies:
                self._write_rows(self.fill_tok[: self.W].clamp(min=0),
                                 torch.where(self.fill_tok[: self.W] >= 0, self._arange_w, self.W))
            self._outputs()

    def reset(self, prompt_ids, prompt_topk=None):
        """Rebuild the window from the stream [p_0, topk_0[:k_pre], p_1, ...], its last W entries. "ext": only the
        target's top-k_pre at the last prompt position, so the first draft step has candidates."""
        self.wait()
        dev = self.device
        prompt_ids = torch.as_tensor(prompt_ids, device=dev).reshape(-1).long()
        if prompt_topk is not None:
            prompt_topk = torch.as_tensor(prompt_topk, device=dev).long()
            if prompt_topk.dim() != 2 or prompt_topk.shape[0] != prompt_ids.shape[0]:
                raise ValueError(f"prompt_topk must be [T={prompt_ids.shape[0]}, K], got {tuple(prompt_topk.shape)}")
            prompt_topk = prompt_topk[:, : self.k_pre]
        if self.ablation == "ext":
            stream = prompt_topk[-1] if prompt_topk is not None and prompt_topk.shape[0] else prompt_ids[:0]
        elif prompt_topk is None:
            stream = prompt_ids
        else:
            stream = torch.cat([prompt_ids[:, None], prompt_topk], 1).reshape(-1)
        stream = stream[(stream >= 0) & (stream < self.V)][-self.W:]
        packed, self.packed = self.packed, None  # the packed copy is rebuilt once below, not row by row
        try:
            self._clear()
            if stream.numel():
                self._append(stream, torch.ones_like(stream, dtype=torch.bool))
        finally:
            self.packed = packed
        if packed is not None:  # one strided copy of every slot's row (scattering thousands of rows: 5x slower)
            new = cpu_gemm.pack(self.rows)
            packed[: new.shape[0]].copy_(new)

    def wait(self):
        if self._pending:
            cuda_gather.wait_event(self._ready)
            self._pending = False

    def contains(self, ids):
        """Which ids the draft scores: the window's, and fill tokens in free slots."""
        self.wait()
        ids = ids.long()
        inside = self.count_[ids] > 0
        if not self.has_fill:
            return inside
        s = self.fill_slot_[ids].long()
        return inside | ((s >= 0) & (self.token_of_[s.clamp(min=0)] < 0))

    def active_size(self):
        """Slots the window's own tokens hold (fill tokens not counted)."""
        self.wait()
        return (self.token_of_[: self.W] >= 0).sum()

    def state_bytes(self):
        return nbytes(self.ring, self.head, self.count_, self.slot_of_, self.token_of_, self.winner, self.ids,
                      self.bias, self._arange_w, self._inf, self.fill_tok, self.fill_slot_, self.rows, self.packed,
                      *((self.codes, self.scales, self.offsets) if self.kw is not None else ()))

    def rows_dst(self):
        """The C row writer's view of the window's copies (cbuild.RowsDst), or None where C does not write them."""
        if self.dst is not None:
            return self.dst
        if not (self.c_rows and self.packed is not None):
            return None
        return cbuild.RowsDst(self.rows.data_ptr(), self.packed.data_ptr(), self.weight.data_ptr(), self.V, self.W,
                              self.weight.shape[1], cpu_gemm.PANEL, cpu_gemm.KB, cpu_gemm._SLOT.data_ptr())


def nanospec_state_bytes(V, d, w_max=3072, dtype=torch.float16, **kw):
    """State size of NanoSpecVocab for a (V, d) LM head, from the real constructor (meta device)."""
    return NanoSpecVocab(torch.empty(V, d, dtype=dtype, device="meta"), w_max, **kw).state_bytes()


def make_vocab(spec, weight, *, w_max=3072, k_pre=3, k_ver=3, ablation=None, eos_ids=(),
               max_append=None, token_to_row=None, fill=None):
    """spec: "full" | "freq:PATH" | "freq:PATH:K" | "nanospec"; weight: the LM head's matrix, or a quantized LM head
    (qlinear.QLinear: "full" scores it as it is). fill: NanoSpec's free-slot tokens (most frequent
    first) or a frequency file. token_to_row [V_target] (-1 absent): a pruned head's rows (EAGLE-3 d2t), or None."""
    if ablation is not None and spec != "nanospec":
        raise ValueError(f"ablation {ablation!r} only applies to the 'nanospec' vocabulary, not {spec!r}")
    if spec == "full":
        return FullVocab(weight)
    if spec == "nanospec" and ablation != "noasync" and fast_rows(weight):
        pass  # a draft model's 4-bit head: the window copies its rows as they are
    elif isinstance(weight, torch.nn.Module):  # another quantized LM head: its rows widened once for the copies
        weight = weight.weight
    if spec == "nanospec":
        if isinstance(fill, (str, os.PathLike)):
            # the file's ranking as it is: eos enters with the target's top-k when it is likely
            V = weight.out_features if isinstance(weight, torch.nn.Module) else weight.shape[0]
            fill = vocab_freq.load_freq_file(fill, V)[:w_max]
        return NanoSpecVocab(weight, w_max, k_pre, k_ver, ablation, max_append, fill)
    if spec.startswith("freq:"):
        path, k = spec[len("freq:"):], None
        head, sep, tail = path.rpartition(":")
        if sep and tail.isdigit():
            path, k = head, int(tail)
        if not path:
            raise ValueError(f"vocab spec {spec!r}: missing frequency file path")
        if token_to_row is None:
            return FreqVocab(weight, vocab_freq.load_freq_file(path, weight.shape[0], k, eos_ids))
        rows = token_to_row.cpu()[vocab_freq.load_freq_file(path, token_to_row.shape[0], None, eos_ids)]
        rows = rows[rows >= 0][: k or weight.shape[0]]  # target tokens the pruned head cannot emit drop out
        return FreqVocab(weight, rows)
    raise ValueError(f"unknown vocab spec {spec!r}; use 'full', 'freq:PATH[:K]' or 'nanospec'")


if __name__ == "__main__":  # the frequency-file CLI lives with the files it builds
    vocab_freq.main(sys.argv[1:])
