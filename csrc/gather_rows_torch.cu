// The torch binding of gather_rows.cu, compiled after it in one unit (cuda_gather.py, load_inline). c10/cuda
// headers only: ATen/cuda/CUDAContext.h would drag in cuBLAS/cuSPARSE headers; c10's current stream is ATen's.
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
