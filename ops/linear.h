#pragma once
// Autograd functions of dwgraph's deferred-wgrad modules (SPEC C1, C2, C5).
//
// Each returns its output connected to autograd through a dwgraph node whose backward
// computes the input gradient (dgrad) at once and, per WgradConfig:
//  - delay_wgrad_compute: queues the weight (and bias) gradient work as one unit of the
//    module's WgradStore and returns None for them; WgradStore::run_oldest later computes
//    it and lands it (.grad initialised when None, added otherwise; main_grad accumulated
//    in the GEMM; a distributed weight's finalize);
//  - otherwise: computes it in the backward and returns it to autograd (None for fused
//    main_grad and distributed weights, which receive it directly).
// Weights are WeightRefs held by the node, not saved tensors: Note [Weights are plain
// references] in ops/weight_ref.h.

#include "ops/fp8.h"
#include "ops/weight_ref.h"
#include "ops/wgrad_store.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace dwgraph::ops {

// y[..., N] = x[..., K] · wᵀ (+ b). `bias` may be null.
// Under fp8_autocast (ops/fp8.h) the GEMMs run in FP8 (Note [FP8 Linear] in linear.cpp),
// with `fp8_meta` the module's scaling state (needed for delayed scaling).
at::Tensor linear(const at::Tensor& x, const WeightRefPtr& weight, const WeightRefPtr& bias,
                  const WgradConfig& cfg, const Fp8Meta& fp8_meta = {});

// Grouped: rows m_splits[g] of x [M, K] use weight g. `weights` holds G refs of [N, K]
// parameters, or one ref of a packed [G, N, K] parameter; `biases` is empty, G refs of
// [N] or one ref of a packed [G, N].
at::Tensor grouped_linear(const at::Tensor& x, const std::vector<int64_t>& m_splits,
                          const std::vector<WeightRefPtr>& weights,
                          const std::vector<WeightRefPtr>& biases, const WgradConfig& cfg,
                          const Fp8Meta& fp8_meta = {});

// LayerNorm (an ordinary autograd op; its weight and bias are not deferred) followed by
// linear(): (output, LayerNorm output). The weight and bias follow `cfg`. `normalization`
// "RMSNorm" normalises with at::rms_norm instead (`ln_bias` undefined).
std::pair<at::Tensor, at::Tensor> layernorm_linear(const at::Tensor& x, const at::Tensor& ln_weight,
                                                   const at::Tensor& ln_bias, double eps, const WeightRefPtr& weight,
                                                   const WeightRefPtr& bias, const WgradConfig& cfg,
                                                   const std::string& normalization = "LayerNorm",
                                                   const Fp8Meta& fp8_meta = {});

// LayerNorm (an ordinary autograd op; its weight and bias are not deferred; or RMSNorm), fc1,
// activation ("gelu" (erf), "gelu_tanh" or "relu"), fc2. Both FC weights and biases
// follow `cfg`; one forward queues one unit holding fc2's and fc1's work. With `checkpoint`
// the forward keeps only its input and the backward recomputes the rest (Note
// [Checkpointed LayerNormMLP] in linear.cpp): the same gradients and units, bit for bit.
// Under fp8_autocast `fp8_meta` holds two GEMMs' state (fc1's, then fc2's); with checkpoint
// the recomputation quantizes with the forward's scales (Note [FP8 in a checkpoint's
// recomputation], ops/fp8.h); checkpoint with FP8 weight caching is refused.
at::Tensor layernorm_mlp(const at::Tensor& x, const at::Tensor& ln_weight, const at::Tensor& ln_bias,
                         double eps, const WeightRefPtr& fc1_weight, const WeightRefPtr& fc1_bias,
                         const std::string& activation, const WeightRefPtr& fc2_weight,
                         const WeightRefPtr& fc2_bias, const WgradConfig& cfg, bool checkpoint = false,
                         const std::string& normalization = "LayerNorm", const Fp8Meta& fp8_meta = {});

// Checks `activation` names a supported activation (ArgumentError otherwise).
void check_activation(const std::string& module, const std::string& activation);

// Checks `normalization` names a supported normalization ("LayerNorm", "RMSNorm"; ArgumentError otherwise).
void check_normalization(const std::string& module, const std::string& normalization);

}  // namespace dwgraph::ops
