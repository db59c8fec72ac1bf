#include "graphs/host_graph.h"

#include "common/check.h"
#include "graphs/capture_dispatch.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>


namespace dwgraph::graphs {
namespace {

void no_delete(void*) {}

// Swallows the warnings of an out= call that we are about to discard.
struct WarningCollector final : c10::WarningHandler {
  bool any = false;
  void process(const c10::Warning&) override { any = true; }
};

// The out= overload of `op` whose arguments are op's followed by one mutable tensor per
// tensor return (mm -> mm.out, gelu_backward -> gelu_backward.grad_input), if any.
std::optional<c10::OperatorHandle> out_overload(const c10::OperatorHandle& op) {
  static std::mutex mu;
  static std::unordered_map<std::string, std::vector<c10::OperatorName>>* by_name = nullptr;
  static std::unordered_map<c10::OperatorName, std::optional<c10::OperatorHandle>>* cache = nullptr;
  const std::lock_guard<std::mutex> lock(mu);
  if (by_name == nullptr) {
    by_name = new std::unordered_map<std::string, std::vector<c10::OperatorName>>();
    cache = new std::unordered_map<c10::OperatorName, std::optional<c10::OperatorHandle>>();
    for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) (*by_name)[name.name].push_back(name);
  }
  const auto& schema = op.schema();
  auto hit = cache->find(schema.operator_name());
  if (hit != cache->end()) return hit->second;
  std::optional<c10::OperatorHandle> found;
  const auto& args = schema.arguments();
  const auto& rets = schema.returns();
  const bool all_tensor_returns = !rets.empty() && std::all_of(rets.begin(), rets.end(), [](const c10::Argument& r) {
    return r.type()->kind() == c10::TypeKind::TensorType && r.alias_info() == nullptr;
  });
  auto candidates = by_name->find(schema.name());
  if (all_tensor_returns && candidates != by_name->end()) {
    for (const auto& name : candidates->second) {
      if (name.overload_name == schema.overload_name()) continue;
      auto h = c10::Dispatcher::singleton().findSchema(name);
      if (!h) continue;
      const auto& oargs = h->schema().arguments();
      if (oargs.size() != args.size() + rets.size()) continue;
      bool match = true;
      for (size_t i = 0; i < args.size() && match; ++i) {
        match = oargs[i].name() == args[i].name() && oargs[i].type()->str() == args[i].type()->str();
      }
      for (size_t i = args.size(); i < oargs.size() && match; ++i) {
        const auto* info = oargs[i].alias_info();
        match = oargs[i].type()->kind() == c10::TypeKind::TensorType && info != nullptr && info->isWrite();
      }
      if (match) {
        found = *h;
        break;
      }
    }
  }
  cache->emplace(schema.operator_name(), found);
  return found;
}

}  // namespace

std::unique_ptr<GraphPool::AllocationScope> HostGraphPool::allocation_scope() {
  struct Scope final : AllocationScope {
    explicit Scope(std::shared_ptr<allocator::HostPool> p) : guard(std::move(p)) {}
    allocator::CaptureAllocationGuard guard;
  };
  return std::make_unique<Scope>(pool_);
}

HostGraph::~HostGraph() {
  if (is_capturing()) capture_abort();
  reset();
}

std::shared_ptr<GraphPool> HostGraph::adopt_pool(std::shared_ptr<GraphPool> requested) {
  if (!requested) return std::make_shared<HostGraphPool>();
  DWGRAPH_CHECK_ARG(std::dynamic_pointer_cast<HostGraphPool>(requested) != nullptr,
                    "dwgraph host graph: argument 'pool' must be a host (cpu) pool, got a ", requested->device(),
                    " pool");
  return requested;
}

std::unique_ptr<detail::Recorder> HostGraph::make_recorder() {
  auto hp = static_cast<HostGraphPool&>(*pool_).host_pool();
  auto rec = std::make_unique<detail::Recorder>(
      ledger_, [hp](const void* p) { return hp->owns(p); }, /*execute=*/true,
      [hp](const void* p) { return hp->allocation_serial(p); }, hp->stats().num_allocations);
  rec->probe_pool([hp] { return hp->stats().num_allocations; },
                  [hp](int64_t serial) { return hp->live_serials_since(serial); });
  return rec;
}

std::function<bool()> HostGraph::claim() { return detail::claim_this_thread(); }

void HostGraph::begin_backend() {
  DWGRAPH_CHECK_STATE(!detail::this_thread_records(),
                      "dwgraph host graph: capture_begin() while this thread captures another graph");
  alloc_guard_ = std::make_unique<allocator::CaptureAllocationGuard>(static_cast<HostGraphPool&>(*pool_).host_pool());
}

