#pragma once
// Host work around a replay (namespace dwgraph::graphs).
//
// Note [Host work around a replay]: some work of a captured region cannot be in a graph: a
// collective of torch.distributed (the all-gather that materialises a sharded weight, the
// reduce-scatter of its gradient) runs through a process group on the host, which a
// replay never calls. Code that meets a capture asks for it to be hoisted instead:
//  * replay_buffer(): a buffer the captured kernels read, filled by `fill` right before
//    every replay of the graph (and of every graph of the pool that asked for the same
//    owner and tag: they share it, each refilling it before its own replay, so a weight
//    costs one buffer per pool however many microbatch slots read it);
//  * after_replay(): `fn` runs right after every replay, before the caller sees anything
//    (before the hand-off's delayed hooks).
// Hoisting is exact when nothing inside the graph writes what the fill reads (a region that
// writes the owner's storage, such as a weight clamped in place in the forward, is refused
// at capture end, even after its last read; a fill must read only its owner, the one
// storage checked) and nothing inside it reads what the after-call writes (the
// caller's .grad of a sharded weight: a graph that reads .grad after the reduction, such as
// a graphed optimizer step, refuses after-calls; see Graph::refuse_after_calls).
// On CUDA both run on the current stream, before and after the graph's launch.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <functional>
#include <string>
#include <vector>

namespace dwgraph::graphs {

// True while a dwgraph capture claims this thread's work (host) or the current stream's
// (CUDA).
bool capturing();

// The buffer of `sizes` and `dtype` on `owner`'s device that the capture's kernels may read
// in place of materialised data, `fill(buffer)` being run before each replay. Shared by the
// graphs of one pool for the same (owner, tag). Raises GraphStateError outside a capture.
at::Tensor replay_buffer(const at::Tensor& owner, const std::string& tag, at::IntArrayRef sizes, at::ScalarType dtype,
                         std::function<void(const at::Tensor&)> fill);

// Runs `fn` after every replay of the graph being captured. Raises GraphStateError
// outside a capture and ArgumentError in a capture that refuses after-calls, unless
// `state_only`: `fn` keeps host bookkeeping (a count of optimizer steps) and touches no
// tensor any graph reads or writes, so it may follow every replay.
void after_replay(std::function<void()> fn, bool state_only = false);

namespace detail {
// What a capture hoisted, in the order the region asked for it.
struct HostCalls {
  std::vector<std::function<void()>> before;
  std::vector<std::function<void()>> after;
  // The storages the fills read, with what they are (for the message): a graph that writes
  // one would read, at replay, the value from before its own write (Graph::capture_end
  // refuses it). Held only until the capture ends.
  std::vector<std::pair<c10::Storage, std::string>> filled_from;
  // Non-empty: after_replay() raises ArgumentError with this explanation.
  std::string refuse_after;
};
}  // namespace detail

}  // namespace dwgraph::graphs
