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
