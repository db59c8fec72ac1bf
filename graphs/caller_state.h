#pragma once
// Caller state that warmup and capture must leave as they found it (namespace
// dwgraph::graphs), SPEC C3 and C8: capture changes nothing the caller sees, and a capture
// that raises rolls back every wgrad unit it queued and every buffer it changed.
//
// One RAII guard saves it all when made and puts it all back when destroyed, on every
// exit path, each piece on its own (a piece that fails to restore is reported as a
// warning and the others are still restored):
//  - each parameter's .grad (the object) and, where capture runs kernels for real (host
//    backend), its contents: writes a kernel does not declare are undone too;
//  - the contents of module buffers (BatchNorm's running statistics) and of main_grad;
//  - the grad_added_to_main_grad flags;
//  - the wgrad units queued in dwgraph modules (taken out, so capture neither runs nor
//    loses the caller's; whatever the capture queued or retained is dropped);
//  - the default generators' states (CPU, and the capture device's);
// and for its lifetime it suppresses the wgrad hooks of the dwgraph modules and, when
// asked, the parameters' tensor hooks (Note [Parameter tensor hooks at replay]).

#include "graphs/module_spec.h"

#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/function_hook.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <optional>
#include <vector>

namespace dwgraph::graphs {

struct CallerState {
  std::vector<at::Tensor> parameters;
  bool parameter_contents = false;  // also save the parameters' values
  std::vector<at::Tensor> buffers;
  std::vector<FusedParameter> fused;
  std::vector<std::shared_ptr<ops::WgradStore>> stores;
  c10::Device device = c10::Device(c10::kCPU);
  bool suspend_tensor_hooks = false;  // the parameters' register_hook hooks, while the guard lives
};

class CallerStateGuard {
 public:
  explicit CallerStateGuard(CallerState state);
  ~CallerStateGuard();
  CallerStateGuard(const CallerStateGuard&) = delete;
  CallerStateGuard& operator=(const CallerStateGuard&) = delete;

  // Sets every parameter's .grad to None (until the guard restores them).
  void clear_grads();
  // Puts the caller's .grad objects back now.
  void restore_grads();
  // Puts the generators' states back now (between warmup and capture).
  void restore_rng();
  // Keeps every unit run from now on (and the tensors it holds) until the guard ends: the
  // memory a captured backward-dw graph reads stays allocated until every backward-dw
  // graph is captured (Note [Backward-dw graphs are captured last]).
  void retain_consumed_units();
  // Takes off the parameters the tensor hooks registered on them since (a warmup hook, a
  // capture-time hook), until the guard ends, before each warmup or captured backward: one
  // would run inside the capture and again at every replay (Note [Parameter tensor hooks at
  // replay]).
  void take_tensor_hooks();

 private:
  CallerState state_;
  std::vector<at::Tensor> grads_;
  std::vector<std::pair<at::Tensor, at::Tensor>> contents_;  // (tensor, saved copy)
  std::vector<std::optional<bool>> flags_;
  std::vector<std::unique_ptr<ops::WgradStore::Stash>> stashes_;
  std::vector<std::pair<at::Generator, at::Tensor>> rng_;
  std::vector<std::pair<at::Tensor, std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>>> tensor_hooks_;
};

// Sets the .grad of `params` to None while alive, so captured kernels write only fresh
// graph-pool buffers (SPEC C3); puts the caller's .grad back on every exit path.
class GradsDetached {
 public:
  explicit GradsDetached(std::vector<at::Tensor> params);
  ~GradsDetached();
  GradsDetached(const GradsDetached&) = delete;
  GradsDetached& operator=(const GradsDetached&) = delete;

 private:
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> grads_;
};

// Note [A graph returns the gradient autograd computed]: on the way to a leaf's
// AccumulateGrad the engine casts its gradient to the leaf's grad_dtype (a BF16 parameter
// accumulating in FP32). Captured, that cast would be fixed at the capture's grad_dtype,
// while eager code asks for it at each backward (FSDP2 switches it between microbatches).
// So a backward capture runs with no grad_dtype on its parameters: the graph returns the
// gradient in the dtype autograd computes it, and the replay's engine casts it as it
// would cast an eager backward's.
class GradDtypesUnset {
 public:
  explicit GradDtypesUnset(std::vector<at::Tensor> params);
  ~GradDtypesUnset();
  GradDtypesUnset(const GradDtypesUnset&) = delete;
  GradDtypesUnset& operator=(const GradDtypesUnset&) = delete;

 private:
  std::vector<at::Tensor> params_;
  std::vector<std::optional<at::ScalarType>> dtypes_;
};

}  // namespace dwgraph::graphs
