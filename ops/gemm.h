#pragma once
// The GEMMs under every dwgraph module: forward, input gradient (dgrad) and weight
// gradient (wgrad), single and grouped, for row-major 2-D tensors:
//   x [M, K] (M tokens, K in-features), w [N, K] (N out-features), y / dy [M, N].
//
// Each function is a thin front end over a dispatcher op (torch.ops.dwgraph.<name>), so
// the same op runs on CPU (ATen, FP32 accumulation) and CUDA (cuBLASLt, compute type
// 32F), works under torch.compile, and is recorded by the host graph like any ATen kernel.
// Every argument is validated before anything is written; a bad one throws
// dwgraph::ArgumentError naming the argument, the expected and the actual value.
//
// dtypes: inputs float32, bfloat16 or float16 (all inputs of one call share it). Outputs
// of fwd/dgrad have the input dtype; wgrad's `out` is float32 or the input dtype.

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <optional>
#include <vector>

namespace dwgraph::ops {

// y = x · wᵀ (+ bias). bias: [N], input dtype.
at::Tensor fwd_gemm(const at::Tensor& x, const at::Tensor& w,
                    const std::optional<at::Tensor>& bias = std::nullopt);

// dx = dy · w.
at::Tensor dgrad_gemm(const at::Tensor& dy, const at::Tensor& w);

// out = (accumulate ? out : 0) + dyᵀ · x, accumulated in FP32 and written in place into
// `out` [N, K] (no temporary for the product when out is FP32). When given,
// bias_grad_out [N] receives Σ_M dy (written, not accumulated) in out's dtype.
void wgrad_gemm(const at::Tensor& dy, const at::Tensor& x, at::Tensor& out, bool accumulate,
                const std::optional<at::Tensor>& bias_grad_out = std::nullopt);

// Grouped forms: rows of x / dy are split into consecutive groups of m_splits[g] rows
// (zeros allowed, sum = M); group g uses weight g. Weights are a list of G [N, K] tensors
// or one packed [G, N, K] tensor; biases a list of G [N] tensors or one packed [G, N].
at::Tensor grouped_fwd_gemm(const at::Tensor& x, at::TensorList w, at::IntArrayRef m_splits,
                            std::optional<at::TensorList> bias = std::nullopt);
at::Tensor grouped_fwd_gemm(const at::Tensor& x, const at::Tensor& w_packed,
                            at::IntArrayRef m_splits,
                            const std::optional<at::Tensor>& bias_packed = std::nullopt);

at::Tensor grouped_dgrad_gemm(const at::Tensor& dy, at::TensorList w, at::IntArrayRef m_splits);
at::Tensor grouped_dgrad_gemm(const at::Tensor& dy, const at::Tensor& w_packed,
                              at::IntArrayRef m_splits);

void grouped_wgrad_gemm(const at::Tensor& dy, const at::Tensor& x, at::TensorList out,
                        at::IntArrayRef m_splits, bool accumulate,
                        std::optional<at::TensorList> bias_grad_out = std::nullopt);
void grouped_wgrad_gemm(const at::Tensor& dy, const at::Tensor& x, at::Tensor& out_packed,
                        at::IntArrayRef m_splits, bool accumulate,
                        const std::optional<at::Tensor>& bias_grad_out_packed = std::nullopt);

// Creates what the GEMMs need on `stream` (on CUDA: the cuBLASLt handle and the stream's
// workspace) so that a graph capture on that stream allocates nothing for them (Note
// [cuBLASLt under capture] in ops/impl/cublaslt.h). A no-op for host streams.
void prepare_for_capture(c10::Stream stream);

}  // namespace dwgraph::ops
