// The capture half of the GraphManager: validation, warmup, and the forward, backward and
// backward-dw captures in the schedule's order (graphs/manager_impl.h).
#include "graphs/manager_impl.h"

#include "common/check.h"
#include "common/log.h"
#include "graphs/capture_log.h"
#include "graphs/host_graph.h"
#include "graphs/state_epoch.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones_like.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

namespace dwgraph::graphs {
namespace {

constexpr const char* kApi = "dwgraph.make_graphed_callables";

template <class T>
bool contains_impl(const std::vector<T>& v, const at::Tensor& t) {
  for (const auto& x : v) {
    if (x.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return true;
  }
  return false;
}

// The leaves the autograd graph of `outputs` accumulates into (and, with `nodes`, every
// node of that graph).
std::vector<at::Tensor> reached_leaves(const std::vector<at::Tensor>& outputs,
                                       std::unordered_set<const void*>* nodes = nullptr) {
  std::vector<at::Tensor> out;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& o : outputs) {
    if (!o.defined()) continue;
    if (o.grad_fn()) {
      stack.push_back(o.grad_fn().get());
    } else if (o.requires_grad()) {
      out.push_back(o);  // an output that is a leaf (a parameter returned as itself) reaches itself
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      out.push_back(acc->variable);
      continue;
    }
    for (const auto& e : node->next_edges()) {
      if (e.function) stack.push_back(e.function.get());
    }
  }
  if (nodes != nullptr) nodes->insert(seen.begin(), seen.end());
  return out;
}

// Leaves the autograd graph of `outputs` accumulates into, other than `known` ones.
std::vector<at::Tensor> unknown_leaves(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& known) {
  std::unordered_set<const void*> ok;
  for (const auto& t : known) {
    if (t.defined()) ok.insert(t.unsafeGetTensorImpl());
  }
  std::vector<at::Tensor> out;
  for (auto& leaf : reached_leaves(outputs)) {
    if (ok.count(leaf.unsafeGetTensorImpl()) == 0) out.push_back(std::move(leaf));
  }
  return out;
}

// The state a backward capture runs in (Note [Autocast in the backward]): the forward's,
// or the same with autocast disabled.
ops::AutocastState backward_state(const ops::AutocastState& forward, bool under_autocast) {
  if (under_autocast) return forward;
  ops::AutocastState s = forward;
  s.cpu = false;
  s.cuda = false;
  return s;
}

// The index of `p` in the callable's parameters (its size when it is not one of them).
size_t parameter_index(const GraphableCallable& c, const at::Tensor& p) {
  for (size_t i = 0; i < c.parameters.size(); ++i) {
    if (c.parameters[i].unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return i;
  }
  return c.parameters.size();
}

// The indices of the parameters whose gradients module `m` lands (deferred or fused).
std::vector<size_t> module_parameter_indices(const GraphableCallable& c, const ModuleSpec& m) {
  std::vector<size_t> out;
  for (const auto& p : m.deferred) out.push_back(parameter_index(c, p));
  for (const auto& f : m.fused) out.push_back(parameter_index(c, f.param));
  return out;
}

}  // namespace

GraphManager::GraphManager(std::vector<GraphableCallable> callables, GraphedCallableOptions opts)
    : callables_(std::move(callables)), opts_(std::move(opts)) {}

std::string GraphManager::describe_slot(size_t s) const {
  const SlotInfo& slot = slots_.at(s).info;
  const std::string& name = callables_[slot.callable].name;
  if (slot.chunk == 0) return c10::str("graphed callable ", slot.callable, " ('", name, "')");
  return c10::str("graphed callable ", slot.callable, " ('", name, "', chunk ", slot.chunk, ", microbatch ",
                  slot.microbatch, ")");
}

bool GraphManager::module_defers(const ModuleSpec& m) const {
  if (!m.defers) return false;
  if (!m.store) return true;  // another library's module: trust need_backward_dw()
  // A dwgraph module whose deferred parameters are all frozen queues no work.
  for (const auto& p : m.deferred) {
    if (p.requires_grad()) return true;
  }
  for (const auto& f : m.fused) {
    if (f.param.requires_grad()) return true;
  }
  return false;
}

CallerState GraphManager::caller_state() const {
  CallerState st;
  st.device = device_;
  // The host backend runs the captured kernels: undo even writes a kernel does not declare.
  st.parameter_contents = device_.is_cpu();
  st.suspend_tensor_hooks = true;  // Note [Parameter tensor hooks at replay]
  for (const auto& c : callables_) {
    st.parameters.insert(st.parameters.end(), c.parameters.begin(), c.parameters.end());
    st.buffers.insert(st.buffers.end(), c.buffers.begin(), c.buffers.end());
    for (const auto& m : c.modules) {
      st.fused.insert(st.fused.end(), m.fused.begin(), m.fused.end());
      if (m.store) st.stores.push_back(m.store);
      for (const auto& inner : m.inner) {
        if (inner.store) st.stores.push_back(inner.store);
      }
    }
  }
  return st;
}

void GraphManager::name_storages(Graph& g, size_t s) const {
  const Slot& slot = slots_[s];
  const auto& c = callables_[slot.info.callable];
  for (size_t i = 0; i < slot.buffers->inputs.tensors().size(); ++i) {
    const auto& t = slot.buffers->inputs.tensors()[i];
    if (t.defined()) g.set_role(t.storage(), c10::str("static input ", i, " of ", where(s)), true);
  }
  for (size_t i = 0; i < c.parameters.size(); ++i) {
    const auto& p = c.parameters[i];
    g.set_role(p.storage(), c10::str("parameter '", c.parameter_names.at(i), "' of ", where(s)), true);
    if (p.grad().defined()) g.set_role(p.grad().storage(), c10::str(".grad of parameter '", c.parameter_names.at(i), "'"), false);
  }
  for (const auto& m : c.modules) {
    for (const auto& f : m.fused) g.set_role(f.main_grad().storage(), c10::str("main_grad of parameter '", f.name, "'"), true);
  }
  for (size_t i = 0; i < slot.static_grad_outputs.size(); ++i) {
    const auto& t = slot.static_grad_outputs[i];
    if (t.defined()) g.set_role(t.storage(), c10::str("static grad output ", i, " of ", where(s)), true);
  }
  if (pooled_buffers_) {
    // Note [Slots share the pool by liveness]: blocks of the pool, like the captures' own.
    for (const auto& t : slot.buffers->inputs.tensors()) {
      if (t.defined() && t.numel() > 0) g.mark_pool_block(t.storage());
    }
    for (const auto& t : slot.static_grad_outputs) {
      if (t.defined() && t.numel() > 0) g.mark_pool_block(t.storage());
    }
  }
}

namespace {

// Note [Parameter hooks in autograd's order]: torch::autograd::grad runs the tensor hooks
// of the leaves it captures gradients for in the order eager's backward would run their
// AccumulateGrad nodes; a hook per parameter around the captured backward records it.
class ReachRecorder final : public torch::autograd::FunctionPreHook {
 public:
  ReachRecorder(std::vector<size_t>& order, size_t index) : order_(order), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    order_.push_back(index_);
    return grads;
  }

