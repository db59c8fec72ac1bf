#pragma once
// A whole training step as graphs (namespace dwgraph::graphs; also dwgraph::GraphedStep):
// the core of @dwgraph.graphed_step and its C++ form. docs/graphed-step.md.
//
// The first `warmup_iters` calls of a key run the step eagerly; the next captures it on a
// private pool and replays it; later calls replay. A key is what the graph depends on:
// the caller's key string (non-tensor arguments, by value) plus every tensor argument's
// dtype, shape, strides, device and requires_grad.
//
// Note [A step's gradients are graph state]: eager code inside a step may read .grad
// (clip_grad_norm_, a loss scaler's inf check), zero it, step an optimizer, and accumulate
// into gradients from earlier calls in its own order of additions. So the graph gets the
// gradients as the step would see them: each key has one variant per pattern of which
// gradient tensors (parameters' and inputs') exist at the call. In a variant, a gradient
// that exists is a static buffer the caller's .grad is copied into before each replay;
// one that does not is None, exactly as eager sees it. After the replay every gradient
// goes back to the caller as the step left it: copied into the caller's own .grad tensor
// (same object, as eager's in-place accumulation), a fresh clone of the tensor the step
// produced, or None. The result is eager's to the bit, whatever the step does with .grad,
// and the caller still owns every .grad (SPEC C4). A variant is also specific to which
// parameters require grad and where their memory is: freezing, unfreezing or
// re-allocating a parameter selects (captures) another variant rather than replaying one
// that would train the wrong set.
//
// Note [A step that keeps capturing] (contract C10): a value that changes at every call
// and is baked into the graph (a Python-number hyperparameter of an optimizer whose step
// cannot read it at replay, an int argument) makes every call capture, or warm up, again:
// slower than eager, with nothing said. So the step (1) warns once, naming what changed
// from the previous capture, when it has captured more graphs since its last reset() than
// it holds (max_graphs); (2) after max_captures captures since its last reset() (128, as
// Inductor's CUDA graph trees stop re-recording), runs every call that would capture
// eagerly instead, as a warmup call does, and says so once; (3) keeps at most
// max_idle_keys() keys that hold no graph, dropping the least recently used (an int
// counter argument makes a key per call, each waiting for its warmup calls forever), and
// warns once, naming what changed in the key, when it first drops one. stats() counts
// captures, variants, keys, replays and eager calls.

#include "graphs/graph.h"
#include "graphs/landing.h"
#include "graphs/module_spec.h"
#include "graphs/replay_checks.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph::graphs {

using StepFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

struct GraphedStepOptions {
  int warmup_iters = 3;
  std::shared_ptr<GraphPool> pool;  // null: one private pool for all of the step's graphs
  int64_t max_graphs = 8;           // graphs held (one per key and gradient pattern), LRU
  // The tensors, other than its inputs, that the step gives gradients to (parameters),
  // asked once per key before its first capture. Python passes the leaves the step's
  // backward calls reached during the warmup calls.
  std::function<NamedTensors()> params;
  // The dwgraph modules the step runs (main_grad, flags, hooks, stores). Optional.
  std::function<std::vector<ModuleSpec>()> modules;
  // Module buffers, restored after the capture (BatchNorm statistics). Optional.
  std::function<std::vector<at::Tensor>()> buffers;
  // Other state the captured kernels bake in, asked at every call after the warmup calls
  // (Python: the training flags of the modules the step runs, the optimizers' Python-number
  // hyperparameters): a change selects (captures) another variant. Optional. Called at
  // every call: it should be cheap when nothing changed (Python: Note [What selects a
  // graph, watched]).
  std::function<std::string()> variant_state;
  // The variant state in words, for the log (asked at capture only). Optional.
  std::function<std::string()> describe_state;
  // Note [A step that keeps capturing]: after this many captures since the last reset(),
  // calls that would capture run eagerly.
  int64_t max_captures = 128;
};

