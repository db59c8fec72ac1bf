#pragma once
// Backend-independent bodies of the GEMM ops (dwgraph::ops::detail).
//
// Note [One body, three backends]: every op validates its arguments, handles the
// degenerate sizes (M, N or K of 0, empty groups) and splits grouped calls into per-group
// views here, once. A backend only supplies three primitives on validated, contiguous,
// non-empty operands:
//   K::fwd(x, w, bias_or_undefined, y)
//   K::dgrad(dy, w, dx)
//   K::wgrad(dy, x, out, accumulate, bias_grad_or_undefined)
// CPU (ATen), CUDA (cuBLASLt) and Meta (no-op: shapes only, for torch.compile) register
// the same bodies with register_gemm_kernels<K>(), so messages, edge cases and the
// "validate everything before writing anything" rule cannot drift between backends.

#include "ops/impl/gemm_args.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>

namespace dwgraph::ops::detail {

// Kernel signatures, shared by the registrations and the typed dispatcher calls.
using FwdGemmFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);
using DgradGemmFn = at::Tensor(const at::Tensor&, const at::Tensor&);
using WgradGemmFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                         const std::optional<at::Tensor>&);
using GroupedFwdFn = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef,
                                std::optional<at::TensorList>);
using GroupedFwdPackedFn = at::Tensor(const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                      const std::optional<at::Tensor>&);
using GroupedDgradFn = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef);
using GroupedDgradPackedFn = at::Tensor(const at::Tensor&, const at::Tensor&, at::IntArrayRef);
using GroupedWgradFn = void(const at::Tensor&, const at::Tensor&, at::TensorList, at::IntArrayRef,
                            bool, std::optional<at::TensorList>);
using GroupedWgradPackedFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  at::IntArrayRef, bool, const std::optional<at::Tensor>&);

inline const at::Tensor& or_undefined(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

// bias_grad[N] = Σ_M dy, accumulated by ATen's reduction in FP32, written in its own dtype.
inline void column_sum_into(const at::Tensor& bias_grad, const at::Tensor& dy) {
  at::Tensor out = bias_grad;
  const int64_t dim0[] = {0};
  at::sum_out(out, dy, at::OptionalIntArrayRef(dim0), false, out.scalar_type());
}

template <class K>
void fwd_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
              const at::Tensor& y) {
  if (y.numel() == 0) return;
  if (x.size(1) == 0) {  // K = 0: the product is empty, y is the bias (or zero)
    if (bias.defined()) {
      y.copy_(bias.expand_as(y));
    } else {
      y.zero_();
    }
    return;
  }
  K::fwd(x, w, bias, y);
}

template <class K>
void dgrad_into(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& dx) {
  if (dx.numel() == 0) return;
  if (dy.size(1) == 0) {  // N = 0
    dx.zero_();
    return;
  }
  K::dgrad(dy, w, dx);
}

template <class K>
void wgrad_into(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& out, bool accumulate,
                const at::Tensor& bias_grad) {
  if (dy.size(0) == 0) {  // M = 0 (an empty group): the product is zero
    if (!accumulate) out.zero_();
    if (bias_grad.defined()) bias_grad.zero_();
    return;
  }
  if (out.numel() == 0) {  // N = 0 or K = 0: nothing to multiply, the bias sum may remain
    if (bias_grad.defined()) column_sum_into(bias_grad, dy);
    return;
  }
  K::wgrad(dy, x, out, accumulate, bias_grad);
}

template <class K>
at::Tensor fwd_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  const auto d = check_fwd("fwd_gemm", x, w, bias);
  const c10::OptionalDeviceGuard guard(x.device());
  auto y = at::empty({d.m, d.n}, x.options());
  fwd_into<K>(x, w, or_undefined(bias), y);
  return y;
}

template <class K>
at::Tensor dgrad_gemm(const at::Tensor& dy, const at::Tensor& w) {
  const auto d = check_dgrad("dgrad_gemm", dy, w);
  const c10::OptionalDeviceGuard guard(dy.device());
  auto dx = at::empty({d.m, d.k}, dy.options());
  dgrad_into<K>(dy, w, dx);
  return dx;
}

template <class K>
void wgrad_gemm(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& out, bool accumulate,
                const std::optional<at::Tensor>& bias_grad_out) {
  check_wgrad("wgrad_gemm", dy, x, out, bias_grad_out);
  const c10::OptionalDeviceGuard guard(dy.device());
  wgrad_into<K>(dy, x, out, accumulate, or_undefined(bias_grad_out));
}

