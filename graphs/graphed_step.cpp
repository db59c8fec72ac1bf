#include "graphs/graphed_step.h"

#include "common/check.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <sstream>

namespace dwgraph {

struct GraphedStep::Entry {
  int calls = 0;
  std::unique_ptr<graphs::Graph> graph;
  std::vector<at::Tensor> static_inputs;
  std::vector<at::Tensor> static_outputs;
  std::vector<graphs::Contribution> contributions;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<bool> requires_grad;
  std::vector<void*> param_data;
  std::vector<void*> main_grad_data;
  std::vector<std::string> main_grad_names;
};

namespace {

constexpr const char* kApi = "dwgraph.graphed_step";

std::string tensor_key(const at::Tensor& t) {
  std::ostringstream os;
  if (!t.defined()) return "None;";
  os << t.scalar_type() << t.sizes() << '@' << t.device() << (t.requires_grad() ? "g" : "") << ';';
  return os.str();
}

}  // namespace

GraphedStep::GraphedStep(StepFn step, GraphedStepOptions options)
    : step_(std::move(step)), opts_(std::move(options)), pool_(opts_.pool) {
  DWGRAPH_CHECK_ARG(step_ != nullptr, kApi, ": argument 'fn' must be a callable step, got none");
  DWGRAPH_CHECK_ARG(opts_.warmup_iters >= 0, kApi, ": argument 'warmup_iters' must be >= 0, got ", opts_.warmup_iters);
  DWGRAPH_CHECK_ARG(opts_.max_graphs >= 1, kApi, ": argument 'max_graphs' must be >= 1, got ", opts_.max_graphs);
}

GraphedStep::~GraphedStep() { reset(); }

size_t GraphedStep::num_graphs() const {
  size_t n = 0;
  for (const auto& [key, e] : entries_) n += e->graph ? 1 : 0;
  return n;
}

void GraphedStep::reset() {
  for (auto& [key, e] : entries_) {
    if (e->graph) e->graph->reset();
  }
  entries_.clear();
  lru_.clear();
  if (!opts_.pool) pool_.reset();
}

std::vector<at::Tensor> GraphedStep::operator()(const std::vector<at::Tensor>& tensors, const std::string& key) {
  if (device_known_) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      DWGRAPH_CHECK_ARG(!tensors[i].defined() || tensors[i].device() == device_, kApi, ": tensor argument ", i,
                        " is on ", tensors[i].device(), " but the step runs on ", device_,
                        " (its parameters' device); move it there first");
    }
  }
  std::string full = key + "|";
  for (const auto& t : tensors) full += tensor_key(t);
  auto it = entries_.find(full);
  if (it == entries_.end()) {
    // A new key: warmup and capture again, releasing the least recently used graph first.
    while (static_cast<int64_t>(entries_.size()) >= opts_.max_graphs) {
      const std::string victim = lru_.back();
      lru_.pop_back();
      auto& e = entries_.at(victim);
      if (e->graph) e->graph->reset();
      entries_.erase(victim);
    }
    it = entries_.emplace(full, std::make_unique<Entry>()).first;
    lru_.push_front(full);
  } else {
    lru_.remove(full);
    lru_.push_front(full);
  }
  Entry& e = *it->second;
  ++e.calls;
  if (e.calls <= opts_.warmup_iters) return step_(tensors);  // warmup: the real step, eagerly
  if (!e.graph) return capture(e, tensors);
  return replay(e, tensors);
}

