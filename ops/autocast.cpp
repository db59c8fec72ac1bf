// Autocast for the GEMM ops (see ops/autocast.h) and their Autocast kernels: cast the
// operands, then run the op below autocast, as ATen's own lower-precision ops do.
#include "ops/autocast.h"

#include "ops/gemm.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <vector>

namespace dwgraph::ops {

std::optional<at::ScalarType> autocast_gemm_dtype(c10::DeviceType device_type) {
  if (!at::autocast::is_autocast_available(device_type) || !at::autocast::is_autocast_enabled(device_type)) {
    return std::nullopt;
  }
  return at::autocast::get_autocast_dtype(device_type);
}

AutocastState AutocastState::current() {
  AutocastState s;
  s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
  s.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  return s;
}

std::string AutocastState::describe() const {
  // Python's names (torch.bfloat16), as the caller spells them.
  auto name = [](at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); };
  std::string defaults;  // set with torch.set_autocast_dtype where autocast is off
  if (!cpu && cpu_dtype != AutocastState().cpu_dtype) defaults += "cpu " + name(cpu_dtype);
  if (!cuda && cuda_dtype != AutocastState().cuda_dtype) {
    defaults += (defaults.empty() ? "cuda " : ", cuda ") + name(cuda_dtype);
  }
  if (!defaults.empty()) defaults = " (default dtype " + defaults + ")";
  if (!cpu && !cuda) return "off" + defaults;
  std::string out = "on (";
  if (cpu) out += "cpu " + name(cpu_dtype);
  if (cpu && cuda) out += ", ";
  if (cuda) out += "cuda " + name(cuda_dtype);
  return out + ")" + defaults;
}

namespace {
void apply_autocast_state(const AutocastState& s) {
  at::autocast::set_autocast_enabled(at::kCPU, s.cpu);
  at::autocast::set_autocast_enabled(at::kCUDA, s.cuda);
  at::autocast::set_autocast_dtype(at::kCPU, s.cpu_dtype);
  at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
}
}  // namespace

AutocastStateGuard::AutocastStateGuard(const AutocastState& state) : saved_(AutocastState::current()) {
  apply_autocast_state(state);
}

AutocastStateGuard::~AutocastStateGuard() { apply_autocast_state(saved_); }

at::ScalarType autocast_operand_dtype(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  const bool eligible = dtype && t.is_floating_point() && t.scalar_type() != at::kDouble;
  return eligible ? *dtype : t.scalar_type();
}

at::Tensor autocast_operand(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  if (!t.defined()) return t;
  const at::ScalarType to = autocast_operand_dtype(t, dtype);
  return to == t.scalar_type() ? t : t.to(to);
}

namespace {

template <c10::DeviceType D>
struct AutocastKernels {
  static std::optional<at::ScalarType> dtype() { return at::autocast::get_autocast_dtype(D); }
  static at::Tensor cast(const at::Tensor& t) { return autocast_operand(t, dtype()); }
  static std::optional<at::Tensor> cast(const std::optional<at::Tensor>& t) {
    return t ? std::optional<at::Tensor>(cast(*t)) : std::nullopt;
  }
  static std::vector<at::Tensor> cast(at::TensorList ts) {
    std::vector<at::Tensor> out;
    out.reserve(ts.size());
    for (const auto& t : ts) out.push_back(cast(t));
    return out;
  }

  static at::Tensor fwd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
    const NoAutocast below;
    return fwd_gemm(cast(x), cast(w), cast(b));
  }
  static at::Tensor dgrad(const at::Tensor& dy, const at::Tensor& w) {
    const NoAutocast below;
    return dgrad_gemm(cast(dy), cast(w));
  }
  // The output keeps its dtype: an FP32 `out` takes the lower-precision product in FP32.
  static void wgrad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& out, bool accumulate,
                    const std::optional<at::Tensor>& bias_grad_out) {
    const NoAutocast below;
    at::Tensor o = out;
    wgrad_gemm(cast(dy), cast(x), o, accumulate, bias_grad_out);
  }
  static at::Tensor grouped_fwd(const at::Tensor& x, at::TensorList w, at::IntArrayRef m_splits,
                                std::optional<at::TensorList> bias) {
    const NoAutocast below;
    const auto cw = cast(w);
    if (!bias) return grouped_fwd_gemm(cast(x), cw, m_splits, std::nullopt);
    const auto cb = cast(*bias);
    return grouped_fwd_gemm(cast(x), cw, m_splits, at::TensorList(cb));
  }
  static at::Tensor grouped_fwd_packed(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef m_splits,
                                       const std::optional<at::Tensor>& bias) {
    const NoAutocast below;
    return grouped_fwd_gemm(cast(x), cast(w), m_splits, cast(bias));
  }
  static at::Tensor grouped_dgrad(const at::Tensor& dy, at::TensorList w, at::IntArrayRef m_splits) {
    const NoAutocast below;
    return grouped_dgrad_gemm(cast(dy), cast(w), m_splits);
  }
  static at::Tensor grouped_dgrad_packed(const at::Tensor& dy, const at::Tensor& w, at::IntArrayRef m_splits) {
    const NoAutocast below;
    return grouped_dgrad_gemm(cast(dy), cast(w), m_splits);
  }
  static void grouped_wgrad(const at::Tensor& dy, const at::Tensor& x, at::TensorList out, at::IntArrayRef m_splits,
                            bool accumulate, std::optional<at::TensorList> bias_grad_out) {
    const NoAutocast below;
    grouped_wgrad_gemm(cast(dy), cast(x), out, m_splits, accumulate, bias_grad_out);
  }
  static void grouped_wgrad_packed(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& out,
                                   at::IntArrayRef m_splits, bool accumulate,
                                   const std::optional<at::Tensor>& bias_grad_out) {
    const NoAutocast below;
    at::Tensor o = out;
    grouped_wgrad_gemm(cast(dy), cast(x), o, m_splits, accumulate, bias_grad_out);
  }

  static void register_all(torch::Library& m) {
    m.impl("fwd_gemm", &fwd);
    m.impl("dgrad_gemm", &dgrad);
    m.impl("wgrad_gemm", &wgrad);
    m.impl("grouped_fwd_gemm", &grouped_fwd);
    m.impl("grouped_fwd_gemm_packed", &grouped_fwd_packed);
    m.impl("grouped_dgrad_gemm", &grouped_dgrad);
    m.impl("grouped_dgrad_gemm_packed", &grouped_dgrad_packed);
    m.impl("grouped_wgrad_gemm", &grouped_wgrad);
    m.impl("grouped_wgrad_gemm_packed", &grouped_wgrad_packed);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(dwgraph, AutocastCPU, m) { AutocastKernels<c10::DeviceType::CPU>::register_all(m); }
TORCH_LIBRARY_IMPL(dwgraph, Autocast, m) { AutocastKernels<c10::DeviceType::CUDA>::register_all(m); }

}  // namespace dwgraph::ops
