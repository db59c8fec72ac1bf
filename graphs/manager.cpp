#include "graphs/manager.h"

#include "common/autograd_node.h"
#include "common/check.h"
#include "graphs/capture_log.h"
#include "graphs/handoff.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones_like.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

namespace dwgraph {

enum class SlotState { kIdle, kForward, kBackward };

struct Slot {
  size_t callable = 0;
  int64_t chunk = 0;       // 1-based in the pipeline schedule; 0 in the sequential one
  int64_t microbatch = 0;
  std::vector<at::Tensor> static_inputs;
  std::vector<at::Tensor> captured_outputs;  // with the capture's autograd graph, until bwd capture
  std::vector<at::Tensor> static_outputs;
  std::vector<bool> output_requires_grad;
  std::vector<at::Tensor> static_grad_outputs;
  // Gradient targets of the backward graph: inputs that require grad, then non-deferred
  // parameters that require grad; the graph's results land in static_grad_inputs.
  std::vector<size_t> grad_input_indices;
  std::vector<size_t> grad_param_indices;
  std::vector<at::Tensor> static_grad_inputs;
  std::unique_ptr<graphs::Graph> fwd, bwd, dw;
  std::vector<graphs::Contribution> contributions;
  bool captured_training = true;
  SlotState state = SlotState::kIdle;
};

class GraphManager : public std::enable_shared_from_this<GraphManager> {
 public:
  GraphManager(std::vector<GraphableCallable> callables, GraphedCallableOptions opts)
      : callables_(std::move(callables)), opts_(std::move(opts)) {}

  void build(const std::vector<std::vector<at::Tensor>>& sample_args);
  std::vector<at::Tensor> call(size_t s, const std::vector<at::Tensor>& inputs);
  torch::autograd::variable_list backward(size_t s, const torch::autograd::variable_list& grads);
  void backward_dw(size_t s);
  bool need_backward_dw(size_t s) const { return has_deferred(slots_.at(s).callable); }
  void reset();
  int64_t contribution_bytes(size_t s) const;
  GraphedStats stats() const;
  const std::string& name(size_t s) const { return callables_.at(slots_.at(s).callable).name; }
  std::function<void()> after_backward(size_t s) const { return callables_.at(slots_.at(s).callable).after_backward; }
  size_t num_slots() const { return slots_.size(); }

 private:
  bool has_deferred(size_t c) const { return !callables_[c].deferred_modules.empty(); }
  std::string where(size_t s) const;
  void check_live(const char* what) const;
  std::vector<at::Tensor> deferred_params(size_t c) const;
  bool is_deferred_or_fused(size_t c, const at::Tensor& p) const;
  void name_storages(graphs::Graph& g, size_t s) const;
  void warmup();
  void capture_fwd(size_t s);
  void capture_bwd(size_t s);
  void capture_dw(size_t s);
  template <class Body>
  void capture(std::unique_ptr<graphs::Graph>& g, size_t s, Body&& body);
  void capture_sequential();
  void capture_pipeline();
  std::vector<size_t> chunk_layers(int64_t chunk) const;

  std::vector<GraphableCallable> callables_;
  GraphedCallableOptions opts_;
  std::vector<Slot> slots_;
  std::shared_ptr<graphs::GraphPool> pool_;
  c10::Device device_ = c10::Device(c10::kCPU);
  int64_t microbatches_ = 1;
  std::vector<int64_t> layers_per_chunk_;
  std::vector<std::vector<void*>> param_data_;      // per callable, at capture
  std::vector<std::vector<void*>> main_grad_data_;  // per callable, fused parameters in order
  // Contribution buffers shared by the backward-dw graphs of one callable's microbatches:
  // (callable, module) -> parameter -> buffer. Each backward_dw() hands its contribution
  // off right after its replay, so one buffer serves every microbatch.
  std::map<std::pair<size_t, size_t>, std::map<const void*, at::Tensor>> shared_contributions_;
  bool reset_ = false;
};

namespace {

class GraphedBackward final : public torch::autograd::Node {
 public:
  GraphedBackward(std::shared_ptr<GraphManager> m, size_t slot) : manager_(std::move(m)), slot_(slot) {}
  std::string name() const override { return "dwgraph::GraphedBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    auto out = manager_->backward(slot_, grads);
    if (auto hooks = manager_->after_backward(slot_)) {
      // After autograd has accumulated what this node returns: at the end of the backward.
      torch::autograd::Engine::get_default_engine().queue_callback(std::move(hooks));
    }
    return out;
  }

