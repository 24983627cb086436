// NanoSpec's row gather: rows[slots[i]] = weight[token_ids[i]] where slots[i] >= 0 (cuda_gather.py).
// Plain CUDA C++, no torch headers: `nvcc -c` compiles it alone, which is how test_cuda_gather.py checks the
// device code on machines without a GPU. gather_rows_torch.cu binds it to torch (load_inline).
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
