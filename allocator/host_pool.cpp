#include "allocator/host_pool.h"

#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <unordered_map>

namespace dwgraph::allocator {
namespace {

constexpr size_t kAlign = 64;

// Note [An expandable host segment]
// A graph keeps all the memory its capture used, freed temporaries included, so a pool's
// reserved bytes should follow its layout's extent and no more. A pool of separate chunks,
// each sized to the request that opened it, cannot: a request that fits no free block
// opens a chunk while a free tail sits at the end of the last one, and both stay reserved;
// nor can it place blocks at the offsets of a plan (Note [Planned placement]). So a pool
// reserves address space once (PROT_NONE: no memory, no commit charge) and commits pages
// as its extent grows; a request that fits nowhere grows the free block at the end, if
// any, by what it lacks. It is the host form of the CUDA caching allocator's expandable
// segments. Reserved bytes count the extent handed to blocks (64-byte granular, as
// before), not the page rounding of the commit. Address space is not free either (a
// process under `ulimit -v` counts it), so reservations grow geometrically: the first
// segment reserves 16 MiB (or the request, or a plan's whole extent), each next one twice
// the last (or the request); a request that fits in no segment's room opens the next.
// When a pool's graphs are all gone but a block outlives them (a tensor the caller kept),
// the pool gives its free pages back to the system (trim()).
constexpr size_t kFirstSegmentBytes = size_t{16} << 20;

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

size_t page_bytes() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

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
  for (const Segment& s : segments_) munmap(s.base, s.reserved);
}

bool HostPool::extend(size_t idx, size_t extent) {
  Segment& s = segments_[idx];
  if (extent <= s.extent) return true;
  if (extent > s.reserved) return false;
  if (extent > s.committed) {
    const size_t committed = std::min(round_up(extent, page_bytes()), s.reserved);
    const int rc = mprotect(s.base + s.committed, committed - s.committed, PROT_READ | PROT_WRITE);
    TORCH_CHECK(rc == 0, "dwgraph host pool: out of memory committing ", committed - s.committed,
                " bytes (", std::strerror(errno), ")");
    s.committed = committed;
  }
  const size_t more = extent - s.extent;
  char* const end = s.base + s.extent;
  const auto tail = free_tail(idx);
  s.extent = extent;
  stats_.reserved_bytes += static_cast<int64_t>(more);
  if (tail != blocks_.end()) {  // the free tail takes the new bytes
    free_.erase({tail->second.size, idx, tail->first});
    tail->second.size += more;
    free_.insert({tail->second.size, idx, tail->first});
  } else {
    blocks_[end] = Block{more, idx, true, 0};
    free_.insert({more, idx, end});
  }
  return true;
}

std::map<char*, HostPool::Block>::iterator HostPool::free_tail(size_t idx) {
  const Segment& s = segments_[idx];
  auto last = blocks_.lower_bound(s.base + s.extent);
  if (last == blocks_.begin()) return blocks_.end();
  --last;
  return last->second.chunk == idx && last->second.free ? last : blocks_.end();
}

std::set<std::tuple<size_t, size_t, char*>>::iterator HostPool::grow(size_t n) {
  // The newest segment first (its tail is where the last blocks went), then older ones.
  for (size_t k = segments_.size(); k-- > 0;) {
    const auto tail = free_tail(k);
    const size_t have = tail != blocks_.end() ? tail->second.size : 0;
    if (!extend(k, segments_[k].extent + (n - have))) continue;
    const auto b = free_tail(k);
    return free_.find({b->second.size, k, b->first});
  }
  return free_.end();
}

void HostPool::open_segment(size_t n) {
  const size_t need = round_up(n, page_bytes());
  const size_t grown = segments_.empty() ? kFirstSegmentBytes : 2 * segments_.back().reserved;
  size_t reserve = std::max(grown, need);
  void* base = mmap(nullptr, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED && reserve > need) {  // short of address space: just what is asked
    reserve = need;
    base = mmap(nullptr, reserve, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  }
  TORCH_CHECK(base != MAP_FAILED, "dwgraph host pool: out of memory: could not reserve ", reserve,
              " bytes of address space for a segment (", std::strerror(errno), ")");
  segments_.push_back(Segment{static_cast<char*>(base), reserve, 0, 0});
  chunk_index_[static_cast<char*>(base)] = segments_.size() - 1;
}

void HostPool::trim() {
  const std::lock_guard<std::mutex> lock(mu_);
  const size_t page = page_bytes();
  for (const auto& [p, b] : blocks_) {
    if (!b.free) continue;
    const auto begin = round_up(reinterpret_cast<uintptr_t>(p), page);
    const auto end = (reinterpret_cast<uintptr_t>(p) + b.size) / page * page;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }
}

char* HostPool::take_planned(size_t n) {
  if (!plan_ || plan_next_ >= plan_->sizes.size()) return nullptr;
  const size_t k = plan_next_++;
  if (plan_->sizes[k] != n) return nullptr;
  if (segments_.empty()) open_segment(plan_->extent);
  const size_t offset = plan_->offsets[k];
  if (!extend(0, offset + n)) return nullptr;
  char* const p = segments_[0].base + offset;
  auto it = blocks_.upper_bound(p);  // the block holding p: the last one starting at or before it
  if (it == blocks_.begin()) return nullptr;
  --it;
  Block b = it->second;
  char* const start = it->first;
  if (!b.free || b.chunk != 0 || start + b.size < p + n) return nullptr;
  free_.erase({b.size, 0, start});
  if (start < p) {  // the head stays free
    it->second.size = static_cast<size_t>(p - start);
    free_.insert({it->second.size, 0, start});
  } else {
    blocks_.erase(it);
  }
  if (start + b.size > p + n) {  // so does the tail
    const size_t tail = static_cast<size_t>(start + b.size - (p + n));
    blocks_[p + n] = Block{tail, 0, true, 0};
    free_.insert({tail, 0, p + n});
  }
  blocks_[p] = Block{n, 0, true, 0};
  return p;
}

c10::DataPtr HostPool::allocate(size_t nbytes) {
  const size_t n = round_up(std::max<size_t>(nbytes, 1), kAlign);
  char* p = nullptr;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    p = take_planned(n);
    if (p == nullptr) {
      auto it = free_.lower_bound({n, 0, nullptr});
      if (it == free_.end()) it = grow(n);
      if (it == free_.end()) {  // no segment yet, or none has room left
        open_segment(n);
        it = grow(n);
        TORCH_INTERNAL_ASSERT(it != free_.end(), "dwgraph host pool: a new segment did not fit ", n, " bytes");
      }
      p = std::get<2>(*it);
      Block& b = blocks_.at(p);
      free_.erase(it);
      if (b.size - n >= kAlign) {  // split: the tail stays free
        blocks_[p + n] = Block{b.size - n, b.chunk, true, 0};
        free_.insert({b.size - n, b.chunk, p + n});
        b.size = n;
      }
    }
    Block& b = blocks_.at(p);
    b.free = false;
    stats_.allocated_bytes += static_cast<int64_t>(b.size);
    stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
    stats_.live_blocks += 1;
    stats_.num_allocations += 1;
    b.serial = stats_.num_allocations;
    b.empty = nbytes == 0;
    if (recording_) records_.push_back(AllocationRecord{b.size, record_clock_++, AllocationRecord::kLive});
  }
  {
    const std::lock_guard<std::mutex> lock(live_mu);
    live_blocks()[p] = shared_from_this();
  }
  return c10::DataPtr(p, p, &HostPool::delete_block, c10::Device(c10::kCPU));
}

void HostPool::record_allocations(bool on) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (on) {
    records_.clear();
    record_base_ = stats_.num_allocations;
    record_clock_ = 0;
  }
  recording_ = on;
}

