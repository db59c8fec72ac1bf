#include "graphs/pool_use.h"

#include "common/check.h"

namespace dwgraph::graphs {

PoolUse::Scope::Scope(PoolUse& use, const std::string& who, bool alone) : use_(use) {
  const auto me = std::this_thread::get_id();
  if (!alone && use.user_.load(std::memory_order_acquire) == me) {
    use.depth_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const std::lock_guard<std::mutex> lock(use.mu_);
  DWGRAPH_CHECK_STATE(!alone || use.depth_ == 0, who, ": graphs of this pool are in use now (",
                      use.who_.empty() ? std::string("a graph") : use.who_, ", on ",
                      use.user_ == me ? "this thread: from Python it runs, such as a parameter's flag setter"
                                      : "another thread",
                      "); call it once that returns (a wgrad hook runs after it, and may). Nothing was released.");
  DWGRAPH_CHECK_STATE(use.depth_ == 0 || use.user_ == me, who.empty() ? std::string("dwgraph graph") : who,
                      ": another thread is using graphs of the same memory "
                      "pool now (", use.who_.empty() ? std::string("a graph") : use.who_,
                      "); graphs that share a pool share memory and must run one thread at a time (serialize "
                      "these calls, or give each thread graphs of its own). Nothing was run.");
  // depth_ is 0 here: another thread's use was refused above, and this thread's took the
  // nested path.
  use.who_.assign(who);  // its capacity kept: no allocation per call
  use.depth_.store(1, std::memory_order_relaxed);
  use.user_.store(me, std::memory_order_release);
}

PoolUse::Scope::~Scope() {
  if (use_.depth_.load(std::memory_order_relaxed) > 1) {  // nested: only this thread changes it now
    use_.depth_.fetch_sub(1, std::memory_order_relaxed);
    return;
  }
  const std::lock_guard<std::mutex> lock(use_.mu_);
  use_.depth_.store(0, std::memory_order_relaxed);
  use_.user_.store(std::thread::id(), std::memory_order_release);
}

}  // namespace dwgraph::graphs
