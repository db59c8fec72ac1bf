// The host pool and capture-allocation routing (allocator/): counters, block reuse only
// within the pool, poisoning of freed blocks, and routing of the capturing thread only.
#include "testing.h"

#include "allocator/capture_allocator.h"
#include "allocator/host_pool.h"

#include <cstring>
#include <thread>

using dwgraph::allocator::HostPool;

TEST_CASE("host pool counts, reuses its own blocks and returns to zero", "[allocator][cpu]") {
  auto pool = HostPool::create();
  CHECK(pool->stats().reserved_bytes == 0);
  void* first = nullptr;
  {
    auto a = pool->allocate(1000);
    auto b = pool->allocate(10);
    first = a.get();
    CHECK(pool->owns(a.get()));
    CHECK(pool->owns(b.get()));
    CHECK(reinterpret_cast<uintptr_t>(a.get()) % 64 == 0);
    const auto st = pool->stats();
    CHECK(st.allocated_bytes == 1024 + 64);  // rounded to 64-byte blocks
    CHECK(st.live_blocks == 2);
    CHECK(st.reserved_bytes >= st.allocated_bytes);
  }
  CHECK(pool->stats().allocated_bytes == 0);
  CHECK(pool->stats().live_blocks == 0);
  CHECK(pool->stats().peak_allocated_bytes == 1024 + 64);
  auto again = pool->allocate(1000);
  CHECK(again.get() == first);  // the freed block comes back to the same pool
  int outside = 0;
  CHECK_FALSE(pool->owns(&outside));
}

TEST_CASE("debug poison fills freed blocks with 0xFF", "[allocator][cpu]") {
  auto pool = HostPool::create();
  pool->set_debug_poison(true);
  void* p = nullptr;
  {
    auto a = pool->allocate(256);
    p = a.get();
    std::memset(p, 0, 256);
  }
  // The chunk stays with the pool, so the freed block can be inspected.
  const auto* bytes = static_cast<const unsigned char*>(p);
  bool all_ff = true;
  for (int i = 0; i < 256; ++i) all_ff = all_ff && bytes[i] == 0xFF;
  CHECK(all_ff);
  float f;
  std::memcpy(&f, p, sizeof(f));
  CHECK(std::isnan(f));
}

TEST_CASE("capture routing sends only the capturing thread's CPU allocations to the pool",
          "[allocator][cpu]") {
  auto pool = HostPool::create();
  at::Tensor mine, theirs;
  {
    const dwgraph::allocator::CaptureAllocationGuard guard(pool);
    mine = at::empty({128});
    std::thread other([&] { theirs = at::empty({128}); });
    other.join();
  }
  const auto after = at::empty({128});
  CHECK(pool->owns(mine.data_ptr()));
  CHECK_FALSE(pool->owns(theirs.data_ptr()));
  CHECK_FALSE(pool->owns(after.data_ptr()));
  CHECK(pool->stats().live_blocks == 1);
  mine = at::Tensor();
  CHECK(pool->stats().live_blocks == 0);
}

TEST_CASE("a request that fits no free block grows the free tail of the segment", "[allocator][cpu]") {
  auto pool = HostPool::create();
  auto a = pool->allocate(1024);
  void* tail = nullptr;
  {
    auto b = pool->allocate(1024);
    tail = b.get();
  }
  CHECK(pool->stats().reserved_bytes == 2048);
  // 4096 bytes fit nowhere: the free 1024 at the end grows by 3072 (a chunk of its own
  // would have made the pool 6144).
  auto c = pool->allocate(4096);
  CHECK(c.get() == tail);
  CHECK(pool->stats().reserved_bytes == 1024 + 4096);
  CHECK(pool->owns(static_cast<char*>(c.get()) + 4095));
  CHECK_FALSE(pool->owns(static_cast<char*>(c.get()) + 4096));  // past the extent
}

namespace {

using dwgraph::allocator::AllocationRecord;
using dwgraph::allocator::PlacementPlan;

// Random allocate/free sequences as (size, born, died) records.
std::vector<AllocationRecord> random_records(uint32_t seed, size_t n) {
  std::vector<AllocationRecord> records;
  std::vector<size_t> live;
  uint32_t state = seed;
  const auto next = [&state] { return state = state * 1664525u + 1013904223u; };
  int64_t clock = 0;
  while (records.size() < n) {
    if (!live.empty() && next() % 3 == 0) {
      const size_t k = next() % live.size();
      records[live[k]].died = clock++;
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const size_t size = 64 * (1 + next() % (next() % 4 == 0 ? 256 : 8));
      records.push_back(AllocationRecord{size, clock++, AllocationRecord::kLive});
      live.push_back(records.size() - 1);
    }
  }
  return records;
}

size_t peak_live(const std::vector<AllocationRecord>& records) {
  std::vector<std::pair<int64_t, int64_t>> events;
  for (const auto& r : records) {
    events.emplace_back(r.born, static_cast<int64_t>(r.size));
    if (r.died != AllocationRecord::kLive) events.emplace_back(r.died, -static_cast<int64_t>(r.size));
  }
  std::sort(events.begin(), events.end());
  int64_t live = 0, peak = 0;
  for (const auto& [t, d] : events) peak = std::max(peak, live += d);
  return static_cast<size_t>(peak);
}

}  // namespace

