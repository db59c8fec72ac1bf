#pragma once

// Note [One thread at a time on a pool]: graphs that share a pool share memory, and the
// pool's replay order (graphs/pool_order.h) is checked before a replay and recorded after
// it. Two threads replaying graphs of one pool at once (one graphed callable called from
// two threads, or two callables of one set) could both pass the check and then write the
// same blocks, or one replay the forward into the static buffers another is reading: a
// silent wrong result. So each entry point that reads or writes a pool's memory (a call, a
// backward, a backward_dw(), a graph's replay) holds the pool's use for its length; another
// thread arriving meanwhile is refused with a GraphStateError before it writes anything,
// rather than made to wait (CUDA graphs sharing a pool must not run concurrently either, and
// waiting could hold the GIL against a hook of the thread inside). The same thread may enter
// again (Python the hand-off runs, a host call). The modules' hooks run outside the use
// (backward_dw() gives it up first): on CUDA, a backward a hook starts runs on autograd's
// device thread, which would be refused as another thread while its caller waits for it.

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <thread>

namespace dwgraph::graphs {

class PoolUse {
 public:
  // While a Scope lives, its thread uses the pool; `who` names it in another thread's
  // refusal. The caller keeps the pool alive meanwhile (a hook may reset() the graphs).
  class Scope {
   public:
    // `alone`: refused while any thread, this one included, is inside (reset(), which frees
    // what a call, backward or backward_dw() running meanwhile holds).
    Scope(PoolUse& use, const std::string& who, bool alone = false);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    PoolUse& use_;
  };

 private:
  // The outermost scope takes mu_; one nested inside it on the same thread (a replay inside
  // a call or backward_dw(): once per part) only counts, as no other thread changes user_ or
  // depth_ while they name this one.
  std::mutex mu_;
  std::atomic<std::thread::id> user_{};
  std::atomic<size_t> depth_{0};
  std::string who_;  // the outermost scope's, while depth_ > 0
};

}  // namespace dwgraph::graphs
