#pragma once
// The private host memory pool of the host graph backend (namespace dwgraph::allocator).
//
// An arena with stable addresses: a block freed back to the pool is reused only by later
// allocations from the same pool (the graphs that share it), never by the rest of the
// process, as CUDA routes capture allocations to a graph's private pool. The memory lives
// as long as the pool: each graph captured on it and each live block hold a reference, so
// the memory a graph baked in stays valid until the graph is reset.
//
// The arena is made of expandable segments (Note [An expandable host segment],
// host_pool.cpp): address space reserved up front and committed as the pool grows, so a
// request that fits nowhere extends the free block at a segment's end instead of opening a
// chunk of its own beside it.

#include "allocator/placement_plan.h"

#include <c10/core/Allocator.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

namespace dwgraph::allocator {

struct PoolStats {
  int64_t reserved_bytes = 0;        // bytes of the segments handed to blocks (their extent)
  int64_t allocated_bytes = 0;       // bytes in live blocks (rounded block sizes)
  int64_t peak_allocated_bytes = 0;  // high-water mark of allocated_bytes
  int64_t live_blocks = 0;
  int64_t num_allocations = 0;       // allocations served since creation
};

class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  static std::shared_ptr<HostPool> create();
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A block of at least `nbytes` (64-byte aligned); its DataPtr returns it to this pool.
  // The DataPtr's context is its data pointer (as c10's raw_allocate requires); a
  // process-wide table maps live blocks to their pool, which each live block keeps alive.
  c10::DataPtr allocate(size_t nbytes);
  // Returns a live pool block at `p` to its pool; false when `p` is no pool block.
  static bool release_block(void* p);
  // True when `p` points into memory this pool has handed to blocks.
  bool owns(const void* p) const;
  // The allocation number (1, 2, ... per pool) of the live block starting at `p`; 0 when
  // `p` starts no live block. Compare with stats().num_allocations taken earlier to tell
  // whether a block was allocated since.
  int64_t allocation_serial(const void* p) const;
  PoolStats stats() const;
  // The allocation numbers of the blocks live now that were allocated after `serial`,
  // blocks given for 0 bytes left out (they hold nothing).
  std::vector<int64_t> live_serials_since(int64_t serial) const;
  // Note [Planned placement]: records the allocations made from now on (clearing any
  // earlier record) until stopped; recorded() returns them, in order.
  void record_allocations(bool on);
  std::vector<AllocationRecord> recorded() const;
  // The allocations made from now on follow `plan` where it fits (its k-th entry for the
  // k-th allocation); a pool follows one plan, set before its first allocation.
  void follow_plan(std::shared_ptr<const PlacementPlan> plan);
  // Gives the pages of free blocks back to the system (their contents are lost; the
  // address space stays): for a pool whose graphs are gone while some block lives on.
  void trim();
  // Debug mode: freed blocks are filled with 0xFF bytes (NaN for floating point), so a
  // replay that reads memory it does not own shows up as NaN instead of stale values.
  void set_debug_poison(bool on);
  bool debug_poison() const;
  uint64_t id() const { return id_; }

 private:
  HostPool();
  void free_block(char* p);
  static void delete_block(void* p);

  struct Block {
    size_t size;
    size_t chunk;  // index of its segment in segments_
    bool free;
    int64_t serial = 0;
    bool empty = false;  // allocated for 0 bytes (holds no data)
  };
  struct Segment {
    char* base;
    size_t reserved;   // address space reserved (PROT_NONE beyond `committed`)
    size_t extent;     // bytes handed to blocks, from base
    size_t committed;  // bytes readable and writable, from base (pages)
  };
  // A free block of at least n bytes at the end of a segment (the newest with room),
  // grown into its reserved space; end() when none has room (a new segment is opened then).
  std::set<std::tuple<size_t, size_t, char*>>::iterator grow(size_t n);
  // The free block ending segment `idx`, or blocks_.end() when its last block is live.
  std::map<char*, Block>::iterator free_tail(size_t idx);
  // Grows segment `idx` to `extent` bytes (its free tail, or a new free block, takes them);
  // false when that is beyond its reservation.
  bool extend(size_t idx, size_t extent);
  // Opens a segment of at least n bytes.
  void open_segment(size_t n);
  // The block at `offset` of the first segment when the plan's next entry is for n bytes
  // and that range is free; nullptr otherwise (the caller falls back to best fit).
  char* take_planned(size_t n);

  const uint64_t id_;
  mutable std::mutex mu_;
  std::vector<Segment> segments_;
  std::map<char*, size_t> chunk_index_;  // segment base -> index, for owns()
  std::map<char*, Block> blocks_;        // every block, by address
  // Free blocks, best fit by size; ties go to the oldest segment, then the lowest offset,
  // so the layout (which blocks later captures reuse) does not depend on where the system
  // put the segments: the same program shares the same memory in every run.
  std::set<std::tuple<size_t, size_t, char*>> free_;  // size, segment, address
  PoolStats stats_;
  bool poison_ = false;
  bool recording_ = false;
  int64_t record_base_ = 0;  // num_allocations when recording started
  int64_t record_clock_ = 0;
  std::vector<AllocationRecord> records_;
  std::shared_ptr<const PlacementPlan> plan_;
  size_t plan_next_ = 0;
};

}  // namespace dwgraph::allocator
