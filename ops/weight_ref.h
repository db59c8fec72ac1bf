#pragma once
// How dwgraph's autograd functions reach a weight or bias parameter (SPEC C1, C2, C5).
//
// Note [Weights are plain references]: an autograd function keeps WeightRefs as ordinary
// members of its node, never through save_for_backward. Saved-tensor hooks (activation
// offloading) therefore cannot turn a distributed-weight wrapper into a plain tensor, and
// the reference stays valid for a second backward with retain_graph=True. Activations
// (the GEMM inputs) are saved as SavedVariables, so the hooks do apply to them.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace dwgraph::ops {

struct WeightRef {
  // The leaf that owns the gradient (.grad, main_grad).
  at::Tensor param;
  // Name used in messages, e.g. "fc1.weight".
  std::string name;
  // Fused accumulation (C2): the persistent buffer the wgrad GEMM accumulates into.
  std::optional<at::Tensor> main_grad;
  // The dtype of .grad when it differs from the parameter's (a BF16 parameter with an
  // FP32 .grad, torch's Tensor.grad_dtype): the GEMM writes or accumulates .grad directly.
  std::optional<at::ScalarType> grad_dtype;
  // Distributed weights (C5). materialize_forward / materialize_backward return the full
  // weight used by the forward / backward GEMMs (empty: the parameter itself); finalize
  // receives the finished weight gradient instead of .grad or main_grad.
  std::function<at::Tensor()> materialize_forward;
  std::function<at::Tensor()> materialize_backward;
  std::function<void(const at::Tensor&)> finalize;
  // Called after every accumulation into main_grad (sets grad_added_to_main_grad).
  std::function<void()> on_main_grad_accumulated;
  // The parameter's main_grad now (nullopt: none). Checked before the deferred or backward
  // GEMM accumulates into `main_grad`: a buffer replaced since the forward would otherwise
  // take the gradient unseen.
  std::function<std::optional<at::Tensor>()> current_main_grad;
  // The tensor autograd differentiates with respect to (its gradient edge); undefined: `param`.
  // A checkpointed recomputation (Note [Checkpointed LayerNormMLP], ops/linear.cpp) passes a
  // detached alias, so its nested backward captures the gradient without running the
  // parameter's hooks; the gradient still lands on `param`.
  at::Tensor autograd_input;

  const at::Tensor& differentiated() const { return autograd_input.defined() ? autograd_input : param; }
  at::Tensor for_forward() const { return materialize_forward ? materialize_forward() : param; }
  at::Tensor for_backward() const {
    if (materialize_backward) return materialize_backward();
    return for_forward();
  }
};

using WeightRefPtr = std::shared_ptr<const WeightRef>;

// Where and how a module's weight gradients are computed.
struct WgradConfig {
  bool delay_wgrad_compute = false;
  bool fuse_wgrad_accumulation = false;
  std::shared_ptr<class WgradStore> store;  // required with delay_wgrad_compute
  uint64_t unit_id = 0;                     // the forward call's unit in `store`
  std::string module_name = "module";       // for messages
  // The key the work is queued under in `store` (WgradStore::push's `source`); null: the
  // autograd node itself. Recomputed nodes live for one backward, so a checkpointed module
  // queues under keys of its own node, which lives as long as the forward's graph.
  const void* source = nullptr;
};

}  // namespace dwgraph::ops
