#pragma once
// Data-parallel reduction of deferred weight gradients (SPEC C9), namespace
// dwgraph::distributed.
//
// torch's DDP reducer all-reduces a parameter when autograd accumulates its gradient,
// which for a deferred weight is during the main backward, before backward_dw() computes
// it. DataParallelReducer owns those parameters instead (DDP is told to ignore them): each
// module's wgrad hook reports its landing; once a module has nothing left queued and the
// step synchronises, its gradient buffers (.grad, or main_grad when fused) are copied into
// flat buckets, and every bucket whose parameters are all in starts an asynchronous
// all-reduce, in bucket order on every rank, overlapping the remaining weight steps.
// finish() launches what is left, waits, checks that every rank contributed every bucket,
// and writes the averages back.
//
// Note [Agreement flag]: each bucket carries one extra element, 1 when this rank's
// contribution is complete and 0 otherwise (a module whose backward_dw() was skipped, or
// that did not run). finish() launches every bucket on every rank whatever is missing, so
// no rank waits forever for a peer that gave up, and after the wait all ranks see the same
// sum: anything but the world size raises GraphStateError on every rank, before any
// gradient is written.

#include "ops/wgrad_store.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dwgraph::distributed {

struct ReducedParameter {
  at::Tensor param;            // the leaf whose gradient is averaged
  std::string name;            // qualified name, for messages
  bool fused = false;          // reduce the main_grad buffer instead of .grad
  at::ScalarType grad_dtype;   // dtype of the buffer reduced
  std::vector<size_t> owners;  // indices of the modules that land it (tied: several)
};

struct ReducedModule {
  std::string name;
  // The module's deferred-wgrad store; null when it does not defer (its hook runs at the
  // end of each backward).
  std::shared_ptr<ops::WgradStore> store;
  std::vector<size_t> params;  // indices into the reducer's parameters, in hook order
};

class DataParallelReducer {
 public:
  DataParallelReducer(c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<ReducedParameter> params,
                      std::vector<ReducedModule> modules, int64_t bucket_cap_bytes);

  // A forward of the step: `sync` false (inside no_sync()) keeps landings from starting
  // reductions. Throws GraphStateError when the previous step started reducing and was
  // never finished.
  void begin_forward(bool sync);
  // Module `module`'s weight gradients landed; `buffers[i]` is the gradient buffer of its
  // i-th parameter (.grad or main_grad; undefined for None).
  void on_landed(size_t module, const std::vector<at::Tensor>& buffers);
  // Reduces everything landed since the last finish(): `buffers[m]` are module m's current
  // buffers, used for what no hook started. Raises GraphStateError on every rank when a
  // rank's contribution is incomplete, before writing any gradient.
  void finish(const std::vector<std::vector<at::Tensor>>& buffers);
  // Forgets the step (after an exception) without waiting: launched reductions complete
  // into buffers the next step no longer uses.
  void abandon();

  // Something landed or was launched since the last finish().
  bool pending() const;
  // How often each module was marked ready in the last finished step.
  std::vector<int64_t> ready_counts() const;
  size_t num_buckets() const { return buckets_.size(); }
  // Buckets launched so far in the current step.
  size_t num_launched() const;

 private:
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;
    int64_t numel = 0;
    at::Tensor flat;  // numel values, then the agreement flag
    size_t filled = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };

  void fill(size_t p, const at::Tensor& buffer);
  void launch(size_t b, bool complete);
  void launch_ready();
  bool drained(size_t m) const;
  std::string describe_module(size_t m) const;
  void reset_step(bool fresh_buckets = false);

  mutable std::mutex mu_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<ReducedParameter> params_;
  std::vector<ReducedModule> modules_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;  // per parameter
  std::vector<bool> filled_;       // per parameter, this step
  std::vector<bool> landed_;       // per module, since the last finish()
  std::vector<bool> ready_;        // per module, this step
  std::vector<int64_t> ready_count_, last_ready_count_;
  size_t next_launch_ = 0;
  bool sync_ = true;
};

// Every rank passes `ok`; returns how many ranks passed true (one small all-reduce), so
// all ranks can raise together instead of one leaving its peers waiting in a collective.
int64_t count_agreeing(const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool ok, const at::Device& device);

}  // namespace dwgraph::distributed
