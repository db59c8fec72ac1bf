#include "graphs/replay_checks.h"

#include "common/check.h"
#include "graphs/graph.h"
#include "graphs/state_epoch.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <unordered_map>

namespace dwgraph::graphs {
namespace {

// Strides matter only along dimensions of more than one element.
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return true;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

}  // namespace

std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.storage().data()) +
                     static_cast<uintptr_t>(t.storage_offset() * static_cast<int64_t>(t.dtype().itemsize()));
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {begin, begin + static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.dtype().itemsize()))};
}

void check_distinct_memory(const std::vector<at::Tensor>& tensors, const std::vector<size_t>& among,
                           const std::string& where, const char* what) {
  auto shares = [&](size_t i, size_t j) {
    const at::Tensor& a = tensors[i];
    const at::Tensor& b = tensors[j];
    if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage()) {
      return false;
    }
    if (a.storage().data() != b.storage().data() && !a.storage().is_alias_of(b.storage())) return false;
    const auto x = byte_span(a), y = byte_span(b);
    return x.first < y.second && y.first < x.second;
  };
  const bool all = among.empty();
  const size_t n = all ? tensors.size() : among.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = all ? k : among[k];
    for (size_t j = 0; j < tensors.size(); ++j) {
      if (j == i || (all && j < i) || !shares(i, j)) continue;
      DWGRAPH_CHECK_ARG(false, where, ": ", what, "s ", std::min(i, j), " and ", std::max(i, j),
                        tensors[i].is_same(tensors[j]) ? " are the same tensor" : " share memory",
                        all ? "" : c10::str(", and the graph writes ", what, " ", i, " in place"),
                        "; a graph copies each argument into its own static input, so a write through one would "
                        "not reach the other as it does in eager code. Pass one tensor and take the views inside "
                        "the callable (or pass copies)");
    }
  }
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "None";
  return c10::str("a ", t.scalar_type(), " tensor of shape ", t.sizes(), " on ", t.device(),
                  t.requires_grad() ? " that requires grad" : "");
}

void check_has_memory(const at::Tensor& t, const char* what) {
  if (!t.defined()) return;
  DWGRAPH_CHECK_STATE(t.layout() == at::kStrided, "dwgraph: ", what, " is a ", t.layout(),
                      " tensor; graphs capture strided tensors only");
  DWGRAPH_CHECK_ARG(!t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python), "dwgraph: ", what, " (",
                    describe(t), ") is a tensor subclass whose operations run in Python (a DTensor: an FSDP2 "
                    "sharded parameter, tensor parallelism); graphs capture plain tensors. Graph FSDP2 modules with "
                    "dwgraph.distributed.FullyShardReducer.make_graphed_callables, which captures their unsharded "
                    "parameters (docs/distributed.md)");
  if (t.numel() == 0 || !t.has_storage()) return;
  const size_t needed = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize(),
                                                         static_cast<size_t>(t.storage_offset()));
  const size_t held = t.storage().nbytes();
  DWGRAPH_CHECK_STATE(held >= needed, "dwgraph: ", what, " (", describe(t), ") has no memory: its storage holds ", held,
                      " of the ", needed, " bytes it views. Its owner frees it between uses (as FSDP2 does with "
                      "unsharded parameters), so a graph would read and write freed memory. Graph FSDP2 modules "
                      "with dwgraph.distributed.FullyShardReducer.make_graphed_callables (it keeps their unsharded "
                      "storage); graphed_step runs no FSDP2 model (docs/distributed.md)");
}

CapturedParameters::CapturedParameters(std::vector<std::string> names, std::vector<at::Tensor> params,
                                       std::function<NamedTensors()> current, std::string kind)
    : names_(std::move(names)), params_(std::move(params)), current_(std::move(current)), kind_(std::move(kind)) {
  TORCH_INTERNAL_ASSERT(names_.size() == params_.size());
  for (const auto& p : params_) {
    requires_grad_.push_back(p.requires_grad());
    data_.push_back(p.data_ptr());
    sizes_.push_back(p.sizes().vec());
    strides_.push_back(p.strides().vec());
  }
  registrations_seen_ = registration_epoch();
}

