#pragma once
// The capture/replay manager (SPEC C3, C4, C7): make_graphed_callables with forward,
// backward and backward-dw graphs, the gradient hand-off and the delayed hooks.
// docs/memory-contract.md says who owns which buffer, when, and why
// zero_grad(set_to_none=True) between replays is safe.

#include "graphs/graph.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph {

// A module whose weight gradients are deferred to backward_dw(): dwgraph's own, or any
// other (TransformerEngine's) described by these functions.
struct DeferredWgradModuleSpec {
  std::string name;
  std::function<bool()> need_backward_dw;
  // Runs the oldest queued unit. For dwgraph modules it does not run the hooks (the
  // manager runs them after the hand-off); `run_hooks` is empty when it does.
  std::function<void()> backward_dw;
  std::function<void()> run_hooks;
  // Parameters whose gradient lands in .grad during backward_dw().
  std::vector<at::Tensor> deferred_parameters;
  std::vector<std::string> deferred_parameter_names;
  // Fused parameters: their main_grad (persistent, written in the graph) and what marks
  // an accumulation (grad_added_to_main_grad).
  std::vector<at::Tensor> fused_parameters;
  std::vector<std::string> fused_parameter_names;
  std::function<at::Tensor(size_t)> main_grad;
  std::function<void(size_t)> mark_main_grad_accumulated;
  // True when deferred_parameters are exactly the parameters backward_dw() lands (dwgraph
  // modules); false for other modules, whose parameters may get their gradient in the main
  // backward instead: they also stay targets of the backward graph.
  bool exact_deferred = true;
  // Keep consumed units alive during capture (WgradStore::set_retain_consumed); optional.
  std::function<void(bool)> retain_consumed;
  std::function<void()> release_consumed;
};

// What the manager graphs: a forward function over tensors plus its parameters and its
// deferred-wgrad modules.
struct GraphableCallable {
  std::string name;
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
  std::vector<at::Tensor> parameters;  // every trainable parameter the forward uses
  std::vector<std::string> parameter_names;
  std::vector<DeferredWgradModuleSpec> deferred_modules;
  std::function<bool()> is_training;   // optional: replay only in the mode captured
  // Optional: run once at the end of each backward that replays this callable's backward
  // graph, after autograd has accumulated its gradients (hooks of non-deferred modules).
  std::function<void()> after_backward;
  // Optional: module buffers, whose contents warmup and capture must leave unchanged.
  std::vector<at::Tensor> buffers;
};

struct GraphedCallableOptions {
  int num_warmup_iters = 3;
  bool allow_unused_input = false;
  // Pipeline schedule (TransformerEngine's _order): +c forward of chunk c (1-based) for
  // its next microbatch, -c its backward, -(c + 0.5) its backward-dw.
  std::optional<std::vector<double>> order;
  std::optional<std::vector<int64_t>> num_layers_per_chunk;
  std::shared_ptr<graphs::GraphPool> pool;
  bool retain_graph_in_backward = false;
  // Test-only: capture backward-dw with the caller's .grad in place and skip the
  // hand-off, i.e. the unfixed behaviour whose hazard the ledger must catch.
  bool unsafe_capture_with_caller_grad = false;
};

class GraphManager;

// One captured graph of a set (the capture log and dwgraph.summary list them).
struct GraphInfo {
  std::string callable;  // "graphed callable 0 ('Linear')", as in error messages
  std::string kind;      // "forward", "backward" or "backward-dw"
  size_t num_kernels = 0;
};

// Pool statistics and contribution bytes of a set of graphed callables.
struct GraphedStats {
  allocator::PoolStats pool;
  int64_t contribution_bytes = 0;  // distinct contribution buffers (microbatches share them)
  int64_t static_bytes = 0;  // static inputs, outputs, grad outputs and grad inputs
  size_t num_graphs = 0;
  std::vector<GraphInfo> graphs;  // per slot: forward, backward, backward-dw
};

// One graphed (module, microbatch) slot. operator() replays its forward graph and
// returns outputs connected to autograd, whose backward replays its backward graph;
// backward_dw() replays its backward-dw graph, hands the contributions to .grad and runs
// the delayed hooks.
class GraphedCallable {
 public:
  std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& inputs);
  void backward_dw();
  bool need_backward_dw() const;
  // Releases every graph, pool reference and contribution of the whole set; any later
  // call raises GraphStateError.
  void reset();
  // Bytes held by this slot's contribution buffers.
  int64_t contribution_bytes() const;
  size_t index() const { return index_; }
  const std::string& name() const;

 private:
  friend class GraphManager;

  friend GraphedStats graphed_stats(const GraphedCallable&);
  friend std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables(
      std::vector<GraphableCallable>, const std::vector<std::vector<at::Tensor>>&, GraphedCallableOptions);
  GraphedCallable(std::shared_ptr<GraphManager> m, size_t index) : manager_(std::move(m)), index_(index) {}
  std::shared_ptr<GraphManager> manager_;
  size_t index_;
};

// Captures every callable (sequential schedule: forwards in order, backwards in reverse,
// then the backward-dw graphs; pipeline: in `order`) on one private pool.
// `sample_args[i]` are callable i's sample inputs (their device picks the backend).
std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables(
    std::vector<GraphableCallable> callables, const std::vector<std::vector<at::Tensor>>& sample_args,
    GraphedCallableOptions options = {});

GraphedStats graphed_stats(const GraphedCallable& any_of_the_set);

}  // namespace dwgraph
