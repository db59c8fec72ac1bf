#pragma once
// The gradient hand-off (SPEC C4), namespace dwgraph::graphs: after each replay of a graph
// that wrote a parameter's contribution (a graph-pool buffer), the caller gets it as
// `.grad = contribution.clone()` when .grad is None and `.grad.add_(contribution)`
// otherwise, so the caller owns every .grad and zero_grad(set_to_none=True) is safe.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace dwgraph::graphs {

struct Contribution {
  at::Tensor param;
  at::Tensor buffer;  // the graph-pool buffer the captured kernels write
  std::string name;
};

// Raises ArgumentError, before anything is written, when an existing .grad has another
// dtype or shape than its contribution (never a silent cast). `where` prefixes messages.
void check_hand_off(const std::vector<Contribution>& contributions, const std::string& where);

// Clones or adds every contribution into its parameter's .grad.
void hand_off(const std::vector<Contribution>& contributions);

}  // namespace dwgraph::graphs
