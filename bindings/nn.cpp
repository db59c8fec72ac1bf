// Bindings of the deferred-wgrad autograd functions and their store (dwgraph._C.nn);
// the modules themselves are Python (bindings/python/dwgraph/nn.py).
#include "bindings/bindings.h"

#include "common/check.h"
#include "ops/grad_accumulation.h"
#include "ops/linear.h"
#include "ops/param_roles.h"
#include "ops/wgrad_store.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

using ops::WeightRef;
using ops::WgradConfig;
using ops::WgradStore;

using RefPtr = std::shared_ptr<WeightRef>;

ops::WeightRefPtr as_const(const RefPtr& p) { return p; }

std::vector<ops::WeightRefPtr> as_const(const std::vector<RefPtr>& v) {
  return std::vector<ops::WeightRefPtr>(v.begin(), v.end());
}

WgradConfig make_config(bool delay, bool fuse, std::shared_ptr<WgradStore> store, uint64_t unit,
                        std::string module) {
  WgradConfig c;
  c.delay_wgrad_compute = delay;
  c.fuse_wgrad_accumulation = fuse;
  c.store = std::move(store);
  c.unit_id = unit;
  c.module_name = std::move(module);
  return c;
}

}  // namespace

void init_nn(py::module_& parent) {
  auto m = parent.def_submodule("nn", "Deferred-wgrad autograd functions");

  // The one rule (ops/grad_accumulation.h): .grad = g when None, else .grad += g.
  m.def(
      "accumulate_grad",
      [](const at::Tensor& param, const at::Tensor& g, const std::string& what) {
        ops::accumulate_grad(param, g, ops::Take::kSteal, what);
      },
      py::arg("param"), py::arg("grad"), py::arg("what"));

  py::class_<WgradStore, std::shared_ptr<WgradStore>>(m, "WgradStore")
      .def(py::init<>())
      .def("new_unit_id", &WgradStore::new_unit_id)
      .def("run_oldest", &WgradStore::run_oldest, py::arg("owner"),
           py::call_guard<py::gil_scoped_release>())
      .def("num_units", &WgradStore::num_units)
      .def("num_graph_pending", &WgradStore::num_graph_pending)
      .def("num_pending", &WgradStore::num_pending)
      .def("num_graph_lost", &WgradStore::num_graph_lost)
      .def("clear", &WgradStore::clear)
      .def("hooks_suppressed", &WgradStore::hooks_suppressed)
      .def("set_num_hooks", &WgradStore::set_num_hooks, py::arg("n"))
      .def("num_hooks", &WgradStore::num_hooks)
      .def("note_hook_run", &WgradStore::note_hook_run)
      .def("set_notes_hook_runs", &WgradStore::set_notes_hook_runs, py::arg("on"))
      .def("take_after", &WgradStore::take_after, py::arg("keep"))
      // A copied module starts with nothing queued: queued work belongs to the original's
      // autograd graphs.
      .def("__deepcopy__", [](const WgradStore&, py::dict) { return std::make_shared<WgradStore>(); })
      // Only an empty store pickles (it is rebuilt empty): queued units hold autograd state
      // that cannot be saved. dwgraph.nn modules refuse first, naming themselves.
      .def(py::pickle(
          [](const WgradStore& s) {
            DWGRAPH_CHECK_STATE(s.num_units() == 0, "dwgraph._C.nn.WgradStore: cannot pickle a store with ",
                                s.num_units(), " queued weight-gradient units; expected none (run backward_dw() "
                                "for each first)");
            return py::tuple();
          },
          [](const py::tuple&) { return std::make_shared<WgradStore>(); }));

  py::class_<ops::WgradUnits, std::shared_ptr<ops::WgradUnits>>(m, "WgradUnits")
      .def("__len__", &ops::WgradUnits::size)
      .def("run", &ops::WgradUnits::run, py::arg("owner"), py::call_guard<py::gil_scoped_release>());

  py::class_<WeightRef, RefPtr>(m, "WeightRef")
      .def(py::init([](at::Tensor param, std::string name, std::optional<at::Tensor> main_grad,
                       std::optional<at::ScalarType> grad_dtype,
                       std::optional<std::function<at::Tensor()>> materialize_forward,
                       std::optional<std::function<at::Tensor()>> materialize_backward,
                       std::optional<std::function<void(const at::Tensor&)>> finalize,
                       std::optional<std::function<void()>> on_main_grad_accumulated,
                       std::optional<std::function<std::optional<at::Tensor>()>> current_main_grad) {
             auto r = std::make_shared<WeightRef>();
             r->param = std::move(param);
             r->name = std::move(name);
             r->main_grad = std::move(main_grad);
             r->grad_dtype = grad_dtype;
             if (materialize_forward) r->materialize_forward = *materialize_forward;
             if (materialize_backward) r->materialize_backward = *materialize_backward;
             if (finalize) r->finalize = *finalize;
             if (on_main_grad_accumulated) r->on_main_grad_accumulated = *on_main_grad_accumulated;
             if (current_main_grad) r->current_main_grad = *current_main_grad;
             return r;
           }),
           py::arg("param"), py::arg("name"), py::kw_only(), py::arg("main_grad") = py::none(),
           py::arg("grad_dtype") = py::none(), py::arg("materialize_forward") = py::none(),
           py::arg("materialize_backward") = py::none(), py::arg("finalize") = py::none(),
           py::arg("on_main_grad_accumulated") = py::none(), py::arg("current_main_grad") = py::none());

  m.def(
      "linear",
      [](const at::Tensor& x, const RefPtr& weight, const RefPtr& bias, bool delay, bool fuse,
         std::shared_ptr<WgradStore> store, uint64_t unit, std::string module,
         const std::optional<ops::Fp8Meta>& fp8) {
        return ops::linear(x, as_const(weight), as_const(bias),
                           make_config(delay, fuse, std::move(store), unit, std::move(module)),
                           fp8.value_or(ops::Fp8Meta()));
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::kw_only(), py::arg("delay_wgrad_compute"),
      py::arg("fuse_wgrad_accumulation"), py::arg("store"), py::arg("unit_id"), py::arg("module"),
      py::arg("fp8") = py::none());

  m.def(
      "grouped_linear",
      [](const at::Tensor& x, std::vector<int64_t> m_splits, const std::vector<RefPtr>& weights,
         const std::vector<RefPtr>& biases, bool delay, bool fuse, std::shared_ptr<WgradStore> store,
         uint64_t unit, std::string module, const std::optional<ops::Fp8Meta>& fp8) {
        return ops::grouped_linear(x, m_splits, as_const(weights), as_const(biases),
                                   make_config(delay, fuse, std::move(store), unit, std::move(module)),
                                   fp8.value_or(ops::Fp8Meta()));
      },
      py::arg("x"), py::arg("m_splits"), py::arg("weights"), py::arg("biases"), py::kw_only(),
      py::arg("delay_wgrad_compute"), py::arg("fuse_wgrad_accumulation"), py::arg("store"),
      py::arg("unit_id"), py::arg("module"), py::arg("fp8") = py::none());

  m.def(
      "layernorm_mlp",
      [](const at::Tensor& x, const at::Tensor& ln_weight, const std::optional<at::Tensor>& ln_bias, double eps,
         const RefPtr& fc1_weight, const RefPtr& fc1_bias, const std::string& activation,
         const RefPtr& fc2_weight, const RefPtr& fc2_bias, bool delay, bool fuse,
         std::shared_ptr<WgradStore> store, uint64_t unit, std::string module, bool checkpoint,
         const std::string& normalization, const std::optional<ops::Fp8Meta>& fp8) {
        return ops::layernorm_mlp(x, ln_weight, ln_bias.value_or(at::Tensor()), eps, as_const(fc1_weight), as_const(fc1_bias),
                                  activation, as_const(fc2_weight), as_const(fc2_bias),
                                  make_config(delay, fuse, std::move(store), unit, std::move(module)), checkpoint,
                                  normalization, fp8.value_or(ops::Fp8Meta()));
      },
      py::arg("x"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"), py::arg("fc1_weight"),
      py::arg("fc1_bias"), py::arg("activation"), py::arg("fc2_weight"), py::arg("fc2_bias"),
      py::kw_only(), py::arg("delay_wgrad_compute"), py::arg("fuse_wgrad_accumulation"),
      py::arg("store"), py::arg("unit_id"), py::arg("module"), py::arg("checkpoint") = false,
      py::arg("normalization") = "LayerNorm", py::arg("fp8") = py::none());

  m.def(
      "layernorm_linear",
      [](const at::Tensor& x, const at::Tensor& ln_weight, const std::optional<at::Tensor>& ln_bias, double eps,
         const RefPtr& weight, const RefPtr& bias, bool delay, bool fuse, std::shared_ptr<WgradStore> store,
         uint64_t unit, std::string module, const std::string& normalization,
         const std::optional<ops::Fp8Meta>& fp8) {
        return ops::layernorm_linear(x, ln_weight, ln_bias.value_or(at::Tensor()), eps, as_const(weight), as_const(bias),
                                     make_config(delay, fuse, std::move(store), unit, std::move(module)),
                                     normalization, fp8.value_or(ops::Fp8Meta()));
      },
      py::arg("x"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("eps"), py::arg("weight"), py::arg("bias"),
      py::kw_only(), py::arg("delay_wgrad_compute"), py::arg("fuse_wgrad_accumulation"), py::arg("store"),
      py::arg("unit_id"), py::arg("module"), py::arg("normalization") = "LayerNorm",
      py::arg("fp8") = py::none());

  m.def("check_activation", &ops::check_activation, py::arg("module"), py::arg("activation"));
  m.def("check_normalization", &ops::check_normalization, py::arg("module"), py::arg("normalization"));
  // The one rule for how a dwgraph module's parameter gets its gradient (ops/param_roles.h).
  m.def(
      "classify_parameter",
      [](const std::string& name, bool delay, bool fuse) {
        return std::string(ops::to_string(ops::classify_parameter(name, delay, fuse)));
      },
      py::arg("name"), py::arg("delay_wgrad_compute"), py::arg("fuse_wgrad_accumulation"));
}

}  // namespace dwgraph::bindings