std::vector<at::Tensor> GraphedStep::capture(Entry& e, const std::vector<at::Tensor>& tensors) {
  e.params = opts_.params ? opts_.params() : std::vector<at::Tensor>{};
  e.names = opts_.param_names ? opts_.param_names() : std::vector<std::string>{};
  e.names.resize(e.params.size(), "?");
  if (!e.params.empty()) {
    device_ = e.params[0].device();
  } else if (!tensors.empty() && tensors[0].defined()) {
    device_ = tensors[0].device();
  }
  device_known_ = true;
  for (size_t i = 0; i < e.params.size(); ++i) {
    DWGRAPH_CHECK_ARG(e.params[i].device() == device_, kApi, ": parameter '", e.names[i], "' is on ",
                      e.params[i].device(), " but the step's other parameters are on ", device_);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    DWGRAPH_CHECK_ARG(!tensors[i].defined() || tensors[i].device() == device_, kApi, ": tensor argument ", i,
                      " is on ", tensors[i].device(), " but the step runs on ", device_,
                      " (its parameters' device); move it there first");
  }
  e.static_inputs.clear();
  for (const auto& t : tensors) {
    e.static_inputs.push_back(t.defined() ? t.detach().clone().requires_grad_(t.requires_grad()) : at::Tensor());
  }
  if (!pool_) pool_ = graphs::make_pool(device_);
  // Every gradient of the step lands in a fresh graph-pool buffer (SPEC C3/C4).
  std::vector<at::Tensor> caller_grads;
  for (const auto& p : e.params) {
    caller_grads.push_back(p.grad());
    p.mutable_grad() = at::Tensor();
  }
  auto restore = [&] {
    for (size_t i = 0; i < e.params.size(); ++i) e.params[i].mutable_grad() = caller_grads[i];
    if (opts_.capturing) opts_.capturing(false);
  };
  auto graph = graphs::make_graph(device_);
  for (size_t i = 0; i < e.static_inputs.size(); ++i) {
    if (e.static_inputs[i].defined()) graph->set_role(e.static_inputs[i].storage(), c10::str("static input ", i), true);
  }
  for (size_t i = 0; i < e.params.size(); ++i) {
    graph->set_role(e.params[i].storage(), c10::str("parameter '", e.names[i], "'"), true);
  }
  std::vector<at::Tensor> outs;
  if (opts_.capturing) opts_.capturing(true);
  try {
    graph->capture_begin(pool_);
    try {
      outs = step_(e.static_inputs);
    } catch (...) {
      graph->capture_abort();
      throw;
    }
    graph->capture_end();
  } catch (...) {
    restore();
    throw;
  }
  e.contributions.clear();
  for (size_t i = 0; i < e.params.size(); ++i) {
    if (e.params[i].grad().defined()) {
      e.contributions.push_back(graphs::Contribution{e.params[i], e.params[i].grad(), e.names[i]});
    }
  }
  restore();
  e.static_outputs.clear();
  for (const auto& o : outs) e.static_outputs.push_back(o.defined() ? o.detach() : at::Tensor());
  e.requires_grad.clear();
  e.param_data.clear();
  for (const auto& p : e.params) {
    e.requires_grad.push_back(p.requires_grad());
    e.param_data.push_back(p.data_ptr());
  }
  e.main_grad_data.clear();
  e.main_grad_names = opts_.main_grad_names ? opts_.main_grad_names() : std::vector<std::string>{};
  if (opts_.main_grads) {
    for (const auto& mg : opts_.main_grads()) e.main_grad_data.push_back(mg.data_ptr());
  }
  e.main_grad_names.resize(e.main_grad_data.size(), "?");
  e.graph = std::move(graph);
  ++captures_;
  // The capture changed nothing the caller sees; this call's step happens by replaying.
  return replay(e, tensors);
}

std::vector<at::Tensor> GraphedStep::replay(Entry& e, const std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < e.params.size(); ++i) {
    DWGRAPH_CHECK_STATE(e.params[i].requires_grad() == e.requires_grad[i], kApi, ": parameter '", e.names[i],
                        "' ", e.requires_grad[i] ? "no longer requires" : "now requires",
                        " grad, so the step would give gradients to other parameters than the graph captured; "
                        "call reset() on the step to capture it again");
    DWGRAPH_CHECK_STATE(e.params[i].data_ptr() == e.param_data[i], kApi, ": parameter '", e.names[i],
                        "' was reallocated since capture (its data moved); update parameters in place, or "
                        "reset() the step");
  }
  if (opts_.main_grads && !e.main_grad_data.empty()) {
    const auto mgs = opts_.main_grads();
    for (size_t i = 0; i < e.main_grad_data.size(); ++i) {
      DWGRAPH_CHECK_STATE(i < mgs.size() && mgs[i].data_ptr() == e.main_grad_data[i], kApi, ": main_grad of parameter '",
                          e.main_grad_names[i], "' was replaced or reallocated since capture; the graph accumulates "
                          "into the captured buffer. Zero it in place instead, or reset() the step");
    }
  }
  {
    const at::NoGradGuard no_grad;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].defined() && tensors[i].data_ptr() != e.static_inputs[i].data_ptr()) {
        e.static_inputs[i].copy_(tensors[i]);
      }
    }
  }
  graphs::check_hand_off(e.contributions, kApi);
  e.graph->replay();
  graphs::hand_off(e.contributions);
  if (opts_.after_hand_off) opts_.after_hand_off();
  if (opts_.mark_main_grads) opts_.mark_main_grads();
  return outputs(e);
}

std::vector<at::Tensor> GraphedStep::outputs(const Entry& e) const {
  std::vector<at::Tensor> out;
  for (const auto& o : e.static_outputs) {
    if (!o.defined()) {
      out.emplace_back();
    } else if (o.numel() <= opts_.clone_numel_limit) {
      out.push_back(o.clone());
    } else {
      const at::AutoDispatchBelowADInplaceOrView below;
      out.push_back(o.view(o.sizes()));
    }
  }
  return out;
}

}  // namespace dwgraph
