#pragma once
// The checks every replay makes before it writes anything (namespace dwgraph::graphs),
// shared by make_graphed_callables and graphed_step (SPEC C7, C8): the parameters are the
// ones captured (same objects, same requires_grad, same memory), main_grad is the buffer
// captured, the inputs match the static inputs the graph reads.

#include "graphs/module_spec.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dwgraph::graphs {

// [begin, end) of the bytes a strided tensor's elements reach (numel > 0): its data to its
// last element, gaps included (a column slice reaches past its own nbytes()).
std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t);

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// What a callable's graphs captured of its parameters (or buffers). Its owner decides
// when to check (Note [Checks paid when state changes] in graphs/state_epoch.h).
class CapturedParameters {
 public:
  CapturedParameters() = default;
  // `current` (optional) lists the parameters the callable has now, by name.
  CapturedParameters(std::vector<std::string> names, std::vector<at::Tensor> params,
                     std::function<NamedTensors()> current = nullptr, std::string kind = "parameter");

  // Also compares, at every check, what `registered` lists now with what it listed here
  // (GraphableCallable::registered_parameters).
  void watch_slots(std::function<NamedTensors()> registered);

  // GraphStateError naming the parameter when one was replaced, added or removed, changed
  // requires_grad, or had its memory moved (`.data = ...`, a re-allocation) since capture.
  void check(const std::string& where) const;
  const std::vector<at::Tensor>& tensors() const { return params_; }
  const std::vector<std::string>& names() const { return names_; }

 private:
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<bool> requires_grad_;
  std::vector<const void*> data_;
  std::vector<std::vector<int64_t>> sizes_, strides_;  // the layout the graphs read
  std::function<NamedTensors()> current_;
  void check_registered(const std::string& where) const;  // the scan of current_
  void check_slots(const std::string& where) const;       // registered_ against slots_
  std::function<NamedTensors()> registered_;
  std::vector<std::pair<std::string, const void*>> slots_;  // what `registered_` listed at capture
  std::string kind_ = "parameter";
  mutable uint64_t registrations_seen_ = 0;  // registration_epoch() when last checked
};

class CapturedMainGrads {
 public:
  CapturedMainGrads() = default;
  explicit CapturedMainGrads(std::vector<FusedParameter> fused);
  // GraphStateError naming the parameter when its main_grad is not the buffer captured
  // (the graphs accumulate into that one).
  void check(const std::string& where) const;

 private:
  std::vector<FusedParameter> fused_;
  std::vector<const void*> data_;
};