void CapturedParameters::watch_slots(std::function<NamedTensors()> registered) {
  registered_ = std::move(registered);
  slots_.clear();
  if (!registered_) return;
  for (const auto& [name, t] : registered_()) slots_.emplace_back(name, t.unsafeGetTensorImpl());
}

void CapturedParameters::check(const std::string& where) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    DWGRAPH_CHECK_STATE(p.requires_grad() == requires_grad_[i], where, ": ", kind_, " '", names_[i], "' ",
                        requires_grad_[i] ? "no longer requires" : "now requires",
                        " grad, so the graphs would give gradients to other parameters than eager code would; "
                        "reset() and capture again after freezing or unfreezing parameters");
    DWGRAPH_CHECK_STATE(p.data_ptr() == data_[i], where, ": ", kind_, " '", names_[i],
                        "' was reallocated since capture (its data moved); the graphs would use the old memory. "
                        "Update parameters in place, or reset() and capture again");
    // The same memory seen through other sizes or strides (`.data = p.t()`, `t_()`): the
    // graphs' kernels would read it with the captured ones (a review found it silent).
    DWGRAPH_CHECK_STATE(p.sizes() == c10::IntArrayRef(sizes_[i]) && p.strides() == c10::IntArrayRef(strides_[i]),
                        where, ": ", kind_, " '", names_[i], "' has other sizes or strides than at capture (sizes ",
                        p.sizes(), ", strides ", p.strides(), "; captured ", c10::IntArrayRef(sizes_[i]), ", ",
                        c10::IntArrayRef(strides_[i]), "); the graphs would read its memory the captured way. "
                        "Keep its layout, or reset() and capture again");
  }
  // A registration since the last check names a replaced parameter as replaced; a tensor
  // put into a slot without one (FSDP2) is named as that.
  const uint64_t registrations = registration_epoch();
  if (current_ && registrations != registrations_seen_) check_registered(where);
  check_slots(where);
  if (current_) check_registered(where);
  registrations_seen_ = registrations;
}

void CapturedParameters::check_registered(const std::string& where) const {
  const NamedTensors now = current_();
  std::unordered_map<std::string, const void*> captured;
  for (size_t i = 0; i < params_.size(); ++i) captured.emplace(names_[i], params_[i].unsafeGetTensorImpl());
  for (const auto& [name, t] : now) {
    auto it = captured.find(name);
    DWGRAPH_CHECK_STATE(it != captured.end(), where, ": ", kind_, " '", name, "' was added since capture; the graphs "
                        "do not use it. reset() and capture again after changing the module");
    DWGRAPH_CHECK_STATE(it->second == t.unsafeGetTensorImpl(), where, ": ", kind_, " '", name,
                        "' was replaced since capture (e.g. module.", name, " = ...(...), "
                        "load_state_dict(..., assign=True) or a replaced submodule); the graphs would keep using "
                        "and updating the old one. Copy new values in place (load_state_dict without assign), or "
                        "reset() and capture again");
    captured.erase(it);
  }
  DWGRAPH_CHECK_STATE(captured.empty(), where, ": ", kind_, " '", captured.empty() ? "" : captured.begin()->first,
                      "' was removed since capture; reset() and capture again after changing the module");
}

void CapturedParameters::check_slots(const std::string& where) const {
  if (!registered_) return;
  const NamedTensors now = registered_();
  for (size_t i = 0; i < std::max(now.size(), slots_.size()); ++i) {
    const bool same = i < now.size() && i < slots_.size() && now[i].first == slots_[i].first &&
                      now[i].second.unsafeGetTensorImpl() == slots_[i].second;
    if (same) continue;
    const std::string& name = i < slots_.size() ? slots_[i].first : now[i].first;
    DWGRAPH_CHECK_STATE(false, where, ": ", kind_, " '", name, "' is not the tensor the graphs captured: another "
                        "tensor was put in its slot",
                        i < now.size() && now[i].second.defined() ? c10::str(" (", describe(now[i].second), ")")
                                                                  : std::string(),
                        ", bypassing module registration. FSDP2 does this between its unshards (its sharded "
                        "parameters are registered outside the FSDP unit's forward and backward): call graphed "
                        "FSDP2 modules only through their unit, and keep its parameters unsharded until "
                        "backward_dw() (dwgraph.distributed.FullyShardReducer); otherwise reset() and capture again");
  }
}

