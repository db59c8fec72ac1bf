// The replay order of graphs on one pool (graphs/pool_order.h): what each graph expects to
// read, what a replay would overwrite, and what forgetting a graph releases.
#include "testing.h"

#include "common/check.h"
#include "graphs/pool_order.h"

#include <algorithm>
#include <array>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

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

TEST_CASE("PoolOrder: a step re-arms its reads over the same pieces, and pieces left uncovered are dropped",
          "[pool_order][cpu]") {
  PoolOrder order;
  // One callable's step: a forward writing one block per layer, a part per layer reading
  // its layer's block (as backward_dw()'s parts read the saved activations).
  constexpr uintptr_t kLayers = 100;
  const auto fwd = order.add_graph("fwd", {{0, 8 * kLayers, Kind::kWrite}});
  std::vector<PoolOrder::GraphId> parts;
  for (uintptr_t l = 0; l < kLayers; ++l) {
    parts.push_back(order.add_graph("part", {{8 * l, 8 * l + 8, Kind::kRead}, {4096 + 8 * l, 4104 + 8 * l, Kind::kWrite}}));
  }
  const auto step = [&] {
    order.check_replay(fwd);
    order.replayed(fwd);
    for (const auto p : parts) {
      order.check_replay(p);
      order.replayed(p);
    }
  };
  step();
  const size_t pieces = order.num_cover_pieces();
  CHECK(pieces >= kLayers);  // one per layer's read, kept at zero after the parts read them
  for (int i = 0; i < 50; ++i) step();
  CHECK(order.num_cover_pieces() == pieces);  // the same pieces, no more
  // The checks still see the reads: after the forward, rewriting a layer's block before its
  // part ran is refused.
  order.replayed(fwd);
  const auto rewrite = order.add_graph("rewrite", {{16, 24, Kind::kWrite}});
  CHECK_THROWS_AS(order.check_replay(rewrite), dwgraph::GraphStateError);
  for (const auto p : parts) order.replayed(p);
  order.check_replay(rewrite);

  // Another layout on the same bytes (the step's graphs released, a graph reading all of
  // them at once): its read makes the pieces at zero one piece, at its first replay.
  for (const auto p : parts) order.remove_graph(p);
  order.remove_graph(fwd);
  order.remove_graph(rewrite);
  const auto w = order.add_graph("w", {{0, 8 * kLayers, Kind::kWrite}});
  const auto r = order.add_graph("r", {{0, 8 * kLayers, Kind::kRead}});
  const auto x = order.add_graph("x", {{16, 24, Kind::kWrite}});
  order.replayed(w);
  CHECK(order.num_cover_pieces() == 1);
  CHECK_THROWS_AS(order.check_replay(x), dwgraph::GraphStateError);  // r has not read yet
  order.replayed(r);
  order.check_replay(x);

  // Reads over ever new bytes, each read once and its graphs released (a long run that
  // captures and frees): the pieces at zero are dropped at the compactions, not kept.
  PoolOrder churn;
  for (uintptr_t i = 0; i < 2000; ++i) {
    const uintptr_t at = 1 << 20 | (i * 64);
    const auto w = churn.add_graph("w", {{at, at + 32, Kind::kWrite}});
    const auto r = churn.add_graph("r", {{at, at + 32, Kind::kRead}});
    churn.replayed(w);
    churn.check_replay(r);
    churn.replayed(r);
    churn.remove_graph(w);
    churn.remove_graph(r);
  }
  CHECK(churn.num_cover_pieces() <= 200);
}

namespace {

// A byte-by-byte model of Note [Replay order on a shared pool], independent of PoolOrder's
// intervals: who wrote each byte at capture and at replay, and which (writer, reader) reads
// pend on each byte.
struct ByteModel {
  explicit ByteModel(int n = 96) : bytes(n), captured(static_cast<size_t>(n)), replayed(static_cast<size_t>(n)) {}
  int bytes;
  struct G {
    std::map<int, uint64_t> expects;  // byte -> capture-time writer
    std::set<int> writes;
  };
  std::map<uint64_t, G> graphs;
  std::vector<uint64_t> captured, replayed;
  std::set<std::tuple<int, uint64_t, uint64_t>> pending;  // (byte, writer, reader)

