#pragma once
// The capture/replay manager (namespace dwgraph::graphs; the names are also in dwgraph::),
// SPEC C3, C4, C7, C8: make_graphed_callables with forward, backward and backward-dw
// graphs, the gradient hand-off and the delayed hooks. docs/memory-contract.md says who
// owns which buffer, when, and why zero_grad(set_to_none=True) between replays is safe.

#include "allocator/placement_plan.h"
#include "graphs/graph.h"
#include "graphs/module_spec.h"
#include "graphs/replay_checks.h"
#include "graphs/schedule.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph::graphs {

// What the manager graphs: a forward function over tensors plus its parameters and the
// modules whose gradients it lands or whose hooks it runs.
struct GraphableCallable {
  std::string name;
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
  // Every parameter the forward uses, frozen ones too: requires_grad is checked at replay.
  std::vector<at::Tensor> parameters;
  std::vector<std::string> parameter_names;
  // Optional: the parameters the callable has now, by name (a replaced parameter or
  // submodule is refused at replay).
  std::function<NamedTensors()> current_parameters;
  // Optional: what every parameter slot of the modules holds now ((qualified name, tensor),
  // cheap: no traversal). Libraries swap parameters without registering them (FSDP2 puts
  // its sharded and unsharded parameters straight into module._parameters), which
  // current_parameters cannot tell from a registration.
  std::function<NamedTensors()> registered_parameters;
  // Optional: what else only the front end can check (Python: module hooks registered
  // after capture, a changed module tree); throws the typed error, naming `where`.
  std::function<void(const std::string& where)> check_state;
  // Note [Checks paid when state changes] (graphs/state_epoch.h): true when the front end
  // moves the state epoch on every change the checks above (and the parameters'
  // requires_grad, memory and main_grad, and training_mode) can see; the checks then run
  // only after the epoch moved. False (the C++ API): they run at every call.
  bool state_watched = false;
  // dwgraph modules (deferring or not: hooks, main_grad) and other modules with
  // backward_dw()/need_backward_dw() found in the callable.
  std::vector<ModuleSpec> modules;
  // Optional: the mode of a call, as a string compared with the capture's: the training
  // flag of every module the callable runs ("1101": train, train, eval, train) and whatever
  // else a forward decides its kernels by (Python adds the grad_dtype of dwgraph modules'
  // parameters). The graphs replay only in the mode captured; in any other (a module
  // switched to eval, BatchNorm frozen, FSDP2's mixed precision deferring the FP32 upcast)
  // the callable runs eagerly.
  std::function<std::string()> training_mode;
  // Optional: run before (after=false) and after (after=true) each forward ("forward") and
  // backward ("backward") of warmup and capture, outside the captured region, never
  // replayed (TransformerEngine's capture_time_hooks).
  std::function<void(const std::string& phase, bool after)> capture_time_hook;
  // Module buffers: warmup and capture leave their contents unchanged, and replays check
  // that they are still the ones captured (a replaced buffer is refused, as a parameter).
  std::vector<at::Tensor> buffers;
  std::vector<std::string> buffer_names;          // optional (default "buffer <i>")
  std::function<NamedTensors()> current_buffers;  // optional
  // Optional: the parameters and buffers the forward saved for its backward (autograd's
  // saved tensors, whose versions an eager backward checks), asked after each forward
  // capture (Note [State saved for the backward]).
  std::function<NamedTensors()> saved_state;
  std::shared_ptr<void> keep_alive;  // held while the graphed callables exist
};