template <class K>
at::Tensor grouped_fwd(const at::Tensor& x, const GroupedOperands& ops) {
  const c10::OptionalDeviceGuard guard(x.device());
  auto y = at::empty({ops.dims.m, ops.dims.n}, x.options());
  for (size_t g = 0; g < ops.weights.size(); ++g) {
    const int64_t rows = ops.offsets[g + 1] - ops.offsets[g];
    fwd_into<K>(x.narrow(0, ops.offsets[g], rows), ops.weights[g],
                ops.biases.empty() ? at::Tensor() : ops.biases[g], y.narrow(0, ops.offsets[g], rows));
  }
  return y;
}

template <class K>
at::Tensor grouped_dgrad(const at::Tensor& dy, const GroupedOperands& ops) {
  const c10::OptionalDeviceGuard guard(dy.device());
  auto dx = at::empty({ops.dims.m, ops.dims.k}, dy.options());
  for (size_t g = 0; g < ops.weights.size(); ++g) {
    const int64_t rows = ops.offsets[g + 1] - ops.offsets[g];
    dgrad_into<K>(dy.narrow(0, ops.offsets[g], rows), ops.weights[g],
                  dx.narrow(0, ops.offsets[g], rows));
  }
  return dx;
}

// For wgrad, GroupedOperands::weights are the per-group outputs.
template <class K>
void grouped_wgrad(const at::Tensor& dy, const at::Tensor& x, const GroupedOperands& ops,
                   bool accumulate) {
  const c10::OptionalDeviceGuard guard(dy.device());
  for (size_t g = 0; g < ops.weights.size(); ++g) {
    const int64_t rows = ops.offsets[g + 1] - ops.offsets[g];
    wgrad_into<K>(dy.narrow(0, ops.offsets[g], rows), x.narrow(0, ops.offsets[g], rows),
                  ops.weights[g], accumulate, ops.biases.empty() ? at::Tensor() : ops.biases[g]);
  }
}

template <class K>
void register_gemm_kernels(torch::Library& m) {
  m.impl("fwd_gemm", [](const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) { return fwd_gemm<K>(x, w, bias); });
  m.impl("dgrad_gemm",
         [](const at::Tensor& dy, const at::Tensor& w) { return dgrad_gemm<K>(dy, w); });
  m.impl("wgrad_gemm", [](const at::Tensor& dy, const at::Tensor& x, const at::Tensor& out,
                          bool accumulate, const std::optional<at::Tensor>& bias_grad_out) {
    wgrad_gemm<K>(dy, x, out, accumulate, bias_grad_out);
  });
  m.impl("grouped_fwd_gemm", [](const at::Tensor& x, at::TensorList w, at::IntArrayRef m_splits,
                                std::optional<at::TensorList> bias) {
    return grouped_fwd<K>(x, check_grouped_fwd("grouped_fwd_gemm", x, w, m_splits, bias));
  });
  m.impl("grouped_fwd_gemm_packed", [](const at::Tensor& x, const at::Tensor& w,
                                       at::IntArrayRef m_splits,
                                       const std::optional<at::Tensor>& bias) {
    return grouped_fwd<K>(x, check_grouped_fwd_packed("grouped_fwd_gemm", x, w, m_splits, bias));
  });
  m.impl("grouped_dgrad_gemm",
         [](const at::Tensor& dy, at::TensorList w, at::IntArrayRef m_splits) {
           return grouped_dgrad<K>(dy, check_grouped_dgrad("grouped_dgrad_gemm", dy, w, m_splits));
         });
  m.impl("grouped_dgrad_gemm_packed",
         [](const at::Tensor& dy, const at::Tensor& w, at::IntArrayRef m_splits) {
           return grouped_dgrad<K>(
               dy, check_grouped_dgrad_packed("grouped_dgrad_gemm", dy, w, m_splits));
         });
  m.impl("grouped_wgrad_gemm", [](const at::Tensor& dy, const at::Tensor& x, at::TensorList out,
                                  at::IntArrayRef m_splits, bool accumulate,
                                  std::optional<at::TensorList> bias_grad_out) {
    grouped_wgrad<K>(dy, x,
                     check_grouped_wgrad("grouped_wgrad_gemm", dy, x, out, m_splits, bias_grad_out),
                     accumulate);
  });
  m.impl("grouped_wgrad_gemm_packed",
         [](const at::Tensor& dy, const at::Tensor& x, const at::Tensor& out,
            at::IntArrayRef m_splits, bool accumulate,
            const std::optional<at::Tensor>& bias_grad_out) {
           grouped_wgrad<K>(dy, x,
                            check_grouped_wgrad_packed("grouped_wgrad_gemm", dy, x, out, m_splits,
                                                       bias_grad_out),
                            accumulate);
         });
}

}  // namespace dwgraph::ops::detail