 private:
  std::shared_ptr<GraphManager> manager_;
  size_t slot_;
};

// A plain alias of `t` (no autograd view tracking), so a node can own its history.
at::Tensor plain_alias(const at::Tensor& t) {
  const at::AutoDispatchBelowADInplaceOrView below;
  return t.view(t.sizes());
}

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return c10::str("a ", t.scalar_type(), " tensor of shape ", t.sizes(), " on ", t.device());
}

struct SavedState {
  std::vector<at::Tensor> grads;
  std::vector<std::pair<at::Tensor, at::Tensor>> contents;  // (tensor, copy)
};

}  // namespace

std::string GraphManager::where(size_t s) const {
  const Slot& slot = slots_.at(s);
  if (slot.chunk == 0) return c10::str("graphed callable ", slot.callable, " ('", callables_[slot.callable].name, "')");
  return c10::str("graphed callable ", slot.callable, " ('", callables_[slot.callable].name, "', chunk ", slot.chunk,
                  ", microbatch ", slot.microbatch, ")");
}

void GraphManager::check_live(const char* what) const {
  DWGRAPH_CHECK_STATE(!reset_, "dwgraph: ", what, " after reset(): the graphs, their pool and contributions were "
                               "released; build new graphed callables with make_graphed_callables");
}

std::vector<at::Tensor> GraphManager::deferred_params(size_t c) const {
  std::vector<at::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& m : callables_[c].deferred_modules) {
    for (const auto& p : m.deferred_parameters) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
    }
  }
  return out;
}