std::vector<AllocationRecord> HostPool::recorded() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

void HostPool::follow_plan(std::shared_ptr<const PlacementPlan> plan) {
  const std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(stats_.num_allocations == 0, "dwgraph host pool: a plan is followed from the first allocation, but ",
              stats_.num_allocations, " were made already");
  plan_ = std::move(plan);
  plan_next_ = 0;
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
  if (recording_ && b.serial > record_base_) {
    records_[static_cast<size_t>(b.serial - record_base_ - 1)].died = record_clock_++;
  }
  stats_.allocated_bytes -= static_cast<int64_t>(b.size);
  stats_.live_blocks -= 1;
  if (poison_) std::memset(p, 0xFF, b.size);
  b.free = true;
  // Coalesce with free neighbours of the same segment.
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
  auto it = chunk_index_.upper_bound(c);  // the first segment starting after p
  if (it == chunk_index_.begin()) return false;
  --it;
  return c < it->first + segments_[it->second].extent;
}

int64_t HostPool::allocation_serial(const void* p) const {
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find(static_cast<char*>(const_cast<void*>(p)));
  if (it == blocks_.end() || it->second.free) return 0;
  return it->second.serial;
}

std::vector<int64_t> HostPool::live_serials_since(int64_t serial) const {
  const std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  for (const auto& [p, b] : blocks_) {
    if (!b.free && !b.empty && b.serial > serial) out.push_back(b.serial);
  }
  return out;
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
