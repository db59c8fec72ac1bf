#pragma once
// The one rule by which a gradient reaches a parameter's .grad outside autograd (namespace
// dwgraph::ops), contract C1 and C4: `.grad = g` when .grad is None, `.grad += g`
// otherwise, and a dtype, shape or device mismatch is an error, never a silent cast. Eager
// deferred units, the graphs' hand-off (graphs/landing.h) and a DistributedWeight's default
// finalize all land through it.

#include <ATen/core/Tensor.h>

#include <string>

namespace dwgraph::ops {

enum class Take {
  kSteal,  // `g` is a fresh buffer nobody else holds: it becomes .grad without a copy
  kClone,  // `g` is reused (a graph-pool buffer the next replay rewrites): .grad gets a clone
};

// ArgumentError naming `what` (and, when given, "parameter '<param_name>'" after it) when an
// existing .grad of `param` cannot take `g`. The message is built only when it is raised:
// a landing checks every parameter at every hand-off (contract C10).
void check_accumulable(const at::Tensor& param, const at::Tensor& g, const std::string& what,
                       const std::string* param_name = nullptr);
// check_accumulable, then .grad = g (or its clone) when None, else .grad += g.
void accumulate_grad(const at::Tensor& param, const at::Tensor& g, Take take, const std::string& what);

}  // namespace dwgraph::ops