// What a step did (GraphedStep::stats()).
struct GraphedStepStats {
  size_t num_graphs = 0;            // graphs held now
  size_t num_captures = 0;          // captures in the step's lifetime
  size_t captures_since_reset = 0;  // what max_captures counts
  size_t num_variants = 0;          // distinct (key, variant) the step made a graph slot for, lifetime
  size_t num_keys = 0;              // keys known now
  size_t replays = 0;
  size_t eager_calls = 0;           // warmup calls, abandoned captures, calls past max_captures
  size_t capture_limited_calls = 0; // of those: calls past max_captures
  size_t released = 0;              // graphs released for room (max_graphs)
  size_t dropped_keys = 0;          // keys without a graph dropped (max_idle_keys)
  int64_t max_graphs = 0;
  int64_t max_captures = 0;
  int64_t pool_reserved_bytes = 0;
  int64_t pool_allocated_bytes = 0;
  int64_t pool_peak_allocated_bytes = 0;
};

// What a step's key holds besides its arguments (docs/graphed-step.md, "The key"): grad
// mode, autocast state (its dtypes too), fp8 state and inference mode, in words; `autocast_on` (optional):
// whether autocast is on (the front end then refuses the autocast weight cache).
std::string step_ambient(bool* autocast_on = nullptr);

class GraphedStep {
 public:
  GraphedStep(StepFn step, GraphedStepOptions options);
  ~GraphedStep();
  GraphedStep(const GraphedStep&) = delete;
  GraphedStep& operator=(const GraphedStep&) = delete;