CapturedMainGrads::CapturedMainGrads(std::vector<FusedParameter> fused) : fused_(std::move(fused)) {
  for (const auto& f : fused_) data_.push_back(f.main_grad().data_ptr());
}

void CapturedMainGrads::check(const std::string& where) const {
  for (size_t i = 0; i < fused_.size(); ++i) {
    const at::Tensor mg = fused_[i].main_grad();
    DWGRAPH_CHECK_STATE(mg.defined() && mg.data_ptr() == data_[i], where, ": main_grad of parameter '",
                        fused_[i].name, "' was replaced or reallocated since capture; the graphs accumulate into "
                        "the captured buffer. Zero it in place instead, or reset() and capture again");
  }
}

namespace {

// Whether no two elements of `t` share memory (an expanded tensor's do).
bool elements_apart(const at::Tensor& t) {
  // Dimensions by stride: each stride must pass the reach of the smaller ones.
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dimensions with size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;  // the largest offset the smaller dimensions give
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

// The elements from t's first to its last in its storage (0 for no element).
int64_t extent(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t n = 1;
  for (int64_t d = 0; d < t.dim(); ++d) n += (t.size(d) - 1) * t.stride(d);
  return n;
}

// The memory t's elements lie in, as a flat tensor over its storage.
at::Tensor flat_extent(const at::Tensor& t) { return t.as_strided({extent(t)}, {1}, t.storage_offset()); }

// t with each expanded dimension (stride 0) cut to size 1: the elements that hold its values.
at::Tensor unexpanded(const at::Tensor& t) {
  at::Tensor c = t;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) c = c.narrow(d, 0, 1);
  }
  return c;
}

// Copies the values of `from` into `to` (same sizes and strides, elements that may overlap):
// through their unexpanded elements where those lie apart (an expanded tensor: numel of its
// source), else through the memory they lie in.
void copy_overlapping(const at::Tensor& to, const at::Tensor& from) {
  const at::Tensor a = unexpanded(to), b = unexpanded(from);
  if (elements_apart(a)) {
    a.copy_(b);
  } else {
    flat_extent(to).copy_(flat_extent(from));
  }
}

}  // namespace

at::Tensor layout_copy(const at::Tensor& t) {
  if (t.layout() != at::kStrided || t.is_non_overlapping_and_dense()) return t.clone();
  if (elements_apart(t)) return at::empty_strided(t.sizes(), t.strides(), t.options()).copy_(t);
  // Overlapping (expanded, unfolded): its strides over memory of its own, the size of the
  // memory its elements lie in (a review found expanded outputs made dense, and their sums
  // 0.095 off); only its unexpanded elements copied (an expanded row of a large tensor
  // copied the whole tensor, another found). Not a view of that memory: nothing else holds it.
  const at::Tensor u = unexpanded(t);
  const at::Tensor memory = elements_apart(u) ? at::empty_strided(u.sizes(), u.strides(), u.options())
                                              : at::empty({extent(t)}, t.options());
  at::Tensor out = at::empty({0}, t.options()).set_(memory.storage(), 0, t.sizes(), t.strides());
  copy_overlapping(out, t);
  return out;
}

