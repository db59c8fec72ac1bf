#include "nn/modules.h"

#include "common/check.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/init.h>

#include <cmath>

namespace dwgraph::nn {
namespace {

// torch.nn.Linear's initialisation.
void init_linear(at::Tensor w, at::Tensor b, int64_t fan_in) {
  at::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
  if (b.defined()) {
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    torch::nn::init::uniform_(b, -bound, bound);
  }
}

// The normalisation's parameters: a weight of ones and, for LayerNorm, a bias of zeros.
void register_norm(torch::nn::Module& m, const std::string& display_name, const std::string& normalization,
                   int64_t width, at::Tensor& weight, at::Tensor& bias) {
  ops::check_normalization(display_name, normalization);
  weight = m.register_parameter("layer_norm_weight", at::ones({width}));
  if (normalization == "LayerNorm") bias = m.register_parameter("layer_norm_bias", at::zeros({width}));
}

std::string flags(const DeferredOptions& o) {
  return std::string("bias=") + (o.bias ? "true" : "false") +
         ", delay_wgrad_compute=" + (o.delay_wgrad_compute ? "true" : "false") +
         ", fuse_wgrad_accumulation=" + (o.fuse_wgrad_accumulation ? "true" : "false");
}

}  // namespace

DeferredWgradModule::DeferredWgradModule(std::string display_name, DeferredOptions opts)
    : display_name_(std::move(display_name)), opts_(opts) {}

void DeferredWgradModule::backward_dw() {
  DWGRAPH_CHECK_STATE(opts_.delay_wgrad_compute, display_name_,
                      ".backward_dw(): delay_wgrad_compute is false, so no weight-gradient work "
                      "is ever queued");
  store_->run_oldest(display_name_);
  run_wgrad_hooks();
}

void DeferredWgradModule::run_wgrad_hooks() {
  if (store_->hooks_suppressed()) return;
  for (auto& h : hooks_) h(*this);
}

at::Tensor& DeferredWgradModule::main_grad(const std::string& name) {
  auto it = main_grads_->find(name);
  DWGRAPH_CHECK_ARG(it != main_grads_->end(), display_name_, ": parameter '", name,
                    "' has no main_grad (fuse_wgrad_accumulation=",
                    opts_.fuse_wgrad_accumulation ? "true" : "false", ")");
  return it->second;
}

ops::WgradConfig DeferredWgradModule::config() const {
  ops::WgradConfig c;
  c.delay_wgrad_compute = opts_.delay_wgrad_compute;
  c.fuse_wgrad_accumulation = opts_.fuse_wgrad_accumulation;
  c.store = store_;
  c.unit_id = (opts_.delay_wgrad_compute && at::GradMode::is_enabled()) ? store_->new_unit_id() : 0;
  c.module_name = display_name_;
  return c;
}

ops::WeightRefPtr DeferredWgradModule::ref(const std::string& name, const at::Tensor& param,
                                           bool is_weight) {
  if (!param.defined()) return nullptr;
  auto r = std::make_shared<ops::WeightRef>();
  r->param = param;
  r->name = name;
  if (is_weight && opts_.fuse_wgrad_accumulation) {
    auto it = main_grads_->find(name);
    if (it != main_grads_->end()) r->main_grad = it->second;
    r->current_main_grad = [grads = main_grads_, name]() -> std::optional<at::Tensor> {
      auto now = grads->find(name);
      return now == grads->end() ? std::nullopt : std::optional<at::Tensor>(now->second);
    };
  }
  return r;
}

void DeferredWgradModule::allocate_main_grads(const std::vector<std::string>& weight_names) {
  if (!opts_.fuse_wgrad_accumulation) return;
  for (const auto& name : weight_names) {
    const at::Tensor& p = named_parameters(/*recurse=*/false)[name];
    (*main_grads_)[name] = at::zeros(p.sizes(), p.options().dtype(at::kFloat));
  }
}

graphs::ModuleSpec DeferredWgradModule::wgrad_spec(const std::string& name, std::shared_ptr<torch::nn::Module> self) {
  TORCH_INTERNAL_ASSERT(self.get() == this);
  graphs::DwgraphModuleInfo info;
  info.name = name;
  info.display_name = display_name_;
  info.store = store_;
  info.delay_wgrad_compute = opts_.delay_wgrad_compute;
  info.fuse_wgrad_accumulation = opts_.fuse_wgrad_accumulation;
  for (const auto& item : named_parameters(/*recurse=*/false)) {
    info.parameter_names.push_back(item.key());
    info.parameters.push_back(item.value());
  }
  // `this` stays valid: the spec holds the module (keep_alive).
  info.run_hooks = [this] { run_wgrad_hooks(); };
  info.main_grad = [this](const std::string& param) { return main_grad(param); };
  info.keep_alive = std::move(self);
  return graphs::dwgraph_module_spec(info);
}

graphs::GraphableCallable graphable(const std::string& name, std::shared_ptr<torch::nn::Module> root,
                                    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward) {
  graphs::GraphableCallable c;
  c.name = name;
  c.forward = std::move(forward);
  for (const auto& item : root->named_parameters(/*recurse=*/true)) {
    c.parameters.push_back(item.value());
    c.parameter_names.push_back(item.key());
  }
  // A replaced child module or parameter is refused at replay (C++ has no registration
  // hooks, so the list is asked at every call; it is a walk over the module tree).
  c.current_parameters = [root] {
    graphs::NamedTensors out;
    for (const auto& item : root->named_parameters(/*recurse=*/true)) out.emplace_back(item.key(), item.value());
    return out;
  };
  for (const auto& b : root->buffers(/*recurse=*/true)) c.buffers.push_back(b);
  c.training_mode = [root] {
    std::string mode;
    for (const auto& m : root->modules(/*include_self=*/true)) mode += m->is_training() ? '1' : '0';
    return mode;
  };
  for (const auto& item : root->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    auto* m = dynamic_cast<DeferredWgradModule*>(item.value().get());
    if (m != nullptr) c.modules.push_back(m->wgrad_spec(item.key(), item.value()));
  }
  c.keep_alive = std::move(root);
  return c;
}

Linear::Linear(int64_t in_features, int64_t out_features, DeferredOptions opts)
    : DeferredWgradModule("dwgraph::nn::Linear(in_features=" + std::to_string(in_features) +
                              ", out_features=" + std::to_string(out_features) + ", " + flags(opts) + ")",
                          opts) {
  weight = register_parameter("weight", at::empty({out_features, in_features}));
  if (opts.bias) bias = register_parameter("bias", at::empty({out_features}));
  init_linear(weight, bias, in_features);
  allocate_main_grads({"weight"});
}

at::Tensor Linear::forward(const at::Tensor& x) {
  return ops::linear(x, ref("weight", weight, true), ref("bias", bias, false), config());
}

GroupedLinear::GroupedLinear(int64_t num_gemms, int64_t in_features, int64_t out_features,
                             DeferredOptions opts, bool packed)
    : DeferredWgradModule("dwgraph::nn::GroupedLinear(num_gemms=" + std::to_string(num_gemms) +
                              ", in_features=" + std::to_string(in_features) + ", out_features=" +
                              std::to_string(out_features) + ", " + flags(opts) +
                              ", packed_weights=" + (packed ? "true" : "false") + ")",
                          opts),
      packed_weights(packed) {
  std::vector<std::string> names;
  if (packed) {
    weights.push_back(register_parameter("weight", at::empty({num_gemms, out_features, in_features})));
    if (opts.bias) biases.push_back(register_parameter("bias", at::empty({num_gemms, out_features})));
    for (int64_t g = 0; g < num_gemms; ++g) {
      init_linear(weights[0][g], opts.bias ? biases[0][g] : at::Tensor(), in_features);
    }
    names.push_back("weight");
  } else {
    for (int64_t g = 0; g < num_gemms; ++g) {
      const auto idx = std::to_string(g);
      weights.push_back(register_parameter("weight" + idx, at::empty({out_features, in_features})));
      if (opts.bias) biases.push_back(register_parameter("bias" + idx, at::empty({out_features})));
      init_linear(weights.back(), opts.bias ? biases.back() : at::Tensor(), in_features);
      names.push_back("weight" + idx);
    }
  }
  allocate_main_grads(names);
}

at::Tensor GroupedLinear::forward(const at::Tensor& x, const std::vector<int64_t>& m_splits) {
  std::vector<ops::WeightRefPtr> w, b;
  for (size_t g = 0; g < weights.size(); ++g) {
    w.push_back(ref(packed_weights ? "weight" : "weight" + std::to_string(g), weights[g], true));
  }
  for (size_t g = 0; g < biases.size(); ++g) {
    b.push_back(ref(packed_weights ? "bias" : "bias" + std::to_string(g), biases[g], false));
  }
  return ops::grouped_linear(x, m_splits, w, b, config());
}

LayerNormLinear::LayerNormLinear(int64_t in_features, int64_t out_features, DeferredOptions opts, double eps_,
                                 const std::string& normalization_)
    : DeferredWgradModule("dwgraph::nn::LayerNormLinear(in_features=" + std::to_string(in_features) +
                              ", out_features=" + std::to_string(out_features) + ", " + flags(opts) +
                              (normalization_ != "LayerNorm" ? ", normalization=" + normalization_ : "") + ")",
                          opts),
      eps(eps_),
      normalization(normalization_) {
  register_norm(*this, display_name_, normalization, in_features, layer_norm_weight, layer_norm_bias);
  weight = register_parameter("weight", at::empty({out_features, in_features}));
  if (opts.bias) bias = register_parameter("bias", at::empty({out_features}));
  init_linear(weight, bias, in_features);
  allocate_main_grads({"weight"});
}

std::pair<at::Tensor, at::Tensor> LayerNormLinear::forward_with_layernorm_output(const at::Tensor& x) {
  return ops::layernorm_linear(x, layer_norm_weight, layer_norm_bias, eps, ref("weight", weight, true),
                               ref("bias", bias, false), config(), normalization);
}

at::Tensor LayerNormLinear::forward(const at::Tensor& x) { return forward_with_layernorm_output(x).first; }

LayerNormMLP::LayerNormMLP(int64_t hidden, int64_t ffn, DeferredOptions opts, std::string act, double eps_,
                           bool checkpoint_, const std::string& normalization_)
    : DeferredWgradModule("dwgraph::nn::LayerNormMLP(hidden_size=" + std::to_string(hidden) +
                              ", ffn_hidden_size=" + std::to_string(ffn) + ", " + flags(opts) +
                              ", activation=" + act + (checkpoint_ ? ", checkpoint=true" : "") +
                              (normalization_ != "LayerNorm" ? ", normalization=" + normalization_ : "") + ")",
                          opts),
      activation(std::move(act)),
      eps(eps_),
      checkpoint(checkpoint_),
      normalization(normalization_) {
  ops::check_activation(display_name_, activation);
  register_norm(*this, display_name_, normalization, hidden, layer_norm_weight, layer_norm_bias);
  fc1_weight = register_parameter("fc1_weight", at::empty({ffn, hidden}));
  fc2_weight = register_parameter("fc2_weight", at::empty({hidden, ffn}));
  if (opts.bias) {
    fc1_bias = register_parameter("fc1_bias", at::empty({ffn}));
    fc2_bias = register_parameter("fc2_bias", at::empty({hidden}));
  }
  init_linear(fc1_weight, fc1_bias, hidden);
  init_linear(fc2_weight, fc2_bias, ffn);
  allocate_main_grads({"fc1_weight", "fc2_weight"});
}

at::Tensor LayerNormMLP::forward(const at::Tensor& x) {
  return ops::layernorm_mlp(x, layer_norm_weight, layer_norm_bias, eps, ref("fc1_weight", fc1_weight, true),
                            ref("fc1_bias", fc1_bias, false), activation,
                            ref("fc2_weight", fc2_weight, true), ref("fc2_bias", fc2_bias, false),
                            config(), checkpoint, normalization);
}

}  // namespace dwgraph::nn