  void add(uint64_t id, const std::vector<MemoryAccess>& accesses) {
    G g;
    std::set<int> own;
    for (const auto& a : accesses) {
      for (int b = static_cast<int>(a.begin); b < static_cast<int>(a.end); ++b) {
        if (a.kind != Kind::kWrite && !own.count(b) && captured[b] != 0) g.expects[b] = captured[b];
      }
      if (a.kind != Kind::kRead) {
        for (int b = static_cast<int>(a.begin); b < static_cast<int>(a.end); ++b) own.insert(b);
      }
    }
    g.writes = own;
    for (int b : own) captured[b] = id;
    graphs[id] = g;
  }
  bool refuses(uint64_t x) const {
    const G& g = graphs.at(x);
    for (const auto& [b, w] : g.expects) {
      if (replayed[b] != w) return true;
    }
    for (const auto& [b, w, r] : pending) {
      if (g.writes.count(b) && r != x && w != x) return true;
    }
    return false;
  }
  void replay(uint64_t x) {
    for (auto it = pending.begin(); it != pending.end();) {
      it = (std::get<1>(*it) == x || std::get<2>(*it) == x) ? pending.erase(it) : std::next(it);
    }
    for (int b : graphs.at(x).writes) replayed[b] = x;
    for (const auto& [id, g] : graphs) {
      for (const auto& [b, w] : g.expects) {
        if (w == x) pending.emplace(b, x, id);
      }
    }
  }
  void abandon(uint64_t w, uint64_t r) {
    for (auto it = pending.begin(); it != pending.end();) {
      it = (std::get<1>(*it) == w && std::get<2>(*it) == r) ? pending.erase(it) : std::next(it);
    }
  }
  void remove(uint64_t x) {
    for (auto* bytes : {&captured, &replayed}) {
      for (auto& owner : *bytes) {
        if (owner == x) owner = 0;
      }
    }
    for (auto it = pending.begin(); it != pending.end();) {
      it = (std::get<1>(*it) == x || std::get<2>(*it) == x) ? pending.erase(it) : std::next(it);
    }
    graphs.erase(x);
  }
};

int random_below(std::mt19937& rng, int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); }

// One to four accesses (read, write or read-write) of random ranges inside the model's bytes.
std::vector<MemoryAccess> random_model_accesses(std::mt19937& rng, int base, int bytes) {
  std::vector<MemoryAccess> out;
  const int n = 1 + random_below(rng, 4);
  for (int i = 0; i < n; ++i) {
    const int b = random_below(rng, bytes - 1);
    const int e = b + 1 + random_below(rng, std::min(16, bytes - b));
    out.push_back(MemoryAccess{static_cast<uintptr_t>(base + b), static_cast<uintptr_t>(base + e),
                               static_cast<Kind>(random_below(rng, 3))});
  }
  return out;
}

// A PoolOrder and the byte model, given the same graphs and the same operations.
struct ModelledPool {
  // Accesses fall in a window of 96 bytes, which moves by `slide` bytes at each capture
  // through the model's bytes (captures over new memory as older graphs go).
  explicit ModelledPool(std::mt19937& r, int bytes = 96, int slide = 0) : rng(r), model(bytes), slide(slide) {}
  int slide, base = 0;
  std::mt19937& rng;
  PoolOrder order;
  ByteModel model;
  std::vector<uint64_t> ids;  // ascending

  uint64_t any() { return ids[static_cast<size_t>(random_below(rng, static_cast<int>(ids.size())))]; }
  void add() {
    const auto acc = random_model_accesses(rng, base, std::min(96, model.bytes));
    if (slide > 0) base = (base + slide) % (model.bytes - 96 + 1);
    const auto id = order.add_graph("g", acc);
    model.add(id, acc);
    ids.push_back(id);
  }
  bool refuses(uint64_t x) {
    try {
      order.check_replay(x);
    } catch (const dwgraph::GraphStateError&) {
      return true;
    }
    return false;
  }
  enum class Step { kOther, kRefused, kReplayed };
  // One random step of `choices`: a removal (while more than `min_ids` graphs are left), a
  // capture, an abandon, else a replay, whose check must agree with the model's.
  Step step(int choices, size_t min_ids) {
    const int what = random_below(rng, choices);
    if (what == 0 && ids.size() > min_ids) {
      const size_t k = static_cast<size_t>(random_below(rng, static_cast<int>(ids.size())));
      order.remove_graph(ids[k]);
      model.remove(ids[k]);
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(k));
    } else if (what == 1) {
      add();
    } else if (what == 2) {
      const auto w = any();
      const auto r = any();
      order.abandon(w, r);
      model.abandon(w, r);
    } else {
      const auto x = any();
      const bool refused = refuses(x);
      INFO("graph " << x);
      REQUIRE(refused == model.refuses(x));
      if (refused) return Step::kRefused;
      order.replayed(x);
      model.replay(x);
      return Step::kReplayed;
    }
    return Step::kOther;
  }
};

}  // namespace

