#pragma once
// The private host memory pool of the host graph backend (namespace dwgraph::allocator).
//
// An arena of chunks (each sized to the request that opened it) with stable addresses: a block freed back to the pool is reused only
// by later allocations from the same pool (the graphs that share it), never by the rest
// of the process, as CUDA routes capture allocations to a graph's private pool. The
// chunks live as long as the pool: each graph captured on it and each live block hold a
// reference, so the memory a graph baked in stays valid until the graph is reset.

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
  int64_t reserved_bytes = 0;        // chunk memory held by the pool
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
  // True when `p` points into one of this pool's chunks.
  bool owns(const void* p) const;
  // The allocation number (1, 2, ... per pool) of the live block starting at `p`; 0 when
  // `p` starts no live block. Compare with stats().num_allocations taken earlier to tell
  // whether a block was allocated since.
  int64_t allocation_serial(const void* p) const;
  PoolStats stats() const;
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
    size_t chunk;
    bool free;
    int64_t serial = 0;
  };
  const uint64_t id_;
  mutable std::mutex mu_;
  std::vector<std::pair<char*, size_t>> chunks_;  // base, size
  std::map<char*, size_t> chunk_index_;            // base -> size, for owns()
  std::map<char*, Block> blocks_;                 // every block, by address
  // Free blocks, best fit by size; ties go to the oldest chunk, then the lowest offset, so
  // the layout (which blocks later captures reuse) does not depend on where the system
  // put the chunks: the same program shares the same memory in every run.
  std::set<std::tuple<size_t, size_t, char*>> free_;  // size, chunk, address
  PoolStats stats_;
  bool poison_ = false;
};

}  // namespace dwgraph::allocator
