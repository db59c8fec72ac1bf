#pragma once
// One Graph interface, two backends (namespace dwgraph::graphs): the CUDA graph
// (at::cuda::CUDAGraph on a private pool) and the host graph, which follows CUDA graph
// semantics on CPU (SPEC C6). See docs/graphs.md.

#include "allocator/host_pool.h"
#include "allocator/ledger.h"

#include <c10/core/Device.h>
#include <c10/core/Storage.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dwgraph::graphs {

// A private memory pool that several graphs can share. Graphs captured on one pool must
// be replayed in capture order: a later capture may reuse blocks an earlier one freed.
class GraphPool {
 public:
  virtual ~GraphPool() = default;
  virtual c10::Device device() const = 0;
  virtual allocator::PoolStats stats() const = 0;
};

// A fresh private pool on `device` (CPU: a host arena; CUDA: a PyTorch private pool).
std::shared_ptr<GraphPool> make_pool(c10::Device device);

struct StorageInfo {
  allocator::Ownership ownership;
  size_t nbytes;
  std::string role;
  bool alive;  // for storages the graph does not own: is the owner still holding it
};

class Graph {
 public:
  virtual ~Graph() = default;
  virtual c10::Device device() const = 0;

  // Starts capturing the calling thread's work. `pool` null: a fresh private pool.
  virtual void capture_begin(std::shared_ptr<GraphPool> pool = nullptr) = 0;
  virtual void capture_end() = 0;
  // Abandons a capture whose region raised: no graph, no pool reference, no capture mode.
  virtual void capture_abort() = 0;
  virtual void replay() = 0;
  // Releases what the capture holds (kernels, pool reference, ledger). Never throws.
  virtual void reset() noexcept = 0;

  virtual bool is_captured() const = 0;
  virtual bool is_capturing() const = 0;
  virtual std::shared_ptr<GraphPool> pool() const = 0;
  // Number of captured kernels (host: dispatcher calls recorded; CUDA: graph nodes).
  virtual size_t num_kernels() const = 0;
  // The dispatcher calls the capture recorded, in order ("aten::mm", "aten::t [skipped]").
  virtual std::vector<std::string> recorded_calls() const = 0;
  // The storages the capture touched, with their ownership.
  virtual std::vector<StorageInfo> storages() const = 0;
  // Names a storage for error messages; `persistent` marks parameters and main_grad.
  virtual void set_role(const c10::Storage& storage, const std::string& role, bool persistent) = 0;
};

// A graph for `device` (the backend follows the device type).
std::unique_ptr<Graph> make_graph(c10::Device device);

// Runs `fn` on a side stream of `device` that waits for the current stream and is waited
// for afterwards (CUDA), as warmup before capture must; on CPU it just runs `fn`.
void run_on_side_stream(c10::Device device, const std::function<void()>& fn);

}  // namespace dwgraph::graphs
