// Note [One thread at a time on a pool] (graphs/pool_use.h): a thread inside a pool's use
// may enter again; another thread is refused, naming the first, until it is done; a scope
// that must be alone (reset()) is refused while any thread is inside.
#include "testing.h"

#include "common/check.h"
#include "graphs/pool_use.h"

#include <optional>
#include <string>
#include <thread>

using dwgraph::graphs::PoolUse;

namespace {

// What Scope(use, who) does on a thread of its own: "" when it entered, else the refusal.
std::string enter_on_another_thread(PoolUse& use, const std::string& who) {
  std::string out;
  std::thread t([&] {
    try {
      const PoolUse::Scope s(use, who);
    } catch (const dwgraph::GraphStateError& e) {
      out = e.what();
    }
  });
  t.join();
  return out;
}

}  // namespace

TEST_CASE("PoolUse: the same thread enters again, another is refused until the first is done",
          "[pool_use][cpu]") {
  PoolUse use;
  const std::string first = "graphed callable 0 ('Linear')", second = "graphed callable 1 ('Linear')";
  CHECK(enter_on_another_thread(use, second).empty());  // free
  {
    const PoolUse::Scope outer(use, first);
    {
      const PoolUse::Scope inner(use, second);  // a hook calling another graph of the set
      const std::string refused = enter_on_another_thread(use, second);
      CHECK(refused.find("another thread is using graphs of the same memory pool now") != std::string::npos);
      CHECK(refused.find(first) != std::string::npos);  // names the outermost user
    }
    CHECK_FALSE(enter_on_another_thread(use, second).empty());  // still inside `outer`
  }
  CHECK(enter_on_another_thread(use, second).empty());
  // A refusal leaves the use as it was: this thread enters again.
  std::optional<PoolUse::Scope> again;
  again.emplace(use, first);
  again.reset();
  CHECK(enter_on_another_thread(use, second).empty());
}

TEST_CASE("PoolUse: a scope that must be alone is refused while any thread is inside", "[pool_use][cpu]") {
  PoolUse use;
  const std::string call = "graphed callable 0 ('Linear')", reset = "reset()";
  {
    const PoolUse::Scope inside(use, call);
    CHECK_THROWS_AS(PoolUse::Scope(use, reset, /*alone=*/true), dwgraph::GraphStateError);  // this thread
    std::string refused;
    std::thread t([&] {
      try {
        const PoolUse::Scope s(use, reset, /*alone=*/true);
      } catch (const dwgraph::GraphStateError& e) {
        refused = e.what();
      }
    });
    t.join();
    CHECK(refused.find("in use now (" + call + ", on another thread)") != std::string::npos);
  }
  {
    const PoolUse::Scope alone(use, reset, /*alone=*/true);
    CHECK_FALSE(enter_on_another_thread(use, call).empty());  // others wait for it to end
  }
  CHECK(enter_on_another_thread(use, call).empty());
}
