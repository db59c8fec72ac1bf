#include "allocator/placement_plan.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace dwgraph::allocator {

PlacementPlan plan_placement(const std::vector<AllocationRecord>& records, size_t max_records) {
  PlacementPlan plan;
  if (records.empty() || records.size() > max_records) return plan;
  // Largest first, ties by the earliest made. (Also tried on bench_reuse's schedules: ties
  // by the latest freed, the longest lived, the smallest gap instead of the lowest offset,
  // and orders by lifetime or by size times lifetime: none spanned less.)
  std::vector<size_t> order(records.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (records[a].size != records[b].size) return records[a].size > records[b].size;
    return records[a].born < records[b].born;
  });
  plan.sizes.resize(records.size());
  plan.offsets.resize(records.size());
  std::vector<size_t> placed;
  placed.reserve(records.size());
  std::vector<std::pair<size_t, size_t>> busy;  // [begin, end) of the placed blocks live with this one
  for (const size_t i : order) {
    const AllocationRecord& r = records[i];
    busy.clear();
    for (const size_t j : placed) {
      const AllocationRecord& o = records[j];
      if (o.born < r.died && r.born < o.died) busy.emplace_back(plan.offsets[j], plan.offsets[j] + o.size);
    }
    std::sort(busy.begin(), busy.end());
    size_t offset = 0;
    for (const auto& [begin, end] : busy) {
      if (offset + r.size <= begin) break;
      offset = std::max(offset, end);
    }
    plan.sizes[i] = r.size;
    plan.offsets[i] = offset;
    plan.extent = std::max(plan.extent, offset + r.size);
    placed.push_back(i);
  }
  return plan;
}

}  // namespace dwgraph::allocator
