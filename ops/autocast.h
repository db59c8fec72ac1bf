#pragma once
// dwgraph's GEMMs under torch.autocast, as aten::linear and aten::mm (lower-precision ops):
// inside an enabled autocast region of the operands' device, floating operands other than
// float64 run in the region's dtype. The modules' autograd functions (ops/linear.cpp) and
// the dispatcher ops' Autocast kernels (torch.ops.dwgraph.*, ops/autocast.cpp) both ask
// autocast_gemm_dtype, so the two cannot disagree.
//
// Weight gradients of FP32 parameters computed from lower-precision operands are written
// in FP32 by the GEMM (wgrad_gemm's FP32 output), not rounded to the autocast dtype first.

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>
#include <string>

namespace dwgraph::ops {

// The dtype the GEMMs of a call on `device_type` run in, or nullopt outside autocast.
std::optional<at::ScalarType> autocast_gemm_dtype(c10::DeviceType device_type);

// The dtype `t` runs in under `dtype` (nullopt: outside autocast): `dtype` when `t` is
// autocast-eligible (floating, not float64), else its own.
at::ScalarType autocast_operand_dtype(const at::Tensor& t, std::optional<at::ScalarType> dtype);

// `t` in `dtype` when one is given and `t` is autocast-eligible (floating, not float64),
// else `t` itself. An ordinary aten::to: differentiable, as autocast's own casts are.
at::Tensor autocast_operand(const at::Tensor& t, std::optional<at::ScalarType> dtype);

// The calling thread's autocast state on CPU and CUDA: what a graph captured under it
// bakes into its kernels. The dtypes count where autocast is off too: torch.autocast(device)
// entered inside captured code without a dtype takes the default, which
// torch.set_autocast_dtype changes.
struct AutocastState {
  bool cpu = false;
  bool cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  at::ScalarType cuda_dtype = at::kHalf;

  static AutocastState current();
  static AutocastState off() { return AutocastState(); }
  bool operator==(const AutocastState& o) const {
    return cpu == o.cpu && cuda == o.cuda && cpu_dtype == o.cpu_dtype && cuda_dtype == o.cuda_dtype;
  }
  bool operator!=(const AutocastState& o) const { return !(*this == o); }
  // The same where autocast is on (a backward started outside the region sees the defaults
  // again, whatever dtype the forward's region had).
  bool same_where_on(const AutocastState& o) const {
    return cpu == o.cpu && cuda == o.cuda && (!cpu || cpu_dtype == o.cpu_dtype) &&
           (!cuda || cuda_dtype == o.cuda_dtype);
  }
  // "off", "on (cpu torch.bfloat16)"; a default dtype other than torch's where autocast is
  // off is named too.
  std::string describe() const;
};

// Sets the calling thread's autocast state while alive (the autograd engine carries it
// into the backward it starts), and puts the previous one back.
class AutocastStateGuard {
 public:
  explicit AutocastStateGuard(const AutocastState& state);
  ~AutocastStateGuard();
  AutocastStateGuard(const AutocastStateGuard&) = delete;
  AutocastStateGuard& operator=(const AutocastStateGuard&) = delete;

 private:
  AutocastState saved_;
};

// Within its scope the GEMM ops run without their Autocast kernels: the caller has cast
// already, or (a backward, backward_dw) keeps the forward's precision whatever autocast
// region it happens to run in.
struct NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

}  // namespace dwgraph::ops