class StaticInputs {
 public:
  StaticInputs() = default;
  // Manager-owned copies of `samples` (undefined stays undefined), leaves with the same
  // requires_grad.
  explicit StaticInputs(const std::vector<at::Tensor>& samples);
  const std::vector<at::Tensor>& tensors() const { return tensors_; }
  // ArgumentError naming the argument for a count, shape, strides, dtype or device that
  // differs from capture (eager code would run other kernels, with other rounding and
  // output layouts, for another layout), for an input that requires grad where the sample
  // did not (the graph computes no gradient for it), and where the graph writes an argument
  // in place: for an argument that shares memory with another (eager's write would reach
  // both), and for arguments passed otherwise than the samples (Note [One tensor in two
  // argument positions]; without writes GraphManager::runs_eagerly runs such calls eagerly).
  void check(const std::vector<at::Tensor>& inputs, const std::string& where) const;
  // Copies `inputs` in (skipping those already in place, and an argument position that
  // repeats an earlier one's tensor).
  void copy_in(const std::vector<at::Tensor>& inputs) const;
  // Note [One tensor in two argument positions]: "arguments 0 and 2 are one tensor, where
  // the samples were two" (or the other way round) for the first position `inputs` are
  // passed otherwise than the samples were; empty when they are passed alike.
  // `aliases`, when given, is set to whether the call passes one tensor where the samples
  // were two (against two where they were one).
  std::string identity_mismatch(const std::vector<at::Tensor>& inputs, bool* aliases = nullptr) const;
  // Whether `other` could serve the calls these serve: the same sizes, strides, dtypes and
  // requires_grad, and arguments repeated and expanded alike (reuse_static_buffers).
  bool interchangeable_with(const StaticInputs& other) const;
  // Copies the values `other` holds into these (interchangeable_with(other)).
  void copy_values_from(const StaticInputs& other) const;
  // Whether the graphs write an argument in place (note_writes).
  bool writes_arguments() const { return !written_.empty(); }
  // Whether argument i is the first position of its tensor among the samples (a later one
  // is the same static input: it gets no gradient of its own).
  bool first_of_its_tensor(size_t i) const { return first_of_.empty() || first_of_.at(i) == i; }
  // Note [Slots share the pool by liveness]: moves the buffers into blocks of `pool`
  // (their values kept), so that once released they are memory later captures may reuse.
  void move_into(class GraphPool& pool);
  // Keeps views of the buffers that do not own their memory: the pool may give it to a
  // later capture, and the pool's replay order keeps the two apart at replay.
  void release();
  bool released() const { return released_; }
  bool sample_requires_grad(size_t i) const { return requires_grad_.at(i); }
  // The first of `inputs` that requires grad where its sample did not, or -1.
  int64_t first_gaining_grad(const std::vector<at::Tensor>& inputs) const;
  // Marks the static inputs `graph` writes (in-place ops on an argument): eager code would
  // have changed the caller's tensor, so copy_back() does after each replay.
  void note_writes(const class Graph& graph);
  void copy_back(const std::vector<at::Tensor>& inputs) const;
  int64_t nbytes() const;
  void clear() { tensors_.clear(); }

 private:
  void share_repeated();  // Note [One tensor in two argument positions]
  std::vector<at::Tensor> tensors_;
  // Per argument, the first argument holding the same sample tensor; empty when the samples
  // are all distinct tensors.
  std::vector<size_t> first_of_;
  std::vector<bool> requires_grad_;  // of the samples (released views do not require grad)
  std::vector<bool> overlapping_;    // an expanded sample's layout, kept (copied in by its memory)
  std::vector<bool> held_dense_;     // an expanded sample held dense (it requires grad, or went into the pool)
  std::vector<size_t> written_;
  bool released_ = false;
};

// A view of `t` that does not own its memory (same data, sizes, strides, dtype, device).
at::Tensor unowned_view(const at::Tensor& t);

// A copy of `t` in its own layout, so that what reads it runs as on `t`: clone() keeps the
// strides of a dense tensor only, and one with gaps (t[:, ::2], a column slice, logits[:, :-1])
// gets its strides over storage of its own. Static inputs are made so (the kernels captured
// on them are those eager code runs on the argument), and the outputs a replay hands the
// caller (a reduction over them adds in eager's order). A layout whose elements overlap
// (expanded, unfolded) is a copy of the memory they lie in, with the same strides over it.
// Static inputs moved into a pool (move_into) are dense.
at::Tensor layout_copy(const at::Tensor& t);

// "a float tensor of shape [2, 3] on cpu"
std::string describe(const at::Tensor& t);

// ArgumentError naming both when tensors[i] for some i in `among` (all of them when
// `among` is empty) shares memory with another of `tensors`: a graph copies each argument
// into its own static input, so a write through one would not reach the other, where it
// would in eager code. `what` names one of them in the message ("tensor argument").
void check_distinct_memory(const std::vector<at::Tensor>& tensors, const std::vector<size_t>& among,
                           const std::string& where, const char* what = "argument");

// Throws GraphStateError unless `t`'s storage holds every element it views: an owner that
// frees a tensor's memory between uses (FSDP2's unsharded parameters) would have graphs read
// and write freed memory. `what` names it ("a parameter").
void check_has_memory(const at::Tensor& t, const char* what);

}  // namespace dwgraph::graphs
