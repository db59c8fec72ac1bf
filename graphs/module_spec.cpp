#include "graphs/module_spec.h"

#include "common/check.h"
#include "ops/param_roles.h"

namespace dwgraph::graphs {

ModuleSpec dwgraph_module_spec(const DwgraphModuleInfo& info) {
  DWGRAPH_CHECK_ARG(info.store != nullptr, "dwgraph module '", info.name, "': its wgrad store is missing");
  DWGRAPH_CHECK_ARG(info.parameter_names.size() == info.parameters.size(), "dwgraph module '", info.name,
                    "': ", info.parameter_names.size(), " parameter names for ", info.parameters.size(),
                    " parameters");
  ModuleSpec spec;
  spec.name = info.name.empty() ? info.display_name : info.name;
  spec.defers = info.delay_wgrad_compute;
  spec.store = info.store;
  spec.keep_alive = info.keep_alive;
  spec.run_hooks = info.run_hooks;
  // Also for a module that does not defer now: if it does later (delay_wgrad_compute set
  // after capture), its units are landed through this (run_eager_backward_dw).
  spec.backward_dw = [store = info.store, owner = info.display_name] { store->run_oldest(owner); };
  const std::string prefix = info.name.empty() ? "" : info.name + ".";
  for (size_t i = 0; i < info.parameters.size(); ++i) {
    const std::string& local = info.parameter_names[i];
    switch (ops::classify_parameter(local, info.delay_wgrad_compute, info.fuse_wgrad_accumulation)) {
      case ops::ParamRole::kMainBackward:
        break;
      case ops::ParamRole::kDeferred:
        spec.deferred_names.push_back(prefix + local);
        spec.deferred.push_back(info.parameters[i]);
        break;
      case ops::ParamRole::kFused: {
        FusedParameter f;
        f.name = prefix + local;
        f.param = info.parameters[i];
        f.main_grad = [fn = info.main_grad, local] { return fn(local); };
        if (info.get_flag) f.get_flag = [fn = info.get_flag, local] { return fn(local); };
        if (info.set_flag) f.set_flag = [fn = info.set_flag, local](std::optional<bool> v) { fn(local, v); };
        spec.fused.push_back(std::move(f));
        break;
      }
    }
  }
  return spec;
}

}  // namespace dwgraph::graphs
