#include "graphs/landing.h"

#include "common/check.h"

#include <ATen/core/grad_mode.h>

namespace dwgraph::graphs {

void Landing::check(const std::string& where) const {
  for (const auto& c : contributions) {
    const at::Tensor& grad = c.param.grad();
    if (!grad.defined()) continue;
    DWGRAPH_CHECK_ARG(grad.scalar_type() == c.buffer.scalar_type() && grad.sizes() == c.buffer.sizes() &&
                          grad.device() == c.buffer.device(),
                      where, ": .grad of parameter '", c.name, "' is a ", grad.scalar_type(), " tensor of shape ",
                      grad.sizes(), " on ", grad.device(), " but its gradient is a ", c.buffer.scalar_type(),
                      " tensor of shape ", c.buffer.sizes(), " on ", c.buffer.device(), " (no silent cast)");
  }
}

void Landing::land() const {
  {
    const at::NoGradGuard no_grad;
    for (const auto& c : contributions) {
      at::Tensor& grad = c.param.mutable_grad();
      if (!grad.defined()) {
        grad = c.buffer.clone();
      } else if (c.mode == Contribution::Mode::kAccumulate) {
        grad.add_(c.buffer);
      } else if (grad.data_ptr() != c.buffer.data_ptr()) {
        grad.copy_(c.buffer);
      }
    }
  }
  for (const auto& f : mark_flags) f();
  // A hook may reset() the graphs that own this landing, destroying it: the hooks run from
  // a copy (nothing of the landing is read after them).
  const std::vector<std::function<void()>> run = hooks;
  for (const auto& h : run) h();
}

}  // namespace dwgraph::graphs
