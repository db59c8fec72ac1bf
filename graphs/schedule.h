#pragma once
// Capture schedules of make_graphed_callables (namespace dwgraph::graphs): the one parser
// and validator of a pipeline `order`, and the owner of the slot layout. Python and C++
// both ask a Schedule which callable a slot runs; nobody else decodes `order`.
//
// Sequential schedule: one slot per callable; captured as all forwards in order, all
// backwards in reverse, then the backward-dw graphs (Note [Backward-dw graphs are
// captured last] in graphs/manager_impl.h).
// Pipeline schedule (TransformerEngine's _order): `+c` is the forward of chunk c (1-based)
// for its next microbatch, `-c` its backward, `-(c + 0.5)` its backward-dw. Chunk c holds
// layers_per_chunk[c-1] consecutive callables (default: an equal share). Slots are laid
// out chunk by chunk, microbatch by microbatch, layer by layer: slot
//   sum(layers_per_chunk[:c-1]) * M + m * layers_per_chunk[c-1] + l
// runs callable sum(layers_per_chunk[:c-1]) + l for microbatch m of chunk c.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph::graphs {

enum class Phase { kForward, kBackward, kBackwardDw };
const char* to_string(Phase p);

struct SlotInfo {
  size_t callable = 0;
  int64_t chunk = 0;       // 1-based; 0 in the sequential schedule
  int64_t microbatch = 0;
};

struct CaptureStep {
  Phase phase;
  size_t slot;
};

class Schedule {
 public:
  static Schedule sequential(size_t num_callables);
  // Validates every entry before converting it: finite, +c / -c integers or -(c + 0.5),
  // 1 <= c <= num_callables; counts per chunk consistent. Errors are ArgumentErrors naming
  // the entry.
  // `layers_each` (TransformerEngine's int form of _num_layers_per_chunk): that many
  // layers in every chunk, instead of `layers_per_chunk`.
  static Schedule pipeline(const std::vector<double>& order,
                           const std::optional<std::vector<int64_t>>& layers_per_chunk, size_t num_callables,
                           std::optional<int64_t> layers_each = std::nullopt);

  // The schedule make_graphed_callables' arguments ask for: pipeline with `order`,
  // sequential without (where num_layers_per_chunk, which needs an order, is refused).
  static Schedule from_arguments(const std::optional<std::vector<double>>& order,
                                 const std::optional<std::vector<int64_t>>& layers_per_chunk, size_t num_callables,
                                 std::optional<int64_t> layers_each = std::nullopt);
  // ArgumentError unless `n` entries of argument `what` (sample_args, sample_kwargs) give
  // one per slot (per callable in the sequential schedule).
  void check_per_slot(size_t n, const char* what) const;

  // Checks the backward-dw entries against which callables defer their weight gradients:
  // one per backward for chunks that have a deferred callable, none for the others.
  void check_deferred(const std::vector<bool>& callable_defers) const;

  bool pipelined() const { return pipelined_; }
  size_t num_callables() const { return num_callables_; }
  size_t num_slots() const { return slots_.size(); }
  const SlotInfo& slot(size_t s) const;
  size_t callable_of_slot(size_t s) const { return slot(s).callable; }
  int64_t num_microbatches() const { return microbatches_; }
  int64_t num_chunks() const { return static_cast<int64_t>(layers_per_chunk_.size()); }
  const std::vector<int64_t>& layers_per_chunk() const { return layers_per_chunk_; }

  // Graphs to capture, in capture order; backward-dw steps only for callables that defer.
  std::vector<CaptureStep> capture_steps(const std::vector<bool>& callable_defers) const;
  // The slots a pipeline entry covers (its chunk's layers for its microbatch), in the
  // order the phase runs them (backwards reversed).
  std::vector<size_t> slots_of(Phase phase, int64_t chunk, int64_t microbatch) const;

 private:
  struct Entry {
    Phase phase;
    int64_t chunk;
  };
  Schedule() = default;
  size_t slot_index(int64_t chunk, int64_t microbatch, int64_t layer) const;
  std::vector<size_t> chunk_callables(int64_t chunk) const;

  bool pipelined_ = false;
  size_t num_callables_ = 0;
  int64_t microbatches_ = 1;
  std::vector<int64_t> layers_per_chunk_;
  std::vector<Entry> order_;
  std::vector<SlotInfo> slots_;
};

}  // namespace dwgraph::graphs