void HostGraph::end_backend() {
  alloc_guard_.reset();
  recorder_->restore_caller_writes();
  recorder_->check_none_raised("at the end of the captured region");
  recorder_->check_generator_at_end();
  recorder_->check_kernel_internals();
  recorder_->restore_generator();
}

void HostGraph::abort_backend() noexcept {
  alloc_guard_.reset();
  recorder_->restore_caller_writes();
  try {
    recorder_->restore_generator();
  } catch (...) {  // noexcept: an abort never throws (set_state checks the tensor it made)
  }
}

void HostGraph::after_capture() {
  // Non-owning views of the captured memory (see raw_storages_).
  raw_storages_.clear();
  for (size_t i = 0; i < ledger_.size(); ++i) {
    const auto& e = ledger_.entry(i);
    void* data = const_cast<void*>(e.data);
    raw_storages_.emplace_back(c10::Storage::use_byte_size_t(), e.nbytes,
                               c10::DataPtr(data, nullptr, &no_delete, c10::Device(c10::kCPU)),
                               /*allocator=*/nullptr, /*resizable=*/false);
  }
  replay_args_.clear();
  replay_outputs_.clear();
  replay_ops_.clear();
  out_targets_.clear();
  for (size_t r = 0; r < records_.size(); ++r) {
    const auto& rec = records_[r];
    std::vector<c10::IValue> args;
    for (size_t a = 0; a < rec.args.size(); ++a) {
      // The same tensor where the call had one tensor twice (Note [The same tensor twice in
      // a call], recorder.cpp).
      const int64_t same = rec.args[a].same_as;
      args.push_back(same >= 0 ? args.at(static_cast<size_t>(same)) : rebuild(rec.args[a]));
    }
    std::vector<std::pair<size_t, at::Tensor>> outs;
    size_t flat = 0;
    for (const auto& ret : rec.returns) {
      for (size_t k = 0; k < ret.tensors.size(); ++k, ++flat) {
        if (k < ret.fresh.size() && ret.fresh[k]) outs.emplace_back(flat, rebuild(ret.tensors[k]));
      }
    }
    // Every return fresh and defined, and an out= overload: write straight into them.
    std::optional<c10::OperatorHandle> op_out;
    size_t n_tensor_returns = 0;
    bool all_fresh = true;
    for (const auto& ret : rec.returns) {
      n_tensor_returns += ret.kind == detail::ValueSlot::Kind::kTensor ? 1 : 0;
      all_fresh = all_fresh && ret.kind == detail::ValueSlot::Kind::kTensor && !ret.fresh.empty() && ret.fresh[0] &&
                  ret.tensors[0].defined;
    }
    static const bool no_out = std::getenv("DWGRAPH_HOST_GRAPH_NO_OUT_OVERLOADS") != nullptr;
    // A call that also writes an argument (BatchNorm's running statistics) keeps its
    // functional form: its out= overload is another kernel, and torch's
    // native_batch_norm.out normalizes a strided input wrongly (BatchNorm1d over
    // x.transpose(1, 2): 0.8 off eager, helper-47).
    const bool writes_an_argument =
        std::any_of(rec.args.begin(), rec.args.end(), [](const detail::ValueSlot& a) { return a.written; });
    if (!no_out && !rec.skip_at_replay && all_fresh && !writes_an_argument && n_tensor_returns == outs.size()) {
      op_out = out_overload(rec.op);
    }
    std::vector<std::pair<size_t, at::Tensor>> targets;
    if (op_out) {
      for (auto& [index, target] : outs) args.emplace_back(target);
      targets = std::move(outs);
      outs.clear();
    }
    out_targets_.push_back(std::move(targets));
    replay_ops_.push_back(op_out);
    replay_args_.push_back(std::move(args));
    replay_outputs_.push_back(std::move(outs));
  }
}

