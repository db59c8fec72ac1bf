#include "graphs/pool_order.h"

#include "common/check.h"

#include <algorithm>

namespace dwgraph::graphs {

void PoolOrder::assign(Intervals& map, uintptr_t begin, uintptr_t end, GraphId g) {
  if (begin >= end) return;
  // Cut the intervals that straddle begin or end, then replace everything inside.
  auto it = map.lower_bound(begin);
  if (it != map.begin()) {
    auto prev = std::prev(it);
    if (prev->second.first > begin) {
      const auto [old_end, old_g] = prev->second;
      prev->second.first = begin;
      if (old_end > end) map.emplace(end, std::make_pair(old_end, old_g));
      if (old_end > begin) it = map.lower_bound(begin);
    }
  }
  while (it != map.end() && it->first < end) {
    const auto [old_end, old_g] = it->second;
    it = map.erase(it);
    if (old_end > end) {
      map.emplace(end, std::make_pair(old_end, old_g));
      break;
    }
  }
  if (g != 0) map.emplace(begin, std::make_pair(end, g));
}

std::vector<PoolOrder::Range> PoolOrder::query(const Intervals& map, uintptr_t begin, uintptr_t end) {
  // The pieces of [begin, end) with their graph; uncovered pieces have graph 0.
  std::vector<Range> out;
  uintptr_t at = begin;
  auto it = map.upper_bound(begin);
  if (it != map.begin()) --it;
  for (; it != map.end() && it->first < end; ++it) {
    const uintptr_t b = std::max(it->first, begin);
    const uintptr_t e = std::min(it->second.first, end);
    if (e <= b) continue;
    if (b > at) out.push_back(Range{at, b, 0});
    out.push_back(Range{b, e, it->second.second});
    at = e;
  }
  if (at < end) out.push_back(Range{at, end, 0});
  return out;
}

void PoolOrder::coalesce(std::vector<Range>& ranges) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.graph != b.graph ? a.graph < b.graph : a.begin < b.begin;
  });
  size_t n = 0;
  for (const Range& r : ranges) {
    if (n > 0 && ranges[n - 1].graph == r.graph && ranges[n - 1].end >= r.begin) {
      ranges[n - 1].end = std::max(ranges[n - 1].end, r.end);
    } else {
      ranges[n++] = r;
    }
  }
  ranges.resize(n);
}

void PoolOrder::coalesce(std::vector<std::pair<uintptr_t, uintptr_t>>& ranges) {
  std::sort(ranges.begin(), ranges.end());
  size_t n = 0;
  for (const auto& r : ranges) {
    if (n > 0 && ranges[n - 1].second >= r.first) {
      ranges[n - 1].second = std::max(ranges[n - 1].second, r.second);
    } else {
      ranges[n++] = r;
    }
  }
  ranges.resize(n);
}

// Note [Pending reads indexed by bytes]: what a replay wrote for a reader that has not
// replayed since is kept by byte range, so a replay's checks and bookkeeping cost the pool
// blocks it touches (its writes, what it reads, its readers' ranges), not every pending read
// of every graph on the pool: with one graph per layer (or per deferred module) a list
// scanned at each replay made a step quadratic in the layers (bench_overhead: backward_dw of
// 1024 deferred layers in one callable 16 ms, a third of it here). A piece's pairs are the
// (writer, reader) of each pending read over it; the writer of a pair is the graph that last
// wrote those bytes at replay, since any other write over them is refused while it pends.
PoolOrder::Pending::iterator PoolOrder::split_at(Pending& map, uintptr_t at) {
  auto it = map.lower_bound(at);
  if (it == map.begin()) return it;
  auto prev = std::prev(it);
  if (prev->second.first <= at) return it;
  auto tail = prev->second;  // (end, pairs), the part from `at` on
  prev->second.first = at;
  return map.emplace_hint(it, at, std::move(tail));
}

void PoolOrder::add_pending(Pending& map, uintptr_t begin, uintptr_t end, Pair pair) {
  if (begin >= end) return;
  auto it = split_at(map, begin);
  split_at(map, end);
  it = map.lower_bound(begin);
  uintptr_t at = begin;
  while (at < end) {
    if (it == map.end() || it->first > at) {  // a gap: a new piece up to the next one
      const uintptr_t stop = (it == map.end()) ? end : std::min(end, it->first);
      it = map.emplace_hint(it, at, std::make_pair(stop, std::vector<Pair>{pair}));
    } else {
      it->second.second.push_back(pair);
    }
    at = it->second.first;
    ++it;
  }
}

template <class Drop>
void PoolOrder::drop_pending(Pending& map, uintptr_t begin, uintptr_t end, Drop drop) {
  if (begin >= end || map.empty()) return;
  auto it = split_at(map, begin);
  split_at(map, end);
  it = map.lower_bound(begin);
  while (it != map.end() && it->first < end) {
    auto& pairs = it->second.second;
    pairs.erase(std::remove_if(pairs.begin(), pairs.end(), drop), pairs.end());
    it = pairs.empty() ? map.erase(it) : std::next(it);
  }
}