bool GraphManager::is_deferred_or_fused(size_t c, const at::Tensor& p) const {
  for (const auto& m : callables_[c].deferred_modules) {
    if (!m.exact_deferred) continue;  // may land in the main backward too: stays a target
    for (const auto& q : m.deferred_parameters) {
      if (q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return true;
    }
    for (const auto& q : m.fused_parameters) {
      if (q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return true;
    }
  }
  return false;
}

void GraphManager::name_storages(graphs::Graph& g, size_t s) const {
  const Slot& slot = slots_[s];
  const auto& c = callables_[slot.callable];
  for (size_t i = 0; i < slot.static_inputs.size(); ++i) {
    if (slot.static_inputs[i].defined()) g.set_role(slot.static_inputs[i].storage(), c10::str("static input ", i, " of ", where(s)), true);
  }
  for (size_t i = 0; i < c.parameters.size(); ++i) {
    const auto& p = c.parameters[i];
    g.set_role(p.storage(), c10::str("parameter '", c.parameter_names.at(i), "' of ", where(s)), true);
    if (p.grad().defined()) g.set_role(p.grad().storage(), c10::str(".grad of parameter '", c.parameter_names.at(i), "'"), false);
  }
  for (const auto& m : c.deferred_modules) {
    for (size_t i = 0; i < m.fused_parameters.size(); ++i) {
      g.set_role(m.main_grad(i).storage(), c10::str("main_grad of parameter '", m.fused_parameter_names.at(i), "'"), true);
    }
  }
  for (size_t i = 0; i < slot.static_grad_outputs.size(); ++i) {
    if (slot.static_grad_outputs[i].defined()) g.set_role(slot.static_grad_outputs[i].storage(), c10::str("static grad output ", i, " of ", where(s)), true);
  }
}

template <class Body>
void GraphManager::capture(std::unique_ptr<graphs::Graph>& g, size_t s, Body&& body) {
  g = graphs::make_graph(device_);
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
}

void GraphManager::warmup() {
  // Warmup leaves no trace: .grad, main_grad, buffers and the RNG state are put back.
  SavedState saved;
  std::vector<at::Tensor> all_params;
  std::unordered_set<const void*> seen;
  for (const auto& c : callables_) {
    for (const auto& p : c.parameters) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) all_params.push_back(p);
    }
    for (const auto& m : c.deferred_modules) {
      for (size_t i = 0; i < m.fused_parameters.size(); ++i) {
        const at::Tensor mg = m.main_grad(i);
        saved.contents.emplace_back(mg, mg.clone());
      }
    }
    for (const auto& b : c.buffers) saved.contents.emplace_back(b, b.clone());
  }
  for (const auto& p : all_params) {
    saved.grads.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  auto gen = at::globalContext().defaultGenerator(device_);
  const at::Tensor rng = gen.get_state();
  try {
    for (int it = 0; it < opts_.num_warmup_iters; ++it) {
      for (size_t s = 0; s < slots_.size(); ++s) {
        Slot& slot = slots_[s];
        const auto& c = callables_[slot.callable];
        auto outputs = c.forward(slot.static_inputs);
        std::vector<at::Tensor> outs, grads_out, targets;
        for (const auto& o : outputs) {
          if (o.defined() && o.requires_grad()) {
            outs.push_back(o);
            grads_out.push_back(at::ones_like(o));
          }
        }
        for (const auto& x : slot.static_inputs) {
          if (x.requires_grad()) targets.push_back(x);
        }
        for (const auto& p : c.parameters) {
          if (p.requires_grad() && !is_deferred_or_fused(slot.callable, p)) targets.push_back(p);
        }
        if (!outs.empty()) {
          if (targets.empty()) {
            torch::autograd::backward(outs, grads_out);
          } else {
            torch::autograd::grad(outs, targets, grads_out, /*retain_graph=*/false, /*create_graph=*/false,
                                  /*allow_unused=*/true);
          }
        }
        for (const auto& m : c.deferred_modules) {
          if (m.need_backward_dw()) m.backward_dw();
        }
      }
    }
  } catch (...) {
    gen.set_state(rng);
    for (size_t i = 0; i < all_params.size(); ++i) all_params[i].mutable_grad() = saved.grads[i];
    for (auto& [t, copy] : saved.contents) t.copy_(copy);
    throw;
  }
  gen.set_state(rng);
  const at::NoGradGuard no_grad;
  for (size_t i = 0; i < all_params.size(); ++i) all_params[i].mutable_grad() = saved.grads[i];
  for (auto& [t, copy] : saved.contents) t.copy_(copy);
}

void GraphManager::capture_fwd(size_t s) {
  Slot& slot = slots_[s];
  const auto& c = callables_[slot.callable];
  slot.captured_training = c.is_training ? c.is_training() : true;
  std::vector<at::Tensor> outputs;
  capture(slot.fwd, s, [&] { outputs = c.forward(slot.static_inputs); });
  slot.captured_outputs = outputs;
  for (const auto& o : outputs) {
    DWGRAPH_CHECK_ARG(o.defined(), "dwgraph.make_graphed_callables: ", where(s),
                      " returned an undefined output; expected tensors");
    slot.static_outputs.push_back(o.detach());
    slot.output_requires_grad.push_back(o.requires_grad());
  }
}

void GraphManager::capture_bwd(size_t s) {
  Slot& slot = slots_[s];
  const auto& c = callables_[slot.callable];
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < slot.captured_outputs.size(); ++i) {
    const auto& o = slot.captured_outputs[i];
    if (slot.output_requires_grad[i]) {
      outs.push_back(o);
      slot.static_grad_outputs.push_back(at::empty_like(o).detach());
    } else {
      slot.static_grad_outputs.emplace_back();
    }
  }
  std::vector<at::Tensor> targets;
  for (size_t i = 0; i < slot.static_inputs.size(); ++i) {
    if (slot.static_inputs[i].requires_grad()) {
      slot.grad_input_indices.push_back(i);
      targets.push_back(slot.static_inputs[i]);
    }
  }
  for (size_t i = 0; i < c.parameters.size(); ++i) {
    if (c.parameters[i].requires_grad() && !is_deferred_or_fused(slot.callable, c.parameters[i])) {
      slot.grad_param_indices.push_back(i);
      targets.push_back(c.parameters[i]);
    }
  }
  if (outs.empty()) {
    slot.captured_outputs.clear();
    return;  // nothing to differentiate: no backward graph
  }
  std::vector<at::Tensor> grad_outs;
  for (const auto& g : slot.static_grad_outputs) {
    if (g.defined()) grad_outs.push_back(g);
  }
  // The captured kernels must write only fresh graph-pool buffers (SPEC C3).
  std::vector<at::Tensor> caller_grads;
  for (const auto& p : c.parameters) {
    caller_grads.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  auto restore = [&] {
    for (size_t i = 0; i < c.parameters.size(); ++i) c.parameters[i].mutable_grad() = caller_grads[i];
  };
  std::vector<at::Tensor> grads;
  try {
    capture(slot.bwd, s, [&] {
      if (targets.empty()) {
        torch::autograd::backward(outs, grad_outs, opts_.retain_graph_in_backward);
      } else {
        grads = torch::autograd::grad(outs, targets, grad_outs, opts_.retain_graph_in_backward,
                                      /*create_graph=*/false, /*allow_unused=*/true);
      }
    });
  } catch (...) {
    restore();
    throw;
  }
  restore();
  if (!opts_.allow_unused_input) {
    for (size_t j = 0; j < slot.grad_input_indices.size(); ++j) {
      DWGRAPH_CHECK_ARG(grads.size() > j && grads[j].defined(), "dwgraph.make_graphed_callables: ", where(s),
                        ": sample input ", slot.grad_input_indices[j],
                        " requires grad but the outputs do not depend on it; pass allow_unused_input=True "
                        "or detach it");
    }
  }
  slot.static_grad_inputs = grads;
  if (!opts_.retain_graph_in_backward) slot.captured_outputs.clear();
}

void GraphManager::capture_dw(size_t s) {
  Slot& slot = slots_[s];
  const auto& c = callables_[slot.callable];
  const auto params = deferred_params(slot.callable);
  std::vector<at::Tensor> caller_grads;
  for (const auto& p : params) caller_grads.push_back(p.grad());
  if (!opts_.unsafe_capture_with_caller_grad) {
    for (const auto& p : params) p.mutable_grad() = at::Tensor();
  }
  auto restore = [&] {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = caller_grads[i];
  };
  // One contribution per (module, parameter), in the order the modules land them, so a
  // parameter tied between two modules receives a, then b, exactly as the eager modules
  // hand them over (.grad = a; .grad += b).
  std::vector<graphs::Contribution> contributions;
  try {
    capture(slot.dw, s, [&] {
      for (size_t k = 0; k < c.deferred_modules.size(); ++k) {
        const auto& m = c.deferred_modules[k];
        DWGRAPH_CHECK_STATE(m.need_backward_dw(), "dwgraph.make_graphed_callables: module '", m.name,
                            "' of ", where(s), " does not need backward_dw()");
        auto& shared = shared_contributions_[{slot.callable, k}];
        if (!opts_.unsafe_capture_with_caller_grad) {
          // An earlier microbatch's graph of this callable already has a buffer for this
          // parameter: land into it (zeroed in the graph, then the gradient added).
          for (const auto& p : m.deferred_parameters) {
            auto it = shared.find(p.unsafeGetTensorImpl());
            if (it == shared.end()) continue;
            it->second.zero_();
            p.mutable_grad() = it->second;
          }
        }
        m.backward_dw();
        if (opts_.unsafe_capture_with_caller_grad) continue;
        for (size_t i = 0; i < m.deferred_parameters.size(); ++i) {
          const at::Tensor& p = m.deferred_parameters[i];
          if (!p.grad().defined()) continue;
          contributions.push_back(graphs::Contribution{p, p.grad(), m.deferred_parameter_names.at(i)});
          shared.emplace(p.unsafeGetTensorImpl(), p.grad());
          p.mutable_grad() = at::Tensor();
        }
      }
    });
  } catch (...) {
    restore();
    throw;
  }
  slot.contributions = std::move(contributions);
  restore();
}

std::vector<size_t> GraphManager::chunk_layers(int64_t chunk) const {
  int64_t offset = 0;
  for (int64_t c = 1; c < chunk; ++c) offset += layers_per_chunk_[c - 1];
  std::vector<size_t> out;
  for (int64_t l = 0; l < layers_per_chunk_[chunk - 1]; ++l) out.push_back(static_cast<size_t>(offset + l));
  return out;
}

void GraphManager::capture_sequential() {
  for (size_t s = 0; s < slots_.size(); ++s) capture_fwd(s);
  for (size_t s = slots_.size(); s-- > 0;) capture_bwd(s);
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (has_deferred(slots_[s].callable)) capture_dw(s);
  }
}

