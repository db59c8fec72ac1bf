#include "allocator/host_pool.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace dwgraph::allocator {
namespace {

constexpr size_t kAlign = 64;
// A new chunk is sized to the request that needs it: the pool's reserved bytes then
// follow the capture's peak instead of a fixed chunk granularity (a graph keeps all the
// memory its capture used, freed temporaries included, so its peak is the floor).
constexpr size_t kMinChunkBytes = kAlign;

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

std::atomic<uint64_t> next_pool_id{1};

// Live pool blocks and their pools, process-wide (see HostPool::allocate).
std::mutex live_mu;
std::unordered_map<void*, std::shared_ptr<HostPool>>& live_blocks() {
  static auto* m = new std::unordered_map<void*, std::shared_ptr<HostPool>>();
  return *m;
}

}  // namespace

HostPool::HostPool() : id_(next_pool_id++) {}

std::shared_ptr<HostPool> HostPool::create() { return std::shared_ptr<HostPool>(new HostPool()); }

HostPool::~HostPool() {
  for (auto& [base, size] : chunks_) std::free(base);
}

c10::DataPtr HostPool::allocate(size_t nbytes) {
  const size_t n = round_up(std::max<size_t>(nbytes, 1), kAlign);
  char* p = nullptr;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.lower_bound({n, 0, nullptr});
    if (it == free_.end()) {
      const size_t chunk_size = std::max(kMinChunkBytes, n);
      auto* base = static_cast<char*>(std::aligned_alloc(kAlign, chunk_size));
      TORCH_CHECK(base != nullptr, "dwgraph host pool: out of memory allocating a ", chunk_size,
                  "-byte chunk");
      chunks_.emplace_back(base, chunk_size);
      chunk_index_[base] = chunk_size;
      blocks_[base] = Block{chunk_size, chunks_.size() - 1, true, 0};
      it = free_.insert({chunk_size, chunks_.size() - 1, base}).first;
      stats_.reserved_bytes += static_cast<int64_t>(chunk_size);
    }
    p = std::get<2>(*it);
    Block& b = blocks_.at(p);
    free_.erase(it);
    if (b.size - n >= kAlign) {  // split: the tail stays free
      blocks_[p + n] = Block{b.size - n, b.chunk, true, 0};
      free_.insert({b.size - n, b.chunk, p + n});
      b.size = n;
    }
    b.free = false;
    stats_.allocated_bytes += static_cast<int64_t>(b.size);
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    stats_.live_blocks += 1;
    stats_.num_allocations += 1;
    b.serial = stats_.num_allocations;
  }
  {
    const std::lock_guard<std::mutex> lock(live_mu);
    live_blocks()[p] = shared_from_this();
  }
  return c10::DataPtr(p, p, &HostPool::delete_block, c10::Device(c10::kCPU));
}

bool HostPool::release_block(void* p) {
  std::shared_ptr<HostPool> pool;
  {
    const std::lock_guard<std::mutex> lock(live_mu);
    auto it = live_blocks().find(p);
    if (it == live_blocks().end()) return false;
    pool = std::move(it->second);
    live_blocks().erase(it);
  }
  pool->free_block(static_cast<char*>(p));
  return true;  // `pool` may be the last reference: the pool goes with it
}

void HostPool::delete_block(void* p) {
  const bool ok = release_block(p);
  TORCH_INTERNAL_ASSERT(ok, "dwgraph host pool: freeing a block no pool owns");
}

void HostPool::free_block(char* p) {
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(p);
  TORCH_INTERNAL_ASSERT(it != blocks_.end() && !it->second.free, "dwgraph host pool: bad free");
  Block& b = it->second;
  stats_.allocated_bytes -= static_cast<int64_t>(b.size);
  stats_.live_blocks -= 1;
  if (poison_) std::memset(p, 0xFF, b.size);
  b.free = true;
  // Coalesce with free neighbours of the same chunk.
  auto next = std::next(it);
  if (next != blocks_.end() && next->second.free && next->second.chunk == b.chunk &&
      it->first + b.size == next->first) {
    free_.erase({next->second.size, next->second.chunk, next->first});
    b.size += next->second.size;
    blocks_.erase(next);
  }
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && prev->second.chunk == b.chunk && prev->first + prev->second.size == it->first) {
      free_.erase({prev->second.size, prev->second.chunk, prev->first});
      prev->second.size += b.size;
      blocks_.erase(it);
      it = prev;
    }
  }
  free_.insert({it->second.size, it->second.chunk, it->first});
}

bool HostPool::owns(const void* p) const {
  auto* c = static_cast<char*>(const_cast<void*>(p));
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = chunk_index_.upper_bound(c);  // the first chunk starting after p
  if (it == chunk_index_.begin()) return false;
  --it;
  return c < it->first + it->second;
}

int64_t HostPool::allocation_serial(const void* p) const {
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(static_cast<char*>(const_cast<void*>(p)));
  if (it == blocks_.end() || it->second.free) return 0;
  return it->second.serial;
}

PoolStats HostPool::stats() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void HostPool::set_debug_poison(bool on) {
  const std::lock_guard<std::mutex> lock(mu_);
  poison_ = on;
}

bool HostPool::debug_poison() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return poison_;
}

}  // namespace dwgraph::allocator
