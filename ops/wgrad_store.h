#pragma once
// The deferred-wgrad store (SPEC C1): a FIFO of queued weight-gradient work.
//
// A module's backward does not compute its weight gradients; it queues the work (a
// closure holding the tensors it needs) here. All work queued by the backward of one
// forward call forms one *unit*, even when it is queued by several autograd nodes (the
// two GEMMs of LayerNormMLP), so each backward_dw() runs exactly one backward's worth, the
// oldest, as in TransformerEngine.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph::ops {

class WgradUnits;

// A process-wide, increasing number for each backward that queues deferred work: the
// order in which backward_dw() calls must land them.
uint64_t next_wgrad_sequence();
// `n` consecutive numbers at once (the first returned): one backward's units, in order.
uint64_t next_wgrad_sequences(size_t n);

// Units queued in every store of the process (not counting graphs' pending work): when 0,
// no eager unit can be older than a graphed backward, and the FIFO check costs nothing.
size_t num_queued_units_anywhere();
// How many stores (modules) in this process have wgrad hooks now: a landing with no
// hooked module anywhere skips its per-module scan (contract C10).
size_t num_stores_with_hooks();

// Note [Graphed units]: one unit of a store's work that waits in a graph instead of its
// FIFO: a graphed callable's backward-dw part for this module (one per unit one backward
// of the callable queues: a module used twice in the forward has two; graphs/manager_impl.h).
// The graph manager owns it: pending() from the graphed backward that owes the unit
// until the unit lands or is dropped, and sequence() is that backward's place among the
// process's deferred work (next_wgrad_sequence()). The store counts pending units
// (num_graph_pending) and, in run_oldest, lands the oldest of its eager units and pending
// graphed units, so a module's backward_dw() on a graphed callable lands its own part in
// the order eager's FIFO would (across the pipeline slots of the callable too). `land`
// checks, replays that part and hands its gradients over (no hooks: the module's own
// backward_dw() runs them), or throws a typed error having written nothing; null for work
// that lands only with its callable's backward_dw() (a dwgraph module inside another
// library's deferring module, whose own backward_dw() the graphs replace).
//
// Note [Units armed together]: a graphed backward arms every part of its slot at once in
// the common case (every parameter given a gradient), so that arming and disarming them
// costs O(1), not a write per part (contract C10: at 1024 parts those visits, each a cache
// miss after the replays, were most of backward_dw()'s own time). The units of one slot
// share a GraphedArm: while `all` is set, a unit is pending, with sequence base + its
// index, unless it holds a state of its own written in the arm's current epoch (a backward
// that armed only some parts, or a part landed or dropped alone). A new epoch voids every
// state of its own at once. Written by the graph manager under its lock; read by the
// stores (atomics: a read racing a write sees either).
struct GraphedArm {
  std::atomic<uint64_t> epoch{1};
  std::atomic<bool> all{false};
  std::atomic<uint64_t> base{0};
  // Every unit pending, in index order from `first` (next_wgrad_sequences()).
  void arm_all(uint64_t first);
  // No unit pending until each is set on its own (set_own) in the new epoch.
  void disarm_all();
};

struct GraphedUnit {
  GraphedUnit() = default;
  GraphedUnit(std::shared_ptr<GraphedArm> arm, size_t index) : arm_(std::move(arm)), index_(index) {}
  bool pending() const;
  uint64_t sequence() const;  // meaningful while pending()
  // Its own state in the arm's current epoch (a unit without an arm holds only its own).
  void set_own(bool pending, uint64_t sequence);
  std::function<void()> land;
  // Drops it unlanded (discard_wgrad_units(): going on after an aborted step), if still pending.
  std::function<void()> discard;
  std::string owner;  // where the graphs are, for messages ("graphed callable 0 ('Sequential')")

 private:
  bool own_now() const;  // its own state is of the arm's current epoch
  const std::shared_ptr<GraphedArm> arm_;
  const size_t index_ = 0;
  std::atomic<uint64_t> own_epoch_{0};
  std::atomic<bool> own_pending_{false};
  std::atomic<uint64_t> own_sequence_{0};
};

class WgradStore {
 public:
  using Work = std::function<void()>;