 private:
  std::vector<size_t>& order_;
  size_t index_;
};

class ReachRecording {
 public:
  explicit ReachRecording(const std::vector<at::Tensor>& params) {
    for (size_t j = 0; j < params.size(); ++j) {
      if (!params[j].requires_grad() || torch::autograd::impl::get_autograd_meta(params[j]) == nullptr) continue;
      auto hook = std::make_unique<ReachRecorder>(order, j);
      added_.emplace_back(params[j], hook.get());
      torch::autograd::impl::hooks(params[j]).push_back(std::move(hook));
    }
  }
  ~ReachRecording() {
    for (auto& [p, hook] : added_) {
      auto& hooks = torch::autograd::impl::hooks(p);
      hooks.erase(std::remove_if(hooks.begin(), hooks.end(), [h = hook](const auto& x) { return x.get() == h; }),
                  hooks.end());
    }
  }
  ReachRecording(const ReachRecording&) = delete;
  ReachRecording& operator=(const ReachRecording&) = delete;
  std::vector<size_t> order;

 private:
  std::vector<std::pair<at::Tensor, const torch::autograd::FunctionPreHook*>> added_;
};

}  // namespace

template <class Body>
void GraphManager::capture(std::unique_ptr<Graph>& g, Phase phase, size_t s, Body&& body, const std::string& part) {
  const auto& hook = callables_[slots_[s].info.callable].capture_time_hook;
  const bool hooked = hook && phase != Phase::kBackwardDw;
  if (hooked) hook(to_string(phase), false);
  // A tensor hook registered on a parameter since (a warmup or capture-time hook) would run
  // inside the captured backward and again at every replay.
  if (phase == Phase::kBackward && capture_guard_ != nullptr) capture_guard_->take_tensor_hooks();
  g = make_graph(device_);
  g->set_name(c10::str(to_string(phase), " graph of ", where(s), part));
  name_storages(*g, s);
  g->capture_begin(pool_);
  try {
    body();
  } catch (...) {
    g->capture_abort();
    g.reset();
    throw;
  }
  g->capture_end();
  if (hooked) hook(to_string(phase), true);
}

std::vector<at::Tensor> GraphManager::backward_targets(size_t s, bool for_capture) {
  // Inputs that require grad, then every parameter that requires grad: deferred ones too,
  // so their deferred node runs (and queues its unit) even when nothing else needs it, and
  // a parameter tied between a deferred module and an ordinary one gets the ordinary
  // share from the backward and the deferred one from backward_dw(), as eager does.
  Slot& slot = slots_[s];
  const auto& c = callables_[slot.info.callable];
  std::vector<at::Tensor> targets;
  if (for_capture) {
    slot.grad_input_indices.clear();
    slot.grad_param_indices.clear();
    slot.param_deferred.clear();
    slot.param_fused.clear();
  }
  for (size_t i = 0; i < slot.buffers->inputs.tensors().size(); ++i) {
    // A tensor given in two positions gets its gradient once (Note [One tensor in two
    // argument positions], graphs/replay_checks.cpp): its one autograd edge.
    if (slot.buffers->inputs.tensors()[i].requires_grad() && slot.buffers->inputs.first_of_its_tensor(i)) {
      targets.push_back(slot.buffers->inputs.tensors()[i]);
      if (for_capture) slot.grad_input_indices.push_back(i);
    }
  }
  for (size_t i = 0; i < c.parameters.size(); ++i) {
    if (!c.parameters[i].requires_grad()) continue;
    targets.push_back(c.parameters[i]);
    if (!for_capture) continue;
    slot.grad_param_indices.push_back(i);
    bool deferred = false, fused = false;
    for (const auto& m : c.modules) {
      bool in_fused = false;
      for (const auto& f : m.fused) in_fused = in_fused || f.param.unsafeGetTensorImpl() == c.parameters[i].unsafeGetTensorImpl();
      fused = fused || in_fused;
      if (!module_defers(m)) continue;
      deferred = deferred || in_fused || contains_impl(m.deferred, c.parameters[i]);
    }
    slot.param_deferred.push_back(deferred);
    slot.param_fused.push_back(fused);
  }
  if (for_capture) {
    slot.any_param_deferred =
        std::find(slot.param_deferred.begin(), slot.param_deferred.end(), true) != slot.param_deferred.end();
  }
  return targets;
}

void GraphManager::warmup() {
  // Inside the CallerStateGuard of build(): everything it changes is put back.
  // In the captures' order (schedule_.capture_steps), as TransformerEngine warms up, so
  // capture-time hooks see the sequence the captures will show them (sequential: every
  // forward, then the backwards in reverse, then the backward-dw steps; pipeline: the
  // order's sequence). A forward's outputs are kept until its backward step, and each
  // backward-dw step runs the units its own backward queued (a module used twice in the
  // forward queues two), as the capture does.
  const auto steps = schedule_.capture_steps(defers_);
  // The graphs are told at build() the grad mode and autocast state they are captured in
  // (what the calls are compared with); a warmup hook that switched either would have the
  // captures run in another one, silently: refused before anything is captured.
  const auto unchanged_by = [this](const char* hook) {
    DWGRAPH_CHECK_ARG(at::GradMode::is_enabled() == grad_at_capture_, kApi, ": argument '", hook,
                      "' switched grad mode ", grad_at_capture_ ? "off" : "on", "; the graphs are captured in the "
                      "grad mode of the make_graphed_callables call (calls are compared with it). Switch it around "
                      "the call instead (with torch.no_grad(): ...)");
    const ops::AutocastState now = ops::AutocastState::current();
    DWGRAPH_CHECK_ARG(now == forward_autocast_, kApi, ": argument '", hook, "' changed the autocast state from ",
                      forward_autocast_.describe(), " to ", now.describe(), "; the graphs are captured in the "
                      "autocast state of the make_graphed_callables call. Enter torch.autocast around the call "
                      "instead");
  };
  if (opts_.pre_warmup_hook) {
    opts_.pre_warmup_hook();
    unchanged_by("pre_warmup_hook");
  }
  for (int it = 0; it < opts_.num_warmup_iters; ++it) {
    std::vector<std::vector<at::Tensor>> kept(slots_.size());  // per slot: its outputs that require grad
    std::vector<std::vector<size_t>> queued(slots_.size());    // per slot, per module: units its backward queued
    for (const auto& step : steps) {
      const size_t s = step.slot;
      const auto& c = callables_[slots_[s].info.callable];
      const auto hook = [&](const char* phase, bool after) {
        if (c.capture_time_hook) c.capture_time_hook(phase, after);
      };
      switch (step.phase) {
        case Phase::kForward: {
          hook("forward", false);
          const auto outputs = c.forward(slots_[s].buffers->inputs.tensors());
          hook("forward", true);
          kept[s].clear();
          for (const auto& o : outputs) {
            if (o.defined() && o.requires_grad()) kept[s].push_back(o);
          }
          break;
        }
        case Phase::kBackward: {
          const std::vector<at::Tensor> outs = std::move(kept[s]);
          kept[s].clear();
          queued[s].assign(c.modules.size(), 0);
          if (outs.empty()) break;  // as the capture: no backward graph, no hooks
          const auto targets = backward_targets(s, /*for_capture=*/false);
          DWGRAPH_CHECK_ARG(!targets.empty(), kApi, ": the outputs of ", where(s),
                            " require grad through tensors that are neither its inputs nor its parameters; "
                            "make them parameters of the module or inputs of the callable");
          std::vector<at::Tensor> grads_out;
          for (const auto& o : outs) grads_out.push_back(at::ones_like(o));
          std::vector<size_t> before;
          for (const auto& m : c.modules) before.push_back(m.store ? m.store->num_units() : 0);
          hook("backward", false);
          if (capture_guard_ != nullptr) capture_guard_->take_tensor_hooks();  // registered since
          {
            const ops::AutocastStateGuard autocast(backward_autocast_);  // Note [Autocast in the backward]
            run_autograd_engine([&] {
              return torch::autograd::grad(outs, targets, grads_out, /*retain_graph=*/false, /*create_graph=*/false,
                                           /*allow_unused=*/true);
            });
          }
          hook("backward", true);
          for (size_t k = 0; k < c.modules.size(); ++k) {
            const auto& m = c.modules[k];
            // Another library's module keeps its own queue: one backward_dw() per backward.
            queued[s][k] = m.store ? m.store->num_units() - std::min(before[k], m.store->num_units()) : 1;
          }
          break;
        }
        case Phase::kBackwardDw: {
          for (size_t k = 0; k < c.modules.size(); ++k) {
            const auto& m = c.modules[k];
            if (!module_defers(m)) continue;
            if (!m.store) {
              m.backward_dw();
              continue;
            }
            const size_t n = k < queued[s].size() ? queued[s][k] : 0;
            for (size_t r = 0; r < n && !m.store->empty(); ++r) m.backward_dw();
          }
          break;
        }
      }
    }
    // Nothing may be left for the captures' backward-dw steps to pop (a unit queued by
    // another callable's backward would otherwise be landed by the wrong graph).
    for (const auto& c : callables_) {
      for (const auto& m : c.modules) {
        if (m.store && module_defers(m)) {
          while (!m.store->empty()) m.backward_dw();
        }
      }
    }
  }
  if (opts_.post_warmup_hook) {
    opts_.post_warmup_hook();
    unchanged_by("post_warmup_hook");
  }
}

void GraphManager::capture_fwd(size_t s) {
  Slot& slot = slots_[s];
  const auto& c = callables_[slot.info.callable];
  auto& checks = *checks_[slot.info.callable];
  if (c.training_mode && checks.mode.load() == 0) {
    checks.captured_mode = c.training_mode();
    checks.mode.store((state_epoch() << 1) | 1);
  }
  if (pooled_buffers_) {
    // Note [Slots share the pool by liveness]: the static inputs become pool blocks, and
    // the call's copy into them takes its place in the pool's replay order, before this
    // forward.
    slot.buffers->inputs.move_into(*pool_);
    slot.input_write.add(pool_, c10::str("copy into the static inputs of ", where(s)), slot.buffers->inputs.tensors());
  }
  std::vector<at::Tensor> outputs;
  capture(slot.fwd, Phase::kForward, s, [&] { outputs = c.forward(slot.buffers->inputs.tensors()); });
  slot.buffers->inputs.note_writes(*slot.fwd);
  slot.captured_outputs = outputs;
  slot.saved_state.reset();
  if (c.saved_state) {
    auto saved = std::make_shared<SavedState>();
    for (const auto& [name, t] : c.saved_state()) {
      saved->counters.push_back(torch::autograd::impl::version_counter(t));
      saved->names.push_back(name);
    }
    if (!saved->counters.empty()) slot.saved_state = std::move(saved);
  }
  std::vector<at::Tensor> known = slot.buffers->inputs.tensors();
  known.insert(known.end(), c.parameters.begin(), c.parameters.end());
  const auto strays = unknown_leaves(outputs, known);
  DWGRAPH_CHECK_ARG(strays.empty(), kApi, ": the forward of ", where(s), " uses a tensor that requires grad (",
                    strays.empty() ? std::string() : describe(strays[0]),
                    ") and is neither one of its inputs nor a parameter of the module; the graphs would drop its "
                    "gradient. Make it a parameter of the module (or pass it as an input)");
  for (size_t i = 0; i < outputs.size(); ++i) {
    const auto& o = outputs[i];
    DWGRAPH_CHECK_ARG(o.defined(), kApi, ": output ", i, " of ", where(s), " is undefined; expected a tensor");
    // Pooled: a view; the captured outputs (and the autograd graph) own it until the
    // backward's capture, as eager code holds a layer's output until its backward.
    slot.static_outputs.push_back(pooled_buffers_ ? unowned_view(o) : o.detach());
    slot.output_requires_grad.push_back(o.requires_grad());
  }
}

void GraphManager::capture_bwd(size_t s) {
  Slot& slot = slots_[s];
  const auto& c = callables_[slot.info.callable];
  std::vector<at::Tensor> outs, grad_outs;
  // Note [Static buffers reused across microbatches]: the grad outputs of an earlier slot
  // sharing this one's buffers, when they fit.
  const std::vector<at::Tensor>* earlier = nullptr;
  for (size_t other : slot.buffers->slots) {
    const auto& g = slots_[other].static_grad_outputs;
    if (other == s || g.size() != slot.captured_outputs.size()) continue;
    bool fits = true;
    for (size_t i = 0; i < g.size() && fits; ++i) {
      const auto& o = slot.captured_outputs[i];
      fits = g[i].defined() == static_cast<bool>(slot.output_requires_grad[i]) &&
             (!g[i].defined() || (g[i].sizes() == o.sizes() && g[i].strides() == o.strides() &&
                                  g[i].scalar_type() == o.scalar_type()));
    }
    if (fits) earlier = &g;
  }
  {
    const auto scope = pooled_buffers_ ? pool_->allocation_scope() : nullptr;
    for (size_t i = 0; i < slot.captured_outputs.size(); ++i) {
      const auto& o = slot.captured_outputs[i];
      if (slot.output_requires_grad[i]) {
        outs.push_back(o);
        slot.static_grad_outputs.push_back(earlier != nullptr ? (*earlier)[i] : at::empty_like(o).detach());
        grad_outs.push_back(slot.static_grad_outputs.back());
      } else {
        slot.static_grad_outputs.emplace_back();
      }
    }
  }
  const auto targets = backward_targets(s, /*for_capture=*/true);
  if (outs.empty()) {
    slot.captured_outputs.clear();
    if (pooled_buffers_) slot.buffers->inputs.release();
    return;  // nothing to differentiate: no backward graph
  }
  if (pooled_buffers_) {
    slot.grad_write.add(pool_, c10::str("copy into the static grad outputs of ", where(s)), slot.static_grad_outputs);
  }
  DWGRAPH_CHECK_ARG(!targets.empty(), kApi, ": the outputs of ", where(s),
                    " require grad through tensors that are neither its inputs nor its parameters; make them "
                    "parameters of the module or inputs of the callable");
  record_reach(s, outs, targets);
  // The captured kernels write only fresh graph-pool buffers (SPEC C3).
  const GradsDetached detached(c.parameters);
  const GradDtypesUnset raw_grads(c.parameters);  // Note [A graph returns the gradient autograd computed]
  std::vector<size_t> units_before;
  for (const auto& m : c.modules) units_before.push_back(m.store ? m.store->num_units() : 0);
  // Which modules without deferral this backward reaches: those whose hooks it would run
  // (Note [Hook runs a capture saw]).
  std::vector<const ops::WgradStore*> stores;
  for (const auto& m : c.modules) {
    if (m.store) stores.push_back(m.store.get());
    for (const auto& inner : m.inner) {
      if (inner.store) stores.push_back(inner.store.get());
    }
  }
  ops::HookRunRecording hook_runs(std::move(stores));
  std::vector<at::Tensor> grads;
  std::vector<at::Tensor> grad_params;
  for (size_t j : slot.grad_param_indices) grad_params.push_back(c.parameters[j]);
  capture(slot.bwd, Phase::kBackward, s, [&] {
    const ops::AutocastStateGuard autocast(backward_autocast_);  // Note [Autocast in the backward]
    const ReachRecording reach(grad_params);
    grads = run_autograd_engine([&] {
      return torch::autograd::grad(outs, targets, grad_outs, opts_.retain_graph_in_backward, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    });
    slot.param_order = reach.order;
  });
  slot.units_per_backward.clear();
  slot.unit_sources.assign(c.modules.size(), {});
  for (size_t k = 0; k < c.modules.size(); ++k) {
    const auto& m = c.modules[k];
    if (m.store) slot.unit_sources[k] = m.store->unit_sources(units_before[k]);  // Note [Parts armed per use]
    const size_t after = m.store ? m.store->num_units() : 0;
    // Another library's module keeps its own queue: one backward_dw() per backward.
    slot.units_per_backward.push_back(m.store ? (after > units_before[k] ? after - units_before[k] : 0) : 1);
  }
  if (!opts_.allow_unused_input) {
    for (size_t j = 0; j < slot.grad_input_indices.size(); ++j) {
      DWGRAPH_CHECK_ARG(grads.size() > j && grads[j].defined(), kApi, ": ", where(s), ": sample input ",
                        slot.grad_input_indices[j],
                        " requires grad but the outputs do not depend on it; pass allow_unused_input=True or detach it");
    }
  }
  slot.static_grad_inputs = grads;
  make_param_node(s);
  if (!opts_.retain_graph_in_backward) slot.captured_outputs.clear();
  for (const auto& o : slot.static_outputs) slot.output_read_by_bwd.push_back(slot.bwd->touches(o.storage()));
  for (const auto& t : slot.buffers->inputs.tensors()) {
    slot.input_read_by_bwd.push_back(t.defined() && slot.bwd->touches(t.storage()));
  }
  if (pooled_buffers_) {
    // Note [Slots share the pool by liveness]: from here on the slot keeps views; what a
    // later graph of the slot reads is held by the autograd graph or the queued units.
    slot.buffers->inputs.release();
    for (auto& t : slot.static_grad_outputs) t = unowned_view(t);
    for (auto& t : slot.static_grad_inputs) t = unowned_view(t);
  }
  // Modules without deferral: their main_grad was accumulated and their hooks run at the
  // end of each backward. Eager queues a layer's hooks when its backward starts (its
  // output's gradient), in the order the backward reaches the layers, which the captured
  // backward recorded for their parameters (Note [Parameter hooks in autograd's order]);
  // layers it did not reach, and hooks of inner modules, after those, in module order.
  std::unordered_map<size_t, size_t> reached_at;  // callable parameter index -> first reach
  for (size_t k = 0; k < slot.param_order.size(); ++k) {
    const size_t j = slot.param_order[k];
    if (j < slot.grad_param_indices.size()) reached_at.emplace(slot.grad_param_indices[j], k);
  }
  // A module whose front end notes its hook runs (dwgraph's) and whose hooks this backward
  // would not run: eager runs none of them after such a backward (a review found them run
  // after every graphed backward).
  const auto runs = hook_runs.take();
  DWGRAPH_CHECK_STATE(runs.has_value(), kApi, ": ", where(s), ": a capture that shares a module with this one ran on "
                      "another thread at the same time, so which wgrad-hook runs were whose cannot be told; capture "
                      "them one at a time");
  const std::unordered_set<const ops::WgradStore*> reached(runs->begin(), runs->end());
  auto unreached = [&](const std::shared_ptr<ops::WgradStore>& store) {
    return store && store->notes_hook_runs() && reached.count(store.get()) == 0;
  };
  const std::unordered_set<size_t> trainable(slot.grad_param_indices.begin(), slot.grad_param_indices.end());
  std::vector<std::pair<size_t, ModuleHooks>> hooks;
  for (const auto& m : c.modules) {
    if (module_defers(m)) continue;
    std::vector<size_t> indices;
    for (const auto& f : m.fused) {
      const size_t i = parameter_index(c, f.param);
      indices.push_back(i);
      if (f.set_flag && f.param.requires_grad()) slot.after_backward.flags.push_back(FlagSetter{[f] { f.set_flag(true); }, i});
    }
    if (!m.run_hooks || unreached(m.store)) continue;
    // Its own parameters: named "<module>.<name>" in the callable ("<name>" at the root).
    // Its hooks run after a backward that reaches one of its trainable ones (an output the
    // loss does not use reaches none, as it reaches not the layer in eager); with none
    // trainable, after every backward its capture reached it in.
    size_t first = std::numeric_limits<size_t>::max();
    const std::string prefix = m.name.empty() ? "" : m.name + ".";
    for (size_t i = 0; i < c.parameter_names.size(); ++i) {
      const auto& n = c.parameter_names[i];
      if (n.compare(0, prefix.size(), prefix) != 0 || n.find('.', prefix.size()) != std::string::npos) continue;
      auto it = reached_at.find(i);
      if (it != reached_at.end()) first = std::min(first, it->second);
      if (trainable.count(i) > 0) indices.push_back(i);
    }
    hooks.emplace_back(first, ModuleHooks{m.run_hooks, m.store, std::move(indices)});
  }
  for (const auto& m : c.modules) {
    for (const auto& inner : m.inner) {
      if (!inner.defers && inner.run_hooks && !unreached(inner.store)) {
        hooks.emplace_back(std::numeric_limits<size_t>::max(), ModuleHooks{inner.run_hooks, inner.store, {}});
      }
    }
  }
  std::stable_sort(hooks.begin(), hooks.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [_, h] : hooks) slot.after_backward.add_hook(std::move(h));
}

void GraphManager::record_reach(size_t s, const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& targets) {
  Slot& slot = slots_[s];
  std::unordered_map<const void*, size_t> index;
  for (size_t j = 0; j < targets.size(); ++j) index.emplace(targets[j].unsafeGetTensorImpl(), j);
  slot.reaches.assign(outs.size(), std::vector<uint8_t>(targets.size(), 0));
  slot.reached.assign(targets.size(), 0);
  slot.reach_nodes.assign(outs.size(), {});
  for (size_t i = 0; i < outs.size(); ++i) {
    for (const auto& leaf : reached_leaves({outs[i]}, &slot.reach_nodes[i])) {
      auto it = index.find(leaf.unsafeGetTensorImpl());
      if (it == index.end()) continue;
      slot.reaches[i][it->second] = 1;
      slot.reached[it->second] = 1;
    }
  }
}

void GraphManager::capture_dw(size_t s) {
  Slot& slot = slots_[s];
  // No backward graph (nothing required grad: a capture under torch.no_grad()), so no
  // backward queued anything: calls with grad run eagerly (Note [Calls eager autograd would
  // differentiate further]) and backward_dw() lands the units their backwards queue.
  if (!slot.bwd) return;
  const auto& c = callables_[slot.info.callable];
  std::vector<at::Tensor> deferred;
  for (const auto& m : c.modules) {
    if (module_defers(m)) deferred.insert(deferred.end(), m.deferred.begin(), m.deferred.end());
  }
  std::optional<GradsDetached> detached;
  if (!opts_.unsafe_capture_with_caller_grad) detached.emplace(deferred);
  auto runs_of = [&](size_t k) {
    return k < slot.units_per_backward.size() ? std::max<size_t>(slot.units_per_backward[k], 1) : size_t{1};
  };
  // A deferring module whose backward capture queued nothing (a submodule the forward does
  // not use, or uses without grad): nothing to land and no hook to run, as eager, where its
  // own backward_dw() finds no unit.
  auto lands = [&](size_t k) {
    const auto& m = c.modules[k];
    return module_defers(m) && !(m.store && m.store->empty() && k < slot.units_per_backward.size() &&
                                 slot.units_per_backward[k] == 0);
  };
  size_t num_parts = 0;
  for (size_t k = 0; k < c.modules.size(); ++k) num_parts += lands(k) ? runs_of(k) : 0;
  // Note [A backward-dw graph per unit]: one graph per unit of one backward, in the order
  // the modules land them. One contribution per (module, unit, parameter), so a parameter
  // tied between two modules receives a, then b, exactly as the eager modules hand them
  // over (.grad = a; .grad += b), and a module used twice hands its units over one by one,
  // as eager's backward_dw() calls add them to .grad (the sums must round the same).
  slot.dw_parts.clear();
  slot.armed_parts = 0;
  slot.dw_arm = std::make_shared<ops::GraphedArm>();
  slot.dw_hooks.assign(c.modules.size(), nullptr);
  for (size_t k = 0; k < c.modules.size(); ++k) {
    const auto& m = c.modules[k];
    if (!lands(k)) continue;
    DWGRAPH_CHECK_STATE(!m.store || !m.store->empty(), kApi, ": module '", m.name, "' of ", where(s),
                        " has no wgrad unit queued after its backward capture, though its backward queued ",
                        runs_of(k), "; expected them queued until its backward_dw()");
    const size_t runs = runs_of(k);
    for (size_t r = 0; r < runs; ++r) {
      DwPart part;
      part.state = std::make_shared<ops::GraphedUnit>(slot.dw_arm, slot.dw_parts.size());
      part.module = k;
      part.unit = r;
      part.param_indices = module_parameter_indices(c, m);
      auto& shared = shared_contributions_[{slot.info.callable, k, r}];
      const std::string label =
          num_parts < 2 ? std::string()
                        : c10::str(", module '", m.name.empty() ? std::string("(root)") : m.name, "'",
                                   runs > 1 ? c10::str(" unit ", r) : std::string());
      capture(part.graph, Phase::kBackwardDw, s, [&] {
        if (!opts_.unsafe_capture_with_caller_grad) {
          // Note [Contributions are shared across microbatches].
          for (const auto& p : m.deferred) {
            auto it = shared.find(p.unsafeGetTensorImpl());
            if (it == shared.end()) continue;
            it->second.zero_();
            p.mutable_grad() = it->second;
          }
        }
        m.backward_dw();
        if (opts_.unsafe_capture_with_caller_grad) return;
        for (size_t i = 0; i < m.deferred.size(); ++i) {
          const at::Tensor& p = m.deferred[i];
          if (!p.grad().defined()) continue;
          part.landing.contributions.push_back(Contribution{p, p.grad(), m.deferred_names.at(i),
                                                            Contribution::Mode::kAccumulate, parameter_index(c, p)});
          shared.emplace(p.unsafeGetTensorImpl(), p.grad());
          p.mutable_grad() = at::Tensor();
        }
      }, label);
      for (const auto& f : m.fused) {
        if (f.set_flag && f.param.requires_grad()) {
          part.landing.flags.push_back(FlagSetter{[f] { f.set_flag(true); }, parameter_index(c, f.param)});
        }
      }
      for (const auto& o : slot.static_outputs) part.reads_output.push_back(o.defined() && part.graph->touches(o.storage()));
      for (const auto& t : slot.buffers->inputs.tensors()) {
        part.reads_input.push_back(t.defined() && part.graph->touches(t.storage()));
      }
      for (const auto& g : slot.static_grad_outputs) {
        part.reads_grad_output.push_back(g.defined() && part.graph->touches(g.storage()));
      }
      part.state->owner = where(s);
      // Note [Parts armed per use]: which outputs reach the use that queued this unit.
      if (k < slot.unit_sources.size() && r < slot.unit_sources[k].size() && runs == slot.unit_sources[k].size()) {
        const auto& sources = slot.unit_sources[k][r];
        part.reached_from.assign(slot.reach_nodes.size(), 0);
        for (size_t i = 0; i < slot.reach_nodes.size(); ++i) {
          for (const void* node : sources) part.reached_from[i] = part.reached_from[i] || slot.reach_nodes[i].count(node) > 0;
        }
        // No output reaches any of them: they are not nodes of the forward's graph (a
        // checkpointed module keys its recomputation's work by its own fields), so its use
        // is not known: its module's parameters decide, as before (a review found such a
        // part never armed by a partial backward: its gradients silently lost).
        if (std::find(part.reached_from.begin(), part.reached_from.end(), 1) == part.reached_from.end()) {
          part.reached_from.clear();
        }
      }
      slot.dw_parts.push_back(std::move(part));
    }
    Landing hooks;
    hooks.hooks_asked_at_turn = true;
    const std::vector<size_t> indices = module_parameter_indices(c, m);
    if (m.run_hooks) hooks.add_hook(ModuleHooks{m.run_hooks, m.store, indices});
    // dwgraph modules inside another library's module: their hooks after its hand-off.
    for (const auto& inner : m.inner) {
      if (inner.defers && inner.run_hooks) hooks.add_hook(ModuleHooks{inner.run_hooks, inner.store, indices});
    }
    if (!hooks.empty()) slot.dw_hooks[k] = std::make_shared<const Landing>(std::move(hooks));
  }
  slot.reach_nodes.clear();  // Note [Parts armed per use]: read, no longer needed
  slot.unit_sources.clear();
  slot.dw_all_parts.resize(slot.dw_parts.size());
  std::iota(slot.dw_all_parts.begin(), slot.dw_all_parts.end(), size_t{0});
  slot.dw_parts_all_have_params = std::all_of(slot.dw_parts.begin(), slot.dw_parts.end(),
                                              [](const DwPart& p) { return !p.param_indices.empty(); });
  slot.any_dw_hooks = std::any_of(slot.dw_hooks.begin(), slot.dw_hooks.end(),
                                  [](const std::shared_ptr<const Landing>& h) { return h != nullptr; });
  slot.dw_unconditional_hooks = 0;
  for (const auto& h : slot.dw_hooks) slot.dw_unconditional_hooks += h ? h->unconditional_hooks : 0;
  // What any part reads: the call and the backward watch these (Note [Slot states]).
  auto any_part = [&](std::vector<bool> DwPart::*reads, size_t n) {
    std::vector<bool> out(n, false);
    for (const auto& p : slot.dw_parts) {
      for (size_t i = 0; i < n && i < (p.*reads).size(); ++i) out[i] = out[i] || (p.*reads)[i];
    }
    return out;
  };
  slot.output_read_by_dw = any_part(&DwPart::reads_output, slot.static_outputs.size());
  slot.input_read_by_dw = any_part(&DwPart::reads_input, slot.buffers->inputs.tensors().size());
  slot.grad_output_read_by_dw = any_part(&DwPart::reads_grad_output, slot.static_grad_outputs.size());
  // Note [Graphed units]: each part is a unit of its module's store (and of the stores of
  // dwgraph modules inside another library's module, which land only with the callable).
  const std::weak_ptr<GraphManager> self = weak_from_this();
  for (size_t p = 0; p < slot.dw_parts.size(); ++p) {
    DwPart& part = slot.dw_parts[p];
    const auto& m = c.modules[part.module];
    if (m.store) {
      part.state->land = [self, s, p, owner = where(s)] {
        const auto manager = self.lock();
        DWGRAPH_CHECK_STATE(manager != nullptr, owner, ": its graphs were released (the graphed callables were "
                            "dropped) before this backward_dw()");
        manager->land_part(s, p);
      };
      part.state->discard = [self, s, p] {
        if (const auto manager = self.lock()) manager->discard_part(s, p);
      };
      m.store->add_graphed_unit(part.state);
    }
    for (const auto& inner : m.inner) {
      if (inner.store && inner.defers) inner.store->add_graphed_unit(part.state);
    }
  }
  if (schedule_.pipelined() && pooled_buffers_) {
    // The pipeline order is explicit: what this backward-dw graph read may go to later
    // captures now (the sequential schedule keeps it: Note [Backward-dw graphs are
    // captured last]).
    for (const auto& store : deferring_stores(slot.info.callable)) store->release_consumed();
  }
}

void GraphManager::refuse_deferring_modules_shared_across_callables() const {
  // One deferring module in two callables (a shared layer, ALBERT style): its queued units
  // are one FIFO, so each callable's backward-dw graph would be captured on whichever unit
  // was oldest, another callable's as often as its own. Calls in another order than the
  // capture's land them in another order (other rounding), and one callable alone reads the
  // other's saved tensors. Ties of parameters across callables (separate modules) are exact.
  std::unordered_map<const ops::WgradStore*, std::pair<size_t, std::string>> owner;
  for (size_t ci = 0; ci < callables_.size(); ++ci) {
    auto claim = [&](const std::shared_ptr<ops::WgradStore>& store, const std::string& name) {
      if (!store) return;
      auto [it, added] = owner.emplace(store.get(), std::make_pair(ci, name));
      DWGRAPH_CHECK_ARG(added || it->second.first == ci, kApi, ": module '", it->second.second, "' of callable ",
                        it->second.first, " ('", callables_[it->second.first].name, "') is also module '", name,
                        "' of callable ", ci, " ('", callables_[ci].name, "') and defers its weight gradients: its "
                        "queued units are one FIFO, which the backward-dw graphs of two callables cannot share. Graph "
                        "the layers that share it as one callable, or give each callable its own module and tie "
                        "their parameters (ties across callables are exact)");
    };
    for (const auto& m : callables_[ci].modules) {
      if (!module_defers(m)) continue;
      claim(m.store, m.name);
      for (const auto& inner : m.inner) {
        if (inner.defers) claim(inner.store, m.name);
      }
    }
  }
}

void GraphManager::build(const std::vector<std::vector<at::Tensor>>& sample_args) {
  DWGRAPH_CHECK_ARG(!callables_.empty(), kApi, ": argument 'modules' must hold at least one callable, got none");
  DWGRAPH_CHECK_ARG(opts_.num_warmup_iters >= 0, kApi, ": argument 'num_warmup_iters' must be >= 0, got ",
                    opts_.num_warmup_iters);
  const size_t n = callables_.size();
  if (opts_.schedule.has_value()) {
    schedule_ = *opts_.schedule;
    DWGRAPH_CHECK_ARG(schedule_.num_callables() == n, kApi, ": the schedule is for ", schedule_.num_callables(),
                      " callables, got ", n);
  } else {
    schedule_ = Schedule::from_arguments(opts_.order, opts_.num_layers_per_chunk, n);
  }
  for (const auto& c : callables_) {
    DWGRAPH_CHECK_ARG(c.forward != nullptr, kApi, ": callable '", c.name, "' has no forward function");
    DWGRAPH_CHECK_ARG(c.parameters.size() == c.parameter_names.size(), kApi, ": callable '", c.name, "' has ",
                      c.parameters.size(), " parameters but ", c.parameter_names.size(), " parameter names");
    bool defers = false;
    for (const auto& m : c.modules) {
      DWGRAPH_CHECK_ARG(!m.defers || m.backward_dw != nullptr, kApi, ": module '", m.name, "' of callable '", c.name,
                        "' defers its weight gradients but has no backward_dw");
      defers = defers || module_defers(m);
    }
    defers_.push_back(defers);
  }
  refuse_deferring_modules_shared_across_callables();
  schedule_.check_deferred(defers_);
  schedule_.check_per_slot(sample_args.size(), "sample_args");
  bool device_set = false;
  for (size_t s = 0; s < schedule_.num_slots(); ++s) {
    Slot slot;
    slot.info = schedule_.slot(s);
    for (size_t i = 0; i < sample_args[s].size(); ++i) {
      const at::Tensor& a = sample_args[s][i];
      DWGRAPH_CHECK_ARG(a.defined(), kApi, ": sample_args[", s, "][", i, "] must be a tensor, got an undefined one");
      if (!device_set) {
        device_ = a.device();
        device_set = true;
      }
      DWGRAPH_CHECK_ARG(a.device() == device_, kApi, ": sample_args[", s, "][", i, "] must be on ", device_,
                        " (the device of the first sample argument), got ", a.device());
    }
    slot.buffers = std::make_shared<StaticBuffers>();
    slot.buffers->inputs = StaticInputs(sample_args[s]);
    slot.buffers->slots = {s};
    slots_.push_back(std::move(slot));
    slots_.back().where = describe_slot(s);
  }
  for (const auto& c : callables_) {
    for (size_t i = 0; i < c.parameters.size(); ++i) {
      DWGRAPH_CHECK_ARG(c.parameters[i].device() == device_, kApi, ": parameter '", c.parameter_names[i], "' of '",
                        c.name, "' must be on ", device_, " (the device of the sample arguments), got ",
                        c.parameters[i].device());
    }
    std::vector<FusedParameter> fused;
    for (const auto& m : c.modules) fused.insert(fused.end(), m.fused.begin(), m.fused.end());
    params_.emplace_back(c.parameter_names, c.parameters, c.current_parameters);
    params_.back().watch_slots(c.registered_parameters);
    std::vector<std::string> buffer_names = c.buffer_names;
    for (size_t i = buffer_names.size(); i < c.buffers.size(); ++i) buffer_names.push_back(c10::str("buffer ", i));
    buffer_names.resize(c.buffers.size());
    buffers_.emplace_back(buffer_names, c.buffers, c.current_buffers, "buffer");
    main_grads_.emplace_back(std::move(fused));
    checks_.push_back(std::make_unique<CallableChecks>());
  }
  forward_autocast_ = ops::AutocastState::current();
  grad_at_capture_ = at::GradMode::is_enabled();  // Note [Calls eager autograd would differentiate further]
  inference_at_capture_ = c10::InferenceMode::is_enabled();
  backward_autocast_ = backward_state(forward_autocast_, opts_.backward_under_autocast);
  // Note [Slots share the pool by liveness]: the pipeline schedule's slots follow an
  // explicit order on a pool of their own. (Graph sets sharing a caller's pool, and the
  // sequential schedule, whose callables may be called again whenever they are idle, keep
  // their buffers to themselves.) There, reuse_static_buffers asks for less than the
  // liveness sharing gives (the static inputs of one callable's slots only), so it is
  // subsumed; on a caller's pool it shares them explicitly.
  pooled_buffers_ = schedule_.pipelined() && !opts_.pool;
  if (opts_.reuse_static_buffers && !pooled_buffers_) share_static_buffers();
  pool_ = opts_.pool ? opts_.pool : make_pool(device_);
  DWGRAPH_CHECK_ARG(pool_->device().type() == device_.type(), kApi, ": argument 'pool' is a pool of ",
                    pool_->device(), " but the sample arguments are on ", device_);
  // Note [A second capture on a planned pool]
  if (auto* host = dynamic_cast<HostGraphPool*>(pool_.get()); host != nullptr && pooled_buffers_) {
    const bool hooks = std::any_of(callables_.begin(), callables_.end(),
                                   [](const GraphableCallable& c) { return c.capture_time_hook != nullptr; });
    if (opts_.placement) {
      host->host_pool()->follow_plan(opts_.placement);
    } else if (opts_.plan_placement && !hooks) {
      host->host_pool()->record_allocations(true);
      recorded_placement_ = true;
    }
  }

  for (size_t s = 0; s < slots_.size(); ++s) {
    for (const auto& m : callables_[slots_[s].info.callable].modules) {
      if (m.store && module_defers(m)) m.store->set_graph_owner(where(s));
    }
  }
  // Warmup and capture leave no trace (SPEC C3, C8): the guard puts back .grad,
  // parameter, buffer and main_grad contents, flags, queued units and the RNG, whether
  // they finish or raise.
  CallerStateGuard guard(caller_state());
  capture_guard_ = &guard;
  struct Forget {
    CallerStateGuard*& g;
    ~Forget() { g = nullptr; }
  } forget{capture_guard_};
  if (opts_.num_warmup_iters > 0 || opts_.pre_warmup_hook || opts_.post_warmup_hook) {
    guard.clear_grads();
    run_on_capture_stream(pool_, [this] { warmup(); });
    guard.restore_grads();
  }
  guard.restore_rng();
  guard.retain_consumed_units();  // Note [Backward-dw graphs are captured last]
  try {
    for (const auto& step : schedule_.capture_steps(defers_)) {
      switch (step.phase) {
        case Phase::kForward:
          capture_fwd(step.slot);
          break;
        case Phase::kBackward:
          capture_bwd(step.slot);
          break;
        case Phase::kBackwardDw:
          capture_dw(step.slot);
          break;
      }
    }
  } catch (...) {
    for (auto& slot : slots_) {
      for (auto* g : {&slot.fwd, &slot.bwd}) {
        if (*g) (*g)->reset();
        g->reset();
      }
      for (auto& part : slot.dw_parts) {
        if (part.graph) part.graph->reset();
      }
      slot.dw_parts.clear();
      slot.armed_parts = 0;
      slot.dw_all_parts.clear();
      slot.dw_hooks.clear();
      slot.any_dw_hooks = false;
      slot.dw_unconditional_hooks = 0;
    }
    shared_contributions_.clear();
    pool_.reset();
    throw;
  }
  if (recorded_placement_) static_cast<HostGraphPool&>(*pool_).host_pool()->record_allocations(false);
}

std::shared_ptr<const allocator::PlacementPlan> GraphManager::better_placement() const {
  if (!recorded_placement_ || !pool_) return nullptr;
  const auto& host = static_cast<const HostGraphPool&>(*pool_).host_pool();
  auto plan = std::make_shared<allocator::PlacementPlan>(allocator::plan_placement(host->recorded()));
  const auto reserved = static_cast<size_t>(host->stats().reserved_bytes);
  // Worth a second capture when it saves at least 1% of the pool.
  if (plan->sizes.empty() || plan->extent * 100 > reserved * 99) return nullptr;
  return plan;
}

void GraphManager::share_static_buffers() {
  DWGRAPH_CHECK_ARG(schedule_.pipelined(), kApi, ": reusing static buffers across microbatches needs the pipeline "
                    "schedule ('order')");
  // Each slot's lifetime in capture order: from its forward to its last graph.
  const auto steps = schedule_.capture_steps(defers_);
  std::vector<size_t> first(slots_.size(), steps.size()), last(slots_.size(), 0);
  for (size_t k = 0; k < steps.size(); ++k) {
    first[steps[k].slot] = std::min(first[steps[k].slot], k);
    last[steps[k].slot] = std::max(last[steps[k].slot], k);
  }
  std::vector<size_t> by_start(slots_.size());
  for (size_t s = 0; s < by_start.size(); ++s) by_start[s] = s;
  std::sort(by_start.begin(), by_start.end(), [&](size_t a, size_t b) { return first[a] < first[b]; });
  std::vector<std::shared_ptr<StaticBuffers>> groups;
  std::map<const StaticBuffers*, size_t> holder;  // the group's latest slot
  for (size_t s : by_start) {
    const StaticInputs& mine = slots_[s].buffers->inputs;
    for (auto& g : groups) {
      const size_t h = holder[g.get()];
      if (slots_[h].info.callable != slots_[s].info.callable || last[h] >= first[s]) continue;
      // Arguments repeated and expanded alike too (a review found a slot joining one whose
      // samples repeated a tensor, and running eagerly at every call made as its own).
      if (!g->inputs.interchangeable_with(mine)) continue;
      // The sample's values: warmup and capture of this slot read them.
      g->inputs.copy_values_from(mine);
      slots_[s].buffers = g;
      break;
    }
    if (slots_[s].buffers->slots.front() == s) groups.push_back(slots_[s].buffers);
    slots_[s].buffers->slots.push_back(s);
    holder[slots_[s].buffers.get()] = s;
  }
  for (auto& g : groups) {
    std::sort(g->slots.begin(), g->slots.end());
    g->slots.erase(std::unique(g->slots.begin(), g->slots.end()), g->slots.end());
  }
}

std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables(
    std::vector<GraphableCallable> callables, const std::vector<std::vector<at::Tensor>>& sample_args,
    GraphedCallableOptions options) {
  const auto started = std::chrono::steady_clock::now();
  auto manager = std::make_shared<GraphManager>(callables, options);
  manager->build(sample_args);
  // Note [A second capture on a planned pool]: captures are deterministic, so the second
  // makes the same allocations in the same order, and the pool places them by the plan
  // (where a size or a free range does not match, by best fit: never unsafely). Its
  // caller state is the first's: build() leaves none behind (SPEC C3, C8). It runs no
  // warmup and no warmup hooks (they ran); sets with capture-time hooks, which would see
  // every capture twice, are captured once.
  if (auto plan = manager->better_placement()) {
    const int64_t best_fit = manager->pool()->stats().reserved_bytes;
    manager->reset();
    options.placement = std::move(plan);
    options.num_warmup_iters = 0;
    options.pre_warmup_hook = nullptr;
    options.post_warmup_hook = nullptr;
    manager = std::make_shared<GraphManager>(std::move(callables), std::move(options));
    manager->build(sample_args);
    const int64_t planned = manager->pool()->stats().reserved_bytes;
    if (planned > best_fit) {
      log::warning("make_graphed_callables: the second capture, on a planned pool, holds ", log::format_bytes(planned),
                   " where the first held ", log::format_bytes(best_fit),
                   ": the two captures allocated differently (a module that makes state in its first forward, "
                   "with num_warmup_iters=0?). Pass plan_placement=False to capture once");
    }
  }
  std::vector<std::shared_ptr<GraphedCallable>> out;
  for (size_t s = 0; s < manager->num_slots(); ++s) {
    out.push_back(std::shared_ptr<GraphedCallable>(new GraphedCallable(manager, s)));
  }
  log_capture(out, started);  // INFO line per capture, DEBUG per graph (docs/logging.md)
  return out;
}

}  // namespace dwgraph::graphs
