#pragma once
// What the graph manager needs to know of a module whose gradients it lands or whose
// hooks it runs (namespace dwgraph::graphs): dwgraph's own modules (C++ dwgraph::nn and
// Python dwgraph.nn, described through DwgraphModuleInfo and the one classifier in
// ops/param_roles.h) and any other module with backward_dw()/need_backward_dw()
// (TransformerEngine's), described directly.

#include "ops/wgrad_store.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph::graphs {

// A weight whose gradient the wgrad GEMM accumulates into its persistent main_grad.
struct FusedParameter {
  std::string name;
  at::Tensor param;
  std::function<at::Tensor()> main_grad;                   // the current buffer
  std::function<std::optional<bool>()> get_flag;           // grad_added_to_main_grad (nullopt: unset)
  std::function<void(std::optional<bool>)> set_flag;
};

struct ModuleSpec {
  std::string name;
  // Its weight gradients are deferred to backward_dw() (else they land in the backward).
  bool defers = false;
  // Runs the oldest queued unit. dwgraph modules: without the hooks (run_hooks runs them
  // after the hand-off); other modules run their own hooks inside it.
  std::function<void()> backward_dw;
  std::function<void()> run_hooks;  // optional
  // Parameters whose gradient lands in .grad during backward_dw().
  std::vector<std::string> deferred_names;
  std::vector<at::Tensor> deferred;
  // Parameters accumulated into main_grad (in the backward-dw graph when deferred, in the
  // backward graph otherwise).
  std::vector<FusedParameter> fused;
  // dwgraph modules: the wgrad store (queued units are stashed during capture, hooks
  // suppressed, queued units counted for the eager fallback). Null for other modules.
  std::shared_ptr<ops::WgradStore> store;
  // Another library's module whose backward_dw() runs dwgraph modules inside it (a
  // TransformerEngine or Megatron layer): those modules' stores (a capture stashes their
  // units and suppresses their hooks, graphs count their pending work) and hooks (run
  // after the hand-off, which replaces their own backward_dw() at replay).
  struct Inner {
    std::shared_ptr<ops::WgradStore> store;
    std::function<void()> run_hooks;
    bool defers = false;  // its hooks follow backward_dw() (else the end of the backward)
  };
  std::vector<Inner> inner;
  // Held while graphs built from the spec exist (C++ modules: the module itself).
  std::shared_ptr<void> keep_alive;
};

// A dwgraph module as its front end (C++ or Python) sees it.
struct DwgraphModuleInfo {
  std::string name;          // qualified name inside the graphed callable ("" for the root)
  std::string display_name;  // for messages, e.g. "dwgraph.nn.Linear(in_features=8, ...)"
  std::shared_ptr<ops::WgradStore> store;
  bool delay_wgrad_compute = false;
  bool fuse_wgrad_accumulation = false;
  std::vector<std::string> parameter_names;  // its own parameters, unqualified
  std::vector<at::Tensor> parameters;
  std::function<void()> run_hooks;
  std::function<at::Tensor(const std::string&)> main_grad;
  std::function<std::optional<bool>(const std::string&)> get_flag;
  std::function<void(const std::string&, std::optional<bool>)> set_flag;
  std::shared_ptr<void> keep_alive;
};

// The spec of a dwgraph module: deferred and fused parameters from ops::classify_parameter,
// backward_dw() from its store.
ModuleSpec dwgraph_module_spec(const DwgraphModuleInfo& info);

}  // namespace dwgraph::graphs
