#include "ops/grad_accumulation.h"

#include "common/check.h"

#include <ATen/core/grad_mode.h>

namespace dwgraph::ops {

void check_accumulable(const at::Tensor& param, const at::Tensor& g, const std::string& what,
                       const std::string* param_name) {
  const at::Tensor& grad = param.grad();
  if (!grad.defined()) return;
  DWGRAPH_CHECK_ARG(grad.scalar_type() == g.scalar_type() && grad.sizes() == g.sizes() && grad.device() == g.device(),
                    what, param_name ? c10::str(": parameter '", *param_name, "'") : std::string(), ": .grad is a ", grad.scalar_type(), " tensor of shape ", grad.sizes(), " on ", grad.device(),
                    " but its gradient is a ", g.scalar_type(), " tensor of shape ", g.sizes(), " on ", g.device(),
                    " (no silent cast)");
}

void accumulate_grad(const at::Tensor& param, const at::Tensor& g, Take take, const std::string& what) {
  check_accumulable(param, g, what);
  const at::NoGradGuard no_grad;
  at::Tensor& grad = param.mutable_grad();
  if (!grad.defined()) {
    grad = take == Take::kSteal ? g : g.clone();
  } else {
    grad.add_(g);
  }
}

}  // namespace dwgraph::ops