  // Runs the step for `tensors` (undefined tensors allowed); `key` holds what else
  // identifies the graph (non-tensor arguments, by value). Returns the step's outputs,
  // fresh tensors the caller owns.
  std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& tensors, const std::string& key = "");
  // The same call when its key and variant already have a graph: replays it and returns
  // the outputs. Otherwise nullopt, having run and counted nothing and asked the front end
  // at most the variant state (Note [A step's plain call]): operator() then decides the call.
  // `state`: the variant state, where the front end knows it unchanged without asking
  // options' variant_state (its plain call's probe); null: asked.
  std::optional<std::vector<at::Tensor>> replay_if_captured(const std::vector<at::Tensor>& tensors,
                                                            const std::string& key = "",
                                                            const std::string* state = nullptr);
  // Note [A step's plain call] (contract C10): a front end that builds the key in its own
  // language records here the key of a call whose arguments were `num_tensors` distinct
  // plain tensors and nothing else, under the ambient state `ambient` (step_ambient()) and
  // the state epoch `epoch` it saw; `refused`: the objects it refuses as arguments (what
  // the step trains), by the front end's identity. A later call of that form, with the
  // same ambient state and epoch, has the same key: the front end's binding replays it
  // through replay_if_captured() without building the key again. `refused_memory`: where
  // the memory the step updates is (what it trains, its optimizers' state), disjoint byte
  // ranges [start, end) sorted by start; an argument overlapping one is refused.
  // Cleared by reset().
  struct PlainCall {
    size_t num_tensors = 0;
    std::string ambient;
    uint64_t epoch = 0;
    std::string key;
    std::vector<uintptr_t> refused;
    std::vector<std::pair<uintptr_t, uintptr_t>> refused_memory;
  };
  void set_plain_call(std::optional<PlainCall> call);
  const std::optional<PlainCall>& plain_call() const { return plain_; }
  // Runs the step eagerly for this call, as a warmup call does (Python: after a capture
  // was abandoned because the optimizer would create its state inside it).
  std::vector<at::Tensor> run_eagerly(const std::vector<at::Tensor>& tensors);

  size_t num_graphs() const;
  size_t num_captures() const { return captures_; }
  // Which graph the last call ran: an id unique for this step's lifetime ("" for an eager
  // call). Python keeps each graph's output structure under it, and drops those of the
  // graphs no longer held (live_variants()).
  const std::string& last_variant() const { return last_variant_; }
  std::vector<std::string> live_variants() const;
  // Names the step in log lines (Python: the decorated function's name).
  void set_name(std::string name) { name_ = std::move(name); }
  // Releases every graph and the pool.
  void reset();
  // Tensors whose memory the step's graphs depend on beyond the parameters (Python: the
  // optimizers' state tensors): where one's memory moved since a capture, the call selects
  // another variant. Checked when the state epoch moved (set_watched), else at every call.
  void set_state_tensors(std::vector<at::Tensor> tensors) {
    state_tensors_ = std::move(tensors);
    ++state_tensors_version_;
  }
  // Note [A step's checks paid when state changes]: the front end says whether every tensor
  // the step's graphs depend on beyond its arguments (parameters, module buffers, state
  // tensors, main_grads) is watched, so that a change of its memory or requires_grad moves
  // the state epoch (graphs/state_epoch.h). Then a call whose epoch did not move since the
  // last full check of its variant compares only what no watch sees: the variant state and
  // which gradients exist. Unwatched (the default): every call checks everything.
  void set_watched(bool watched) { watched_ = watched; }
  bool watched() const { return watched_; }
  GraphedStepStats stats() const;
  // Note [A step that keeps capturing]: the keys without a graph kept.
  size_t max_idle_keys() const;

 private:
  struct Entry;
  struct Variant;
  // The call's variant; `captured_only`: nullptr where it has no graph yet (or finding it
  // would ask the front end what the step trains), instead of making one.
  Variant* variant_for(Entry& e, const std::vector<at::Tensor>& tensors, bool captured_only,
                       const std::string* known_state = nullptr);
  void check_arguments(const std::vector<at::Tensor>& tensors) const;
  static std::string full_key(const std::string& key, const std::vector<at::Tensor>& tensors);
  void called(Entry& e, const std::string& full);  // a call of the key counted, most recent first
  std::vector<at::Tensor> replay_chosen(Entry& e, Variant& v, const std::string& full,
                                        const std::vector<at::Tensor>& tensors);
  void erase_variant(Entry& e, const std::string& pattern);
  std::vector<at::Tensor> capture(Entry& e, Variant& v, const std::string& key, const std::vector<at::Tensor>& tensors);
  std::vector<at::Tensor> replay(Entry& e, Variant& v, const std::vector<at::Tensor>& tensors);
  void evict_until_room();
  void drop_idle_keys(const std::string& current);
  std::string describe_call(const std::string& key, const Entry& e, const std::vector<at::Tensor>& tensors) const;

  StepFn step_;
  GraphedStepOptions opts_;
  std::shared_ptr<GraphPool> pool_;
  std::map<std::string, std::unique_ptr<Entry>> entries_;
  std::list<std::pair<std::string, std::string>> lru_;  // captured (key, variant), most recent first
  std::list<std::string> key_lru_;                      // every key, most recently called first
  std::vector<at::Tensor> state_tensors_;
  uint64_t state_tensors_version_ = 0;  // moved by set_state_tensors()
  bool watched_ = false;
  std::vector<char> grads_now_;  // variant_for()'s scratch: which gradients exist at this call
  size_t captures_ = 0;
  size_t captures_since_reset_ = 0;
  size_t replays_ = 0;
  size_t eager_calls_ = 0;
  size_t limited_calls_ = 0;
  size_t released_ = 0;
  size_t dropped_keys_ = 0;
  bool warned_storm_ = false;
  bool warned_limit_ = false;
  bool warned_keys_ = false;
  std::string last_capture_;  // the previous capture in words (describe_call())
  std::string last_key_;      // the previous call's key
  std::string name_ = "step";
  std::string last_variant_;
  std::optional<PlainCall> plain_;
  uint64_t variants_made_ = 0;
  c10::Device device_ = c10::Device(c10::kCPU);
  bool device_known_ = false;
};

}  // namespace dwgraph::graphs

namespace dwgraph {
using graphs::GraphedStep;
using graphs::GraphedStepOptions;
using graphs::GraphedStepStats;
using graphs::StepFn;
}  // namespace dwgraph
