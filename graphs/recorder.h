#pragma once
// Records the dispatcher calls of a capture region (dwgraph::graphs::detail): the capture
// policy. capture_dispatch.h says how calls reach it; ledger_check.h what is checked of the
// records at replay.
//
// Each recorded call keeps its operator and its arguments (tensors as storage + geometry)
// and which outputs are fresh and which alias an input. Calls made by a recorded call's
// autograd layer (autograd saving a clone of self before an in-place op, the pieces a
// CompositeImplicitAutograd operator such as layer_norm decomposes into, whose
// intermediates autograd saves) are recorded too, before it; calls made inside its
// kernels, below autograd, are not. A call whose writes are all made by its recorded
// children is not re-run. RecordFunction observers were rejected: they miss inputs of
// several ops and never see autograd's backward kernels.
//
// The same recorder fills the ledger of a CUDA capture (which CUDA replays natively).

#include "allocator/ledger.h"
#include "graphs/host_calls.h"

#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dwgraph::graphs {
class GraphPool;
}  // namespace dwgraph::graphs

namespace dwgraph::graphs::detail {

// Python's reseeding functions (torch.manual_seed, set_rng_state: what activation
// checkpointing does before recomputing dropout) call this on a capturing thread. A replay
// runs no Python: it draws on from the generator's state, so a capture refuses a kernel
// that draws random numbers after a reseed on its thread.
void note_reseed();

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
  // A Python number wrapped as a 0-dim tensor (x * 2): it takes part in type promotion as
  // a scalar, so the replayed call must see it as one too.
  bool wrapped_number = false;
};

// One argument or return of a recorded call.
struct ValueSlot {
  enum class Kind { kOther, kTensor, kOptionalTensor, kTensorList, kOptionalTensorList };
  Kind kind = Kind::kOther;
  c10::IValue other;               // kOther: the value itself
  std::vector<TensorSlot> tensors; // one per tensor (undefined for None)
  std::vector<bool> fresh;         // returns: the tensor was not an alias of an input
  bool written = false;            // arguments: the schema says the kernel writes it
  int64_t same_as = -1;            // arguments: an earlier argument that was the same tensor
};

// Where the default CPU generator stands: its engine and cached normal samples.
struct GeneratorPosition {
  at::mt19937_data_pod engine{};
  std::optional<float> next_float;
  std::optional<double> next_double;
  bool operator==(const GeneratorPosition& o) const;
};

// What runs a call at autograd's level. Note [Calls in a kernel's body]: kComposite,
// kNoneWithGrad and kPython are bodies of calls the capture sees, calls below autograd
// included; kNone and kFallthrough calls replay whole where their inner calls do not stand
// for them (Note [A kernel's own writes]).
enum class AutogradLayer {
  kNone,         // no autograd kernel: torch's autograd fallback runs the kernel (a custom one)
  kFallthrough,  // a fallthrough autograd kernel: the kernel itself, directly
  kNoneWithGrad, // kNone or kFallthrough run with gradients to compute through its inner calls
  kComposite,    // CompositeImplicitAutograd: its body, made of other calls
  kPython,       // a Python kernel registered for Autograd (custom_op's among them)
  kKernel,       // an ATen or C++ autograd kernel: calls below it are inside kernels
};

// The boxed autograd kernel torch registers for ATen's non-differentiable operators.
const c10::KernelFunction& not_implemented_autograd_kernel();

struct OpRecord {
  c10::OperatorHandle op;
  std::vector<ValueSlot> args;
  std::vector<ValueSlot> returns;
  bool skip_at_replay = false;  // views, allocations, composites replayed by their children
  // Graph-pool bytes this call reads that no recorded kernel wrote (Note [Constants in the
  // pool]): restored just before the call at replay.
  std::vector<std::pair<size_t, std::vector<uint8_t>>> constants;
  // Grad mode when it ran: some kernels branch on it (oneDNN's RNN keeps a training
  // workspace only with grad on), so a replay runs each call in it (below autograd).
  bool grad_enabled = false;
  // The calls this call made are the records from first_child up to it. It ran inside its
  // parent's kernel, below the parent's autograd layer (Note [A kernel's own writes]).
  size_t first_child = 0;
  bool in_parent_kernel = false;
  // Host: the pool's allocation count when it began and when it returned (the blocks its
  // kernel allocated are numbered in between), and the allocation numbers of its constants.
  int64_t allocations_before = 0;
  int64_t allocations_after = 0;
  std::vector<int64_t> constant_serials = {};
  bool below_autograd = false;  // made with autograd's keys excluded (inside a kernel)
};

