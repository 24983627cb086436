"""Row-gather kernel and copy-stream helpers for NanoSpec's draft vocabulary.

One op: `gather_rows_(rows, weight, token_ids, slots)` writes
`rows[slots[i]] = weight[token_ids[i]]` for every i with `slots[i] >= 0` and leaves
the other rows alone. It is a `torch.library` custom op (`nanospec::gather_rows_`)
so torch.compile(fullgraph=True) keeps it as a single node instead of breaking the
graph. CUDA tensors use a small hand-written kernel (built lazily with
`load_inline`, launched on the current stream, so it is legal inside CUDA-graph
capture); CPU tensors, and CUDA when the extension cannot be built, use
`gather_rows_reference`, which is also the test oracle.

No algorithm state lives here (vocab.py owns it).
"""
import contextlib
import functools
import hashlib
import os
import warnings

import torch

# --------------------------------------------------------------------------------------
# Pure-torch reference / fallback
# --------------------------------------------------------------------------------------


def gather_rows_reference(rows, weight, token_ids, slots):
    """rows[slots[i]] = weight[token_ids[i]] where slots[i] >= 0; static shapes, no host sync.

    rows [S, d], weight [V, d] (same dtype), token_ids / slots [n] integer.
    Invalid entries (slot < 0) may carry any token id (e.g. -1): they are masked.

    Masking choice (no scratch row needed in `rows`): an invalid entry is turned into a
    duplicate of a valid entry's write (same slot, same value), so `index_copy_` sees
    only duplicate indices that carry identical values and the result is exact whichever
    duplicate wins. If no entry is valid, every entry rewrites rows[0] with its own
    current value. Cost is O(n * d), never O(S * d).
    """
    slots = slots.long()
    token_ids = token_ids.long()
    valid = slots >= 0                                              # [n]
    if valid.numel() == 0:
        return
    first = valid.to(torch.int8).argmax()                           # first valid entry (0 if none)
    any_valid = valid.any()
    safe_tok = torch.where(valid, token_ids, 0)                     # invalid ids may be garbage
    vals = weight.index_select(0, safe_tok)                         # [n, d]
    fill = torch.where(any_valid, vals[first], rows[0])             # [d]
    vals = torch.where(valid[:, None], vals, fill)                  # [n, d]
    dst = torch.where(valid, slots, torch.where(any_valid, slots[first], 0))  # [n]
    rows.index_copy_(0, dst, vals)


# --------------------------------------------------------------------------------------
# CUDA source
# --------------------------------------------------------------------------------------

# Part 1 is plain CUDA C++ (no torch headers): `nvcc -c` compiles it on its own, which is
# how test_cuda_gather.py checks the device code on machines without a GPU (or without the
# CUDA library headers torch's own CUDA headers pull in).
CUDA_KERNEL_SRC = r"""
#include <cstdint>
#include <cuda_runtime.h>

// One block per (entry, chunk of the row); each thread copies VecT-sized pieces.
// It is a byte copy, so it serves bf16 / fp16 / fp32 (any dtype) alike; VecT = uint4
// gives 16-byte loads/stores whenever the row size, strides and base pointers allow.
template <typename VecT>
__global__ void nanospec_gather_rows_kernel(
    char* __restrict__ rows, const char* __restrict__ weight,
    const int64_t* __restrict__ token_ids, const int64_t* __restrict__ slots,
    int64_t n_slots, int64_t vocab, int64_t row_vecs,
    int64_t rows_stride_bytes, int64_t weight_stride_bytes) {
  const int64_t i = blockIdx.x;
  const int64_t slot = slots[i];
  const int64_t tok = token_ids[i];
  // slot < 0: inactive entry, skip. Out-of-range indices are skipped too (never write
  // outside the buffers), the caller guarantees they do not occur.
  if (slot < 0 || slot >= n_slots || tok < 0 || tok >= vocab) return;
  VecT* dst = reinterpret_cast<VecT*>(rows + slot * rows_stride_bytes);
  const VecT* src = reinterpret_cast<const VecT*>(weight + tok * weight_stride_bytes);
  for (int64_t j = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; j < row_vecs;
       j += (int64_t)gridDim.y * blockDim.x) {
    dst[j] = src[j];
  }
}

template <typename VecT>
static void nanospec_launch(char* rows, const char* weight, const int64_t* token_ids,
                            const int64_t* slots, int64_t n, int64_t n_slots, int64_t vocab,
                            int64_t row_bytes, int64_t rows_stride_bytes,
                            int64_t weight_stride_bytes, cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / (int64_t)sizeof(VecT);
  const int threads = 128;
  int64_t chunks = (row_vecs + threads - 1) / threads;
  if (chunks > 65535) chunks = 65535;  // grid.y limit; the loop covers the rest
  if (chunks < 1) chunks = 1;
  dim3 grid((unsigned)n, (unsigned)chunks);
  nanospec_gather_rows_kernel<VecT><<<grid, threads, 0, stream>>>(
      rows, weight, token_ids, slots, n_slots, vocab, row_vecs, rows_stride_bytes,
      weight_stride_bytes);
}

// Picks the widest vector that divides the row size, both row strides and both base
// addresses, then launches on `stream` (the caller's current stream).
extern "C" cudaError_t nanospec_gather_rows_launch(
    void* rows, const void* weight, const int64_t* token_ids, const int64_t* slots,
    int64_t n, int64_t n_slots, int64_t vocab, int64_t row_bytes,
    int64_t rows_stride_bytes, int64_t weight_stride_bytes, cudaStream_t stream) {
  if (n <= 0 || row_bytes <= 0) return cudaSuccess;
  const uint64_t align = (uint64_t)row_bytes | (uint64_t)rows_stride_bytes |
                         (uint64_t)weight_stride_bytes | (uint64_t)(uintptr_t)rows |
                         (uint64_t)(uintptr_t)weight;
  char* r = static_cast<char*>(rows);
  const char* w = static_cast<const char*>(weight);
  if (align % 16 == 0)
    nanospec_launch<uint4>(r, w, token_ids, slots, n, n_slots, vocab, row_bytes, rows_stride_bytes, weight_stride_bytes, stream);
  else if (align % 8 == 0)
    nanospec_launch<uint2>(r, w, token_ids, slots, n, n_slots, vocab, row_bytes, rows_stride_bytes, weight_stride_bytes, stream);
  else if (align % 4 == 0)
    nanospec_launch<uint32_t>(r, w, token_ids, slots, n, n_slots, vocab, row_bytes, rows_stride_bytes, weight_stride_bytes, stream);
  else if (align % 2 == 0)
    nanospec_launch<uint16_t>(r, w, token_ids, slots, n, n_slots, vocab, row_bytes, rows_stride_bytes, weight_stride_bytes, stream);
  else
    nanospec_launch<uint8_t>(r, w, token_ids, slots, n, n_slots, vocab, row_bytes, rows_stride_bytes, weight_stride_bytes, stream);
  return cudaGetLastError();
}
"""

