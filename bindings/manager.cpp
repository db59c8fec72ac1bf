// Bindings of the capture/replay manager (dwgraph._C.graphs.make_graphed_callables); the
// Python front end that describes torch.nn.Modules to it is dwgraph/graphed.py.
#include "bindings/bindings.h"

#include "graphs/graphed_step.h"
#include "graphs/manager.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

template <class T>
T get(const py::dict& d, const char* key, T fallback = T()) {
  if (!d.contains(key) || d[key].is_none()) return fallback;
  return d[key].cast<T>();
}

DeferredWgradModuleSpec module_spec(const py::dict& d) {
  DeferredWgradModuleSpec m;
  m.name = get<std::string>(d, "name");
  m.need_backward_dw = get<std::function<bool()>>(d, "need_backward_dw");
  m.backward_dw = get<std::function<void()>>(d, "backward_dw");
  m.run_hooks = get<std::function<void()>>(d, "run_hooks");
  m.deferred_parameters = get<std::vector<at::Tensor>>(d, "deferred_parameters");
  m.deferred_parameter_names = get<std::vector<std::string>>(d, "deferred_parameter_names");
  m.fused_parameters = get<std::vector<at::Tensor>>(d, "fused_parameters");
  m.fused_parameter_names = get<std::vector<std::string>>(d, "fused_parameter_names");
  m.main_grad = get<std::function<at::Tensor(size_t)>>(d, "main_grad");
  m.mark_main_grad_accumulated = get<std::function<void(size_t)>>(d, "mark_main_grad_accumulated");
  m.retain_consumed = get<std::function<void(bool)>>(d, "retain_consumed");
  m.release_consumed = get<std::function<void()>>(d, "release_consumed");
  m.exact_deferred = get<bool>(d, "exact_deferred", true);
  return m;
}

GraphableCallable callable_spec(const py::dict& d) {
  GraphableCallable c;
  c.name = get<std::string>(d, "name");
  c.forward = get<std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>>(d, "forward");
  c.parameters = get<std::vector<at::Tensor>>(d, "parameters");
  c.parameter_names = get<std::vector<std::string>>(d, "parameter_names");
  c.buffers = get<std::vector<at::Tensor>>(d, "buffers");
  c.is_training = get<std::function<bool()>>(d, "is_training");
  c.after_backward = get<std::function<void()>>(d, "after_backward");
  if (d.contains("deferred_modules")) {
    for (const auto& m : d["deferred_modules"]) c.deferred_modules.push_back(module_spec(m.cast<py::dict>()));
  }
  return c;
}

py::dict stats_dict(const GraphedStats& s) {
  py::dict d;
  d["pool_reserved_bytes"] = s.pool.reserved_bytes;
  d["pool_allocated_bytes"] = s.pool.allocated_bytes;
  d["pool_peak_allocated_bytes"] = s.pool.peak_allocated_bytes;
  d["contribution_bytes"] = s.contribution_bytes;
  d["static_bytes"] = s.static_bytes;
  d["num_graphs"] = s.num_graphs;
  py::list graphs;
  for (const auto& g : s.graphs) {
    py::dict info;
    info["callable"] = g.callable;
    info["kind"] = g.kind;
    info["num_kernels"] = g.num_kernels;
    graphs.append(info);
  }
  d["graphs"] = graphs;
  return d;
}

}  // namespace

void init_manager(py::module_& parent) {
  auto m = parent.attr("graphs").cast<py::module_>();
  py::class_<GraphedCallable, std::shared_ptr<GraphedCallable>>(m, "GraphedCallable")
      .def("__call__", &GraphedCallable::operator(), py::arg("inputs"), py::call_guard<py::gil_scoped_release>())
      .def("backward_dw", &GraphedCallable::backward_dw, py::call_guard<py::gil_scoped_release>())
      .def("need_backward_dw", &GraphedCallable::need_backward_dw)
      .def("reset", &GraphedCallable::reset)
      .def("contribution_bytes", &GraphedCallable::contribution_bytes)
      .def("stats", [](const GraphedCallable& g) { return stats_dict(graphed_stats(g)); })
      .def_property_readonly("index", &GraphedCallable::index)
      .def_property_readonly("name", &GraphedCallable::name);

  py::class_<GraphedStep>(m, "GraphedStep")
      .def(py::init([](StepFn step, int warmup_iters, std::shared_ptr<graphs::GraphPool> pool, int64_t max_graphs,
                       std::function<std::vector<at::Tensor>()> params,
                       std::function<std::vector<std::string>()> param_names,
                       std::function<std::vector<at::Tensor>()> main_grads,
                       std::function<std::vector<std::string>()> main_grad_names, std::function<void()> mark_main_grads,
                       std::function<void()> after_hand_off, std::function<void(bool)> capturing) {
             GraphedStepOptions o;
             o.warmup_iters = warmup_iters;
             o.pool = std::move(pool);
             o.max_graphs = max_graphs;
             o.params = std::move(params);
             o.param_names = std::move(param_names);
             o.main_grads = std::move(main_grads);
             o.main_grad_names = std::move(main_grad_names);
             o.mark_main_grads = std::move(mark_main_grads);
             o.after_hand_off = std::move(after_hand_off);
             o.capturing = std::move(capturing);
             return std::make_unique<GraphedStep>(std::move(step), std::move(o));
           }),
           py::arg("step"), py::kw_only(), py::arg("warmup_iters"), py::arg("pool"), py::arg("max_graphs"),
           py::arg("params"), py::arg("param_names"), py::arg("main_grads"), py::arg("main_grad_names"),
           py::arg("mark_main_grads"), py::arg("after_hand_off"),
           py::arg("capturing"))
      // Warmup and capture run the autograd engine: no GIL (the step takes it back).
      .def("__call__", &GraphedStep::operator(), py::arg("tensors"), py::arg("key"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_graphs", &GraphedStep::num_graphs)
      .def_property_readonly("num_captures", &GraphedStep::num_captures)
      .def("reset", &GraphedStep::reset);

  m.def(
      "make_graphed_callables",
      [](const py::list& callables, const std::vector<std::vector<at::Tensor>>& sample_args, int num_warmup_iters,
         bool allow_unused_input, std::optional<std::vector<double>> order,
         std::optional<std::vector<int64_t>> num_layers_per_chunk, std::shared_ptr<graphs::GraphPool> pool,
         bool retain_graph_in_backward, bool unsafe_capture_with_caller_grad) {
        std::vector<GraphableCallable> specs;
        for (const auto& c : callables) specs.push_back(callable_spec(c.cast<py::dict>()));
        GraphedCallableOptions o;
        o.num_warmup_iters = num_warmup_iters;
        o.allow_unused_input = allow_unused_input;
        o.order = std::move(order);
        o.num_layers_per_chunk = std::move(num_layers_per_chunk);
        o.pool = std::move(pool);
        o.retain_graph_in_backward = retain_graph_in_backward;
        o.unsafe_capture_with_caller_grad = unsafe_capture_with_caller_grad;
        // Warmup and capture run the autograd engine, which must not hold the GIL; the
        // Python forward functions and hooks take it back when they are called.
        const py::gil_scoped_release no_gil;
        return make_graphed_callables(std::move(specs), sample_args, std::move(o));
      },
      py::arg("callables"), py::arg("sample_args"), py::kw_only(), py::arg("num_warmup_iters"),
      py::arg("allow_unused_input"), py::arg("order"), py::arg("num_layers_per_chunk"), py::arg("pool"),
      py::arg("retain_graph_in_backward"), py::arg("unsafe_capture_with_caller_grad"));
}

}  // namespace dwgraph::bindings
