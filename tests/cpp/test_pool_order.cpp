// The replay order of graphs on one pool (graphs/pool_order.h): what each graph expects to
// read, what a replay would overwrite, and what forgetting a graph releases.
#include "testing.h"

#include "common/check.h"
#include "graphs/pool_order.h"

using dwgraph::graphs::MemoryAccess;
using dwgraph::graphs::PoolOrder;
using Kind = MemoryAccess::Kind;

TEST_CASE("PoolOrder: capture order is allowed, reuse out of order is refused", "[pool_order][cpu]") {
  PoolOrder order;
  // fwd writes [0, 100) (saved activations); bwd reads them; next reuses [0, 50) after bwd.
  const auto fwd = order.add_graph("fwd", {{0, 100, Kind::kWrite}});
  const auto bwd = order.add_graph("bwd", {{0, 100, Kind::kRead}, {200, 300, Kind::kWrite}});
  const auto next = order.add_graph("next", {{0, 50, Kind::kWrite}, {0, 50, Kind::kRead}});
  for (int round = 0; round < 2; ++round) {
    for (auto g : {fwd, bwd, next}) {
      order.check_replay(g);
      order.replayed(g);
    }
  }
  // bwd before any fwd since the last next: its data was overwritten.
  try {
    order.check_replay(bwd);
    FAIL("no error");
  } catch (const dwgraph::GraphStateError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("replaying the bwd") && Catch::Contains("the next has overwritten"));
  }
  // fwd then next: next would destroy what fwd wrote for bwd.
  order.replayed(fwd);
  try {
    order.check_replay(next);
    FAIL("no error");
  } catch (const dwgraph::GraphStateError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("would overwrite") && Catch::Contains("for the bwd"));
  }
  // fwd again is fine (it refreshes its own data), then bwd, then next.
  order.check_replay(fwd);
  order.replayed(fwd);
  for (auto g : {bwd, next}) {
    order.check_replay(g);
    order.replayed(g);
  }
}

TEST_CASE("PoolOrder: graphs that share no bytes replay in any order, a partial write is a read too",
          "[pool_order][cpu]") {
  PoolOrder order;
  const auto a = order.add_graph("a", {{0, 10, Kind::kWrite}});
  const auto b = order.add_graph("b", {{100, 110, Kind::kWrite}});
  for (auto g : {b, a, b, b, a}) {
    order.check_replay(g);
    order.replayed(g);
  }
  // c updates a's bytes in place (read-and-write): it expects a's data.
  const auto c = order.add_graph("c", {{0, 10, Kind::kReadWrite}});
  order.check_replay(c);
  order.replayed(c);
  CHECK_THROWS_AS(order.check_replay(c), dwgraph::GraphStateError);  // its own write, not a's
  order.replayed(a);
  order.check_replay(c);
}

TEST_CASE("PoolOrder: a removed graph releases its bytes and its readers", "[pool_order][cpu]") {
  PoolOrder order;
  const auto w = order.add_graph("w", {{0, 64, Kind::kWrite}});
  const auto r = order.add_graph("r", {{0, 64, Kind::kRead}});
  order.replayed(w);
  const auto x = order.add_graph("x", {{0, 32, Kind::kWrite}});  // as if captured after r
  CHECK_THROWS_AS(order.check_replay(x), dwgraph::GraphStateError);  // r still needs w's data
  order.remove_graph(r);
  order.check_replay(x);  // nobody waits for w's data any more
  order.replayed(x);
  order.remove_graph(w);
  // y reads [0, 64): x's data in [0, 32), nobody's (w is gone) in [32, 64).
  const auto y = order.add_graph("y", {{0, 64, Kind::kRead}});
  order.check_replay(y);
  order.replayed(y);
  const auto z = order.add_graph("z", {{0, 16, Kind::kWrite}});
  order.replayed(z);
  CHECK_THROWS_AS(order.check_replay(y), dwgraph::GraphStateError);  // z overwrote part of x's data
}