void GraphManager::capture_pipeline() {
  const auto& order = *opts_.order;
  const auto chunks = static_cast<int64_t>(layers_per_chunk_.size());
  auto slot_of = [&](int64_t chunk, int64_t m, size_t layer_callable) {
    int64_t offset = 0;
    for (int64_t c = 1; c < chunk; ++c) offset += layers_per_chunk_[c - 1];
    const int64_t l = static_cast<int64_t>(layer_callable) - offset;
    return static_cast<size_t>(offset * microbatches_ + m * layers_per_chunk_[chunk - 1] + l);
  };
  std::vector<int64_t> fwd(chunks + 1, 0), bwd(chunks + 1, 0), dw(chunks + 1, 0);
  for (size_t k = 0; k < order.size(); ++k) {
    const double o = order[k];
    const double mag = std::fabs(o);
    const bool is_dw = o < 0 && std::fabs(mag - std::floor(mag) - 0.5) < 1e-9;
    const int64_t chunk = static_cast<int64_t>(is_dw ? std::floor(mag) : mag);
    if (o > 0) {
      const int64_t m = fwd[chunk]++;
      for (size_t layer : chunk_layers(chunk)) capture_fwd(slot_of(chunk, m, layer));
    } else if (!is_dw) {
      const int64_t m = bwd[chunk]++;
      const auto layers = chunk_layers(chunk);
      for (auto it = layers.rbegin(); it != layers.rend(); ++it) capture_bwd(slot_of(chunk, m, *it));
    } else {
      const int64_t m = dw[chunk]++;
      for (size_t layer : chunk_layers(chunk)) {
        if (has_deferred(layer)) capture_dw(slot_of(chunk, m, layer));
      }
    }
  }
}

