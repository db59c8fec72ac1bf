#include "graphs/state_epoch.h"

#include <atomic>

namespace dwgraph::graphs {
namespace {
std::atomic<uint64_t> g_epoch{1};
std::atomic<uint64_t> g_registration{1};
}  // namespace

uint64_t state_epoch() { return g_epoch.load(std::memory_order_acquire); }
void bump_state_epoch() { g_epoch.fetch_add(1, std::memory_order_acq_rel); }

uint64_t registration_epoch() { return g_registration.load(std::memory_order_acquire); }
void bump_registration_epoch() {
  g_registration.fetch_add(1, std::memory_order_acq_rel);
  bump_state_epoch();
}

namespace {
std::atomic<uint64_t> g_tensor_hooks{1};
}  // namespace

uint64_t tensor_hook_epoch() { return g_tensor_hooks.load(std::memory_order_acquire); }
void bump_tensor_hook_epoch() { g_tensor_hooks.fetch_add(1, std::memory_order_acq_rel); }

}  // namespace dwgraph::graphs