class Recorder {
 public:
  // `owned(data)` says a data pointer is a block of the graph's pool. With `execute`,
  // the calls run during capture (host); the pre-capture contents of every non-owned
  // storage a call writes are saved first so restore_caller_writes() can undo them.
  // `serial(data)` is the allocation number of the pool block at `data` (0: none) and
  // `first_serial` the first number of this capture: constants are only looked for in
  // blocks allocated during it (earlier captures on the pool hold their outputs), and a
  // block's contents are new whenever its serial changes.
  Recorder(allocator::Ledger& ledger, std::function<bool(const void*)> owned, bool execute,
           std::function<int64_t(const void*)> serial = nullptr, int64_t first_serial = 0);
  // Only storages on `device` enter the ledger (a CUDA capture ignores host scalars,
  // which CUDA bakes into the kernels' arguments).
  void only_device(c10::DeviceType type) { device_type_ = type; }
  // Host: the pool's allocation count now, and the allocation numbers of its live blocks
  // allocated after a given one (Note [A kernel's tensors outlive it]).
  void probe_pool(std::function<int64_t()> allocations, std::function<std::vector<int64_t>(int64_t)> live_since) {
    allocations_ = std::move(allocations);
    live_since_ = std::move(live_since);
  }
  // Host, at capture end: throws if a tensor a replayed call computed inside its kernel,
  // not one of its outputs, is read by a later replayed call or still alive.
  void check_kernel_internals() const;

