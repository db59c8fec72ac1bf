// Schemas of the GEMM ops, their Meta kernels (shapes only, for torch.compile's fake
// tensors) and the C++ front ends in dwgraph::ops, which call through the dispatcher so
// every C++ caller reaches the same kernels as torch.ops.dwgraph.* does.
#include "ops/gemm.h"

#include "ops/impl/gemm_generic.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace dwgraph::ops {
namespace {

// Meta backend: no computation (see Note [One body, three backends]).
struct MetaKernels {
  static void fwd(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {}
  static void dgrad(const at::Tensor&, const at::Tensor&, const at::Tensor&) {}
  static void wgrad(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                    const at::Tensor&) {}
};

template <class Fn>
c10::TypedOperatorHandle<Fn> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dwgraph, m) {
  m.def("fwd_gemm(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("dgrad_gemm(Tensor dy, Tensor w) -> Tensor");
  m.def("wgrad_gemm(Tensor dy, Tensor x, Tensor(a!) out, bool accumulate, "
        "Tensor(b!)? bias_grad_out=None) -> ()");
  m.def("grouped_fwd_gemm(Tensor x, Tensor[] w, int[] m_splits, Tensor[]? bias=None) -> Tensor");
  m.def("grouped_fwd_gemm_packed(Tensor x, Tensor w, int[] m_splits, Tensor? bias=None) -> Tensor");
  m.def("grouped_dgrad_gemm(Tensor dy, Tensor[] w, int[] m_splits) -> Tensor");
  m.def("grouped_dgrad_gemm_packed(Tensor dy, Tensor w, int[] m_splits) -> Tensor");
  m.def("grouped_wgrad_gemm(Tensor dy, Tensor x, Tensor(a!)[] out, int[] m_splits, "
        "bool accumulate, Tensor(b!)[]? bias_grad_out=None) -> ()");
  m.def("grouped_wgrad_gemm_packed(Tensor dy, Tensor x, Tensor(a!) out, int[] m_splits, "
        "bool accumulate, Tensor(b!)? bias_grad_out=None) -> ()");
}

TORCH_LIBRARY_IMPL(dwgraph, Meta, m) { detail::register_gemm_kernels<MetaKernels>(m); }

at::Tensor fwd_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  static const auto op = op_handle<detail::FwdGemmFn>("dwgraph::fwd_gemm");
  return op.call(x, w, bias);
}

at::Tensor dgrad_gemm(const at::Tensor& dy, const at::Tensor& w) {
  static const auto op = op_handle<detail::DgradGemmFn>("dwgraph::dgrad_gemm");
  return op.call(dy, w);
}

void wgrad_gemm(const at::Tensor& dy, const at::Tensor& x, at::Tensor& out, bool accumulate,
                const std::optional<at::Tensor>& bias_grad_out) {
  static const auto op = op_handle<detail::WgradGemmFn>("dwgraph::wgrad_gemm");
  op.call(dy, x, out, accumulate, bias_grad_out);
}

at::Tensor grouped_fwd_gemm(const at::Tensor& x, at::TensorList w, at::IntArrayRef m_splits,
                            std::optional<at::TensorList> bias) {
  static const auto op = op_handle<detail::GroupedFwdFn>("dwgraph::grouped_fwd_gemm");
  return op.call(x, w, m_splits, bias);
}

at::Tensor grouped_fwd_gemm(const at::Tensor& x, const at::Tensor& w_packed,
                            at::IntArrayRef m_splits, const std::optional<at::Tensor>& bias_packed) {
  static const auto op = op_handle<detail::GroupedFwdPackedFn>("dwgraph::grouped_fwd_gemm_packed");
  return op.call(x, w_packed, m_splits, bias_packed);
}

at::Tensor grouped_dgrad_gemm(const at::Tensor& dy, at::TensorList w, at::IntArrayRef m_splits) {
  static const auto op = op_handle<detail::GroupedDgradFn>("dwgraph::grouped_dgrad_gemm");
  return op.call(dy, w, m_splits);
}

at::Tensor grouped_dgrad_gemm(const at::Tensor& dy, const at::Tensor& w_packed,
                              at::IntArrayRef m_splits) {
  static const auto op =
      op_handle<detail::GroupedDgradPackedFn>("dwgraph::grouped_dgrad_gemm_packed");
  return op.call(dy, w_packed, m_splits);
}

void grouped_wgrad_gemm(const at::Tensor& dy, const at::Tensor& x, at::TensorList out,
                        at::IntArrayRef m_splits, bool accumulate,
                        std::optional<at::TensorList> bias_grad_out) {
  static const auto op = op_handle<detail::GroupedWgradFn>("dwgraph::grouped_wgrad_gemm");
  op.call(dy, x, out, m_splits, accumulate, bias_grad_out);
}

void grouped_wgrad_gemm(const at::Tensor& dy, const at::Tensor& x, at::Tensor& out_packed,
                        at::IntArrayRef m_splits, bool accumulate,
                        const std::optional<at::Tensor>& bias_grad_out_packed) {
  static const auto op =
      op_handle<detail::GroupedWgradPackedFn>("dwgraph::grouped_wgrad_gemm_packed");
  op.call(dy, x, out_packed, m_splits, accumulate, bias_grad_out_packed);
}

#ifdef DWGRAPH_WITH_CUDA
namespace detail {
void prepare_cuda_capture(c10::Stream stream);  // gemm_cuda.cpp
}  // namespace detail
#endif

void prepare_for_capture(c10::Stream stream) {
#ifdef DWGRAPH_WITH_CUDA
  if (stream.device_type() == c10::DeviceType::CUDA) detail::prepare_cuda_capture(stream);
#endif
}

}  // namespace dwgraph::ops
