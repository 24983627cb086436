"""Row gather and copy-stream helpers for NanoSpec's draft vocabulary (vocab.py). `gather_rows_` is a custom op
(one node under torch.compile): on CUDA the kernel of csrc/gather_rows.cu (load_inline, on the current stream, so
CUDA graphs capture it), elsewhere `gather_rows_reference`, the test oracle."""
import contextlib
import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch


def gather_rows_reference(rows, weight, token_ids, slots):
    """rows[slots[i]] = weight[token_ids[i]] where slots[i] >= 0, no host sync. An invalid entry repeats a valid one's
    write (none valid: rows[0]'s own value), so index_copy_'s duplicate indices agree: exact, no scratch row."""
    slots = slots.long()
    valid = slots >= 0                                              # [n]
    if valid.numel() == 0:
        return
    first = valid.to(torch.int8).argmax()                           # first valid entry (0 if none)
    any_valid = valid.any()
    safe_tok = torch.where(valid, token_ids.long(), 0)              # invalid ids may be garbage
    vals = weight.index_select(0, safe_tok)                         # [n, d]
    fill = torch.where(any_valid, vals[first], rows[0])             # [d]
    vals = torch.where(valid[:, None], vals, fill)                  # [n, d]
    dst = torch.where(valid, slots, torch.where(any_valid, slots[first], 0))  # [n]
    rows.index_copy_(0, dst, vals)


CSRC = Path(__file__).resolve().parent / "csrc"
CUDA_KERNEL_SRC = (CSRC / "gather_rows.cu").read_text()
CUDA_SRC = CUDA_KERNEL_SRC + (CSRC / "gather_rows_torch.cu").read_text()
_CPP_DECL = "void gather_rows(torch::Tensor rows, torch::Tensor weight, torch::Tensor token_ids, torch::Tensor slots);"
# named by the source hash, so an edited kernel never reuses a stale build
EXT_NAME = "nanospec_gather_" + hashlib.sha256(CUDA_SRC.encode()).hexdigest()[:12]


@functools.cache
def _cuda_ext():
    """The extension module, built on first call; None if it can't be (or NANOSPEC_NO_CUDA_EXT=1)."""
    if os.environ.get("NANOSPEC_NO_CUDA_EXT") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load_inline
        return load_inline(name=EXT_NAME, cpp_sources=_CPP_DECL, cuda_sources=CUDA_SRC,
                           functions=["gather_rows"], extra_cuda_cflags=["-O3"], verbose=False)
    except Exception as e:  # no nvcc / no compiler / incompatible toolkit
        warnings.warn(f"nanospec CUDA gather kernel unavailable, using the torch fallback: {e}")
        return None


def cuda_ext_available():
    return torch.cuda.is_available() and _cuda_ext() is not None


@torch.library.custom_op("nanospec::gather_rows_", mutates_args=("rows",))
def gather_rows_(rows: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, slots: torch.Tensor) -> None:
    gather_rows_reference(rows, weight, token_ids, slots)


@gather_rows_.register_kernel("cuda")
def _gather_rows_cuda(rows, weight, token_ids, slots):
    ext = _cuda_ext()
    if ext is None or rows.stride(1) != 1 or weight.stride(1) != 1:
        return gather_rows_reference(rows, weight, token_ids, slots)
    ext.gather_rows(rows, weight, token_ids.long().contiguous(), slots.long().contiguous())


@gather_rows_.register_fake
def _gather_rows_fake(rows, weight, token_ids, slots):
    return None


@functools.cache
def _copy_stream(index):
    return torch.cuda.Stream(device=index)


def copy_stream(device):
    """The cached side stream used for vocabulary updates on `device`; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _copy_stream(device.index if device.index is not None else torch.cuda.current_device())


def new_event(device):
    """A reusable 'ready' event for one vocabulary (None off CUDA)."""
    return torch.cuda.Event() if torch.device(device).type == "cuda" else None


@contextlib.contextmanager
def on_copy_stream(stream, event, *inputs):
    """Run the body on `stream` after the current stream's work, then record `event` (stream None: inline).
    record_stream keeps the allocator from reusing the inputs' memory before the copy stream has read them."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    for t in inputs:
        t.record_stream(stream)
    with torch.cuda.stream(stream):
        yield
        event.record(stream)


def wait_event(event):
    """Make the current stream wait for `event` (the last async update); no-op if None."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)
