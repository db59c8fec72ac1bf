#pragma once
// Validation of the GEMM ops' arguments (dwgraph::ops::detail). Every op validates all of
// its arguments through these before it writes anything, on every backend, so the error
// messages and the "bad input writes nothing" guarantee are the same on CPU and CUDA.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>
#include <vector>

namespace dwgraph::ops::detail {

struct GemmDims {
  int64_t m = 0;  // rows of x / dy (tokens)
  int64_t n = 0;  // out-features
  int64_t k = 0;  // in-features
};

// Single GEMMs. `op` is the public name used in messages (e.g. "fwd_gemm").
GemmDims check_fwd(const char* op, const at::Tensor& x, const at::Tensor& w,
                   const std::optional<at::Tensor>& bias);
GemmDims check_dgrad(const char* op, const at::Tensor& dy, const at::Tensor& w);
GemmDims check_wgrad(const char* op, const at::Tensor& dy, const at::Tensor& x,
                     const at::Tensor& out, const std::optional<at::Tensor>& bias_grad_out);

// Grouped GEMMs: weights as a list (w[g] is [N, K]) or packed ([G, N, K]); the views
// below give the per-group [N, K] / [N] tensors of either form.
struct GroupedOperands {
  GemmDims dims;                    // m = total rows
  std::vector<int64_t> offsets;     // row offset of each group (size G + 1)
  std::vector<at::Tensor> weights;  // per group, [N, K] (for wgrad: the outputs)
  std::vector<at::Tensor> biases;   // per group, [N]; empty when absent
};

GroupedOperands check_grouped_fwd(const char* op, const at::Tensor& x, at::TensorList w,
                                  at::IntArrayRef m_splits, std::optional<at::TensorList> bias);
GroupedOperands check_grouped_fwd_packed(const char* op, const at::Tensor& x,
                                         const at::Tensor& w, at::IntArrayRef m_splits,
                                         const std::optional<at::Tensor>& bias);
GroupedOperands check_grouped_dgrad(const char* op, const at::Tensor& dy, at::TensorList w,
                                    at::IntArrayRef m_splits);
GroupedOperands check_grouped_dgrad_packed(const char* op, const at::Tensor& dy,
                                           const at::Tensor& w, at::IntArrayRef m_splits);
GroupedOperands check_grouped_wgrad(const char* op, const at::Tensor& dy, const at::Tensor& x,
                                    at::TensorList out, at::IntArrayRef m_splits,
                                    std::optional<at::TensorList> bias_grad_out);
GroupedOperands check_grouped_wgrad_packed(const char* op, const at::Tensor& dy,
                                           const at::Tensor& x, const at::Tensor& out,
                                           at::IntArrayRef m_splits,
                                           const std::optional<at::Tensor>& bias_grad_out);

}  // namespace dwgraph::ops::detail
