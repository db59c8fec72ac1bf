#include "graphs/caller_state.h"

#include "graphs/replay_checks.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <unordered_set>

namespace dwgraph::graphs {
namespace {

// Runs one restore step; a failure is reported and does not stop the others.
template <class Fn>
void restore_step(const char* what, Fn&& fn) noexcept {
  try {
    fn();
  } catch (const std::exception& e) {
    TORCH_WARN("dwgraph: restoring ", what, " after warmup/capture failed: ", e.what());
  } catch (...) {
    TORCH_WARN("dwgraph: restoring ", what, " after warmup/capture failed");
  }
}

template <class T>
std::vector<T> unique_by_impl(const std::vector<T>& in) {
  std::vector<T> out;
  std::unordered_set<const void*> seen;
  for (const auto& t : in) {
    if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

}  // namespace

CallerStateGuard::CallerStateGuard(CallerState state) : state_(std::move(state)) {
  state_.parameters = unique_by_impl(state_.parameters);
  state_.buffers = unique_by_impl(state_.buffers);
  // Before anything is saved or changed: every tensor the capture may touch has memory.
  for (const auto& p : state_.parameters) check_has_memory(p, "a parameter");
  for (const auto& b : state_.buffers) check_has_memory(b, "a module buffer");
  const at::NoGradGuard no_grad;
  for (const auto& p : state_.parameters) {
    grads_.push_back(p.grad());
    if (state_.parameter_contents) contents_.emplace_back(p, p.detach().clone());
  }
  for (const auto& b : state_.buffers) contents_.emplace_back(b, b.clone());
  std::unordered_set<const void*> seen;
  for (const auto& f : state_.fused) {
    const at::Tensor mg = f.main_grad ? f.main_grad() : at::Tensor();
    if (mg.defined() && seen.insert(mg.unsafeGetTensorImpl()).second) contents_.emplace_back(mg, mg.clone());
    flags_.push_back(f.get_flag ? f.get_flag() : std::nullopt);
  }
  std::vector<at::Generator> gens = {at::detail::getDefaultCPUGenerator()};
  if (!state_.device.is_cpu()) gens.push_back(at::globalContext().defaultGenerator(state_.device));
  for (auto& g : gens) rng_.emplace_back(g, g.get_state());
  std::unordered_set<const void*> stores;
  std::vector<std::shared_ptr<ops::WgradStore>> unique_stores;
  for (const auto& s : state_.stores) {
    if (s && stores.insert(s.get()).second) unique_stores.push_back(s);
  }
  state_.stores = std::move(unique_stores);
  for (const auto& s : state_.stores) {
    stashes_.push_back(s->take_queued());
    s->suppress_hooks(true);
  }
  take_tensor_hooks();
}

void CallerStateGuard::take_tensor_hooks() {
  if (!state_.suspend_tensor_hooks) return;
  // Note [Parameter tensor hooks at replay]: taken off the parameters (AccumulateGrad
  // reads them from the tensor when it runs), so warmup and capture run none; put back in
  // the order they were registered.
  for (const auto& p : state_.parameters) {
    if (torch::autograd::impl::get_autograd_meta(p) == nullptr) continue;
    auto& hooks = torch::autograd::impl::hooks(p);
    if (hooks.empty()) continue;
    auto it = std::find_if(tensor_hooks_.begin(), tensor_hooks_.end(),
                           [&](const auto& e) { return e.first.unsafeGetTensorImpl() == p.unsafeGetTensorImpl(); });
    if (it == tensor_hooks_.end()) it = tensor_hooks_.emplace(tensor_hooks_.end(), p, decltype(it->second)());
    for (auto& h : hooks) it->second.push_back(std::move(h));
    hooks.clear();
  }
}

CallerStateGuard::~CallerStateGuard() {
  restore_step("the queued wgrad units", [&] {
    for (size_t i = 0; i < state_.stores.size(); ++i) state_.stores[i]->restore_queued(std::move(stashes_[i]));
  });
  restore_step("the wgrad hooks", [&] {
    for (const auto& s : state_.stores) s->suppress_hooks(false);
  });
  restore_step("the parameters' tensor hooks", [&] {
    for (auto& [p, saved] : tensor_hooks_) {
      // Ahead of any a capture registered anew (a hook dict assigned during it).
      auto& hooks = torch::autograd::impl::hooks(p);
      for (auto& h : hooks) saved.push_back(std::move(h));
      hooks = std::move(saved);
    }
  });
  restore_step(".grad", [&] { restore_grads(); });
  restore_step("parameter, buffer and main_grad contents", [&] {
    const at::NoGradGuard no_grad;
    for (auto& [t, copy] : contents_) t.copy_(copy);
  });
  restore_step("grad_added_to_main_grad", [&] {
    for (size_t i = 0; i < state_.fused.size(); ++i) {
      if (state_.fused[i].set_flag) state_.fused[i].set_flag(flags_[i]);
    }
  });
  restore_step("the random number generators", [&] { restore_rng(); });
}

void CallerStateGuard::clear_grads() {
  for (const auto& p : state_.parameters) p.mutable_grad() = at::Tensor();
}

void CallerStateGuard::restore_grads() {
  for (size_t i = 0; i < state_.parameters.size(); ++i) state_.parameters[i].mutable_grad() = grads_[i];
}

void CallerStateGuard::restore_rng() {
  for (auto& [gen, saved] : rng_) gen.set_state(saved);
}

void CallerStateGuard::retain_consumed_units() {
  for (const auto& s : state_.stores) s->set_retain_consumed(true);
}

GradsDetached::GradsDetached(std::vector<at::Tensor> params) : params_(std::move(params)) {
  for (const auto& p : params_) grads_.push_back(p.grad());
  for (const auto& p : params_) p.mutable_grad() = at::Tensor();
}

GradsDetached::~GradsDetached() {
  for (size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = grads_[i];
}

GradDtypesUnset::GradDtypesUnset(std::vector<at::Tensor> params) : params_(std::move(params)) {
  for (const auto& p : params_) {
    dtypes_.push_back(p.requires_grad() ? p.grad_dtype() : std::nullopt);
    if (dtypes_.back()) p.set_grad_dtype(std::nullopt);
  }
}

GradDtypesUnset::~GradDtypesUnset() {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!dtypes_[i]) continue;
    try {
      params_[i].set_grad_dtype(dtypes_[i]);
    } catch (const std::exception& e) {  // a destructor: warn, never throw
      TORCH_WARN("dwgraph: restoring the grad_dtype of a parameter after a capture failed: ", e.what());
    }
  }
}

}  // namespace dwgraph::graphs
