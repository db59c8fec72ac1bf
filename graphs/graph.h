#pragma once
// One Graph interface, two backends (namespace dwgraph::graphs): the CUDA graph
// (at::cuda::CUDAGraph on a private pool) and the host graph, which follows CUDA graph
// semantics on CPU (SPEC C6). See docs/graphs.md.
//
// Graph owns what both backends share: the recorder of a capture, the ledger (which
// storages the graph owns, which it only borrows), the check of borrowed storages before
// every replay (SPEC C7) and the replay order on the pool (graphs/pool_order.h). Backends
// implement the capture mechanics and the launch.

#include "allocator/host_pool.h"
#include "allocator/ledger.h"
#include "graphs/host_calls.h"
#include "graphs/pool_order.h"
#include "graphs/pool_use.h"

#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph::graphs {

namespace detail {
class Recorder;
class ActiveRecording;
struct OpRecord;
}  // namespace detail

// A buffer graphs refill before their replays (graphs/host_calls.h), while its owner lives.
struct ReplayBuffer {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> owner;
  at::Tensor buffer;
};

// A private memory pool that several graphs can share. A later capture may reuse blocks
// an earlier one freed, so the pool also keeps the order its graphs must replay in
// (Note [Replay order on a shared pool]).
class GraphPool {
 public:
  virtual ~GraphPool() = default;
  virtual c10::Device device() const = 0;
  virtual allocator::PoolStats stats() const = 0;
  // While the returned scope lives, the calling thread's allocations on the pool's device
  // come from this pool (outside any capture): buffers that graphs on the pool share by
  // liveness, as the captures' own allocations do (Note [Slots share the pool by liveness]).
  struct AllocationScope {
    virtual ~AllocationScope() = default;
  };
  virtual std::unique_ptr<AllocationScope> allocation_scope() = 0;
  PoolOrder& order() { return order_; }
  // Note [One thread at a time on a pool].
  PoolUse& use() { return use_; }
  // Note [Host work around a replay]: the buffers its graphs refill before their replays,
  // by (owner, tag).
  std::map<std::pair<const void*, std::string>, ReplayBuffer>& replay_buffers() { return replay_buffers_; }

 private:
  PoolOrder order_;
  PoolUse use_;
  std::map<std::pair<const void*, std::string>, ReplayBuffer> replay_buffers_;
};

struct StorageInfo {
  allocator::Ownership ownership;
  size_t nbytes;
  std::string role;
  bool alive;  // for storages the graph does not own: is the owner still holding it
};

class Graph {
 public:
  virtual ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  c10::Device device() const { return device_; }
  // Names the graph in error messages ("forward graph of graphed callable 0 ('Linear')").
  void set_name(std::string name);
  const std::string& name() const { return name_; }

  // Starts capturing the region (on CUDA: the work of the capture stream, whichever
  // thread issues it; on the host: the calling thread's). `pool` null: a fresh pool.
  void capture_begin(std::shared_ptr<GraphPool> pool = nullptr);
  void capture_end();
  // Abandons a capture whose region raised: no graph, no pool reference, no capture mode.
  void capture_abort() noexcept;
  // Re-runs the capture, between the host work it hoisted (graphs/host_calls.h). Raises
  // DanglingCaptureError when a borrowed storage was released and GraphStateError when the
  // pool's replay order forbids it, having run nothing.
  void replay();
  // What replay() checks before it runs anything (a capture, a live ledger, the pool's
  // replay order), without running: a caller replaying several graphs checks them all first.
  void check_replay() const;
  // check_replay() of each of `run`, graphs that will replay in this order next (a
  // backward_dw()'s parts), before any runs. On one pool, a run of consecutive captures
  // then skips the pool-order check at each replay: the one done here stands (Note [A
  // checked run of consecutive captures], pool_order.cpp).
  static void check_run(const std::vector<const Graph*>& run);
  // Before capture_begin(): after_replay() inside the capture raises ArgumentError with
  // `why` (a graph that reads what an after-call would write).
  void refuse_after_calls(std::string why) { refuse_after_ = std::move(why); }
  // Host work hoisted out of the capture: run before / after each replay.
  size_t num_before_calls() const { return host_calls_.before.size(); }
  size_t num_after_calls() const { return host_calls_.after.size(); }
  // What this graph's last replay wrote for `reader` will not be read (graphs/pool_order.h).
  void abandon_for(const Graph& reader);
  // Releases what the capture holds (kernels, pool reference, ledger). Never throws.
  void reset() noexcept;

