#include "ops/wgrad_store.h"

#include "common/check.h"

#include <algorithm>
#include <atomic>

namespace dwgraph::ops {

namespace {
std::atomic<size_t> g_queued_units{0};
std::atomic<size_t> g_stores_with_hooks{0};
std::mutex g_recordings_mu;
std::vector<HookRunRecording*> g_recordings;  // Note [Hook runs a capture saw]
}  // namespace

HookRunRecording::HookRunRecording(std::vector<const WgradStore*> stores) : stores_(std::move(stores)) {
  std::sort(stores_.begin(), stores_.end());
  const std::lock_guard<std::mutex> lock(g_recordings_mu);
  for (auto* r : g_recordings) {
    for (const WgradStore* s : stores_) {
      if (r->owns(s)) r->ambiguous_ = ambiguous_ = true;
    }
  }
  g_recordings.push_back(this);
}

bool HookRunRecording::owns(const WgradStore* s) const { return std::binary_search(stores_.begin(), stores_.end(), s); }

HookRunRecording::~HookRunRecording() {
  const std::lock_guard<std::mutex> lock(g_recordings_mu);
  g_recordings.erase(std::remove(g_recordings.begin(), g_recordings.end(), this), g_recordings.end());
}

std::optional<std::vector<const WgradStore*>> HookRunRecording::take() {
  const std::lock_guard<std::mutex> lock(g_recordings_mu);
  if (ambiguous_) return std::nullopt;
  return std::move(runs_);
}

void WgradStore::note_hook_run() const {
  const std::lock_guard<std::mutex> lock(g_recordings_mu);
  for (auto* r : g_recordings) {
    if (r->owns(this)) r->runs_.push_back(this);
  }
}

uint64_t next_wgrad_sequences(size_t n) {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
}

uint64_t next_wgrad_sequence() { return next_wgrad_sequences(1); }

void GraphedArm::arm_all(uint64_t first) {
  base.store(first, std::memory_order_relaxed);
  all.store(true, std::memory_order_relaxed);
  epoch.fetch_add(1, std::memory_order_acq_rel);  // publishes both; voids every unit's own state
}

void GraphedArm::disarm_all() {
  all.store(false, std::memory_order_relaxed);
  epoch.fetch_add(1, std::memory_order_acq_rel);
}

bool GraphedUnit::own_now() const {
  return !arm_ || own_epoch_.load(std::memory_order_acquire) == arm_->epoch.load(std::memory_order_acquire);
}

bool GraphedUnit::pending() const {
  if (own_now()) return own_pending_.load(std::memory_order_acquire);
  return arm_->all.load(std::memory_order_acquire);
}

uint64_t GraphedUnit::sequence() const {
  if (own_now()) return own_sequence_.load(std::memory_order_acquire);
  return arm_->base.load(std::memory_order_acquire) + index_;
}

void GraphedUnit::set_own(bool pending, uint64_t sequence) {
  own_pending_.store(pending, std::memory_order_relaxed);
  own_sequence_.store(sequence, std::memory_order_relaxed);
  own_epoch_.store(arm_ ? arm_->epoch.load(std::memory_order_acquire) : 0, std::memory_order_release);
}

size_t num_queued_units_anywhere() { return g_queued_units.load(std::memory_order_acquire); }
size_t num_stores_with_hooks() { return g_stores_with_hooks.load(std::memory_order_acquire); }

uint64_t WgradStore::new_unit_id() {
  const std::lock_guard<std::mutex> lock(mu_);
  return next_id_++;
}

void WgradStore::push(uint64_t unit_id, const void* source, Work work, Work check, Work stale) {
  const std::lock_guard<std::mutex> lock(mu_);
  for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
    if (it->id != unit_id) continue;
    if (std::find(it->sources.begin(), it->sources.end(), source) != it->sources.end()) break;
    it->sources.push_back(source);
    it->work.push_back(std::move(work));
    if (check) it->checks.push_back(std::move(check));
    if (stale) it->stale.push_back(std::move(stale));
    return;
  }
  Unit unit{unit_id, next_wgrad_sequence(), {source}, {}, {}, {}};
  unit.work.push_back(std::move(work));
  if (check) unit.checks.push_back(std::move(check));
  if (stale) unit.stale.push_back(std::move(stale));
  units_.push_back(std::move(unit));
  count_units(1);
}

