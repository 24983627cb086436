"""Draft-vocabulary strategies: which LM-head rows the draft scores.

All three share one duck-typed interface (row space == token space; a head with a
reduced vocabulary maps its ids through d2t itself):

    logits(h [..., d]) -> (scores [..., N], ids [N] long)   score column j is token ids[j]
    reset(prompt_ids [T], prompt_topk [T, K] | None)        start of a sequence (prefill)
    update(draft_ids [N], draft_valid [N], ver_ids [A, K], ver_valid [A])   one spec step
    contains(ids [n]) -> bool [n]     coverage metric
    active_size() -> 0-dim tensor     number of active rows
    state_bytes() -> int              device memory of the strategy's own state
    width -> int                      N, the number of score columns (static)
    wait()                            make the current stream wait for an async update

FullVocab    every row (the baseline).
FreqVocab    FR-Spec: a fixed top-K frequency subset, rows packed once.
NanoSpecVocab  the dynamic window (README, "How NanoSpec works here").

CLI:  python vocab.py build-freq --tokenizer tokenizer.json --corpus FILE --out freq.pt   (vocab_freq.py)
"""
import os
import sys

import torch
import torch.nn.functional as F

import cpu_draft
import cpu_gemm
import cuda_gather
import vocab_freq

# ---------------------------------------------------------------- Full vocabulary


def packed_copy(rows):
    """cpu_gemm's packed copy of LM-head rows [N, d] where this machine chose its kernel (bf16 on the CPU), else
    None. Why: torch's bf16 GEMM on AVX2 costs about the same per row at any row count, and a drafting level
    scores top-k rows at once (measured: 8 rows x 3072 NanoSpec rows, 1.9 ms with torch, 0.3 ms packed)."""
    return cpu_gemm.pack(rows) if cpu_gemm.enabled() and cpu_gemm.usable(rows) else None


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
        return torch.tensor(self.width, device=self.weight.device)


class FullVocab(StaticVocab):
    def __init__(self, weight):
        self.weight = weight
        self.ids = torch.arange(weight.shape[0], device=weight.device)  # [V], built once
        self.width = weight.shape[0]
        self.packed = packed_copy(weight.detach())                   # a second copy: memory for speed

    def logits(self, h):
        return cpu_gemm.linear(h, self.weight, None, self.packed), self.ids

    def contains(self, ids):
        return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)

    def state_bytes(self):
        return nbytes(self.ids, self.packed)


# ---------------------------------------------------------------- FR-Spec static frequency subset