  bool is_captured() const { return captured_; }
  // Where this graph stands in its pool's replay order (graphs/pool_order.h), once captured.
  std::optional<PoolOrder::GraphId> order_id() const { return order_id_; }
  // Before capture_begin(): `storage` is a block of the pool the capture will use (a
  // buffer allocated in its allocation_scope()), the graph's like the capture's own
  // allocations, with no owner to outlive (the CUDA recorder cannot tell otherwise).
  void mark_pool_block(const c10::Storage& storage);
  bool is_capturing() const { return recorder_ != nullptr; }
  std::shared_ptr<GraphPool> pool() const { return pool_; }
  // Number of captured kernels (dispatcher calls replay re-runs).
  size_t num_kernels() const;
  // The dispatcher calls the capture recorded, in order ("aten::mm", "aten::t [skipped]").
  std::vector<std::string> recorded_calls() const;
  // The storages the capture touched, with their ownership.
  std::vector<StorageInfo> storages() const;
  // Names a storage for error messages; `persistent` marks parameters and main_grad.
  void set_role(const c10::Storage& storage, const std::string& role, bool persistent);
  // True when a kernel of the capture writes (part of) `storage`.
  bool writes(const c10::Storage& storage) const;
  // True when a kernel of the capture reads or writes (part of) `storage`.
  bool touches(const c10::Storage& storage) const;

 protected:
  explicit Graph(c10::Device device);

  // The backend's pool for `requested` (null: a fresh one); throws for a foreign pool.
  virtual std::shared_ptr<GraphPool> adopt_pool(std::shared_ptr<GraphPool> requested) = 0;
  virtual std::unique_ptr<detail::Recorder> make_recorder() = 0;
  // Which dispatcher calls belong to this capture (Note [Captures are found by stream,
  // not by thread] in graphs/capture_dispatch.h).
  virtual std::function<bool()> claim() = 0;
  virtual void begin_backend() = 0;
  virtual void end_backend() = 0;            // may throw: the capture is then aborted
  virtual void abort_backend() noexcept = 0;
  virtual void after_capture() {}            // records_ are final
  virtual void launch() = 0;
  virtual void release_backend() noexcept = 0;

  c10::Device device_;
  std::shared_ptr<GraphPool> pool_;
  allocator::Ledger ledger_;
  std::unique_ptr<detail::Recorder> recorder_;
  std::vector<detail::OpRecord> records_;

 private:
  void check_fills_not_written();
  // A capture, a live ledger: check_replay() less the pool order.
  void check_live() const;

  std::unique_ptr<detail::ActiveRecording> recording_;
  detail::HostCalls host_calls_;
  std::string refuse_after_;
  std::string name_;
  std::string profiler_name_ = "dwgraph::replay";  // the replay's profiler range
  std::optional<PoolOrder::GraphId> order_id_;
  bool captured_ = false;
  // Note [Version counters at a replay] (recorder.cpp): bumped after each replay.
  std::vector<std::pair<c10::VariableVersion, uint32_t>> version_changes_;
};

// A fresh private pool on `device` (CPU: a host arena; CUDA: a PyTorch private pool).
std::shared_ptr<GraphPool> make_pool(c10::Device device);

// A pool over an existing PyTorch private pool (torch.cuda.graph_pool_handle(),
// torch.cuda.MemPool().id) of the current CUDA device, so dwgraph's graphs can share memory
// with torch's. ArgumentError where CUDA is not built or not available.
std::shared_ptr<GraphPool> pool_from_handle(std::pair<uint64_t, uint64_t> handle);

// A graph for `device` (the backend follows the device type).
std::unique_ptr<Graph> make_graph(c10::Device device);

// Runs `fn` where warmup before a capture on `pool` must run: on CUDA on the pool's
// capture stream, which waits for the current stream and is waited for afterwards; on
// the host it just runs `fn`.
void run_on_capture_stream(const std::shared_ptr<GraphPool>& pool, const std::function<void()>& fn);

}  // namespace dwgraph::graphs