void WgradStore::run_oldest(const std::string& owner) {
  Unit unit;
  std::vector<Work> checks, stale;
  std::shared_ptr<GraphedUnit> graphed;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    // Note [Graphed units]: FIFO across this store's eager units and its units pending in
    // graphs (of every pipeline slot), by the sequence of the backward that queued them.
    if (captures_ == 0) {
      for (const auto& w : graphed_units_) {
        auto u = w.lock();
        if (!u || !u->pending()) continue;
        if (!graphed || u->sequence() < graphed->sequence()) {
          graphed = std::move(u);
        }
      }
    }
    if (graphed && !units_.empty() && units_.front().sequence < graphed->sequence()) {
      graphed.reset();  // an older eager unit lands first
    }
    if (graphed) {
      DWGRAPH_CHECK_STATE(static_cast<bool>(graphed->land), owner, ".backward_dw(): its oldest deferred unit waits in the "
                          "graphs of ", graphed->owner, ", inside another module whose backward_dw() the graphs "
                          "replace; expected that module's unit to land with the callable: call that callable's "
                          "backward_dw()");
    } else {
      DWGRAPH_CHECK_STATE(!units_.empty(), owner,
                          ".backward_dw(): no deferred weight-gradient work is queued; expected "
                          "one unit per backward (delay_wgrad_compute=True), got 0 queued units",
                          graph_owner_.empty() ? std::string()
                                               : " (none pending in the graphs of " + graph_owner_ + " either)");
      checks = units_.front().checks;
      stale = units_.front().stale;
    }
  }
  if (graphed) {
    graphed->land();  // outside the lock: it replays and hands off (the manager decides)
    return;
  }
  // Outside the lock (they may call Python).
  for (auto& c : checks) c();  // a failure leaves the unit queued
  try {
    for (auto& c : stale) c();
  } catch (...) {
    const std::lock_guard<std::mutex> lock(mu_);
    if (!units_.empty()) {
      units_.pop_front();  // it can never give eager's result
      count_units(-1);
    }
    throw;
  }
  {
    const std::lock_guard<std::mutex> lock(mu_);
    DWGRAPH_CHECK_STATE(!units_.empty(), owner, ".backward_dw(): its queued unit was taken by another thread");
    unit = std::move(units_.front());
    units_.pop_front();
    count_units(-1);
  }
  // Outside the lock: the work may run user code (hooks of distributed weights).
  for (auto& w : unit.work) w();
  const std::lock_guard<std::mutex> lock(mu_);
  if (retain_consumed_) consumed_.push_back(std::move(unit));
}

void WgradStore::set_retain_consumed(bool on) {
  const std::lock_guard<std::mutex> lock(mu_);
  retain_consumed_ = on;
}

void WgradStore::release_consumed() {
  std::vector<Unit> drop;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    drop.swap(consumed_);
  }
}

size_t WgradStore::num_units() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return units_.size();
}

std::vector<std::vector<const void*>> WgradStore::unit_sources(size_t from) const {
  const std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::vector<const void*>> out;
  for (size_t i = from; i < units_.size(); ++i) out.push_back(units_[i].sources);
  return out;
}

void WgradStore::add_graphed_unit(const std::shared_ptr<GraphedUnit>& unit) {
  const std::lock_guard<std::mutex> lock(mu_);
  graphed_units_.erase(std::remove_if(graphed_units_.begin(), graphed_units_.end(),
                                      [](const std::weak_ptr<GraphedUnit>& w) { return w.expired(); }),
                       graphed_units_.end());
  graphed_units_.push_back(unit);
}

void WgradStore::add_graph_lost(size_t n) {
  const std::lock_guard<std::mutex> lock(mu_);
  graph_lost_ += n;
}

size_t WgradStore::num_graph_lost() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return graph_lost_;
}

size_t WgradStore::num_graph_pending() const {
  const std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& w : graphed_units_) {
    if (auto u = w.lock()) n += u->pending() ? 1 : 0;
  }
  return n;
}

std::optional<uint64_t> WgradStore::oldest_unit_id() const {
  const std::lock_guard<std::mutex> lock(mu_);
  if (units_.empty()) return std::nullopt;
  return units_.front().id;
}

uint64_t WgradStore::peek_next_unit_id() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return next_id_;
}