namespace {

// Per position, the first position holding the same tensor (TensorImpl identity, as
// Python's `is`); empty when all are distinct. Argument counts are small: quadratic.
std::vector<size_t> first_positions(const std::vector<at::Tensor>& ts) {
  std::vector<size_t> first(ts.size());
  bool any = false;
  for (size_t i = 0; i < ts.size(); ++i) {
    first[i] = i;
    if (!ts[i].defined()) continue;
    for (size_t j = 0; j < i; ++j) {
      if (ts[j].is_same(ts[i])) {
        first[i] = first[j];
        any = true;
        break;
      }
    }
  }
  if (!any) first.clear();
  return first;
}

}  // namespace

// Note [One tensor in two argument positions]: kernels branch on whether two arguments are
// one tensor (torch's MultiheadAttention takes its self-attention path when query is key is
// value, and reads the query only). A sample tensor given in several positions is therefore
// one static input, so the capture takes eager's path for it, and it gets its gradient once
// (the captured backward sums its uses' contributions as eager's engine does). Calls must
// pass their tensors the way the samples were: one tensor where they were one (else the
// graph would ignore what the other positions hold) and distinct ones where they were
// distinct (else eager would take the other path and round differently; a review found
// self-attention 1.7e-10 off).
StaticInputs::StaticInputs(const std::vector<at::Tensor>& samples) : first_of_(first_positions(samples)) {
  const at::NoGradGuard no_grad;
  overlapping_.assign(samples.size(), false);
  held_dense_.assign(samples.size(), false);
  for (size_t i = 0; i < samples.size(); ++i) {
    const auto& t = samples[i];
    // Before its storage is asked for (a sparse one has none: torch's untyped error, a review found).
    DWGRAPH_CHECK_ARG(!t.defined() || (t.layout() == at::kStrided && !t.is_nested()), "dwgraph: tensor argument ", i,
                      " is a ", t.defined() && t.is_nested() ? std::string("nested") : c10::str(t.layout()),
                      " tensor; graphs capture strided tensors of fixed shape only (pass it dense, or use it outside "
                      "the graphs)");
    // An expanded sample (position ids, arange(S).expand(B, S)) keeps its layout, copied in
    // through the memory it lies in; one that requires grad is made dense (its gradient is
    // per element), which the call's same layout then cannot match (check says so).
    const bool expanded = t.defined() && !t.is_non_overlapping_and_dense() && !elements_apart(t);
    const bool overlapping = expanded && !t.requires_grad();
    overlapping_[i] = overlapping;
    held_dense_[i] = expanded && !overlapping;
    at::Tensor copy;
    if (t.defined() && first_of_its_tensor(i)) {
      const at::Tensor d = t.detach();
      copy = held_dense_[i] ? d.clone() : layout_copy(d);
      copy.requires_grad_(t.requires_grad());
    }
    tensors_.push_back(copy);
    requires_grad_.push_back(t.defined() && t.requires_grad());
  }
  share_repeated();
}

void StaticInputs::share_repeated() {
  for (size_t i = 0; i < first_of_.size(); ++i) {
    if (first_of_[i] != i) tensors_[i] = tensors_[first_of_[i]];
  }
}

void StaticInputs::move_into(GraphPool& pool) {
  TORCH_INTERNAL_ASSERT(!released_);
  const at::NoGradGuard no_grad;
  const auto scope = pool.allocation_scope();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    // Dense: the pool's replay order accounts for its blocks by what the kernels touch, which
    // a layout with gaps would under-count (a review found a copy into one passing the check).
    // An expanded one whose values lie dense keeps its layout: its memory is what its
    // kernels read, all of it.
    const bool keep = overlapping_[i] && unexpanded(tensors_[i]).is_non_overlapping_and_dense();
    if (overlapping_[i] && !keep) held_dense_[i] = true;
    overlapping_[i] = keep;
    if (tensors_[i].defined() && first_of_its_tensor(i)) {
      tensors_[i] = (keep ? layout_copy(tensors_[i]) : tensors_[i].clone(at::MemoryFormat::Contiguous))
                        .requires_grad_(requires_grad_[i]);
    }
  }
  share_repeated();
}