void GraphManager::build(const std::vector<std::vector<at::Tensor>>& sample_args) {
  const char* api = "dwgraph.make_graphed_callables";
  DWGRAPH_CHECK_ARG(!callables_.empty(), api, ": argument 'modules' must hold at least one callable, got none");
  DWGRAPH_CHECK_ARG(opts_.num_warmup_iters >= 0, api, ": argument 'num_warmup_iters' must be >= 0, got ",
                    opts_.num_warmup_iters);
  const size_t n = callables_.size();
  if (opts_.order.has_value()) {
    const auto& order = *opts_.order;
    // Chunks and layers per chunk.
    int64_t max_chunk = 0;
    for (size_t k = 0; k < order.size(); ++k) {
      const double o = order[k];
      const double mag = std::fabs(o);
      const double frac = mag - std::floor(mag);
      const bool ok = mag >= 1 && (frac == 0.0 || (o < 0 && std::fabs(frac - 0.5) < 1e-9));
      DWGRAPH_CHECK_ARG(ok, api, ": argument 'order' entry ", k, " is ", o,
                        "; expected +c (forward of chunk c), -c (its backward) or -(c + 0.5) (its "
                        "backward-dw), with chunks numbered from 1");
      max_chunk = std::max<int64_t>(max_chunk, static_cast<int64_t>(std::floor(mag)));
    }
    if (opts_.num_layers_per_chunk.has_value()) {
      layers_per_chunk_ = *opts_.num_layers_per_chunk;
      DWGRAPH_CHECK_ARG(static_cast<int64_t>(layers_per_chunk_.size()) == max_chunk, api,
                        ": argument 'num_layers_per_chunk' must have one entry per chunk (", max_chunk,
                        " in 'order'), got ", layers_per_chunk_.size());
    } else {
      DWGRAPH_CHECK_ARG(max_chunk > 0 && static_cast<int64_t>(n) % max_chunk == 0, api, ": ", n,
                        " callables cannot be split evenly over the ", max_chunk,
                        " chunks of 'order'; pass num_layers_per_chunk");
      layers_per_chunk_.assign(max_chunk, static_cast<int64_t>(n) / max_chunk);
    }
    int64_t total_layers = 0;
    for (int64_t l : layers_per_chunk_) {
      DWGRAPH_CHECK_ARG(l > 0, api, ": argument 'num_layers_per_chunk' entries must be > 0, got ", l);
      total_layers += l;
    }
    DWGRAPH_CHECK_ARG(total_layers == static_cast<int64_t>(n), api, ": num_layers_per_chunk sums to ",
                      total_layers, " but ", n, " callables were given");
    // Validate the order: forwards, backwards after forwards, backward-dw after backwards.
    std::vector<int64_t> fwd(max_chunk + 1, 0), bwd(max_chunk + 1, 0), dw(max_chunk + 1, 0);
    std::vector<bool> chunk_deferred(max_chunk + 1, false);
    for (int64_t c = 1; c <= max_chunk; ++c) {
      for (size_t layer : chunk_layers(c)) chunk_deferred[c] = chunk_deferred[c] || has_deferred(layer);
    }
    for (size_t k = 0; k < order.size(); ++k) {
      const double o = order[k];
      const double mag = std::fabs(o);
      const bool is_dw = o < 0 && mag != std::floor(mag);
      const auto c = static_cast<int64_t>(std::floor(mag));
      if (o > 0) {
        ++fwd[c];
      } else if (!is_dw) {
        DWGRAPH_CHECK_ARG(bwd[c] < fwd[c], api, ": argument 'order' entry ", k, " (", o, ") is backward ",
                          bwd[c] + 1, " of chunk ", c, " but only ", fwd[c], " forwards of that chunk come before it");
        ++bwd[c];
      } else {
        DWGRAPH_CHECK_ARG(chunk_deferred[c], api, ": argument 'order' entry ", k, " (", o,
                          ") is a backward-dw of chunk ", c, ", which has no module with deferred weight gradients");
        DWGRAPH_CHECK_ARG(dw[c] < bwd[c], api, ": argument 'order' entry ", k, " (", o, ") is backward-dw ",
                          dw[c] + 1, " of chunk ", c, " but only ", bwd[c], " backwards of that chunk come before it");
        ++dw[c];
      }
    }
    microbatches_ = fwd[1];
    for (int64_t c = 1; c <= max_chunk; ++c) {
      DWGRAPH_CHECK_ARG(fwd[c] == microbatches_ && bwd[c] == microbatches_, api, ": argument 'order' has ", fwd[c],
                        " forwards and ", bwd[c], " backwards of chunk ", c, "; expected ", microbatches_,
                        " of each (one per microbatch, as chunk 1)");
      DWGRAPH_CHECK_ARG(dw[c] == (chunk_deferred[c] ? microbatches_ : 0), api, ": argument 'order' has ", dw[c],
                        " backward-dw entries of chunk ", c, "; expected ", chunk_deferred[c] ? microbatches_ : 0,
                        chunk_deferred[c] ? " (one after each backward)" : " (it has no deferred weight gradients)");
    }
    DWGRAPH_CHECK_ARG(static_cast<int64_t>(sample_args.size()) == microbatches_ * static_cast<int64_t>(n), api,
                      ": argument 'sample_args' must hold one entry per (callable, microbatch) slot (",
                      microbatches_ * static_cast<int64_t>(n), "), got ", sample_args.size());
    for (int64_t c = 1; c <= max_chunk; ++c) {
      const auto layers = chunk_layers(c);
      for (int64_t m = 0; m < microbatches_; ++m) {
        for (size_t layer : layers) {
          Slot slot;
          slot.callable = layer;
          slot.chunk = c;
          slot.microbatch = m;
          slots_.push_back(std::move(slot));
        }
      }
    }
  } else {
    DWGRAPH_CHECK_ARG(opts_.num_layers_per_chunk == std::nullopt, api,
                      ": argument 'num_layers_per_chunk' needs 'order' (the pipeline schedule)");
    DWGRAPH_CHECK_ARG(sample_args.size() == n, api, ": argument 'sample_args' must hold one entry per callable (", n,
                      "), got ", sample_args.size());
    for (size_t i = 0; i < n; ++i) {
      Slot slot;
      slot.callable = i;
      slots_.push_back(std::move(slot));
    }
  }
  // Static inputs: leaves like the samples (same requires_grad), owned by the manager.
  bool device_set = false;
  for (size_t s = 0; s < slots_.size(); ++s) {
    for (size_t i = 0; i < sample_args[s].size(); ++i) {
      const at::Tensor& a = sample_args[s][i];
      DWGRAPH_CHECK_ARG(a.defined(), api, ": sample_args[", s, "][", i, "] must be a tensor, got an undefined one");
      if (!device_set) {
        device_ = a.device();
        device_set = true;
      }
      DWGRAPH_CHECK_ARG(a.device() == device_, api, ": sample_args[", s, "][", i, "] must be on ", device_,
                        " (the device of the first sample argument), got ", a.device());
      slots_[s].static_inputs.push_back(a.detach().clone().requires_grad_(a.requires_grad()));
    }
  }
  for (const auto& c : callables_) {
    std::vector<void*> ptrs;
    for (const auto& p : c.parameters) {
      DWGRAPH_CHECK_ARG(p.device() == device_, api, ": parameter of '", c.name, "' must be on ", device_,
                        " (the device of the sample arguments), got ", p.device());
      ptrs.push_back(p.data_ptr());
    }
    param_data_.push_back(std::move(ptrs));
    std::vector<void*> mg;
    for (const auto& m : c.deferred_modules) {
      for (size_t i = 0; i < m.fused_parameters.size(); ++i) mg.push_back(m.main_grad(i).data_ptr());
    }
    main_grad_data_.push_back(std::move(mg));
  }
  pool_ = opts_.pool ? opts_.pool : graphs::make_pool(device_);
  if (opts_.num_warmup_iters > 0) graphs::run_on_side_stream(device_, [this] { warmup(); });

  // Keep every queued unit's tensors alive until the last backward-dw graph is captured.
  for (auto& c : callables_) {
    for (auto& m : c.deferred_modules) {
      if (m.retain_consumed) m.retain_consumed(true);
    }
  }
  auto release = [&] {
    for (auto& c : callables_) {
      for (auto& m : c.deferred_modules) {
        if (m.retain_consumed) m.retain_consumed(false);
        if (m.release_consumed) m.release_consumed();
      }
    }
  };
  const at::Tensor rng = at::globalContext().defaultGenerator(device_).get_state();
  try {
    if (opts_.order.has_value()) {
      capture_pipeline();
    } else {
      capture_sequential();
    }
  } catch (...) {
    release();
    auto gen = at::globalContext().defaultGenerator(device_);
    gen.set_state(rng);
    for (auto& slot : slots_) {
      for (auto* g : {&slot.fwd, &slot.bwd, &slot.dw}) {
        if (*g) (*g)->reset();
      }
    }
    pool_.reset();
    throw;
  }
  release();
  auto gen = at::globalContext().defaultGenerator(device_);
  gen.set_state(rng);
}

