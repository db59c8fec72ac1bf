#pragma once
// C++ deferred-wgrad modules (namespace dwgraph::nn): the same contract as dwgraph.nn in
// Python (docs/deferred-wgrad.md), as torch::nn::Modules over ops/linear.h.
#include "graphs/manager.h"
#include "ops/linear.h"
#include "ops/wgrad_store.h"

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dwgraph::nn {

struct DeferredOptions {
  bool bias = true;
  bool delay_wgrad_compute = false;
  bool fuse_wgrad_accumulation = false;
};

// What the three modules share: the wgrad store, backward_dw(), hooks, main_grad.
class DeferredWgradModule : public torch::nn::Module {
 public:
  using Hook = std::function<void(DeferredWgradModule&)>;

  bool need_backward_dw() const { return opts_.delay_wgrad_compute; }
  // Runs the oldest queued unit of weight-gradient work, then the hooks.
  void backward_dw();
  void register_wgrad_hook(Hook fn) {
    hooks_.push_back(std::move(fn));
    store_->set_num_hooks(hooks_.size());  // a graph's landing calls the hooks only when there are some
  }
  // Runs the hooks, unless graph warmup or capture suppresses them.
  void run_wgrad_hooks();
  size_t num_queued_wgrad_units() const { return store_->num_units(); }
  // The fused-accumulation buffer of parameter `name` (FP32, owned by the caller).
  at::Tensor& main_grad(const std::string& name);
  const DeferredOptions& options() const { return opts_; }
  // What make_graphed_callables needs to capture and hand off this module's weight
  // gradients and run its hooks; `self` (this module) is held by the spec.
  graphs::ModuleSpec wgrad_spec(const std::string& name, std::shared_ptr<torch::nn::Module> self);

 protected:
  DeferredWgradModule(std::string display_name, DeferredOptions opts);
  ops::WgradConfig config() const;
  ops::WeightRefPtr ref(const std::string& name, const at::Tensor& param, bool is_weight);
  void allocate_main_grads(const std::vector<std::string>& weight_names);

  std::string display_name_;
  DeferredOptions opts_;
  std::shared_ptr<ops::WgradStore> store_ = std::make_shared<ops::WgradStore>();
  std::vector<Hook> hooks_;
  // Shared with the weight refs of queued work, which may outlive the module.
  std::shared_ptr<std::map<std::string, at::Tensor>> main_grads_ = std::make_shared<std::map<std::string, at::Tensor>>();
};

class Linear : public DeferredWgradModule {
 public:
  Linear(int64_t in_features, int64_t out_features, DeferredOptions opts = {});
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight, bias;
};

class GroupedLinear : public DeferredWgradModule {
 public:
  GroupedLinear(int64_t num_gemms, int64_t in_features, int64_t out_features,
                DeferredOptions opts = {}, bool packed_weights = false);
  at::Tensor forward(const at::Tensor& x, const std::vector<int64_t>& m_splits);
  // weight0.. / bias0.. (or one packed weight [G, out, in] / bias [G, out]).
  std::vector<at::Tensor> weights, biases;
  bool packed_weights;
};

// LayerNorm then a Linear (TransformerEngine's LayerNormLinear, the attention QKV
// projection). The LayerNorm parameters get their gradients in the main backward; `weight`
// and `bias` follow `opts`. `normalization` "RMSNorm": no layer_norm_bias.
class LayerNormLinear : public DeferredWgradModule {
 public:
  LayerNormLinear(int64_t in_features, int64_t out_features, DeferredOptions opts = {}, double eps = 1e-5,
                  const std::string& normalization = "LayerNorm");
  at::Tensor forward(const at::Tensor& x);
  // (output, LayerNorm output): TransformerEngine's return_layernorm_output=True.
  std::pair<at::Tensor, at::Tensor> forward_with_layernorm_output(const at::Tensor& x);
  at::Tensor layer_norm_weight, layer_norm_bias, weight, bias;
  double eps;
  std::string normalization;
};

class LayerNormMLP : public DeferredWgradModule {
 public:
  // `checkpoint`: keep only the input in the forward and recompute LayerNorm, fc1 and the
  // activation in the backward (TransformerEngine's checkpoint=True): the same results.
  LayerNormMLP(int64_t hidden_size, int64_t ffn_hidden_size, DeferredOptions opts = {},
               std::string activation = "gelu", double eps = 1e-5, bool checkpoint = false,
               const std::string& normalization = "LayerNorm");
  at::Tensor forward(const at::Tensor& x);
  at::Tensor layer_norm_weight, layer_norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias;
  std::string activation;
  double eps;
  bool checkpoint;
  std::string normalization;
};

// A callable for make_graphed_callables: `forward` over tensors, the parameters of `root`
// (checked at every replay against what root holds then) and every DeferredWgradModule
// among its modules. The callable holds `root`.
graphs::GraphableCallable graphable(const std::string& name, std::shared_ptr<torch::nn::Module> root,
                            std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward);

}  // namespace dwgraph::nn