void WgradStore::set_num_hooks(size_t n) {
  const size_t before = num_hooks_.exchange(n, std::memory_order_acq_rel);
  if ((before == 0) != (n == 0)) {
    if (n == 0) {
      g_stores_with_hooks.fetch_sub(1, std::memory_order_acq_rel);
    } else {
      g_stores_with_hooks.fetch_add(1, std::memory_order_acq_rel);
    }
  }
}
size_t WgradStore::num_hooks() const { return num_hooks_.load(std::memory_order_acquire); }

void WgradStore::count_units(std::ptrdiff_t delta) {
  g_queued_units.fetch_add(static_cast<size_t>(delta), std::memory_order_acq_rel);
}

WgradStore::~WgradStore() {
  count_units(-static_cast<std::ptrdiff_t>(units_.size()));
  if (num_hooks_.load(std::memory_order_acquire) != 0) g_stores_with_hooks.fetch_sub(1, std::memory_order_acq_rel);
}

std::optional<uint64_t> WgradStore::oldest_sequence() const {
  const std::lock_guard<std::mutex> lock(mu_);
  if (units_.empty()) return std::nullopt;
  return units_.front().sequence;
}

std::unique_ptr<WgradStore::Stash> WgradStore::take_queued() {
  auto stash = std::make_unique<Stash>();
  const std::lock_guard<std::mutex> lock(mu_);
  stash->units.swap(units_);
  count_units(-static_cast<std::ptrdiff_t>(stash->units.size()));
  stash->consumed.swap(consumed_);
  stash->retain_consumed = retain_consumed_;
  ++captures_;
  return stash;
}

void WgradStore::restore_queued(std::unique_ptr<Stash> stash) {
  std::deque<Unit> drop_units;
  std::vector<Unit> drop_consumed;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    drop_units.swap(units_);
    count_units(-static_cast<std::ptrdiff_t>(drop_units.size()));
    drop_consumed.swap(consumed_);
    if (captures_ > 0) --captures_;
    if (stash) {
      units_.swap(stash->units);
      count_units(static_cast<std::ptrdiff_t>(units_.size()));
      consumed_.swap(stash->consumed);
      retain_consumed_ = stash->retain_consumed;
    }
  }
  // The dropped closures free their tensors outside the lock.
}

void WgradStore::set_graph_owner(std::string owner) {
  const std::lock_guard<std::mutex> lock(mu_);
  graph_owner_ = std::move(owner);
}

void WgradStore::suppress_hooks(bool on) {
  const std::lock_guard<std::mutex> lock(mu_);
  hooks_suppressed_ += on ? 1 : -1;
  if (hooks_suppressed_ < 0) hooks_suppressed_ = 0;
}

bool WgradStore::hooks_suppressed() const {
  const std::lock_guard<std::mutex> lock(mu_);
  return hooks_suppressed_ > 0;
}

void WgradStore::clear() {
  std::vector<std::shared_ptr<GraphedUnit>> graphed;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    count_units(-static_cast<std::ptrdiff_t>(units_.size()));
    units_.clear();
    consumed_.clear();
    graph_lost_ = 0;
    for (const auto& w : graphed_units_) {
      auto u = w.lock();
      if (u && u->pending() && u->discard) graphed.push_back(std::move(u));
    }
  }
  // Outside the lock, as land(): the graphs' manager decides (its own lock).
  for (const auto& u : graphed) u->discard();
}

WgradUnits WgradStore::take_after(size_t keep) {
  WgradUnits taken;
  const std::lock_guard<std::mutex> lock(mu_);
  while (units_.size() > keep) {
    Unit& u = units_.back();
    taken.units_.insert(taken.units_.begin(),
                        WgradUnits::Taken{std::move(u.work), std::move(u.checks), std::move(u.stale)});
    units_.pop_back();
    count_units(-1);
  }
  return taken;
}

void WgradUnits::run(const std::string& owner) {
  DWGRAPH_CHECK_STATE(!ran_, owner, ": these weight-gradient units already ran; each microbatch's weight "
                      "step runs once");
  for (auto& unit : units_) {
    for (auto& c : unit.checks) c();
  }
  try {
    for (auto& unit : units_) {
      for (auto& c : unit.stale) c();
    }
  } catch (...) {
    ran_ = true;
    units_.clear();
    throw;
  }
  ran_ = true;
  auto units = std::move(units_);
  units_.clear();
  for (auto& unit : units) {
    for (auto& w : unit.work) w();
  }
}

}  // namespace dwgraph::ops
