#include "graphs/pool_use.h"

#include "common/check.h"

namespace dwgraph::graphs {

PoolUse::Scope::Scope(PoolUse& use, const std::string& who, bool alone) : use_(use) {
  const std::lock_guard<std::mutex> lock(use.mu_);
  const auto me = std::this_thread::get_id();
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
  if (use.depth_++ == 0) {
    use.user_ = me;
    use.who_.assign(who);  // its capacity kept: no allocation per call
  }
}

PoolUse::Scope::~Scope() {
  const std::lock_guard<std::mutex> lock(use_.mu_);
  if (--use_.depth_ == 0) {
    use_.user_ = std::thread::id();
  }
}

}  // namespace dwgraph::graphs
