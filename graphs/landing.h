#pragma once
// How gradients reach the caller after a replay (namespace dwgraph::graphs), SPEC C4. One
// sequence serves make_graphed_callables and graphed_step alike, in eager's order:
//  1. the hand-off: each contribution (a graph-pool buffer the replay wrote) goes to its
//     parameter's .grad, `.grad = buffer.clone()` when .grad is None, otherwise added
//     (or, for a step that saw the caller's .grad, copied: the graph already added);
//  2. grad_added_to_main_grad is set on every fused parameter the replay accumulated into
//     (eager sets it inside the GEMM, so hooks see it set);
//  3. the delayed hooks (register_wgrad_hook, distributed reduce hooks), once per module.
// The caller therefore owns every .grad, and zero_grad(set_to_none=True) between replays
// is always safe. check() runs before the replay: nothing is written when it throws.

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace dwgraph::graphs {

struct Contribution {
  enum class Mode {
    kAccumulate,  // None: clone; else .grad += buffer
    kReplace,     // None: clone; else .grad.copy_(buffer) (the buffer already holds .grad + new)
  };
  at::Tensor param;
  at::Tensor buffer;  // the graph-pool buffer the captured kernels write
  std::string name;
  Mode mode = Mode::kAccumulate;
};

struct Landing {
  std::vector<Contribution> contributions;
  std::vector<std::function<void()>> mark_flags;
  std::vector<std::function<void()>> hooks;

  // ArgumentError, before anything is written, when an existing .grad has another dtype,
  // shape or device than its contribution (never a silent cast). `where` prefixes messages.
  void check(const std::string& where) const;
  // Hand-off, flags, hooks.
  void land() const;
  bool empty() const { return contributions.empty() && mark_flags.empty() && hooks.empty(); }
};

}  // namespace dwgraph::graphs
