#pragma once
// The host graph (SPEC C6): CUDA graph semantics on CPU (namespace dwgraph::graphs).
//
// Capture runs the region for real while recording every dispatcher call it makes (Note
// [How the host graph sees kernels] in graphs/capture_dispatch.h); CPU allocations of the
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
  // No graph uses the pool any more: a block a caller kept keeps the pool alive, not its
  // free pages (a replaced first capture's pool, Note [A second capture on a planned pool]).
  ~HostGraphPool() override {
    if (pool_.use_count() > 1) pool_->trim();  // else the pool goes with this, unmapped
  }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  allocator::PoolStats stats() const override { return pool_->stats(); }
  std::unique_ptr<AllocationScope> allocation_scope() override;
  const std::shared_ptr<allocator::HostPool>& host_pool() const { return pool_; }

 private:
  std::shared_ptr<allocator::HostPool> pool_;
};

class HostGraph final : public Graph {
 public:
  HostGraph() : Graph(c10::Device(c10::kCPU)) {}
  ~HostGraph() override;

 protected:
  std::shared_ptr<GraphPool> adopt_pool(std::shared_ptr<GraphPool> requested) override;
  std::unique_ptr<detail::Recorder> make_recorder() override;
  std::function<bool()> claim() override;
  void begin_backend() override;
  void end_backend() override;
  void abort_backend() noexcept override;
  void after_capture() override;
  void launch() override;
  void release_backend() noexcept override;

 private:
  at::Tensor rebuild(const detail::TensorSlot& s) const;
  c10::IValue rebuild(const detail::ValueSlot& s) const;
  void fall_back_to_functional(size_t r);

  std::unique_ptr<allocator::CaptureAllocationGuard> alloc_guard_;
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
  std::vector<std::vector<c10::IValue>> replay_args_;
  std::vector<std::vector<std::pair<size_t, at::Tensor>>> replay_outputs_;  // (flat return index, target)
};

}  // namespace dwgraph::graphs