# Part 2: the thin torch binding. c10/cuda headers only (not ATen/cuda/CUDAContext.h,
# which drags in cuBLAS/cuSPARSE headers); c10::cuda::getCurrentCUDAStream is the
# same stream as at::cuda::getCurrentCUDAStream.
CUDA_BINDING_SRC = r"""
#include <torch/types.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

void gather_rows(torch::Tensor rows, torch::Tensor weight, torch::Tensor token_ids,
                 torch::Tensor slots) {
  TORCH_CHECK(rows.is_cuda() && weight.is_cuda() && token_ids.is_cuda() && slots.is_cuda(),
              "gather_rows: all tensors must be CUDA tensors");
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 2 && rows.size(1) == weight.size(1),
              "gather_rows: rows [S, d] and weight [V, d] must agree on d");
  TORCH_CHECK(rows.scalar_type() == weight.scalar_type(), "gather_rows: dtype mismatch");
  TORCH_CHECK(rows.stride(1) == 1 && weight.stride(1) == 1,
              "gather_rows: rows and weight must be contiguous along d");
  TORCH_CHECK(token_ids.scalar_type() == torch::kLong && slots.scalar_type() == torch::kLong,
              "gather_rows: token_ids and slots must be int64");
  TORCH_CHECK(token_ids.is_contiguous() && slots.is_contiguous() &&
              token_ids.numel() == slots.numel(),
              "gather_rows: token_ids and slots must be contiguous and equally long");
  const c10::cuda::CUDAGuard guard(rows.device());
  const int64_t elt = rows.element_size();
  cudaError_t err = nanospec_gather_rows_launch(
      rows.data_ptr(), weight.data_ptr(), token_ids.data_ptr<int64_t>(),
      slots.data_ptr<int64_t>(), slots.numel(), rows.size(0), weight.size(0),
      rows.size(1) * elt, rows.stride(0) * elt, weight.stride(0) * elt,
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "gather_rows: kernel launch failed: ", cudaGetErrorString(err));
}
"""

CUDA_SRC = CUDA_KERNEL_SRC + CUDA_BINDING_SRC
_CPP_DECL = ("void gather_rows(torch::Tensor rows, torch::Tensor weight, "
             "torch::Tensor token_ids, torch::Tensor slots);")
# Versioned by the source hash so an edited kernel never reuses a stale build.
EXT_NAME = "nanospec_gather_" + hashlib.sha256(CUDA_SRC.encode()).hexdigest()[:12]


@functools.cache
def _cuda_ext():
    """Build (first call only) and return the extension module; None if it can't be built.

    NANOSPEC_NO_CUDA_EXT=1 forces the pure-torch fallback (benchmarks, debugging).
    """
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


# --------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------


@torch.library.custom_op("nanospec::gather_rows_", mutates_args=("rows",))
def gather_rows_(rows: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """rows[slots[i]] = weight[token_ids[i]] for slots[i] >= 0 (in place on `rows`)."""
    gather_rows_reference(rows, weight, token_ids, slots)


@gather_rows_.register_kernel("cuda")
def _gather_rows_cuda(rows, weight, token_ids, slots):
    ext = _cuda_ext()
    if ext is None or rows.stride(1) != 1 or weight.stride(1) != 1:
        gather_rows_reference(rows, weight, token_ids, slots)
        return
    ext.gather_rows(rows, weight, token_ids.long().contiguous(), slots.long().contiguous())


@gather_rows_.register_fake
def _gather_rows_fake(rows, weight, token_ids, slots):
    return None


# --------------------------------------------------------------------------------------
# Copy stream helpers (CPU: everything is None / inline)
# --------------------------------------------------------------------------------------


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
    """Run the body on `stream` after the current stream's queued work; record `event` after.

    The inputs were allocated on the compute stream: record_stream keeps the caching
    allocator from handing their memory out again before the copy stream has read them.
    With stream None (CPU) the body just runs inline.
    """
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