at::Tensor HostGraph::rebuild(const detail::TensorSlot& s) const {
  if (!s.defined) return at::Tensor();
  auto opts = at::TensorOptions().dtype(s.dtype).device(s.device);
  if (s.no_memory) return at::empty(s.sizes, opts);
  at::Tensor t = at::empty({0}, opts);
  t.set_(raw_storages_.at(s.entry), s.storage_offset, s.sizes, s.strides);
  if (s.wrapped_number) t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

c10::IValue HostGraph::rebuild(const detail::ValueSlot& s) const {
  using Kind = detail::ValueSlot::Kind;
  switch (s.kind) {
    case Kind::kOther:
      return s.other;
    case Kind::kTensor:
    case Kind::kOptionalTensor:
      return s.tensors[0].defined ? c10::IValue(rebuild(s.tensors[0])) : c10::IValue();
    case Kind::kTensorList: {
      c10::List<at::Tensor> list;
      for (const auto& t : s.tensors) list.push_back(rebuild(t));
      return list;
    }
    case Kind::kOptionalTensorList: {
      c10::List<std::optional<at::Tensor>> list;
      for (const auto& t : s.tensors) list.push_back(t.defined ? std::optional<at::Tensor>(rebuild(t)) : std::nullopt);
      return list;
    }
  }
  return c10::IValue();
}

void HostGraph::launch() {
  // Below autograd: the recorded calls are kernels, their autograd was recorded too. Each
  // runs in the grad mode it was captured in (OpRecord::grad_enabled).
  const at::AutoDispatchBelowADInplaceOrView below;
  torch::jit::Stack stack;
  for (size_t r = 0; r < records_.size(); ++r) {
    const auto& rec = records_[r];
    const c10::AutoGradMode grad_mode(rec.grad_enabled);
    // Constants first, even for a call that is not replayed (aten::lift_fresh, the first
    // call to see torch.tensor(...)'s data): later calls read the bytes it met.
    for (const auto& [entry, bytes] : rec.constants) {
      std::memcpy(raw_storages_[entry].mutable_data(), bytes.data(), bytes.size());
    }
    if (rec.skip_at_replay) continue;
    if (replay_ops_[r]) {
      // The out= overload writes straight into the captured outputs, unless it resizes
      // or moves them: then this call and every later one use the functional form.
      bool kept = true;
      WarningCollector warnings;
      try {
        const c10::WarningUtils::WarningHandlerGuard quiet(&warnings);
        stack.assign(replay_args_[r].begin(), replay_args_[r].end());
        replay_ops_[r]->callBoxed(&stack);
        kept = !warnings.any;  // e.g. torch's warning that it resized an output
        for (const auto& [index, target] : out_targets_[r]) {
          const auto& slot = rec.returns[index].tensors[0];
          kept = kept && target.sizes() == c10::IntArrayRef(slot.sizes) &&
                 target.strides() == c10::IntArrayRef(slot.strides) &&
                 target.storage().data() == raw_storages_.at(slot.entry).data();
        }
      } catch (const c10::Error&) {
        kept = false;
      }
      if (kept) continue;
      fall_back_to_functional(r);
    }
    stack.assign(replay_args_[r].begin(), replay_args_[r].end());
    rec.op.callBoxed(&stack);
    if (replay_outputs_[r].empty()) continue;
    // Flatten the returns (tensor lists count one per element) and write fresh outputs
    // into the memory the capture gave them.
    std::vector<at::Tensor> flat;
    for (const auto& v : stack) {
      if (v.isTensor()) {
        flat.push_back(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) flat.push_back(t);
      } else {
        flat.emplace_back();
      }
    }
    for (auto& [index, target] : replay_outputs_[r]) {
      const at::Tensor& result = flat.at(index);
      // A kernel that sizes its output from its inputs' values (found at capture where torch
      // reads them with .item()): copy_ would broadcast a smaller result into the capture's
      // output (a review found one silently wrong, another raising an untyped error).
      DWGRAPH_CHECK_STATE(result.sizes() == target.sizes(), "dwgraph host graph replay: ", rec.op.schema().name(),
                          " returned output ", index, " of shape ", result.sizes(), " where its capture returned ",
                          target.sizes(), ": its output's shape depends on its inputs' values, which a graph cannot "
                          "replay (a CUDA graph cannot capture such a kernel); move it out of the captured region");
      if (result.data_ptr() != target.data_ptr()) target.copy_(result);
    }
  }
}

void HostGraph::fall_back_to_functional(size_t r) {
  const auto& rec = records_[r];
  replay_ops_[r].reset();
  replay_args_[r].resize(rec.args.size());
  std::vector<std::pair<size_t, at::Tensor>> outs;
  for (auto& [index, target] : out_targets_[r]) {
    // The out= call may have changed the target's metadata: rebuild it from the capture.
    outs.emplace_back(index, rebuild(rec.returns[index].tensors[0]));
  }
  replay_outputs_[r] = std::move(outs);
  out_targets_[r].clear();
}

void HostGraph::release_backend() noexcept {
  replay_args_.clear();
  replay_outputs_.clear();
  replay_ops_.clear();
  out_targets_.clear();
  raw_storages_.clear();
}

}  // namespace dwgraph::graphs