std::vector<at::Tensor> GraphManager::call(size_t s, const std::vector<at::Tensor>& inputs) {
  check_live("calling a graphed callable");
  Slot& slot = slots_.at(s);
  const auto& c = callables_[slot.callable];
  if (c.is_training && c.is_training() != slot.captured_training) {
    return c.forward(inputs);  // a mode the graphs were not captured in: run eagerly
  }
  DWGRAPH_CHECK_ARG(inputs.size() == slot.static_inputs.size(), where(s), ": expected ", slot.static_inputs.size(),
                    " tensor arguments as at capture, got ", inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& x = inputs[i];
    const auto& st = slot.static_inputs[i];
    DWGRAPH_CHECK_ARG(x.defined() && x.sizes() == st.sizes() && x.scalar_type() == st.scalar_type() &&
                          x.device() == st.device(),
                      where(s), ": argument ", i, " must be ", describe(st), " as at capture, got ", describe(x));
  }
  for (size_t i = 0; i < c.parameters.size(); ++i) {
    DWGRAPH_CHECK_STATE(c.parameters[i].data_ptr() == param_data_[slot.callable][i], where(s), ": parameter '",
                        c.parameter_names[i], "' was reallocated since capture (its data moved); the graphs "
                        "would use the old memory. reset() and capture again");
  }
  {
    // main_grad is persistent and written in the graph: it must still be the same storage.
    size_t k = 0;
    for (const auto& m : c.deferred_modules) {
      for (size_t i = 0; i < m.fused_parameters.size(); ++i, ++k) {
        DWGRAPH_CHECK_STATE(m.main_grad(i).data_ptr() == main_grad_data_[slot.callable][k], where(s),
                            ": main_grad of parameter '", m.fused_parameter_names[i],
                            "' was replaced or reallocated since capture; the graphs accumulate into the "
                            "captured buffer. Zero it in place instead, or reset() and capture again");
      }
    }
  }
  DWGRAPH_CHECK_STATE(slot.state != SlotState::kBackward, where(s),
                      ": called again while the backward_dw() of its previous backward is pending; call "
                      "backward_dw() first");
  {
    const at::NoGradGuard no_grad;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].data_ptr() != slot.static_inputs[i].data_ptr()) slot.static_inputs[i].copy_(inputs[i]);
    }
  }
  slot.fwd->replay();
  std::vector<at::Tensor> outs;
  for (const auto& o : slot.static_outputs) outs.push_back(plain_alias(o));
  // Autograd edges: inputs that require grad, then non-deferred parameters (as captured).
  bool needs_node = false;
  for (bool r : slot.output_requires_grad) needs_node = needs_node || r;
  if (needs_node && at::GradMode::is_enabled() && slot.bwd) {
    auto node = detail::make_node<GraphedBackward>(shared_from_this(), s);
    torch::autograd::edge_list edges;
    for (size_t i : slot.grad_input_indices) edges.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
    for (size_t i : slot.grad_param_indices) edges.push_back(torch::autograd::impl::gradient_edge(c.parameters[i]));
    for (size_t e = 0; e < edges.size(); ++e) {
      const at::Tensor& t = e < slot.grad_input_indices.size() ? inputs[slot.grad_input_indices[e]]
                                                               : c.parameters[slot.grad_param_indices[e - slot.grad_input_indices.size()]];
      if (!t.requires_grad()) edges[e] = torch::autograd::Edge();
    }
    node->set_next_edges(std::move(edges));
    detail::NodePtr base = node;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (slot.output_requires_grad[i]) torch::autograd::set_history(outs[i], base);
    }
  }
  slot.state = SlotState::kForward;
  return outs;
}

