#pragma once
// A whole training step as graphs (namespace dwgraph): the core of @dwgraph.graphed_step
// and its C++ form. The first calls for a key run the step eagerly (warmup), the next
// captures it on a private pool with every parameter's .grad set to None (so the step's
// gradients land in graph-pool buffers) and replays it, and every later call replays.
// After each replay the gradients are handed to the caller (SPEC C4) and the delayed
// hooks run. docs/graphed-step.md.

#include "graphs/graph.h"
#include "graphs/handoff.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dwgraph {

using StepFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

struct GraphedStepOptions {
  int warmup_iters = 3;
  std::shared_ptr<graphs::GraphPool> pool;  // null: one private pool for all of the step's graphs
  int64_t max_graphs = 8;
  // Returned tensors with at most this many elements (scalars, the loss) are clones;
  // larger ones are the graph's static outputs, valid until the next call of the step.
  int64_t clone_numel_limit = 4096;
  // The trainable parameters the step gives gradients to, asked before each capture
  // (Python discovers them during warmup). Names are used in messages.
  std::function<std::vector<at::Tensor>()> params;
  std::function<std::vector<std::string>()> param_names;
  // Fused parameters' main_grad buffers: written inside the graph, so they must stay the
  // same storages (checked at every replay); after each replay they are marked
  // (grad_added_to_main_grad). Optional.
  std::function<std::vector<at::Tensor>()> main_grads;
  std::function<std::vector<std::string>()> main_grad_names;
  std::function<void()> mark_main_grads;
  // Delayed hooks, run after each hand-off. Optional.
  std::function<void()> after_hand_off;
  // Told true around the capture (Python suppresses wgrad hooks inside it). Optional.
  std::function<void(bool)> capturing;
};

class GraphedStep {
 public:
  GraphedStep(StepFn step, GraphedStepOptions options);
  ~GraphedStep();

  // Runs the step for `tensors`; `key` holds what else identifies the graph (non-tensor
  // arguments); tensor shapes, dtypes and devices are added to it.
  std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& tensors, const std::string& key = "");

  // Graphs captured and held (keys still warming up hold none).
  size_t num_graphs() const;
  size_t num_captures() const { return captures_; }
  // Releases every graph and the pool.
  void reset();

 private:
  struct Entry;
  std::vector<at::Tensor> capture(Entry& e, const std::vector<at::Tensor>& tensors);
  std::vector<at::Tensor> replay(Entry& e, const std::vector<at::Tensor>& tensors);
  std::vector<at::Tensor> outputs(const Entry& e) const;

  StepFn step_;
  GraphedStepOptions opts_;
  std::shared_ptr<graphs::GraphPool> pool_;
  std::list<std::string> lru_;  // most recent first
  std::map<std::string, std::unique_ptr<Entry>> entries_;
  size_t captures_ = 0;
  c10::Device device_ = c10::Device(c10::kCPU);
  bool device_known_ = false;
};

}  // namespace dwgraph
