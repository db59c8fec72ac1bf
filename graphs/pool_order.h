#pragma once
// Replay order of the graphs that share one pool (namespace dwgraph::graphs).
//
// Note [Replay order on a shared pool]: a capture may place its memory in pool blocks an
// earlier capture on the same pool freed. Replaying in capture order is then safe; other
// orders may let one graph overwrite bytes another graph still has to read (a forward's
// saved activations overwritten by a later microbatch's forward before the backward that
// reads them), and nothing would fail: the gradients would just be wrong. PoolOrder
// follows every pool byte range: at capture, in capture order, which graph last wrote it,
// and so which graph's data each graph expects when it reads bytes it did not write
// itself first; at replay, which graph really wrote it last. Before a replay it refuses,
// with a GraphStateError naming both graphs and before anything is written,
//  - a graph whose expected data was overwritten by another graph (or never written), and
//  - a graph whose writes would destroy data another graph still has to read (data
//    written by a replay whose reader has not replayed since).
// Orders that differ from the capture but touch no shared bytes stay allowed (the
// backward-dw graphs of the sequential schedule, which keep their inputs alive, replay in
// any order). Only the pool's own memory is followed; static inputs and caller buffers are
// not pool memory.

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dwgraph::graphs {

// One access of a recorded kernel to pool memory, [begin, end) in bytes.
struct MemoryAccess {
  enum class Kind { kRead, kWrite, kReadWrite };
  uintptr_t begin = 0;
  uintptr_t end = 0;
  Kind kind = Kind::kRead;
};

class PoolOrder {
 public:
  using GraphId = uint64_t;

  // Registers a graph whose capture just ended, with its accesses in kernel order. Graphs
  // must be registered in the order they were captured on the pool.
  GraphId add_graph(std::string name, const std::vector<MemoryAccess>& accesses);
  // Forgets a graph (reset): bytes it last wrote become unknown, nothing waits for it.
  void remove_graph(GraphId id);
  void set_name(GraphId id, std::string name);

  // Throws GraphStateError when replaying `id` now would read overwritten data or
  // overwrite data another graph still needs. Changes nothing.
  void check_replay(GraphId id) const;
  // check_replay() of each of `ids`, the graphs about to replay in this order, before any
  // of them runs: one refusal, nothing replayed. Note [A checked run of consecutive
  // captures]: when the ids are consecutive (captured one after the other on this pool) and
  // every check passed, each one's check at its own replay cannot fail, so check_replay()
  // of each returns at once while they replay in this order and nothing else changes the
  // pool in between (any other replay, capture, removal or abandon ends that).
  void check_sequence(const std::vector<GraphId>& ids);
  // Ends a run check_sequence() armed (a replay of it failed): every later replay is
  // checked in full.
  void end_sequence();
  // Records that `id` was replayed.
  void replayed(GraphId id);
  // The data `writer` last wrote for `reader` will never be read (a forward replayed
  // without grad, or whose outputs were dropped before their backward): it no longer
  // holds back other graphs' writes.
  void abandon(GraphId writer, GraphId reader);
  // Test-only: with false, check_replay() lets every order through, so a test can show
  // the corruption the checks prevent (the negative control of SPEC C6).
  void set_enforced(bool on);
  // Test-only: how many byte pieces the pending reads' cover holds (pieces no read covers
  // any more included, until they are dropped).
  size_t num_cover_pieces() const;

 private:
  struct Range {
    uintptr_t begin, end;
    GraphId graph;  // the writer (expectations) or the reader (needs)
  };
  struct GraphInfo {
    std::string name;
    // All three coalesced (sorted; touching ranges of one graph joined), so the checks of a
    // replay cost about the number of separate pool blocks, not of kernels or tensors.
    std::vector<Range> expects;  // bytes read before written, and their capture-time writer
    std::vector<std::pair<uintptr_t, uintptr_t>> writes;
    std::vector<Range> readers;  // graphs reading this graph's data, per range
    bool alive = true;
  };
  // Interval map: start -> (end, graph), non-overlapping.
  using Intervals = std::map<uintptr_t, std::pair<uintptr_t, GraphId>>;
  static void assign(Intervals& map, uintptr_t begin, uintptr_t end, GraphId g);
  static std::vector<Range> query(const Intervals& map, uintptr_t begin, uintptr_t end);
  // The first piece of [begin, end) whose graph is not `g` (a graph, not 0), as query()
  // would list it (graph 0: bytes nobody wrote); false when every byte is `g`'s. No
  // allocation: a replay's check.
  static bool first_other(const Intervals& map, uintptr_t begin, uintptr_t end, GraphId g, Range* piece);
  static void coalesce(std::vector<Range>& ranges);
  static void coalesce(std::vector<std::pair<uintptr_t, uintptr_t>>& ranges);
  std::string name_of(GraphId g) const;

  // A run armed by check_sequence(): the next id whose check is already done, and the last.
  GraphId run_next_ = 0, run_last_ = 0;
  void end_run() { run_next_ = run_last_ = 0; }
  void check_replay_locked(GraphId id) const;
  mutable std::mutex mu_;
  std::map<GraphId, GraphInfo> graphs_;
  // The live graphs by id (map nodes do not move), so a replay's lookups are one load, not
  // a tree walk that misses the cache at every level after a large replay.
  std::vector<GraphInfo*> by_id_;
  GraphInfo& info(GraphId id) const;
  GraphId next_id_ = 1;
  bool enforced_ = true;
  Intervals captured_writer_;  // capture-time simulation
  Intervals replay_writer_;    // who really wrote each range last
  // Data a replay wrote that a reader still has to read (Note [Pending reads indexed by
  // bytes]): each read once, with its range; by graph (writer or reader) for the drops; and
  // how many live reads cover each byte piece, for the checks.
  struct PendingRead {
    uintptr_t begin, end;
    GraphId writer, reader;
    bool live;
  };
  using Cover = std::map<uintptr_t, std::pair<uintptr_t, int64_t>>;  // start -> (end, reads), non-overlapping
  static Cover::iterator split_at(Cover& map, uintptr_t at);
  // Adds `delta` reads over [begin, end); pieces that fall to zero stay until
  // drop_uncovered() (run at a compaction of the reads once they are many).
  static void cover(Cover& map, uintptr_t begin, uintptr_t end, int64_t delta);
  static void drop_uncovered(Cover& map);
  void add_pending(uintptr_t begin, uintptr_t end, GraphId writer, GraphId reader);
  // Drops the live reads of `g` (as writer or reader) that `drop` selects.
  template <class Drop>
  void drop_pending(GraphId g, Drop drop);
  // Renumbers the live reads once the dead ones outnumber them (slots are never reused, so
  // a graph's list never holds one slot twice).
  void compact_reads();
  std::vector<PendingRead> reads_;
  size_t dead_reads_ = 0;
  size_t peak_live_reads_ = 0;  // the most live reads lately (fading at each compaction)
  // Slots where the graph is writer or reader, indexed by GraphId (ids are dense: one per
  // graph ever added), so a replay finds its reads without a tree walk.
  std::vector<std::vector<size_t>> reads_of_;
  std::vector<uint64_t> compacted_at_;  // per id: the compaction that renumbered its list
  std::vector<size_t> renumber_;        // compact_reads()' scratch: new slot per old one,
  std::vector<GraphId> parties_;        // and the graphs whose lists it renumbers
  uint64_t compaction_ = 0;
  std::vector<size_t>* reads_of(GraphId g) { return g < reads_of_.size() ? &reads_of_[g] : nullptr; }
  const std::vector<size_t>* reads_of(GraphId g) const { return g < reads_of_.size() ? &reads_of_[g] : nullptr; }
  Cover cover_;
};

}  // namespace dwgraph::graphs