torch::autograd::variable_list GraphManager::backward(size_t s, const torch::autograd::variable_list& grads) {
  check_live("backward through a graphed callable");
  Slot& slot = slots_.at(s);
  {
    const at::NoGradGuard no_grad;
    size_t k = 0;
    for (size_t i = 0; i < slot.static_outputs.size(); ++i) {
      if (!slot.output_requires_grad[i]) continue;
      const at::Tensor& g = k < grads.size() ? grads[k] : at::Tensor();
      ++k;
      at::Tensor& dst = slot.static_grad_outputs[i];
      if (!g.defined()) {
        dst.zero_();
      } else if (g.data_ptr() != dst.data_ptr()) {
        dst.copy_(g);
      }
    }
  }
  slot.bwd->replay();
  // The caller owns what autograd receives: never the buffers the next replay rewrites.
  torch::autograd::variable_list out;
  for (const auto& g : slot.static_grad_inputs) out.push_back(g.defined() ? g.clone() : at::Tensor());
  slot.state = has_deferred(slot.callable) ? SlotState::kBackward : SlotState::kIdle;
  return out;
}

void GraphManager::backward_dw(size_t s) {
  check_live("backward_dw()");
  Slot& slot = slots_.at(s);
  const auto& c = callables_[slot.callable];
  DWGRAPH_CHECK_STATE(has_deferred(slot.callable), where(s),
                      ".backward_dw(): it has no module with deferred weight gradients");
  DWGRAPH_CHECK_STATE(slot.state == SlotState::kBackward, where(s), ".backward_dw(): ",
                      slot.state == SlotState::kForward ? "its backward has not run yet"
                                                        : "no backward is pending (called before any backward, or twice)");
  graphs::check_hand_off(slot.contributions, where(s) + ".backward_dw()");  // before anything is written
  slot.dw->replay();
  graphs::hand_off(slot.contributions);
  slot.state = SlotState::kIdle;
  // The flag first, as the eager path sets it in the GEMM: hooks (Megatron's reduce hook)
  // read it.
  for (const auto& m : c.deferred_modules) {
    for (size_t i = 0; i < m.fused_parameters.size(); ++i) {
      if (m.mark_main_grad_accumulated) m.mark_main_grad_accumulated(i);
    }
  }
  for (const auto& m : c.deferred_modules) {
    if (m.run_hooks) m.run_hooks();
  }
}

