#pragma once
// The host graph (SPEC C6): CUDA graph semantics on CPU (namespace dwgraph::graphs).
//
// Capture runs the region for real while recording every dispatcher call it makes (Note
// [How the host graph sees kernels] in graphs/recorder.h); CPU allocations of the
// capturing thread come from the graph's private pool. At capture_end the contents of
// every storage the graph does not own that the region wrote are put back, so capture
// changes nothing the caller sees (on CUDA, captured kernels do not run). Replay re-runs
// exactly the recorded calls, below autograd, on the same memory: in-place and out=
// kernels write where they wrote, fresh outputs are written into the memory the capture
// gave them. Python and C++ side effects of the region are not replayed. Before running
// anything, replay checks through the ledger that every storage it does not own is still
// held by its owner and raises DanglingCaptureError otherwise.

#include "graphs/graph.h"
#include "graphs/recorder.h"

#include "allocator/capture_allocator.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace dwgraph::graphs {

class HostGraphPool final : public GraphPool {
 public:
  HostGraphPool() : pool_(allocator::HostPool::create()) {}
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  allocator::PoolStats stats() const override { return pool_->stats(); }
  const std::shared_ptr<allocator::HostPool>& host_pool() const { return pool_; }

 private:
  std::shared_ptr<allocator::HostPool> pool_;
};

class HostGraph final : public Graph {
 public:
  HostGraph() = default;
  ~HostGraph() override;

  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void capture_begin(std::shared_ptr<GraphPool> pool = nullptr) override;
  void capture_end() override;
  void capture_abort() override;
  void replay() override;
  void reset() noexcept override;

  bool is_captured() const override { return captured_; }
  bool is_capturing() const override { return recorder_ != nullptr; }
  std::shared_ptr<GraphPool> pool() const override { return pool_; }
  size_t num_kernels() const override;
  std::vector<StorageInfo> storages() const override;
  std::vector<std::string> recorded_calls() const override { return detail::describe_records(records_); }
  void set_role(const c10::Storage& storage, const std::string& role, bool persistent) override;

 private:
  void end_capture_mode();
  at::Tensor rebuild(const detail::TensorSlot& s) const;
  c10::IValue rebuild(const detail::ValueSlot& s) const;

  std::shared_ptr<HostGraphPool> pool_;
  allocator::Ledger ledger_;
  std::unique_ptr<detail::Recorder> recorder_;
  std::unique_ptr<allocator::CaptureAllocationGuard> alloc_guard_;
  std::unique_ptr<detail::RecordingGuard> record_guard_;
  std::vector<detail::OpRecord> records_;
  // Non-owning storages over the captured memory, one per ledger entry, so replay never
  // holds (and never revives) the caller's storages; validity comes from the ledger.
  std::vector<c10::Storage> raw_storages_;
  // Per record, its argument values and its fresh-output tensors, built once. When the
  // operator has an out= overload, replay calls that with the captured outputs as `out`
  // (no temporary, no copy) and replay_outputs_ stays empty for the record.
  std::vector<std::optional<c10::OperatorHandle>> replay_ops_;
  // With an out= overload: the outputs as (flat index, target), to fall back to the
  // functional call if the overload turns out to resize or move its outputs (some out=
  // kernels, e.g. reductions of losses, resize `out` to scratch shapes first).
  std::vector<std::vector<std::pair<size_t, at::Tensor>>> out_targets_;
  void fall_back_to_functional(size_t r);
  std::vector<std::vector<c10::IValue>> replay_args_;
  std::vector<std::vector<std::pair<size_t, at::Tensor>>> replay_outputs_;  // (flat return index, target)
  bool captured_ = false;
};

}  // namespace dwgraph::graphs
