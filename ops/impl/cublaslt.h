#pragma once
// cuBLASLt plumbing for the CUDA GEMM kernels (dwgraph::ops::detail): one handle per
// device, one workspace per (device, stream), and the heuristic's algorithm cached per
// shape/dtype/layout/alignment key. Only compiled when DWGRAPH_WITH_CUDA.
//
// Note [cuBLASLt under capture]: a CUDA graph bakes in the workspace address, so each
// stream gets its own workspace, allocated once and never freed or moved. It is
// allocated with cudaMalloc (under a relaxed capture-mode guard) rather than from the
// caching allocator, so a first call inside a capture does not take memory from the
// graph's private pool that would then outlive the pool. prepare_cublaslt() creates
// handle and workspace ahead of a capture, as TransformerEngine does.

#include <c10/core/Device.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstdint>

namespace dwgraph::ops::detail {

enum class LtEpilogue { kNone, kBias, kBgradB };

// Column-major D[m, n] = op(A)[m, k] · op(B)[k, n] (+ D when accumulate), computed in FP32.
struct LtMatmul {
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  cudaDataType_t a_type = CUDA_R_32F;
  const void* b = nullptr;
  int64_t ldb = 0;
  cudaDataType_t b_type = CUDA_R_32F;
  void* d = nullptr;
  int64_t ldd = 0;
  cudaDataType_t d_type = CUDA_R_32F;
  bool accumulate = false;  // beta = 1, C = D in place
  LtEpilogue epilogue = LtEpilogue::kNone;
  void* bias = nullptr;  // kBias: [m] added to every column; kBgradB: [n] written
  cudaDataType_t bias_type = CUDA_R_32F;
};

// Runs the matmul on `stream`. Returns false, having launched nothing, only when the
// epilogue is not kNone and cuBLASLt has no algorithm for it (callers then fall back to
// a plain GEMM plus a separate kernel). Any other failure throws, naming the call and
// the cuBLAS status string.
bool lt_matmul(const LtMatmul& p, c10::DeviceIndex device, cudaStream_t stream);

// Creates the handle of `device` and the workspace of (`device`, `stream`) if missing.
void prepare_cublaslt(c10::DeviceIndex device, cudaStream_t stream);

// Bytes of one workspace.
size_t cublaslt_workspace_size();

}  // namespace dwgraph::ops::detail