struct GraphedCallableOptions {
  int num_warmup_iters = 3;
  bool allow_unused_input = false;
  // Pipeline schedule: TransformerEngine's _order (graphs/schedule.h), or a Schedule.
  std::optional<std::vector<double>> order;
  std::optional<std::vector<int64_t>> num_layers_per_chunk;
  std::optional<Schedule> schedule;
  std::shared_ptr<GraphPool> pool;
  bool retain_graph_in_backward = false;
  // Pipeline schedule only: slots of one callable whose lifetimes do not overlap share
  // their static inputs and grad outputs (TransformerEngine's
  // _reuse_graph_input_output_buffers; Note [Static buffers reused across microbatches]).
  bool reuse_static_buffers = false;
  // Note [Autocast in the backward]: the backward graph is captured with autocast off, as
  // the natural loop (forward under torch.autocast, loss.backward() outside it) runs it;
  // true: in the forward's autocast state, for a loop that calls backward inside the
  // region. A backward whose autocast state differs from its capture's is refused.
  bool backward_under_autocast = false;
  // Outputs are fresh clones the caller owns (default), so keeping one across calls or
  // changing it in place cannot touch what the graphs hold. false: the graphs' static
  // outputs themselves, overwritten by the slot's next call (and in a pipeline on the
  // set's own pool, whose slots share it by liveness, by other slots' replays once the
  // output's backward has run) (torch's and
  // TransformerEngine's behaviour; saves a copy per output per call).
  bool clone_outputs = true;
  // TransformerEngine's: called once before the first warmup iteration and once after the
  // last (both, one after the other, with no warmup iterations), before any capture. They
  // run inside the capture's caller-state guard: what it restores after warmup and capture
  // (.grad, buffers, main_grad, flags, queued units, the RNG) it restores after them too.
  std::function<void()> pre_warmup_hook;
  std::function<void()> post_warmup_hook;
  // Pipeline schedule on the set's own host pool: capture a second time with the pool
  // following a placement planned from the first capture's allocations when that holds
  // less (Note [A second capture on a planned pool]). false: one capture, best fit.
  bool plan_placement = true;
  // Set by make_graphed_callables for that second capture.
  std::shared_ptr<const allocator::PlacementPlan> placement;
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

// Pool statistics and bytes of a set of graphed callables.
struct GraphedStats {
  allocator::PoolStats pool;
  int64_t contribution_bytes = 0;  // distinct contribution buffers (microbatches share them)
  int64_t static_bytes = 0;        // static inputs, outputs, grad outputs and grad inputs
  size_t num_graphs = 0;
  size_t num_kernels = 0;
  std::vector<GraphInfo> graphs;  // per slot: forward, backward, backward-dw
  // The peak live bytes of the same schedule run eagerly, when one was recorded
  // (GraphedCallable::record_eager_peak): what `pool` is compared with.
  std::optional<int64_t> eager_peak_bytes;
};

// One graphed (callable, microbatch) slot. operator() replays its forward graph and
// returns outputs connected to autograd, whose backward replays its backward graph;
// backward_dw() replays its backward-dw graph, hands the contributions to .grad and runs
// the delayed hooks.
class GraphedCallable {
 public:
  // Replays, or runs the callable eagerly when it is in a mode its graphs were not
  // captured in (replays() is false).
  std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& inputs);
  // Replays; nullopt, having done nothing, when replays() is false (the front end then
  // runs the callable eagerly with its own arguments).
  std::optional<std::vector<at::Tensor>> replay_or_nothing(const std::vector<at::Tensor>& inputs);
  // False when the callable is in a training mode the graphs were not captured in.
  bool replays() const;
  void backward_dw();
  bool need_backward_dw() const;
  // Releases every graph, pool reference and contribution of the whole set; any later
  // call raises GraphStateError.
  void reset();
  int64_t contribution_bytes() const;  // this slot's contribution buffers
  size_t index() const { return index_; }
  size_t callable_index() const;       // which of the callables this slot runs
  const std::string& name() const;
  GraphedStats stats() const;          // of the whole set
  // Whether `other` came from the same make_graphed_callables call (one set: one pool,
  // one stats()).
  bool same_set(const GraphedCallable& other) const { return manager_ == other.manager_; }
  c10::Device device() const;          // where the set's graphs run
  // The set's pool (null after reset()); for tests' negative controls, which turn its
  // replay-order checks off. Capturing other graphs on it breaks the set's liveness plan.
  std::shared_ptr<GraphPool> pool() const;
  // Records the peak live bytes of the same schedule run eagerly (measured by the caller,
  // e.g. dwgraph.eager_memory), reported by stats() next to the pool's: the graphs cannot
  // measure what eager code would have held. ArgumentError unless nbytes > 0.
  void record_eager_peak(int64_t nbytes);

 private:
  friend std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables(
      std::vector<GraphableCallable>, const std::vector<std::vector<at::Tensor>>&, GraphedCallableOptions);
  GraphedCallable(std::shared_ptr<GraphManager> m, size_t index) : manager_(std::move(m)), index_(index) {}
  std::shared_ptr<GraphManager> manager_;
  size_t index_;
};

// Captures every callable on one private pool, in the schedule's order. `sample_args[s]`
// are slot s's sample inputs (their device picks the backend). Returns one graphed
// callable per slot.
std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables(
    std::vector<GraphableCallable> callables, const std::vector<std::vector<at::Tensor>>& sample_args,
    GraphedCallableOptions options = {});

inline GraphedStats graphed_stats(const GraphedCallable& any_of_the_set) { return any_of_the_set.stats(); }

}  // namespace dwgraph::graphs

namespace dwgraph {
using graphs::GraphableCallable;
using graphs::GraphedCallable;
using graphs::GraphedCallableOptions;
using graphs::GraphedStats;
using graphs::graphed_stats;
using graphs::make_graphed_callables;
using graphs::ModuleSpec;
}  // namespace dwgraph