void StaticInputs::release() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].defined() && first_of_its_tensor(i)) tensors_[i] = unowned_view(tensors_[i]);
  }
  share_repeated();
  released_ = true;
}

at::Tensor unowned_view(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return t.defined() ? t.detach() : t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [](void*) {}, t.options().requires_grad(false));
}

void StaticInputs::check(const std::vector<at::Tensor>& inputs, const std::string& where) const {
  DWGRAPH_CHECK_ARG(inputs.size() == tensors_.size(), where, ": expected ", tensors_.size(),
                    " tensor arguments as at capture, got ", inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& x = inputs[i];
    const auto& st = tensors_[i];
    // What a replay cannot hold, said before its sizes or memory are read (a review found
    // each raising torch's untyped error, or a dual tensor's tangent silently dropped).
    if (x.defined()) {
      DWGRAPH_CHECK_ARG(x.layout() == at::kStrided, where, ": argument ", i, " is a ", x.layout(),
                        " tensor; graphs capture strided tensors only (pass it dense)");
      constexpr c10::DispatchKeySet kTransformed({c10::DispatchKey::FuncTorchBatched,
                                                  c10::DispatchKey::FuncTorchGradWrapper});
      DWGRAPH_CHECK_ARG(!x.unsafeGetTensorImpl()->key_set().has_any(kTransformed) && !x._fw_grad(0).defined(), where,
                        ": argument ", i, " is a tensor of a torch.func transform (vmap, grad, jvp) or a dual tensor "
                        "of forward-mode AD; a replay runs its kernels on plain tensors, with no batch dimension or "
                        "tangent. Call the module itself under such transforms");
      // With grad disabled nothing saves it for a backward, and it replays (as eager runs).
      DWGRAPH_CHECK_ARG(!x.is_inference() || c10::InferenceMode::is_enabled() || !at::GradMode::is_enabled(), where,
                        ": argument ", i, " is an inference tensor (made under torch.inference_mode()) and the call "
                        "computes gradients outside inference mode; the graphs track the versions of what a backward "
                        "reads, which inference tensors do not have (eager refuses to save one for a backward): clone "
                        "it outside inference mode, or call under torch.no_grad() or inference mode");
    }
    DWGRAPH_CHECK_ARG(x.defined() == st.defined() &&
                          (!x.defined() || (x.sizes() == st.sizes() && x.scalar_type() == st.scalar_type() &&
                                            x.device() == st.device())),
                      where, ": argument ", i, " must be ", describe(st.defined() ? st.detach() : st),
                      " as at capture, got ", describe(x.defined() ? x.detach() : x));
    DWGRAPH_CHECK_ARG(!x.defined() || same_layout(x, st) || !held_dense_[i] || elements_apart(x), where,
                      ": argument ", i, " has strides ", x.strides(), ", its elements overlapping as its sample's "
                      "did, but the graphs hold that sample dense (it requires grad, or its static input went into "
                      "the pool dense); pass it dense (.contiguous())");
    DWGRAPH_CHECK_ARG(!x.defined() || same_layout(x, st), where, ": argument ", i, " has strides ", x.strides(),
                      " but its sample had ", st.strides(), "; the graphs replay the kernels captured for the "
                      "sample's layout, where eager code would choose kernels (and output layouts, and rounding) "
                      "for this one. Pass it in the sample's layout (.contiguous() for a contiguous sample), or "
                      "capture with a sample of this layout");
    DWGRAPH_CHECK_ARG(!x.defined() || !x.requires_grad() || requires_grad_[i], where, ": argument ", i,
                      " requires grad but its sample did not, so the graphs compute no gradient for it; capture "
                      "with a sample that requires grad (or detach the input)");
  }
  if (written_.empty()) return;
  // Before the identity check: where a call aliases what the samples did not and the graph
  // writes one of them, that is the message to read.
  if (first_of_.empty()) {
    check_distinct_memory(inputs, written_, where);
  } else {
    // A repeated position is the same static input: a write through it reaches both, as eager's.
    std::vector<at::Tensor> distinct(inputs);
    for (size_t i = 0; i < distinct.size(); ++i) {
      if (!first_of_its_tensor(i)) distinct[i] = at::Tensor();
    }
    check_distinct_memory(distinct, written_, where);
  }
  // Note [One tensor in two argument positions]: GraphManager::runs_eagerly runs the other
  // mismatches eagerly before this is reached; one tensor where the samples were two, to a
  // graph that writes an argument, is refused.
  const std::string mismatch = identity_mismatch(inputs);
  DWGRAPH_CHECK_ARG(mismatch.empty(), where, ": ", mismatch, "; kernels branch on that, and a graph replays the "
                    "path its capture took. Pass them as the samples were passed, or capture with samples passed as "
                    "the calls pass them");
}