TEST_CASE("a placement plan never overlaps blocks that are live together", "[allocator][cpu]") {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const auto records = random_records(seed, 300);
    const PlacementPlan plan = dwgraph::allocator::plan_placement(records);
    REQUIRE(plan.offsets.size() == records.size());
    size_t extent = 0;
    for (size_t i = 0; i < records.size(); ++i) {
      CHECK(plan.sizes[i] == records[i].size);
      extent = std::max(extent, plan.offsets[i] + records[i].size);
      for (size_t j = 0; j < i; ++j) {
        const bool together = records[i].born < records[j].died && records[j].born < records[i].died;
        const bool overlap = plan.offsets[i] < plan.offsets[j] + records[j].size &&
                             plan.offsets[j] < plan.offsets[i] + records[i].size;
        if (together && overlap) FAIL("seed " << seed << ": records " << j << " and " << i << " overlap");
      }
    }
    CHECK(plan.extent == extent);
    CHECK(plan.extent >= peak_live(records));
  }
  CHECK(dwgraph::allocator::plan_placement({}).sizes.empty());
  CHECK(dwgraph::allocator::plan_placement(random_records(1, 10), /*max_records=*/5).sizes.empty());
}

TEST_CASE("a pool records its allocations and a second pool follows the plan made of them", "[allocator][cpu]") {
  // A sequence best fit places badly: a long-lived block lands in the hole a large one
  // left, so the next large one fits nowhere (a live block ends the segment).
  const auto run = [](HostPool& pool) {
    auto big = pool.allocate(4096);
    auto end = pool.allocate(64);  // live to the end
    big.clear();
    auto small = pool.allocate(1024);  // best fit: at offset 0, inside big's old block
    auto big2 = pool.allocate(4096);   // does not fit in the 3072 left: the pool grows
    return pool.stats().reserved_bytes;
  };
  auto first = HostPool::create();
  first->record_allocations(true);
  const int64_t best_fit = run(*first);
  first->record_allocations(false);
  const auto records = first->recorded();
  REQUIRE(records.size() == 4);
  CHECK(records[0].size == 4096);
  CHECK(records[0].died == 2);  // made at 0, then the 64-byte block at 1
  CHECK(records[1].died > records[3].born);
  CHECK(best_fit == 4096 + 64 + 4096);
  auto plan = std::make_shared<PlacementPlan>(dwgraph::allocator::plan_placement(records));
  CHECK(static_cast<int64_t>(plan->extent) < best_fit);
  auto second = HostPool::create();
  second->follow_plan(plan);
  CHECK(run(*second) == static_cast<int64_t>(plan->extent));
  CHECK_THROWS(second->follow_plan(plan));  // a plan is followed from the first allocation
}

TEST_CASE("a pool falls back to best fit where the plan does not match", "[allocator][cpu]") {
  auto plan = std::make_shared<PlacementPlan>();
  plan->sizes = {1024, 1024, 1024};
  plan->offsets = {0, 0, 4096};  // the second overlaps the first, which is still live
  plan->extent = 5120;
  auto pool = HostPool::create();
  pool->follow_plan(plan);
  auto a = pool->allocate(1000);
  auto b = pool->allocate(1000);  // planned onto a live block: placed elsewhere
  auto c = pool->allocate(2000);  // another size than planned: best fit
  const auto base = static_cast<char*>(a.get());
  const auto pb = static_cast<char*>(b.get());
  const auto pc = static_cast<char*>(c.get());
  CHECK(pb != base);
  CHECK((pb >= base + 1024 || pb + 1024 <= base));
  CHECK((pc >= pb + 1024 || pc + 2048 <= pb));
  CHECK((pc >= base + 1024 || pc + 2048 <= base));
  CHECK(pool->stats().live_blocks == 3);
}

TEST_CASE("segments reserve geometrically and a request uses any segment with room", "[allocator][cpu]") {
  auto pool = HostPool::create();
  auto small = pool->allocate(1024);
  // Larger than the first segment's 16 MiB and than twice that: a segment of just its size.
  auto big = pool->allocate(size_t{40} << 20);
  CHECK(pool->owns(small.get()));
  CHECK(pool->owns(static_cast<char*>(big.get()) + (size_t{40} << 20) - 1));
  // The newest segment is full; the first has room: no third segment, it follows `small`.
  auto next = pool->allocate(4096);
  CHECK(static_cast<char*>(next.get()) == static_cast<char*>(small.get()) + 1024);
  CHECK(pool->stats().reserved_bytes == 1024 + (int64_t{40} << 20) + 4096);
}

TEST_CASE("trim gives free pages back and keeps live blocks", "[allocator][cpu]") {
  auto pool = HostPool::create();
  auto live = pool->allocate(4096);
  std::memset(live.get(), 7, 4096);
  void* freed = nullptr;
  {
    auto big = pool->allocate(size_t{1} << 20);
    std::memset(big.get(), 1, size_t{1} << 20);
    freed = big.get();
  }
  pool->trim();
  // The free block's whole pages read as zero again (the system's fresh pages).
  const auto* bytes = static_cast<const unsigned char*>(freed);
  bool zero = true;
  for (size_t i = 4096; i < (size_t{1} << 20) - 4096; i += 512) zero = zero && bytes[i] == 0;
  CHECK(zero);
  const auto* kept = static_cast<const unsigned char*>(live.get());
  bool intact = true;
  for (size_t i = 0; i < 4096; ++i) intact = intact && kept[i] == 7;
  CHECK(intact);
  auto again = pool->allocate(size_t{1} << 20);  // still usable
  std::memset(again.get(), 2, size_t{1} << 20);
}
