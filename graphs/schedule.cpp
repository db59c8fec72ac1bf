#include "graphs/schedule.h"

#include "common/check.h"

#include <cmath>

namespace dwgraph::graphs {
namespace {

constexpr const char* kApi = "dwgraph.make_graphed_callables";

}  // namespace

const char* to_string(Phase p) {
  switch (p) {
    case Phase::kForward:
      return "forward";
    case Phase::kBackward:
      return "backward";
    case Phase::kBackwardDw:
      return "backward-dw";
  }
  return "?";
}

Schedule Schedule::sequential(size_t num_callables) {
  DWGRAPH_CHECK_ARG(num_callables > 0, kApi, ": argument 'modules' must hold at least one callable, got none");
  Schedule s;
  s.num_callables_ = num_callables;
  s.layers_per_chunk_ = {static_cast<int64_t>(num_callables)};
  for (size_t i = 0; i < num_callables; ++i) s.slots_.push_back(SlotInfo{i, 0, 0});
  return s;
}

Schedule Schedule::from_arguments(const std::optional<std::vector<double>>& order,
                                  const std::optional<std::vector<int64_t>>& layers_per_chunk, size_t num_callables,
                                  std::optional<int64_t> layers_each) {
  if (order.has_value()) return pipeline(*order, layers_per_chunk, num_callables, layers_each);
  DWGRAPH_CHECK_ARG(!layers_per_chunk.has_value() && !layers_each.has_value(), kApi,
                    ": argument 'num_layers_per_chunk' needs 'order' (the pipeline schedule)");
  return sequential(num_callables);
}

void Schedule::check_per_slot(size_t n, const char* what) const {
  DWGRAPH_CHECK_ARG(n == num_slots(), kApi, ": argument '", what, "' must hold one entry per ",
                    pipelined_ ? "(callable, microbatch) slot (" : "callable (", num_slots(), "), got ", n);
}

Schedule Schedule::pipeline(const std::vector<double>& order, const std::optional<std::vector<int64_t>>& given,
                            size_t num_callables, std::optional<int64_t> layers_each) {
  DWGRAPH_CHECK_ARG(num_callables > 0, kApi, ": argument 'modules' must hold at least one callable, got none");
  DWGRAPH_CHECK_ARG(!order.empty(), kApi, ": argument 'order' must hold at least one forward and one backward, "
                    "got an empty order");
  Schedule s;
  s.pipelined_ = true;
  s.num_callables_ = num_callables;
  const auto max_chunk = static_cast<double>(num_callables);
  int64_t chunks = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    const double o = order[k];
    // Range first, as a double: no conversion of a huge or non-finite value.
    DWGRAPH_CHECK_ARG(std::isfinite(o) && o != 0.0 && std::fabs(o) < max_chunk + 1.0, kApi,
                      ": argument 'order' entry ", k, " (", o, ") must be +c (forward), -c (backward) or "
                      "-(c + 0.5) (backward-dw) for a chunk c between 1 and ", num_callables,
                      " (there are ", num_callables, " callables)");
    const double twice = 2.0 * o;
    DWGRAPH_CHECK_ARG(twice == std::floor(twice) && (o < 0 || o == std::floor(o)), kApi, ": argument 'order' entry ",
                      k, " (", o, ") must be an integer (+c forward, -c backward) or -(c + 0.5) (backward-dw)");
    const bool is_dw = o != std::floor(o);
    const auto chunk = static_cast<int64_t>(is_dw ? std::floor(-o) : std::fabs(o));
    DWGRAPH_CHECK_ARG(chunk >= 1, kApi, ": argument 'order' entry ", k, " (", o, ") names chunk ", chunk,
                      "; chunks are numbered from 1");
    s.order_.push_back(Entry{o > 0 ? Phase::kForward : (is_dw ? Phase::kBackwardDw : Phase::kBackward), chunk});
    chunks = std::max(chunks, chunk);
  }
  DWGRAPH_CHECK_ARG(!(given.has_value() && layers_each.has_value()), kApi,
                    ": argument 'num_layers_per_chunk' is either one int for every chunk or a list, not both");
  const std::optional<std::vector<int64_t>> layers =
      layers_each.has_value() ? std::optional<std::vector<int64_t>>(std::vector<int64_t>(chunks, *layers_each)) : given;
  if (layers.has_value()) {
    DWGRAPH_CHECK_ARG(static_cast<int64_t>(layers->size()) == chunks, kApi,
                      ": argument 'num_layers_per_chunk' must have one entry per chunk of 'order' (", chunks,
                      "), got ", layers->size());
    int64_t total = 0;
    for (size_t c = 0; c < layers->size(); ++c) {
      const int64_t l = (*layers)[c];
      DWGRAPH_CHECK_ARG(l > 0 && l <= static_cast<int64_t>(num_callables), kApi,
                        ": argument 'num_layers_per_chunk' entry ", c, " must be between 1 and ", num_callables,
                        ", got ", l);
      total += l;
    }
    DWGRAPH_CHECK_ARG(total == static_cast<int64_t>(num_callables), kApi, ": num_layers_per_chunk sums to ", total,
                      " but ", num_callables, " callables were given");
    s.layers_per_chunk_ = *layers;
  } else {
    DWGRAPH_CHECK_ARG(static_cast<int64_t>(num_callables) % chunks == 0, kApi, ": ", num_callables,
                      " callables cannot be split evenly over the ", chunks,
                      " chunks of 'order'; pass num_layers_per_chunk");
    s.layers_per_chunk_.assign(static_cast<size_t>(chunks), static_cast<int64_t>(num_callables) / chunks);
  }
  // Counts: backwards after forwards, backward-dw after backwards, one per microbatch each.
  std::vector<int64_t> fwd(chunks + 1, 0), bwd(chunks + 1, 0), dw(chunks + 1, 0);
  for (size_t k = 0; k < s.order_.size(); ++k) {
    const auto [phase, c] = s.order_[k];
    if (phase == Phase::kForward) {
      ++fwd[c];
    } else if (phase == Phase::kBackward) {
      DWGRAPH_CHECK_ARG(bwd[c] < fwd[c], kApi, ": argument 'order' entry ", k, " (", -c, ") is backward ", bwd[c] + 1,
                        " of chunk ", c, " but only ", fwd[c], " forwards of that chunk come before it");
      ++bwd[c];
    } else {
      DWGRAPH_CHECK_ARG(dw[c] < bwd[c], kApi, ": argument 'order' entry ", k, " (", -(c + 0.5), ") is backward-dw ",
                        dw[c] + 1, " of chunk ", c, " but only ", bwd[c], " backwards of that chunk come before it");
      ++dw[c];
    }
  }
  s.microbatches_ = fwd[1];
  for (int64_t c = 1; c <= chunks; ++c) {
    DWGRAPH_CHECK_ARG(fwd[c] == s.microbatches_ && bwd[c] == s.microbatches_ && s.microbatches_ > 0, kApi,
                      ": argument 'order' has ", fwd[c], " forwards and ", bwd[c], " backwards of chunk ", c,
                      "; expected ", s.microbatches_, " of each (one per microbatch, as chunk 1), at least one");
  }
  for (int64_t c = 1; c <= chunks; ++c) {
    for (int64_t m = 0; m < s.microbatches_; ++m) {
      for (size_t callable : s.chunk_callables(c)) s.slots_.push_back(SlotInfo{callable, c, m});
    }
  }
  return s;
}

