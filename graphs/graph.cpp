#include "graphs/graph.h"

#include "common/check.h"
#include "graphs/capture_dispatch.h"
#include "graphs/host_graph.h"
#include "graphs/ledger_check.h"
#include "graphs/recorder.h"

#include <ATen/record_function.h>

#ifdef DWGRAPH_WITH_CUDA
#include "graphs/cuda_graph.h"
#endif

namespace dwgraph::graphs {
namespace {

[[noreturn]] void unsupported_device(const char* api, c10::Device device) {
#ifdef DWGRAPH_WITH_CUDA
  constexpr const char* kSupported = "cpu or cuda";
#else
  constexpr const char* kSupported = "cpu (this build has no CUDA sources)";
#endif
  DWGRAPH_CHECK_ARG(false, api, ": argument 'device' must be ", kSupported, ", got ", device);
  TORCH_INTERNAL_ASSERT(false);
}

}  // namespace

Graph::Graph(c10::Device device) : device_(device) {}

Graph::~Graph() = default;  // backends call capture_abort()/reset() in their destructors

void Graph::set_name(std::string name) {
  name_ = std::move(name);
  profiler_name_ = name_.empty() ? "dwgraph::replay" : "dwgraph::replay " + name_;
  if (order_id_ && pool_) pool_->order().set_name(*order_id_, name_);
}

void Graph::capture_begin(std::shared_ptr<GraphPool> pool) {
  DWGRAPH_CHECK_STATE(!is_capturing(), "dwgraph graph: capture_begin() while already capturing");
  DWGRAPH_CHECK_STATE(!captured_, "dwgraph graph: capture_begin() on a graph that holds a capture; reset() it first");
  pool_ = adopt_pool(std::move(pool));
  recorder_ = make_recorder();
  recorder_->set_pool(pool_.get());
  recorder_->host_calls().refuse_after = refuse_after_;
  try {
    begin_backend();
    recording_ = std::make_unique<detail::ActiveRecording>(recorder_.get(), claim());
  } catch (...) {
    capture_abort();
    throw;
  }
}

void Graph::capture_end() {
  DWGRAPH_CHECK_STATE(is_capturing(), "dwgraph graph: capture_end() without capture_begin()");
  recording_.reset();
  try {
    end_backend();
    records_ = recorder_->take_records();
    version_changes_ = recorder_->version_changes();
    host_calls_ = std::move(recorder_->host_calls());
    recorder_.reset();
    check_fills_not_written();
    after_capture();
    order_id_ = pool_->order().add_graph(name_, detail::pool_accesses(ledger_, records_));
  } catch (...) {
    capture_abort();
    throw;
  }
  captured_ = true;
}

void Graph::check_fills_not_written() {
  auto filled = std::move(host_calls_.filled_from);
  host_calls_.filled_from.clear();
  for (const auto& [storage, what] : filled) {
    const auto entry = ledger_.find(storage.data());
    DWGRAPH_CHECK_ARG(!entry || !detail::record_touches(records_, *entry, /*writes_only=*/true), "dwgraph graph: ",
                      name_.empty() ? "the captured region" : name_, " writes ", what,
                      " in place, whose value a host call gathers before each replay (Note [Host work around a "
                      "replay]); the replay would use the value from before that write, where eager code gathers "
                      "after it. Make the write outside the graphed region (before the call, or in the optimizer "
                      "step)");
  }
}

void Graph::capture_abort() noexcept {
  recording_.reset();
  if (recorder_) abort_backend();
  recorder_.reset();
  reset();
}

void Graph::check_live() const {
  DWGRAPH_CHECK_STATE(captured_, "dwgraph graph: replay() of ", name_.empty() ? "a graph" : name_,
                      " with no capture (", is_capturing() ? "still capturing" : "never captured or reset", ")");
  detail::check_ledger(ledger_, records_, device_.is_cuda() ? "CUDA graph" : "host graph");
}

void Graph::check_replay() const {
  check_live();
  pool_->order().check_replay(*order_id_);
}

void Graph::check_run(const std::vector<const Graph*>& run) {
  for (const Graph* g : run) g->check_live();
  bool one_pool = true;
  for (const Graph* g : run) one_pool = one_pool && g->pool_ == run.front()->pool_;
  if (!one_pool) {
    for (const Graph* g : run) g->pool_->order().check_replay(*g->order_id_);
    return;
  }
  // Kept between runs (no allocation per backward_dw() of many parts); nothing below runs
  // caller code, so no run of this thread can start inside another.
  thread_local std::vector<PoolOrder::GraphId> ids;
  ids.clear();
  for (const Graph* g : run) ids.push_back(*g->order_id_);
  if (!run.empty()) run.front()->pool_->order().check_sequence(ids);
}

void Graph::replay() {
  if (!captured_) check_live();  // refuses, saying why (no pool before a capture)
  const std::shared_ptr<GraphPool> pool = pool_;  // a host call may reset() this graph
  const PoolUse::Scope in_use(pool->use(), name_);  // Note [One thread at a time on a pool]
  check_replay();
  try {
    for (const auto& fn : host_calls_.before) fn();
    // A profiler range per replay, named after the graph (torch.profiler; an NVTX range
    // under torch.autograd.profiler.emit_nvtx): the replayed kernels show which graph they
    // belong to.
    RECORD_USER_SCOPE(profiler_name_.c_str());
    launch();
  } catch (...) {
    pool_->order().end_sequence();  // a run checked up front does not outlive a failed replay
    throw;
  }
  pool_->order().replayed(*order_id_);
  for (auto& [counter, by] : version_changes_) counter.set_version(counter.current_version() + by);
  for (const auto& fn : host_calls_.after) fn();
}

void Graph::abandon_for(const Graph& reader) {
  if (order_id_ && reader.order_id_ && pool_) pool_->order().abandon(*order_id_, *reader.order_id_);
}

void Graph::reset() noexcept {
  release_backend();
  if (order_id_ && pool_) pool_->order().remove_graph(*order_id_);
  order_id_.reset();
  records_.clear();
  version_changes_.clear();
  ledger_.clear();
  host_calls_ = detail::HostCalls();
  pool_.reset();
  captured_ = false;
}

size_t Graph::num_kernels() const {
  size_t n = 0;
  for (const auto& r : records_) n += r.skip_at_replay ? 0 : 1;
  return n;
}

std::vector<std::string> Graph::recorded_calls() const { return detail::describe_records(records_); }

std::vector<StorageInfo> Graph::storages() const {
  std::vector<StorageInfo> out;
  for (size_t i = 0; i < ledger_.size(); ++i) {
    const auto& e = ledger_.entry(i);
    const bool alive = e.ownership == allocator::Ownership::kGraph || ledger_.lock(i).has_value();
    out.push_back(StorageInfo{e.ownership, e.nbytes, e.role, alive});
  }
  return out;
}

void Graph::mark_pool_block(const c10::Storage& storage) { ledger_.mark_owned(storage); }

void Graph::set_role(const c10::Storage& storage, const std::string& role, bool persistent) {
  ledger_.set_role(storage, role, persistent);
}

bool Graph::writes(const c10::Storage& storage) const {
  const auto entry = ledger_.find(storage.data());
  return entry && detail::record_touches(records_, *entry, /*writes_only=*/true);
}

bool Graph::touches(const c10::Storage& storage) const {
  const auto entry = ledger_.find(storage.data());
  return entry && detail::record_touches(records_, *entry, /*writes_only=*/false);
}

std::shared_ptr<GraphPool> make_pool(c10::Device device) {
  if (device.is_cpu()) return std::make_shared<HostGraphPool>();
#ifdef DWGRAPH_WITH_CUDA
  if (device.is_cuda()) return make_cuda_pool(device);
#endif
  unsupported_device("dwgraph.graph_pool_handle", device);
}

std::shared_ptr<GraphPool> pool_from_handle(std::pair<uint64_t, uint64_t> handle) {
#ifdef DWGRAPH_WITH_CUDA
  return make_cuda_pool_from_handle(handle);
#else
  DWGRAPH_CHECK_ARG(false, "dwgraph: argument 'pool' is a torch CUDA pool handle (", handle.first, ", ", handle.second,
                    ") but this build has no CUDA sources; host graphs take dwgraph.graphs.graph_pool_handle('cpu')");
  TORCH_INTERNAL_ASSERT(false);
#endif
}

void run_on_capture_stream(const std::shared_ptr<GraphPool>& pool, const std::function<void()>& fn) {
#ifdef DWGRAPH_WITH_CUDA
  if (pool->device().is_cuda()) {
    run_on_cuda_capture_stream(pool, fn);
    return;
  }
#endif
  fn();
}

std::unique_ptr<Graph> make_graph(c10::Device device) {
  if (device.is_cpu()) return std::make_unique<HostGraph>();
#ifdef DWGRAPH_WITH_CUDA
  if (device.is_cuda()) return make_cuda_graph(device);
#endif
  unsupported_device("dwgraph.Graph", device);
}

}  // namespace dwgraph::graphs