void GraphManager::reset() {
  for (auto& slot : slots_) {
    for (auto* g : {&slot.fwd, &slot.bwd, &slot.dw}) {
      if (*g) (*g)->reset();
      g->reset();
    }
    slot.contributions.clear();
    slot.static_inputs.clear();
    slot.static_outputs.clear();
    slot.captured_outputs.clear();
    slot.static_grad_outputs.clear();
    slot.static_grad_inputs.clear();
  }
  shared_contributions_.clear();
  pool_.reset();
  reset_ = true;
}

int64_t GraphManager::contribution_bytes(size_t s) const {
  int64_t n = 0;
  for (const auto& c : slots_.at(s).contributions) n += static_cast<int64_t>(c.buffer.nbytes());
  return n;
}

GraphedStats GraphManager::stats() const {
  GraphedStats st;
  if (pool_) st.pool = pool_->stats();
  auto bytes = [](const std::vector<at::Tensor>& v) {
    int64_t n = 0;
    for (const auto& t : v) n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
    return n;
  };
  std::unordered_set<const void*> seen;
  for (size_t s = 0; s < slots_.size(); ++s) {
    const Slot& slot = slots_[s];
    for (const auto& c : slot.contributions) {
      if (seen.insert(c.buffer.storage().data()).second) st.contribution_bytes += static_cast<int64_t>(c.buffer.nbytes());
    }
    st.static_bytes += bytes(slot.static_inputs) + bytes(slot.static_outputs) + bytes(slot.static_grad_outputs) +
                       bytes(slot.static_grad_inputs);
    const std::pair<const char*, const std::unique_ptr<graphs::Graph>*> kinds[] = {
        {"forward", &slot.fwd}, {"backward", &slot.bwd}, {"backward-dw", &slot.dw}};
    for (const auto& [kind, g] : kinds) {
      if (*g) st.graphs.push_back(GraphInfo{where(s), kind, (*g)->num_kernels()});
    }
  }
  st.num_graphs = st.graphs.size();
  return st;
}

// ---- GraphedCallable ------------------------------------------------------------------

std::vector<at::Tensor> GraphedCallable::operator()(const std::vector<at::Tensor>& inputs) {
  return manager_->call(index_, inputs);
}
void GraphedCallable::backward_dw() { manager_->backward_dw(index_); }
bool GraphedCallable::need_backward_dw() const { return manager_->need_backward_dw(index_); }
void GraphedCallable::reset() { manager_->reset(); }
int64_t GraphedCallable::contribution_bytes() const { return manager_->contribution_bytes(index_); }
const std::string& GraphedCallable::name() const { return manager_->name(index_); }

std::vector<std::shared_ptr<GraphedCallable>> make_graphed_callables(
    std::vector<GraphableCallable> callables, const std::vector<std::vector<at::Tensor>>& sample_args,
    GraphedCallableOptions options) {
  const auto started = std::chrono::steady_clock::now();  // for the capture log below
  auto manager = std::make_shared<GraphManager>(std::move(callables), std::move(options));
  manager->build(sample_args);
  std::vector<std::shared_ptr<GraphedCallable>> out;
  for (size_t s = 0; s < manager->num_slots(); ++s) {
    out.push_back(std::shared_ptr<GraphedCallable>(new GraphedCallable(manager, s)));
  }
  graphs::log_capture(out, started);  // INFO line per capture, DEBUG per graph (docs/logging.md)
  return out;
}

GraphedStats graphed_stats(const GraphedCallable& any) { return any.manager_->stats(); }

}  // namespace dwgraph