  WgradStore() = default;
  ~WgradStore();
  WgradStore(const WgradStore&) = delete;
  WgradStore& operator=(const WgradStore&) = delete;

  // A fresh unit id; a module takes one per forward call and tags its work with it.
  uint64_t new_unit_id();

  // Queues `work` from `source` (the autograd node that computed it) into unit
  // `unit_id`: appended to the newest queued unit of that id that `source` has not yet
  // contributed to (another node of the same backward), otherwise as a new unit at the
  // back (a first node, or a second backward of the same forward with retain_graph).
  // The checks (optional) throw when the work cannot give eager's result now; they all run
  // before any of the unit's work. After a failed `check` the unit stays queued (the caller
  // can undo the cause: a replaced main_grad); after a failed `stale` check it is dropped,
  // since the values it needs are gone for good (its inputs were changed in place).
  void push(uint64_t unit_id, const void* source, Work work, Work check = {}, Work stale = {});

  // Runs the oldest unit's checks, then its work in the order it was queued, then drops
  // the unit. Throws GraphStateError naming `owner` when nothing is queued; a failed check
  // writes nothing.
  void run_oldest(const std::string& owner);

  size_t num_units() const;
  // The autograd nodes that queued each unit from the `from`-th on, oldest first (a graph
  // capture maps its backward-dw parts to the uses of the module that queued them).
  std::vector<std::vector<const void*>> unit_sources(size_t from) const;
  // Units whose work waits in graphs instead (Note [Graphed units]): the pending graphed
  // units registered here (add_graphed_unit, once per part at capture; dead ones are
  // dropped). With num_units() it is everything that must land before an optimizer step.
  void add_graphed_unit(const std::shared_ptr<GraphedUnit>& unit);
  size_t num_graph_pending() const;
  // Graphed backwards whose graphs were released (reset(), the graphed callable dropped)
  // before their backward_dw(): their weight gradients never land. Counted as pending so an
  // optimizer step over them is refused; clear() forgets them.
  void add_graph_lost(size_t n);
  size_t num_graph_lost() const;
  size_t num_pending() const { return num_units() + num_graph_pending() + num_graph_lost(); }
  // Where the oldest queued unit stands among every unit and graphed backward of the
  // process (next_wgrad_sequence()); nullopt when nothing is queued. FIFO across eager
  // units and graphed backwards of one module (contract C1) compares these.
  std::optional<uint64_t> oldest_sequence() const;
  // The id of the oldest queued unit (nullopt when none), and the id the next forward
  // will take: units with ids in [a, b) were queued by the backward of forwards made
  // between two peeks.
  std::optional<uint64_t> oldest_unit_id() const;
  uint64_t peek_next_unit_id() const;
  // While on, run_oldest keeps each consumed unit (and the tensors its closures hold)
  // instead of dropping it, until release_consumed(). The graph manager uses it so the
  // memory a captured backward-dw graph reads stays allocated until every backward-dw
  // graph is captured (SPEC C3).
  void set_retain_consumed(bool on);
  void release_consumed();
  bool empty() const { return num_units() == 0; }
  // Drops every queued unit without running it, and forgets lost graphed ones.
  void clear();
  // Takes every unit after the oldest `keep` out of the FIFO: with `keep` the count before a
  // backward, the units that backward queued. A pipeline schedule runs them at the weight
  // step it chose for that microbatch, whatever else is queued by then.
  WgradUnits take_after(size_t keep);

  // Graph capture must not run (or lose) work the caller queued before it, nor leave
  // work of its own behind: it takes the queued units out first and puts them back, in
  // front of nothing, once it is over (graphs/caller_state.h). Until then run_oldest lands
  // no graphed unit: a capture's backward_dw() runs the units its own backward queued.
  struct Stash;
  std::unique_ptr<Stash> take_queued();
  // Drops what was queued or retained since take_queued() and restores the stash.
  void restore_queued(std::unique_ptr<Stash> stash);

  // Names the graphed callable whose graphs hold this module's deferred work, so a
  // backward_dw() on the module itself says where its work went ("" clears it).
  void set_graph_owner(std::string owner);

