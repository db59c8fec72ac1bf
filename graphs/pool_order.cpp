#include "graphs/pool_order.h"

#include "common/check.h"

#include <algorithm>
#include <cstdint>

namespace dwgraph::graphs {

void PoolOrder::assign(Intervals& map, uintptr_t begin, uintptr_t end, GraphId g) {
  if (begin >= end) return;
  auto it = map.lower_bound(begin);
  // A step writes the same ranges again: an interval that is exactly [begin, end) changes
  // its graph in place (no node freed and allocated per replay).
  if (g != 0 && it != map.end() && it->first == begin && it->second.first == end) {
    it->second.second = g;
    return;
  }
  // Cut the intervals that straddle begin or end, then replace everything inside.
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

bool PoolOrder::first_other(const Intervals& map, uintptr_t begin, uintptr_t end, GraphId g, Range* piece) {
  uintptr_t at = begin;
  auto it = map.upper_bound(begin);
  if (it != map.begin() && std::prev(it)->second.first > begin) --it;  // the interval holding `begin`
  while (at < end) {
    if (it == map.end() || it->first > at) {  // a gap: bytes nobody wrote
      *piece = Range{at, it == map.end() ? end : std::min(end, it->first), 0};
      return true;  // (g is a graph, never 0)
    }
    const uintptr_t e = std::min(it->second.first, end);
    if (it->second.second != g) {
      *piece = Range{at, e, it->second.second};
      return true;
    }
    at = e;
    ++it;
  }
  return false;
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
// replayed since (a pending read) is kept once, with its range, listed under its writer and
// its reader; a map of byte pieces counts the live reads over each. So a replay drops and
// arms the reads it is party to, and its check looks at the pieces under its own writes:
// with one graph per layer (or per deferred module) nothing scans every pending read of the
// pool at each replay, which made a step quadratic in the layers (backward_dw() of 1024
// deferred layers in one callable: 16 ms, a third of it here). Reads overlapping one
// another in many ways stay quadratic as with the flat list, at about ten times its
// constant (N readers of sliding windows over one block: 8.7 ms a step at N = 1024, the
// list 0.8); c2e5895 copied each read into every piece it covered, N^3 there (review).
PoolOrder::Cover::iterator PoolOrder::split_at(Cover& map, uintptr_t at) {
  auto it = map.lower_bound(at);
  if (it == map.begin()) return it;
  auto prev = std::prev(it);
  if (prev->second.first <= at) return it;
  const auto tail = prev->second;  // (end, count), the part from `at` on
  prev->second.first = at;
  return map.emplace_hint(it, at, tail);
}

void PoolOrder::cover(Cover& map, uintptr_t begin, uintptr_t end, int64_t delta) {
  if (begin >= end) return;
  split_at(map, begin);
  split_at(map, end);
  auto it = map.lower_bound(begin);
  uintptr_t at = begin;
  // A piece that no read covers any more stays, at zero (until drop_uncovered()): a step
  // re-arms the same reads over the same bytes, so keeping the pieces makes its adds and
  // drops a lookup and a count, not a node allocated and freed per read. An added read
  // makes each run of bytes no read covered (gaps and pieces at zero, side by side) one
  // piece, so pieces left by reads of another layout do not fragment it.
  auto run = map.end();  // the piece holding the current such run (delta > 0)
  while (at < end) {
    if (it == map.end() || it->first > at) {  // a gap: only an added read makes a piece there
      const uintptr_t stop = (it == map.end()) ? end : std::min(end, it->first);
      if (delta > 0) {
        if (run != map.end() && run->second.first == at) {
          run->second.first = stop;
        } else {
          run = map.emplace_hint(it, at, std::make_pair(stop, delta));
        }
      }
      at = stop;
      continue;
    }
    at = it->second.first;
    if (delta > 0 && it->second.second == 0) {
      if (run != map.end() && run->second.first == it->first) {
        run->second.first = at;
        it = map.erase(it);
      } else {
        it->second.second = delta;
        run = it++;
      }
      continue;
    }
    it->second.second += delta;
    run = map.end();
    ++it;
  }
}

void PoolOrder::drop_uncovered(Cover& map) {
  for (auto it = map.begin(); it != map.end();) it = it->second.second == 0 ? map.erase(it) : std::next(it);
}

void PoolOrder::add_pending(uintptr_t begin, uintptr_t end, GraphId writer, GraphId reader) {
  if (begin >= end) return;
  const size_t slot = reads_.size();
  reads_.push_back(PendingRead{begin, end, writer, reader, true});
  const GraphId hi = std::max(writer, reader);
  if (reads_of_.size() <= hi) reads_of_.resize(hi + 1);
  reads_of_[writer].push_back(slot);
  reads_of_[reader].push_back(slot);
  cover(cover_, begin, end, 1);
  peak_live_reads_ = std::max(peak_live_reads_, reads_.size() - dead_reads_);
}

template <class Drop>
void PoolOrder::drop_pending(GraphId g, Drop drop) {
  std::vector<size_t>* listed = reads_of(g);
  if (listed == nullptr || listed->empty()) return;
  auto& slots = *listed;
  size_t kept = 0;
  for (size_t slot : slots) {
    PendingRead& r = reads_[slot];
    if (!r.live) continue;  // dropped through the other party
    if (drop(r)) {
      r.live = false;
      cover(cover_, r.begin, r.end, -1);
      ++dead_reads_;
    } else {
      slots[kept++] = slot;
    }
  }
  slots.resize(kept);
}

void PoolOrder::compact_reads() {
  if (dead_reads_ < 64 || dead_reads_ * 2 < reads_.size()) return;
  // In place, with the renumbering kept between compactions: a step's compaction allocates
  // nothing, and reads_ keeps its capacity for the next step's reads.
  std::vector<size_t>& renumber = renumber_;
  renumber.assign(reads_.size(), SIZE_MAX);
  // Only the graphs party to a read, live or dead (a dead read's slot may still be listed
  // under its other party), have a list to renumber, each once (a stamp per id): the cost
  // is the reads', not the pool's graphs' (compaction runs inside replays).
  ++compaction_;
  if (compacted_at_.size() < reads_of_.size()) compacted_at_.resize(reads_of_.size(), 0);
  std::vector<GraphId>& parties = parties_;
  parties.clear();
  size_t n = 0;
  for (size_t i = 0; i < reads_.size(); ++i) {
    for (const GraphId id : {reads_[i].writer, reads_[i].reader}) {
      if (id >= reads_of_.size() || compacted_at_[id] == compaction_) continue;
      compacted_at_[id] = compaction_;
      parties.push_back(id);
    }
    if (!reads_[i].live) continue;
    renumber[i] = n;
    reads_[n++] = reads_[i];
  }
  reads_.resize(n);
  for (const GraphId id : parties) {
    auto& slots = reads_of_[id];
    size_t kept = 0;
    for (size_t slot : slots) {
      if (renumber[slot] != SIZE_MAX) slots[kept++] = renumber[slot];
    }
    slots.resize(kept);
  }
  dead_reads_ = 0;
  // The pieces at zero are kept for the next step's reads over the same bytes; dropped once
  // they outnumber what the most reads live lately could cover (each read adds at most two
  // boundaries), so graphs released for good leave none behind.
  if (cover_.size() > 4 * peak_live_reads_ + 64) {
    drop_uncovered(cover_);
    peak_live_reads_ = reads_.size();
  } else {
    // The peak fades by an eighth a compaction (a step of many layers compacts a few
    // times, and its next step's reads raise it again), so one large step long ago does
    // not keep the pieces at zero for good.
    peak_live_reads_ = std::max(reads_.size(), peak_live_reads_ - peak_live_reads_ / 8);
  }
}

PoolOrder::GraphInfo& PoolOrder::info(GraphId id) const {
  GraphInfo* g = id < by_id_.size() ? by_id_[id] : nullptr;
  TORCH_INTERNAL_ASSERT(g != nullptr, "PoolOrder: graph #", id, " is not registered");
  return *g;
}

PoolOrder::GraphId PoolOrder::add_graph(std::string name, const std::vector<MemoryAccess>& accesses) {
  const std::lock_guard<std::mutex> lock(mu_);
  end_run();
  const GraphId id = next_id_++;
  GraphInfo g;
  g.name = std::move(name);
  Intervals own;  // bytes this graph has written so far, in kernel order
  std::vector<GraphId> writers;  // whose readers grew
  for (const auto& a : accesses) {
    if (a.begin >= a.end) continue;
    if (a.kind != MemoryAccess::Kind::kWrite) {
      for (const auto& piece : query(own, a.begin, a.end)) {
        if (piece.graph != 0) continue;  // written earlier by this graph
        for (const auto& w : query(captured_writer_, piece.begin, piece.end)) {
          if (w.graph == 0) continue;  // never written by a graph: nothing to expect
          g.expects.push_back(Range{w.begin, w.end, w.graph});
          info(w.graph).readers.push_back(Range{w.begin, w.end, id});
          writers.push_back(w.graph);
        }
      }
    }
    if (a.kind != MemoryAccess::Kind::kRead) {
      assign(own, a.begin, a.end, id);
      g.writes.emplace_back(a.begin, a.end);
    }
  }
  coalesce(g.expects);
  coalesce(g.writes);
  std::sort(writers.begin(), writers.end());
  writers.erase(std::unique(writers.begin(), writers.end()), writers.end());
  for (GraphId w : writers) coalesce(info(w).readers);
  for (const auto& [b, e] : g.writes) assign(captured_writer_, b, e, id);
  GraphInfo* added = &graphs_.emplace(id, std::move(g)).first->second;
  if (by_id_.size() <= id) by_id_.resize(id + 1, nullptr);
  by_id_[id] = added;
  return id;
}

void PoolOrder::remove_graph(GraphId id) {
  const std::lock_guard<std::mutex> lock(mu_);
  end_run();
  auto it = graphs_.find(id);
  if (it == graphs_.end()) return;
  for (auto* map : {&captured_writer_, &replay_writer_}) {
    for (const auto& [b, e] : it->second.writes) {
      for (const auto& piece : query(*map, b, e)) {
        if (piece.graph == id) assign(*map, piece.begin, piece.end, 0);
      }
    }
  }
  drop_pending(id, [](const PendingRead&) { return true; });
  compact_reads();
  if (std::vector<size_t>* listed = reads_of(id)) std::vector<size_t>().swap(*listed);  // its capacity too
  for (auto& [other, info] : graphs_) {
    info.readers.erase(std::remove_if(info.readers.begin(), info.readers.end(),
                                      [&](const Range& r) { return r.graph == id; }),
                       info.readers.end());
  }
  by_id_[id] = nullptr;
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

size_t PoolOrder::num_cover_pieces() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return cover_.size();
}

void PoolOrder::set_enforced(bool on) {
  const std::lock_guard<std::mutex> lock(mu_);
  end_run();
  enforced_ = on;
}

void PoolOrder::check_replay(GraphId id) const {
  const std::lock_guard<std::mutex> lock(mu_);
  if (run_next_ != 0 && id == run_next_) return;  // Note [A checked run of consecutive captures]
  check_replay_locked(id);
}

// Note [A checked run of consecutive captures]: graphs k, k+1, ..., m captured one after the
// other on a pool (a backward_dw()'s parts), all checked against the pool as it is, then
// replayed in that order with nothing else in between. Each one's check at its own turn
// passes: (1) what k+i expects from a writer W: if an earlier graph of the run writes those
// bytes at replay it wrote them at capture too, between W and k+i, so k+i would expect that
// graph, not W; (2) data a graph of the run writes for a reader R, under k+i's writes: R
// expects it only if captured between them, and no graph was. So the checks done up front
// stand, and each replay of the run skips its own. A gap in the ids (a part landed alone
// since: module.backward_dw()) leaves every check to its replay.
void PoolOrder::check_sequence(const std::vector<GraphId>& ids) {
  const std::lock_guard<std::mutex> lock(mu_);
  end_run();
  for (const GraphId id : ids) check_replay_locked(id);
  bool consecutive = !ids.empty() && enforced_;
  for (size_t i = 1; i < ids.size() && consecutive; ++i) consecutive = ids[i] == ids[i - 1] + 1;
  if (consecutive) run_next_ = ids.front(), run_last_ = ids.back();
}

void PoolOrder::end_sequence() {
  const std::lock_guard<std::mutex> lock(mu_);
  end_run();
}

void PoolOrder::check_replay_locked(GraphId id) const {
  if (!enforced_) return;
  const GraphInfo& me = info(id);
  for (const auto& want : me.expects) {
    Range piece{};
    if (first_other(replay_writer_, want.begin, want.end, want.graph, &piece)) {
      DWGRAPH_RAISE(ErrorCode::kGraphState, "dwgraph: replaying the ", name_of(id), " now would read ",
                    piece.end - piece.begin, " bytes of pool memory that hold the data of the ", name_of(want.graph),
                    " at capture, but ",
                    piece.graph == 0 ? c10::str("the ", name_of(want.graph), " has not been replayed since")
                                     : c10::str("the ", name_of(piece.graph), " has overwritten them since"),
                    ". Graphs that share a pool must replay in an order whose memory reuse matches the capture; "
                    "replay them in capture order (or capture them in the order you replay). Nothing was run.");
    }
  }
  // The pending reads over the bytes this graph would write, less its own (Note [Pending
  // reads indexed by bytes]).
  const std::vector<size_t>* own = reads_of(id);
  for (const auto& [b, e] : me.writes) {
    auto it = cover_.upper_bound(b);
    if (it != cover_.begin()) --it;
    for (; it != cover_.end() && it->first < e; ++it) {
      const uintptr_t pb = std::max(it->first, b), pe = std::min(it->second.first, e);
      if (pe <= pb || it->second.second == 0) continue;  // a piece no read covers now
      int64_t mine = 0;
      if (own != nullptr) {
        for (size_t slot : *own) {
          const PendingRead& r = reads_[slot];
          mine += r.live && (r.writer == id || r.reader == id) && r.begin < pe && r.end > pb;
        }
      }
      if (it->second.second <= mine) continue;
      for (const PendingRead& r : reads_) {  // the refusal: name one of the others
        if (!r.live || r.writer == id || r.reader == id || r.begin >= pe || r.end <= pb) continue;
        DWGRAPH_RAISE(ErrorCode::kGraphState, "dwgraph: replaying the ", name_of(id), " now would overwrite pool "
                      "memory that holds data the ", name_of(r.writer), " wrote for the ", name_of(r.reader),
                      ", which has not replayed yet. Graphs that share a pool must replay in an order whose memory "
                      "reuse matches the capture: run the ", name_of(r.reader), " first (or capture in the order "
                      "you replay). Nothing was run.");
      }
    }
  }
}

void PoolOrder::abandon(GraphId writer, GraphId reader) {
  const std::lock_guard<std::mutex> lock(mu_);
  end_run();
  drop_pending(writer, [&](const PendingRead& r) { return r.writer == writer && r.reader == reader; });
  compact_reads();
}

void PoolOrder::replayed(GraphId id) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (run_next_ != 0 && id == run_next_ && id < run_last_) {
    ++run_next_;
  } else {
    end_run();
  }
  const GraphInfo& me = info(id);
  for (const auto& [b, e] : me.writes) assign(replay_writer_, b, e, id);
  // What this graph read is consumed; what it wrote before is superseded.
  drop_pending(id, [](const PendingRead&) { return true; });
  for (const auto& r : me.readers) add_pending(r.begin, r.end, id, r.graph);
  compact_reads();
}

}  // namespace dwgraph::graphs
