#pragma once
// Routes the CPU allocations of a capturing thread to a host pool (dwgraph::allocator),
// as CUDA routes a capturing stream's allocations to the graph's private pool. Other
// threads, and this thread outside the guard, allocate as before.

#include "allocator/host_pool.h"

#include <memory>

namespace dwgraph::allocator {

class CaptureAllocationGuard {
 public:
  explicit CaptureAllocationGuard(std::shared_ptr<HostPool> pool);
  ~CaptureAllocationGuard();
  CaptureAllocationGuard(const CaptureAllocationGuard&) = delete;
  CaptureAllocationGuard& operator=(const CaptureAllocationGuard&) = delete;

 private:
  HostPool* previous_;
  std::shared_ptr<HostPool> pool_;
};

// The pool the current thread allocates from, or null.
HostPool* current_capture_pool();

}  // namespace dwgraph::allocator