void Schedule::check_deferred(const std::vector<bool>& defers) const {
  TORCH_INTERNAL_ASSERT(defers.size() == num_callables_);
  if (!pipelined_) return;
  const int64_t chunks = num_chunks();
  std::vector<int64_t> dw(chunks + 1, 0);
  std::vector<bool> chunk_defers(chunks + 1, false);
  for (int64_t c = 1; c <= chunks; ++c) {
    for (size_t callable : chunk_callables(c)) chunk_defers[c] = chunk_defers[c] || defers[callable];
  }
  for (size_t k = 0; k < order_.size(); ++k) {
    const auto [phase, c] = order_[k];
    if (phase != Phase::kBackwardDw) continue;
    DWGRAPH_CHECK_ARG(chunk_defers[c], kApi, ": argument 'order' entry ", k, " (", -(c + 0.5),
                      ") is a backward-dw of chunk ", c, ", which has no module with deferred weight gradients");
    ++dw[c];
  }
  for (int64_t c = 1; c <= chunks; ++c) {
    const int64_t want = chunk_defers[c] ? microbatches_ : 0;
    DWGRAPH_CHECK_ARG(dw[c] == want, kApi, ": argument 'order' has ", dw[c], " backward-dw entries of chunk ", c,
                      "; expected ", want, chunk_defers[c] ? " (one after each backward)" : "");
  }
}

const SlotInfo& Schedule::slot(size_t s) const {
  DWGRAPH_CHECK_ARG(s < slots_.size(), "dwgraph schedule: slot ", s, " out of range (", slots_.size(), " slots)");
  return slots_[s];
}

std::vector<size_t> Schedule::chunk_callables(int64_t chunk) const {
  int64_t offset = 0;
  for (int64_t c = 1; c < chunk; ++c) offset += layers_per_chunk_[c - 1];
  std::vector<size_t> out;
  for (int64_t l = 0; l < layers_per_chunk_[chunk - 1]; ++l) out.push_back(static_cast<size_t>(offset + l));
  return out;
}

size_t Schedule::slot_index(int64_t chunk, int64_t microbatch, int64_t layer) const {
  int64_t offset = 0;
  for (int64_t c = 1; c < chunk; ++c) offset += layers_per_chunk_[c - 1];
  return static_cast<size_t>(offset * microbatches_ + microbatch * layers_per_chunk_[chunk - 1] + layer);
}

std::vector<size_t> Schedule::slots_of(Phase phase, int64_t chunk, int64_t microbatch) const {
  std::vector<size_t> out;
  const int64_t n = layers_per_chunk_[chunk - 1];
  for (int64_t l = 0; l < n; ++l) out.push_back(slot_index(chunk, microbatch, phase == Phase::kBackward ? n - 1 - l : l));
  return out;
}

std::vector<CaptureStep> Schedule::capture_steps(const std::vector<bool>& defers) const {
  std::vector<CaptureStep> steps;
  if (!pipelined_) {
    for (size_t s = 0; s < slots_.size(); ++s) steps.push_back(CaptureStep{Phase::kForward, s});
    for (size_t s = slots_.size(); s-- > 0;) steps.push_back(CaptureStep{Phase::kBackward, s});
    for (size_t s = 0; s < slots_.size(); ++s) {
      if (defers[slots_[s].callable]) steps.push_back(CaptureStep{Phase::kBackwardDw, s});
    }
    return steps;
  }
  std::vector<int64_t> next(static_cast<size_t>(num_chunks() + 1) * 3, 0);
  for (const auto& [phase, chunk] : order_) {
    const int64_t m = next[static_cast<size_t>(chunk) * 3 + static_cast<size_t>(phase)]++;
    for (size_t s : slots_of(phase, chunk, m)) {
      if (phase != Phase::kBackwardDw || defers[slots_[s].callable]) steps.push_back(CaptureStep{phase, s});
    }
  }
  return steps;
}

}  // namespace dwgraph::graphs