PoolOrder::GraphId PoolOrder::add_graph(std::string name, const std::vector<MemoryAccess>& accesses) {
  const std::lock_guard<std::mutex> lock(mu_);
  const GraphId id = next_id_++;
  GraphInfo info;
  info.name = std::move(name);
  Intervals own;  // bytes this graph has written so far, in kernel order
  std::vector<GraphId> writers;  // whose readers grew
  for (const auto& a : accesses) {
    if (a.begin >= a.end) continue;
    if (a.kind != MemoryAccess::Kind::kWrite) {
      for (const auto& piece : query(own, a.begin, a.end)) {
        if (piece.graph != 0) continue;  // written earlier by this graph
        for (const auto& w : query(captured_writer_, piece.begin, piece.end)) {
          if (w.graph == 0) continue;  // never written by a graph: nothing to expect
          info.expects.push_back(Range{w.begin, w.end, w.graph});
          graphs_.at(w.graph).readers.push_back(Range{w.begin, w.end, id});
          writers.push_back(w.graph);
        }
      }
    }
    if (a.kind != MemoryAccess::Kind::kRead) {
      assign(own, a.begin, a.end, id);
      info.writes.emplace_back(a.begin, a.end);
    }
  }
  coalesce(info.expects);
  coalesce(info.writes);
  std::sort(writers.begin(), writers.end());
  writers.erase(std::unique(writers.begin(), writers.end()), writers.end());
  for (GraphId w : writers) coalesce(graphs_.at(w).readers);
  for (const auto& [b, e] : info.writes) assign(captured_writer_, b, e, id);
  graphs_.emplace(id, std::move(info));
  return id;
}

void PoolOrder::remove_graph(GraphId id) {
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = graphs_.find(id);
  if (it == graphs_.end()) return;
  for (auto* map : {&captured_writer_, &replay_writer_}) {
    for (const auto& [b, e] : it->second.writes) {
      for (const auto& piece : query(*map, b, e)) {
        if (piece.graph == id) assign(*map, piece.begin, piece.end, 0);
      }
    }
  }
  // Its pending reads as writer lie over its writes, as reader over what it expects.
  const auto mine = [id](const Pair& p) { return p.first == id || p.second == id; };
  for (const auto& [b, e] : it->second.writes) drop_pending(pending_, b, e, mine);
  for (const Range& r : it->second.expects) drop_pending(pending_, r.begin, r.end, mine);
  for (auto& [other, info] : graphs_) {
    info.readers.erase(std::remove_if(info.readers.begin(), info.readers.end(),
                                      [&](const Range& r) { return r.graph == id; }),
                       info.readers.end());
  }
  graphs_.erase(it);
}

void PoolOrder::set_name(GraphId id, std::string name) {
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = graphs_.find(id);
  if (it != graphs_.end()) it->second.name = std::move(name);
}

std::string PoolOrder::name_of(GraphId g) const {
  auto it = graphs_.find(g);
  if (it == graphs_.end()) return "a released graph";
  return it->second.name.empty() ? c10::str("graph #", g) : it->second.name;
}

void PoolOrder::set_enforced(bool on) {
  const std::lock_guard<std::mutex> lock(mu_);
  enforced_ = on;
}

void PoolOrder::check_replay(GraphId id) const {
  const std::lock_guard<std::mutex> lock(mu_);
  if (!enforced_) return;
  const GraphInfo& me = graphs_.at(id);
  for (const auto& want : me.expects) {
    for (const auto& piece : query(replay_writer_, want.begin, want.end)) {
      if (piece.graph == want.graph) continue;
      DWGRAPH_RAISE(ErrorCode::kGraphState, "dwgraph: replaying the ", name_of(id), " now would read ",
                    piece.end - piece.begin, " bytes of pool memory that hold the data of the ", name_of(want.graph),
                    " at capture, but ",
                    piece.graph == 0 ? c10::str("the ", name_of(want.graph), " has not been replayed since")
                                     : c10::str("the ", name_of(piece.graph), " has overwritten them since"),
                    ". Graphs that share a pool must replay in an order whose memory reuse matches the capture; "
                    "replay them in capture order (or capture them in the order you replay). Nothing was run.");
    }
  }
  // The pending reads over the bytes this graph would write (Note [Pending reads indexed by
  // bytes]).
  for (const auto& [b, e] : me.writes) {
    auto it = pending_.upper_bound(b);
    if (it != pending_.begin()) --it;
    for (; it != pending_.end() && it->first < e; ++it) {
      if (it->second.first <= b) continue;
      for (const auto& [writer, reader] : it->second.second) {
        if (reader == id || writer == id) continue;
        DWGRAPH_RAISE(ErrorCode::kGraphState, "dwgraph: replaying the ", name_of(id), " now would overwrite pool "
                      "memory that holds data the ", name_of(writer), " wrote for the ", name_of(reader),
                      ", which has not replayed yet. Graphs that share a pool must replay in an order whose memory "
                      "reuse matches the capture: run the ", name_of(reader), " first (or capture in the order "
                      "you replay). Nothing was run.");
      }
    }
  }
}

void PoolOrder::abandon(GraphId writer, GraphId reader) {
  const std::lock_guard<std::mutex> lock(mu_);
  auto it = graphs_.find(writer);
  if (it == graphs_.end()) return;
  for (const Range& r : it->second.readers) {
    if (r.graph != reader) continue;
    drop_pending(pending_, r.begin, r.end, [&](const Pair& p) { return p.first == writer && p.second == reader; });
  }
}

void PoolOrder::replayed(GraphId id) {
  const std::lock_guard<std::mutex> lock(mu_);
  const GraphInfo& me = graphs_.at(id);
  for (const auto& [b, e] : me.writes) assign(replay_writer_, b, e, id);
  // What this graph read is consumed (over what it expects); what it wrote before is
  // superseded (over its writes).
  const auto mine = [id](const Pair& p) { return p.first == id || p.second == id; };
  for (const Range& r : me.expects) drop_pending(pending_, r.begin, r.end, mine);
  for (const auto& [b, e] : me.writes) drop_pending(pending_, b, e, mine);
  for (const auto& r : me.readers) add_pending(pending_, r.begin, r.end, Pair{id, r.graph});
}

}  // namespace dwgraph::graphs
