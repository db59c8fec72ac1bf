#pragma once
// Creating autograd nodes across torch releases (namespace dwgraph::detail).
//
// Nodes are held by std::shared_ptr in older torch releases and by c10::intrusive_ptr in
// newer ones; Edge::function tells which this torch uses, and make_node builds the right one.
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace dwgraph::detail {

using NodePtr = decltype(torch::autograd::Edge::function);

template <class T>
inline constexpr bool kSharedNodes =
    std::is_same_v<std::decay_t<T>, std::shared_ptr<torch::autograd::Node>>;

template <class NodeT, class... Args>
auto make_node(Args&&... args) {
  if constexpr (kSharedNodes<NodePtr>) {
    return std::make_shared<NodeT>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
  }
}

}  // namespace dwgraph::detail