bool StaticInputs::interchangeable_with(const StaticInputs& other) const {
  if (other.tensors_.size() != tensors_.size() || other.first_of_ != first_of_ || other.overlapping_ != overlapping_ ||
      other.held_dense_ != held_dense_) {
    return false;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const at::Tensor &a = tensors_[i], &b = other.tensors_[i];
    if (a.defined() != b.defined()) return false;
    if (a.defined() && (a.sizes() != b.sizes() || a.strides() != b.strides() || a.scalar_type() != b.scalar_type() ||
                        a.requires_grad() != b.requires_grad())) {
      return false;
    }
  }
  return true;
}

void StaticInputs::copy_values_from(const StaticInputs& other) const {
  const at::NoGradGuard no_grad;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!tensors_[i].defined() || !first_of_its_tensor(i)) continue;
    if (overlapping_[i]) {
      copy_overlapping(tensors_[i], other.tensors_[i]);
    } else {
      tensors_[i].copy_(other.tensors_[i]);
    }
  }
}

std::string StaticInputs::identity_mismatch(const std::vector<at::Tensor>& inputs, bool* aliases) const {
  // No allocation: argument counts are small.
  for (size_t i = 1; i < inputs.size() && i < tensors_.size(); ++i) {
    size_t now = i;
    if (inputs[i].defined()) {
      for (size_t j = 0; j < i && now == i; ++j) now = inputs[j].is_same(inputs[i]) ? j : i;
    }
    const size_t then = first_of_.empty() ? i : first_of_[i];
    if (now == then) continue;
    const bool one_now = now != i;
    if (aliases != nullptr) *aliases = one_now;
    return c10::str("arguments ", one_now ? now : then, " and ", i,
                    one_now ? " are one tensor, where the samples were two" : " are two tensors, where the samples were one",
                    " (torch's MultiheadAttention takes its self-attention path for one tensor, reading the query only)");
  }
  return std::string();
}

int64_t StaticInputs::first_gaining_grad(const std::vector<at::Tensor>& inputs) const {
  for (size_t i = 0; i < inputs.size() && i < requires_grad_.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad() && !requires_grad_[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

void StaticInputs::copy_in(const std::vector<at::Tensor>& inputs) const {
  const at::NoGradGuard no_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !first_of_its_tensor(i) || inputs[i].data_ptr() == tensors_[i].data_ptr()) continue;
    if (overlapping_[i]) {
      copy_overlapping(tensors_[i], inputs[i]);  // same sizes and strides (check)
    } else {
      tensors_[i].copy_(inputs[i]);
    }
  }
}

void StaticInputs::note_writes(const Graph& graph) {
  written_.clear();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].defined() && graph.writes(tensors_[i].storage())) written_.push_back(i);
  }
}

void StaticInputs::copy_back(const std::vector<at::Tensor>& inputs) const {
  if (written_.empty()) return;
  const at::NoGradGuard no_grad;
  for (size_t i : written_) {
    if (inputs[i].data_ptr() != tensors_[i].data_ptr()) inputs[i].copy_(tensors_[i]);
  }
}

int64_t StaticInputs::nbytes() const {
  int64_t n = 0;
  for (const auto& t : tensors_) n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  return n;
}

}  // namespace dwgraph::graphs