  // Records `op` with the arguments on `stack`; `redispatch` runs the call itself.
  void on_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& redispatch);

  // Puts back the pre-capture contents of non-owned storages the capture wrote.
  void restore_caller_writes();
  // Host: puts the default CPU generator back where it stood when the capture began.
  void restore_generator();
  // Host: throws unless the default CPU generator is where the recorded kernels left it
  // (see check_generator); called at capture end.
  void check_generator_at_end() { check_generator("at the end of the captured region"); }
  // Host: throws if a recorded call raised and the region went on (see on_call); called
  // before each top-level call and at capture end.
  // `refusals`: also a call refused before it ran (at the region's end; before a later call
  // it may be cleanup while the refusal propagates).
  void check_none_raised(const char* where, bool refusals = true) const;
  // Note [A call that raised]: a refusal made outside the dispatcher (a Python method that
  // reads the host), about to be raised into the region's code.
  void note_refused(const std::string& what) { note_raised(what, "", /*refused=*/true); }
  std::vector<OpRecord> take_records() { return std::move(records_); }
  // Note [Version counters at a replay]: at capture end, the version counter of each caller
  // tensor the region changed (one per tensor and its views), with by how much.
  std::vector<std::pair<c10::VariableVersion, uint32_t>> version_changes() const;
  // Note [Host work around a replay]: what the region hoisted out of the graph, and the
  // pool whose graphs share replay buffers.
  HostCalls& host_calls() { return host_calls_; }
  void set_pool(GraphPool* pool) { pool_ = pool; }
  GraphPool* pool() const { return pool_; }
  size_t num_records() const { return records_.size(); }
  // Note [Calls in a kernel's body]: the innermost recorded call running has no autograd
  // kernel, so calls below autograd inside it are its body's, recorded as its children.
  bool records_calls_below_autograd() const {
    if (frames_.empty()) return false;
    const AutogradLayer layer = frames_.back().layer;
    return layer == AutogradLayer::kComposite || layer == AutogradLayer::kNoneWithGrad ||
           layer == AutogradLayer::kPython;
  }

 private:
  ValueSlot slot_for(const c10::IValue& v);
  TensorSlot tensor_slot(const at::Tensor& t);
  void snapshot_if_caller(const TensorSlot& s, const at::Tensor& t);
  void snapshot_constants(OpRecord& rec, const torch::jit::Stack& stack, size_t base);
  void refuse_draw_after_reseed(const c10::FunctionSchema& schema) const;
  // Note [The generator between kernels]: a replay draws random numbers only through its
  // kernels, from wherever the default generator stands. So between two recorded calls of
  // a host capture (and at its end), the default CPU generator must be exactly where the
  // previous call left it: Python that reseeds, restores (fork_rng, set_state, activation
  // checkpointing's recompute) or draws outside the kernels would be lost at replay.
  void check_generator(const char* where);
  // Reads where the default CPU generator stands; true if it moved since the last read.
  bool advance_generator_mark();
  void note_raised(const std::string& op_name, const char* what, bool refused = false);
  void refuse_uncapturable(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t base) const;
  // The layer that runs `op` with the arguments on `stack` from `base`.
  AutogradLayer autograd_layer(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t base) const;
  std::vector<size_t> written_entries(const OpRecord& rec) const;
  // `writer`: the index of the record that wrote it (-1: a constant, restored at replay).
  void mark_defined(size_t entry, int64_t writer);
  // The record that last wrote the memory the entry holds now (-1: none).
  int64_t last_writer(size_t entry) const;
  bool is_defined(size_t entry) const;
  static void refuse_data_dependent(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                                    size_t base);

  allocator::Ledger& ledger_;
  std::function<bool(const void*)> owned_;
  bool execute_;
  std::function<int64_t(const void*)> serial_;
  std::optional<c10::DeviceType> device_type_;
  int64_t first_serial_ = 0;
  uint64_t reseed_epoch_;  // this thread's reseeds when the capture began
  GeneratorPosition generator_mark_;
  at::Tensor generator_at_begin_;  // host: the default CPU generator's state when the capture began  // host: where the last recorded call began or ended
  int depth_ = 0;               // nesting of recorded calls
  // Per recorded call running: its autograd layer, and whether it drew random numbers in
  // its own kernel, outside its recorded children.
  struct Frame {
    AutogradLayer layer;
    bool drew;
    // Its kernel reads values on the host only to validate them (F.one_hot's label range
    // with num_classes given): a CUDA kernel does not read them, and a replay's kernels
    // still raise for an out-of-range index.
    bool validates_on_host = false;
  };
  std::vector<Frame> frames_;
  // Host: the first recorded call that raised ("" while none did), and its message.
  std::string raised_op_;
  std::string raised_what_;
  bool raised_refused_ = false;  // it was refused before it ran (refuse_uncapturable)
  std::vector<OpRecord> records_;
  HostCalls host_calls_;
  GraphPool* pool_ = nullptr;
  std::map<size_t, std::pair<c10::Storage, std::vector<uint8_t>>> snapshots_;
  // Per ledger entry: the allocation serial of the block when a recorded kernel wrote it.
  std::vector<int64_t> defined_;
  std::function<int64_t()> allocations_;
  // Host, per ledger entry: a hash of the bytes the last call made inside another left in
  // it (Note [A kernel's own writes]).
  std::unordered_map<size_t, uint64_t> child_bytes_;
  std::function<std::vector<int64_t>(int64_t)> live_since_;
  // Per ledger entry: the index of the record that last wrote it (-1: none).
  std::vector<int64_t> writer_;
  // Note [Version counters at a replay]: per tensor a recorded call saw (by the tensor its
  // views share their counter with), its counter, its version then, and its ledger entry.
  struct SeenVersion {
    c10::VariableVersion counter;
    uint32_t version;
    size_t entry;
  };
  std::unordered_map<const c10::TensorImpl*, SeenVersion> seen_versions_;
  void note_version(const at::Tensor& t, size_t entry);
};

}  // namespace dwgraph::graphs::detail