TEST_CASE("PoolOrder refuses exactly what a byte-by-byte model of its rules refuses", "[pool_order][cpu]") {
  // Random graphs (reads, writes, read-writes of random ranges), replays in random orders,
  // abandons and removals; each check against the model. Note [Pending reads indexed by
  // bytes] keeps its pending reads by ranges: this is the independent reference. Short
  // runs on many pools over 96 bytes, and long runs on a few (hundreds of dead reads: the
  // reads' compactions happen inside them), the last with captures moving through 4096
  // bytes, so that the pieces no read covers any more pile up behind and are dropped.
  // (trials, ops, bytes, slide, choices: one in `choices` steps captures, one removes)
  const auto [trials, ops, bytes, slide, choices] =
      GENERATE(std::tuple<int, int, int, int, int>{400, 60, 96, 0, 20}, std::tuple<int, int, int, int, int>{12, 3000, 96, 0, 20},
               std::tuple<int, int, int, int, int>{12, 3000, 4096, 8, 6});
  std::mt19937 rng(20261204 + static_cast<unsigned>(ops + bytes));
  int refusals = 0, replays = 0;
  for (int trial = 0; trial < trials; ++trial) {
    ModelledPool pool(rng, bytes, slide);
    for (int i = 0, n = 2 + random_below(rng, 10); i < n; ++i) pool.add();
    for (int op = 0; op < ops; ++op) {
      INFO("trial " << trial << ", op " << op);
      const auto step = pool.step(choices, 1);
      refusals += step == ModelledPool::Step::kRefused ? 1 : 0;
      replays += step == ModelledPool::Step::kReplayed ? 1 : 0;
    }
  }
  // Both outcomes were exercised many times.
  CHECK(refusals > 1000);
  CHECK(replays > 1000);
}

TEST_CASE("PoolOrder: a checked run of consecutive captures skips only checks that would pass", "[pool_order][cpu]") {
  // Note [A checked run of consecutive captures]: after check_sequence() passes for graphs
  // with consecutive ids, their replays in that order skip their own checks. Against the
  // byte-by-byte model, which checks every replay: each skipped check is one the model
  // passes, also when other replays, abandons, captures or removals interrupt the run.
  std::mt19937 rng(4122026);
  const auto pick = [&](int n) { return random_below(rng, n); };
  int runs = 0, run_replays = 0, interrupted = 0, refused_runs = 0;
  for (int trial = 0; trial < 400; ++trial) {
    ModelledPool pool(rng);
    auto& order = pool.order;
    auto& model = pool.model;
    auto& ids = pool.ids;
    const auto other = [&] { pool.step(12, 2); };
    for (int i = 0, n = 3 + pick(10); i < n; ++i) pool.add();
    for (int op = 0; op < 60; ++op) {
      if (pick(3) != 0) {
        other();
        continue;
      }
      // A run: ids[k..k+len) with consecutive values, or (half the time) graphs in capture
      // order with gaps between them, which check_sequence() must not trust.
      const size_t k = static_cast<size_t>(pick(static_cast<int>(ids.size())));
      std::vector<PoolOrder::GraphId> run{ids[k]};
      if (pick(2) == 0) {
        while (k + run.size() < ids.size() && ids[k + run.size()] == run.back() + 1 && pick(4) != 0) {
          run.push_back(ids[k + run.size()]);
        }
      } else {
        for (size_t j = k + 1; j < ids.size() && run.size() < 4; ++j) {
          if (pick(3) == 0) run.push_back(ids[j]);
        }
      }
      bool model_refuses = false;
      for (auto x : run) model_refuses = model_refuses || model.refuses(x);
      bool refused = false;
      try {
        order.check_sequence(run);
      } catch (const dwgraph::GraphStateError&) {
        refused = true;
      }
      INFO("trial " << trial << ", op " << op << ", run from " << run.front() << ", " << run.size() << " graphs");
      REQUIRE(refused == model_refuses);
      if (refused) {
        ++refused_runs;
        continue;
      }
      ++runs;
      for (auto x : run) {
        if (pick(6) == 0) {
          other();  // ends the run: the rest are checked in full
          ++interrupted;
        }
        if (std::find(ids.begin(), ids.end(), x) == ids.end()) break;  // removed meanwhile
        const bool r = pool.refuses(x);
        REQUIRE(r == model.refuses(x));
        if (r) break;
        order.replayed(x);
        model.replay(x);
        ++run_replays;
      }
    }
  }
  CHECK(runs > 1000);
  CHECK(run_replays > 3000);
  CHECK(interrupted > 300);
  CHECK(refused_runs > 300);
}
