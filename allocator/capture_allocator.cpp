#include "allocator/capture_allocator.h"

#include <c10/core/CPUAllocator.h>

#include <mutex>

namespace dwgraph::allocator {
namespace {

thread_local HostPool* tls_pool = nullptr;
c10::DeleterFnPtr base_raw_deleter = nullptr;

// Frees what raw_allocate handed out, from the pool or from the base allocator.
void routing_raw_delete(void* p) {
  if (HostPool::release_block(p)) return;
  if (base_raw_deleter != nullptr) base_raw_deleter(p);
}

// Installed as the CPU allocator the first time a capture routes allocations; it forwards
// to the allocator it replaced unless the calling thread is capturing.
class RoutingCPUAllocator final : public c10::Allocator {
 public:
  explicit RoutingCPUAllocator(c10::Allocator* base) : base_(base) {}
  c10::DataPtr allocate(size_t n) override {
    if (tls_pool != nullptr) return tls_pool->allocate(n);
    return base_->allocate(n);
  }
  // raw_allocate (used by some CPU kernels for scratch space) may take pool blocks too.
  c10::DeleterFnPtr raw_deleter() const override {
    return base_->raw_deleter() != nullptr ? &routing_raw_delete : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    base_->copy_data(dest, src, count);
  }

 private:
  c10::Allocator* base_;
};

void install_routing_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    static RoutingCPUAllocator routing(c10::GetCPUAllocator());
    base_raw_deleter = c10::GetCPUAllocator()->raw_deleter();
    // Above the default CPU allocator's priority, so GetCPUAllocator() returns it.
    c10::SetCPUAllocator(&routing, /*priority=*/100);
  });
}

}  // namespace

CaptureAllocationGuard::CaptureAllocationGuard(std::shared_ptr<HostPool> pool)
    : previous_(tls_pool), pool_(std::move(pool)) {
  install_routing_allocator();
  tls_pool = pool_.get();
}

CaptureAllocationGuard::~CaptureAllocationGuard() { tls_pool = previous_; }

HostPool* current_capture_pool() { return tls_pool; }

}  // namespace dwgraph::allocator
