#pragma once
// Records the dispatcher calls of a capture region (dwgraph::graphs::detail).
//
// Note [How the host graph sees kernels]: a boxed fallback is registered for the mode
// dispatch key TESTING_ONLY_GenericMode, which sits above autograd, the Python key and
// every backend key. While a capture is active the capturing thread includes that key in
// its thread-local dispatch set (autograd's worker state inherits it), so every
// top-level dispatcher call of the region, from C++ or Python, forward or backward,
// ATen or torch.ops.dwgraph, reaches the fallback first. The fallback records the
// operator and its arguments (tensors as storage + geometry), redispatches with the key
// excluded (so calls nested inside the kernel are not recorded twice) and records which
// outputs are fresh and which alias an input. CompositeImplicitAutograd operators are not
// recorded themselves: they pass through with the key still active, so the calls they
// decompose into are recorded instead, because autograd saves the intermediates of that
// decomposition (layer_norm's mean and rstd) and replay must rewrite them too. RecordFunction observers were rejected:
// they miss inputs of several ops and never see autograd's backward kernels.
//
// The same recorder fills the ledger of a CUDA capture (which CUDA replays natively).

#include "allocator/ledger.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph::graphs::detail {

// A tensor as the capture saw it: which storage, where in it, what shape.
struct TensorSlot {
  bool defined = false;
  size_t entry = 0;  // ledger entry of its storage
  int64_t storage_offset = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Device device = c10::Device(c10::kCPU);
  bool no_memory = false;  // a storage of zero bytes
};

// One argument or return of a recorded call.
struct ValueSlot {
  enum class Kind { kOther, kTensor, kOptionalTensor, kTensorList, kOptionalTensorList };
  Kind kind = Kind::kOther;
  c10::IValue other;               // kOther: the value itself
  std::vector<TensorSlot> tensors; // one per tensor (undefined for None)
  std::vector<bool> fresh;         // returns: the tensor was not an alias of an input
  bool written = false;            // arguments: the schema says the kernel writes it
};

struct OpRecord {
  c10::OperatorHandle op;
  std::vector<ValueSlot> args;
  std::vector<ValueSlot> returns;
  bool skip_at_replay = false;  // views and allocations: no kernel to re-run
};

class Recorder {
 public:
  // `owned(data)` says a data pointer is a block of the graph's pool. With `execute`,
  // the calls run during capture (host); the pre-capture contents of every non-owned
  // storage a call writes are saved first so restore_caller_writes() can undo them.
  Recorder(allocator::Ledger& ledger, std::function<bool(const void*)> owned, bool execute);

  void on_call(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

  // Puts back the pre-capture contents of non-owned storages the capture wrote.
  void restore_caller_writes();
  std::vector<OpRecord> take_records() { return std::move(records_); }
  size_t num_records() const { return records_.size(); }

 private:
  ValueSlot slot_for(const c10::IValue& v);
  TensorSlot tensor_slot(const at::Tensor& t);
  void snapshot_if_caller(const TensorSlot& s, const at::Tensor& t);

  allocator::Ledger& ledger_;
  std::function<bool(const void*)> owned_;
  bool execute_;
  std::vector<OpRecord> records_;
  std::map<size_t, std::pair<c10::Storage, std::vector<uint8_t>>> snapshots_;
};

// Raises DanglingCaptureError, naming the first recorded call that touches it, when a
// storage the graph does not own has been released (or reallocated) by its owner.
void check_ledger(const allocator::Ledger& ledger, const std::vector<OpRecord>& records,
                  const char* backend);

// While alive, the calling thread's dispatcher calls are recorded by `rec`.
class RecordingGuard {
 public:
  explicit RecordingGuard(Recorder* rec);
  ~RecordingGuard();
  RecordingGuard(const RecordingGuard&) = delete;
  RecordingGuard& operator=(const RecordingGuard&) = delete;

 private:
  Recorder* previous_;
  c10::impl::IncludeDispatchKeyGuard include_;
};

// The recorder of the calling thread, or null.
Recorder* current_recorder();

}  // namespace dwgraph::graphs::detail
