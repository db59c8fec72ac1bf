#pragma once
// Planned placement of a recorded allocation sequence (namespace dwgraph::allocator).
//
// Note [Planned placement]: an allocator that places each block when it is asked (best
// fit, as the host pool does) leaves holes a placement knowing every lifetime would not:
// on the pipeline schedules of bench_reuse the pool held 8-9% more than its peak of live
// bytes. Graph captures are deterministic, so the manager records the allocations of a
// first capture (size, and when each was made and freed), plans offsets for them here,
// and captures once more with the pool following the plan (Note [A second capture on a
// planned pool], graphs/manager_capture.cpp). Planning is the dynamic storage allocation
// problem; the heuristic is the one memory planners of inference runtimes use: the
// largest blocks first (ties: the earliest made), each at the lowest offset clear of the
// blocks placed before it whose lifetimes overlap its own. Following a plan never trusts
// it: the pool places a block at its planned offset only when the sizes match and that
// range is free, and falls back to best fit otherwise.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace dwgraph::allocator {

// One allocation of a recorded sequence. Times count the pool's allocations and frees
// together; a block still live when the record was taken died at kLive.
struct AllocationRecord {
  static constexpr int64_t kLive = std::numeric_limits<int64_t>::max();
  size_t size = 0;  // bytes, as the pool rounds them
  int64_t born = 0;
  int64_t died = kLive;
};

struct PlacementPlan {
  std::vector<size_t> sizes;    // per allocation, in order: the size it was planned for
  std::vector<size_t> offsets;  // its offset from the pool's first byte
  size_t extent = 0;            // the bytes the plan spans
};

// The plan for `records` (empty when there are none, or more than `max_records`: the
// planner is quadratic in the allocations).
PlacementPlan plan_placement(const std::vector<AllocationRecord>& records, size_t max_records = 20000);

}  // namespace dwgraph::allocator
