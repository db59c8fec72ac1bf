#pragma once
// Where a weight gradient goes once computed (dwgraph::ops::detail), SPEC C1 and C2.

#include "ops/weight_ref.h"

#include <ATen/core/Tensor.h>

#include <functional>

namespace dwgraph::ops::detail {

// Writes the product into `out` (accumulating when asked) and, when `bias_out` is
// defined, the bias gradient into it: wgrad_gemm or its grouped form.
using WgradGemm = std::function<void(const at::Tensor& out, bool accumulate, const at::Tensor& bias_out)>;

// Gradients to hand back to autograd (undefined = None).
struct WgradResult {
  at::Tensor weight;
  at::Tensor bias;
};

// Computes one weight's (and optionally its bias's) gradient with `gemm` and delivers it:
//  - distributed weight: the fresh wgrad, of the materialised weight's shape
//    `materialized_sizes` (a sharded parameter is smaller), goes to WeightRef::finalize;
//  - main_grad: accumulated into it by the GEMM (beta = 1), then on_main_grad_accumulated;
//  - grad_dtype: the GEMM writes a fresh buffer of that dtype (beta = 0), added to an existing
//    .grad as any other gradient (Note [grad_dtype]);
//  - otherwise a fresh wgrad.
// With `deferred`, everything lands now (.grad initialised when None, added otherwise) and
// the result is empty; without, plain gradients are returned for autograd to accumulate.
WgradResult compute_wgrad(const WeightRef& w, const WeightRef* bias, const WgradGemm& gemm,
                          bool deferred, const std::string& module, at::IntArrayRef materialized_sizes);

// .grad = g when None, .grad += g otherwise (a dtype or shape mismatch is an error).
void land_grad(const at::Tensor& param, const at::Tensor& g, const std::string& what);

// Checks that a fused weight's main_grad can take its wgrad; names module and parameter.
void check_main_grad(const WeightRef& w, const std::string& module);

}  // namespace dwgraph::ops::detail