  // While suppressed (a counter: nested captures), the module's wgrad hooks must not run:
  // warmup and capture of graphs are not training steps.
  void suppress_hooks(bool on);
  bool hooks_suppressed() const;
  // How many wgrad hooks the module has (its front end keeps it current): a landing calls
  // into the module's hooks only when it has some.
  void set_num_hooks(size_t n);
  size_t num_hooks() const;
  // Its front end met a run of the module's wgrad hooks while they were suppressed (Note
  // [Hook runs a capture saw]). `notes_hook_runs`: the front end does (dwgraph's Python
  // modules, which also note the runs of a layer without deferral whether or not it has
  // hooks); for others which runs a capture met is unknown.
  void note_hook_run() const;
  void set_notes_hook_runs(bool on) { notes_hook_runs_.store(on, std::memory_order_release); }
  bool notes_hook_runs() const { return notes_hook_runs_.load(std::memory_order_acquire); }

 private:
  struct Unit {
    uint64_t id;
    uint64_t sequence;
    std::vector<const void*> sources;
    std::vector<Work> work;
    std::vector<Work> checks;
    std::vector<Work> stale;
  };
  // Keeps num_queued_units_anywhere() in step with units_ (called with mu_ held).
  static void count_units(std::ptrdiff_t delta);

  mutable std::mutex mu_;
  std::deque<Unit> units_;
  std::vector<Unit> consumed_;
  bool retain_consumed_ = false;
  uint64_t next_id_ = 1;
  int hooks_suppressed_ = 0;
  std::atomic<size_t> num_hooks_{0};
  std::atomic<bool> notes_hook_runs_{false};
  mutable std::vector<std::weak_ptr<GraphedUnit>> graphed_units_;
  int captures_ = 0;  // take_queued() without its restore_queued(): graphed units do not land
  size_t graph_lost_ = 0;
  std::string graph_owner_;

 public:
  struct Stash {
    std::deque<Unit> units;
    std::vector<Unit> consumed;
    bool retain_consumed = false;
  };
};

// Units taken out of a store (WgradStore::take_after), run once by their owner.
class WgradUnits {
 public:
  size_t size() const { return units_.size(); }
  // Runs every unit's checks, then every unit in queue order; afterwards nothing is left.
  // Throws GraphStateError naming `owner` when the units already ran; after a failed check
  // they can run again, after a failed stale check they are dropped.
  void run(const std::string& owner);

 private:
  friend class WgradStore;
  struct Taken {
    std::vector<WgradStore::Work> work;
    std::vector<WgradStore::Work> checks;
    std::vector<WgradStore::Work> stale;
  };
  std::vector<Taken> units_;
  bool ran_ = false;
};

// Note [Hook runs a capture saw]: while a recording lives, every run of a module's wgrad
// hooks that its suppression skipped (WgradStore::note_hook_run: the end of a backward that
// reached a layer without deferral, a backward_dw() call) is noted in order. A graph of a
// whole step (graphed_step) runs those modules' hooks as often and in the order its capture
// met them, which is what the same step runs eagerly: once per use of a layer, not for a
// layer the loss does not reach, under no_grad or in another mode; a graphed callable's
// backward runs the hooks of the layers without deferral its capture reached. A recording takes
// the notes of the stores it is given (the step's modules), from any thread (on CUDA a
// backward's hooks run on autograd's device thread). Two recordings at once that share a
// store (two threads capturing steps over one module) cannot tell whose runs are whose:
// take() then returns nothing, and the caller refuses the capture.
class HookRunRecording {
 public:
  explicit HookRunRecording(std::vector<const WgradStore*> stores);
  ~HookRunRecording();
  HookRunRecording(const HookRunRecording&) = delete;
  HookRunRecording& operator=(const HookRunRecording&) = delete;
  // The stores whose hooks ran, in order; nullopt when ambiguous.
  std::optional<std::vector<const WgradStore*>> take();

 private:
  friend class WgradStore;
  std::vector<const WgradStore*> stores_;  // sorted
  std::vector<const WgradStore*> runs_;
  bool ambiguous_ = false;
  bool owns(const WgradStore* s) const;
};

}  // namespace dwgraph::ops