class FreqVocab(StaticVocab):
    def __init__(self, weight, ids):
        V = weight.shape[0]
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("FreqVocab needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"FreqVocab: token ids must lie in [0, {V}), got range "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        self.weight = weight
        self.ids = ids.to(weight.device)
        # Packed once: the per-step GEMM reads K contiguous rows instead of gathering.
        self.rows = weight.index_select(0, self.ids).contiguous()    # [K, d]
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


# ---------------------------------------------------------------- NanoSpec dynamic window

ABLATIONS = (None, "ctx", "ext", "noasync", "nofill")


class NanoSpecVocab:
    """Active rows = distinct tokens among the last w_max entries of the candidate stream.

    State (all on weight.device, sizes fixed at construction):
      ring [W+1]     stream ring buffer of token ids (-1 empty); entry W is a write sink
      head           0-dim write position (counter mod W)
      count_ [V+1]   int32 multiplicity of each token in the window (active = count > 0)
      slot_of_ [V+1] int32 slot of each active token, -1 otherwise
      token_of_ [W+1] token in each slot, -1 when free
      rows [W, d]    LM-head rows of the slot owners, packed (absent for "noasync")
      ids [W], bias [W]   what logits() returns / adds: token_of clamped to 0, and 0 / -inf
      winner [V+1]   int32 scratch for de-duplicating one append
      fill_tok [W+1] the fill token of each slot (-1 none), fill_slot_ [V+1] its inverse (with fill only)
    The extra last entry of the V- and W-sized tensors is a sink that masked writes go
    to, so every scatter has a static width and no host sync is needed.

    Stream order at reset: per prompt position t, the prompt token p_t, then the target's top-k_pre ids at t
    (time order), so keeping the last W entries keeps the most recent positions whole.

    Fill (a frequency file's ids, most frequent first): a free slot s scores fill_tok[s] unless the window
    holds that token, so the W-row GEMM, which spans every slot anyway, scores the most frequent tokens in the
    slots the window leaves free (it holds a few hundred of 3072 on chat text). No extra GEMM width, two more
    row gathers per update. "nofill" (or fill=None) is the paper's window alone.

    Fewer active rows than a caller's top-k: the extra picks score -inf and map to token 0 (invalid picks).
    On CUDA, update() runs on the copy stream and the readers wait for it; the `ids` logits() returns is
    rewritten by the next update(): index it first. Reading the state tensors directly needs wait() first.
    """

    def __init__(self, weight, w_max=3072, k_pre=3, k_ver=3, ablation=None, max_append=None, fill=None):
        V, d = weight.shape
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
        self.weight, self.V, self.W = weight, V, w_max
        self.k_pre, self.k_ver, self.ablation = k_pre, k_ver, ablation
        self.width = w_max
        dev = weight.device
        self.ring = torch.full((w_max + 1,), -1, dtype=torch.long, device=dev)
        self.head = torch.zeros((), dtype=torch.long, device=dev)
        self.count_ = torch.zeros(V + 1, dtype=torch.int32, device=dev)
        self.slot_of_ = torch.full((V + 1,), -1, dtype=torch.int32, device=dev)
        self.token_of_ = torch.full((w_max + 1,), -1, dtype=torch.long, device=dev)
        self.winner = torch.zeros(V + 1, dtype=torch.int32, device=dev)
        self.ids = torch.zeros(w_max, dtype=torch.long, device=dev)
        self.bias = torch.full((w_max,), float("-inf"), dtype=weight.dtype, device=dev)
        # "noasync" scores weight rows in place each call, so it has no packed buffer.
        self.rows = None if ablation == "noasync" else torch.zeros(w_max, d, dtype=weight.dtype, device=dev)
        # cpu_gemm's layout of rows (bf16 CPU), plus row W: the sink masked writes go to, never scored
        self.packed = None if self.rows is None else packed_copy(torch.zeros(w_max + 1, d, dtype=weight.dtype,
                                                                              device=dev))
        # the row writes in one C call where it serves (bf16 CPU: cpu_gemm.write_rows_)
        self.c_rows = self.rows is not None and cpu_gemm.writes_rows(self.rows, self.packed, weight)
        self._arange_w = torch.arange(w_max, device=dev)
        self._inf = torch.tensor(float("-inf"), dtype=weight.dtype, device=dev)
        self.fill_tok = torch.full((w_max + 1,), -1, dtype=torch.long, device=dev)
        self.fill_slot_ = None  # [V+1] with fill only (an O(V) map the paper's window does without)
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

    # ---------------------------------------------------------------- hot path

    def logits(self, h):
        self.wait()
        if self.rows is None:  # "noasync": indexed GEMM over non-contiguous weight rows
            return F.linear(h, self.weight.index_select(0, self.ids), self.bias), self.ids
        # bias is 0 for active slots, -inf for free ones: the mask rides in the GEMM epilogue
        return cpu_gemm.linear(h, self.rows, self.bias, self.packed), self.ids  # [..., W], [W]

    def update(self, draft_ids, draft_valid, ver_ids, ver_valid):
        """Append the valid draft tokens and the top-k_ver ids of the valid accepted positions.

        draft_ids [N], draft_valid [N] bool, ver_ids [A, K>=k_ver], ver_valid [A] or [A, K] bool.
        Static shapes, no host syncs: traceable by torch.compile(fullgraph=True).
        """
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
            # host-side flag: only an outstanding update is waited on, so a CUDA graph that does not
            # contain the update never waits on an event recorded outside its capture
            self._pending = True

    def _append(self, new, valid):
        if cpu_draft.append(self, new, valid):  # bf16 CPU: the same steps in one C call (cpu_draft.py)
            return
        V, W = self.V, self.W
        valid = valid & (new >= 0) & (new < V)                       # [n] out-of-range ids drop
        new = torch.where(valid, new, V)                             # [n] invalid -> sink token
        n = new.shape[0]
        # Compact: the r-th valid entry goes to ring position (head + r) % W; invalid
        # entries go to the sink W. n <= W, so the valid positions are distinct.
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
        self.count_[V] = 0                                            # keep the sink clean
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
        if self.has_fill and self.rows is not None:  # a freed slot's fill row back, before born rows take it
            back = self.fill_tok[dead_slot]                           # [2n] (-1: none, or the sink)
            self._write_rows(back.clamp(min=0), torch.where(back >= 0, dead_slot, W))
        # k-th born token takes the k-th free slot (ranks by cumsum, O(W), no sort).
        # Enough free slots always exist: distinct tokens in a W-long window <= W.
        free = self.token_of_[:W] < 0
        free_rank = torch.where(free, torch.cumsum(free, 0) - 1, W)
        free_list = torch.empty(W + 1, dtype=torch.long, device=new.device)
        free_list.index_copy_(0, free_rank, self._arange_w)          # free_list[r] = r-th free slot
        born_rank = torch.where(born, torch.cumsum(born, 0) - 1, W)
        slot = torch.where(born, free_list[born_rank], W)            # [2n], W = no slot
        self.token_of_.index_copy_(0, slot, torch.where(born, cand, -1))
        self.slot_of_.index_copy_(0, torch.where(born, cand, V), slot.to(torch.int32))
        self.slot_of_[V] = -1
        self.token_of_[W] = -1
        self._outputs()
        # Gather only the newly active rows, into their slots.
        if self.rows is not None:
            self._write_rows(new, slot[:n])                          # born tokens are all in `new`

    def _write_rows(self, tok, slot):
        """rows[slot[i]] = weight[tok[i]] (and the packed copy) where slot[i] < W; static shapes."""
        if self.c_rows and self.packed is not None:  # (reset() rebuilds the packed copy once, after)
            cpu_gemm.write_rows_(self.rows, self.packed, self.weight, tok, slot)  # both copies in one C call
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

    # ---------------------------------------------------------------- sequence start

    def _clear(self):
        self.ring.fill_(-1)
        self.head.zero_()
        self.count_.zero_()
        self.slot_of_.fill_(-1)
        self.token_of_.fill_(-1)
        self.ids.zero_()
        self.bias.fill_(float("-inf"))
        if self.has_fill:  # every slot is free: all score their fill tokens
            if self.rows is not None:
                self._write_rows(self.fill_tok[: self.W].clamp(min=0),
                                 torch.where(self.fill_tok[: self.W] >= 0, self._arange_w, self.W))
            self._outputs()

    def reset(self, prompt_ids, prompt_topk=None):
        """Rebuild the window from the prompt (host-side slicing allowed: not the hot path).

        Stream = [p_0, topk_0[:k_pre], p_1, topk_1[:k_pre], ...], negative ids dropped,
        last W entries kept. "ext" (no prompt initialisation): only the target's
        top-k_pre at the last prompt position, so the first draft step has candidates
        (empty if prompt_topk is None).
        """
        self.wait()
        dev = self.weight.device
        prompt_ids = torch.as_tensor(prompt_ids, device=dev).reshape(-1).long()
        if prompt_topk is not None:
            prompt_topk = torch.as_tensor(prompt_topk, device=dev).long()
            if prompt_topk.dim() != 2 or prompt_topk.shape[0] != prompt_ids.shape[0]:
                raise ValueError(f"prompt_topk must be [T={prompt_ids.shape[0]}, K], "
                                 f"got {tuple(prompt_topk.shape)}")
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

    # ---------------------------------------------------------------- metrics

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
        bufs = [self.ring, self.head, self.count_, self.slot_of_, self.token_of_, self.winner,
                self.ids, self.bias, self._arange_w, self._inf, self.fill_tok, self.fill_slot_]
        return nbytes(*bufs, self.rows, self.packed)


def nanospec_state_bytes(V, d, w_max=3072, dtype=torch.float16, **kw):
    """State size of NanoSpecVocab for a (V, d) LM head, from the real constructor (meta device)."""
    return NanoSpecVocab(torch.empty(V, d, dtype=dtype, device="meta"), w_max, **kw).state_bytes()


# ---------------------------------------------------------------- Factory


def make_vocab(spec, weight, *, w_max=3072, k_pre=3, k_ver=3, ablation=None, eos_ids=(),
               max_append=None, token_to_row=None, fill=None):
    """spec: "full" | "freq:PATH" | "freq:PATH:K" | "nanospec". fill: NanoSpec's free-slot tokens (ids, most
    frequent first), or a frequency file's path.

    token_to_row [V_target] (-1 = absent) maps a frequency file's target token ids to the rows of a
    head with a pruned vocabulary (EAGLE-3 d2t); None when rows are token ids."""
    if ablation is not None and spec != "nanospec":
        raise ValueError(f"ablation {ablation!r} only applies to the 'nanospec' vocabulary, not {spec!r}")
    if spec == "full":
        return FullVocab(weight)
    if spec == "nanospec":
        if isinstance(fill, (str, os.PathLike)):
            # the file's ranking as it is: eos enters with the target's top-k when it is likely
            fill = vocab_freq.load_freq_file(fill, weight.shape[0])[:w_max]
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
        ranked = torch.as_tensor(vocab_freq.load_freq_file(path, token_to_row.shape[0], None, eos_ids), dtype=torch.long)
        rows = token_to_row.cpu()[ranked]
        rows = rows[rows >= 0][: k or weight.shape[0]]  # target tokens the pruned head cannot emit drop out
        return FreqVocab(weight, rows)
    raise ValueError(f"unknown vocab spec {spec!r}; use 'full', 'freq:PATH[:K]' or 'nanospec'")


if __name__ == "__main__":  # the frequency-file CLI lives with the files it builds
    vocab_freq.main(sys.argv[1:])
