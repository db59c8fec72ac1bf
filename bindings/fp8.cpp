// Bindings of the FP8 recipes and the thread's fp8_autocast state (dwgraph._C.fp8, ops/fp8.h);
// dwgraph.fp8 spells them as TransformerEngine does.
#include "bindings/bindings.h"

#include "common/check.h"
#include "ops/fp8.h"

#include <ATen/core/grad_mode.h>

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

using ops::Fp8Format;
using ops::Fp8Recipe;
using ops::Fp8Scaling;
using ops::Fp8State;

// TransformerEngine's two recipe classes over the one C++ recipe.
struct DelayedScaling : Fp8Recipe {
  explicit DelayedScaling(const Fp8Recipe& r) : Fp8Recipe(r) {}
};
struct Float8CurrentScaling : Fp8Recipe {
  explicit Float8CurrentScaling(const Fp8Recipe& r) : Fp8Recipe(r) {}
};

py::object as_python(const Fp8Recipe& r) {
  if (r.scaling == Fp8Scaling::kDelayed) return py::cast(DelayedScaling(r));
  return py::cast(Float8CurrentScaling(r));
}

const char* algo_name(const Fp8Recipe& r) {
  return r.amax_compute_algo == ops::AmaxAlgo::kMax ? "max" : "most_recent";
}

Fp8Recipe recipe_of(const py::handle& recipe) {
  if (recipe.is_none()) return Fp8Recipe();  // TransformerEngine's default: DelayedScaling()
  DWGRAPH_CHECK_ARG(py::isinstance<Fp8Recipe>(recipe), "dwgraph.fp8: recipe must be a dwgraph.fp8.DelayedScaling or "
                    "dwgraph.fp8.Float8CurrentScaling, got ", std::string(py::str(py::type::of(recipe).attr("__name__"))));
  return recipe.cast<Fp8Recipe>();
}

}  // namespace

void init_fp8(py::module_& parent) {
  auto m = parent.def_submodule("fp8", "FP8 recipes and the fp8_autocast state");

  py::enum_<Fp8Format>(m, "Format")
      .value("E4M3", Fp8Format::kE4M3)
      .value("HYBRID", Fp8Format::kHybrid);

  py::class_<Fp8Recipe>(m, "Recipe")
      .def_property_readonly("fp8_format", [](const Fp8Recipe& r) { return r.format; })
      .def_property_readonly("margin", [](const Fp8Recipe& r) { return r.margin; })
      .def("delayed", [](const Fp8Recipe& r) { return r.scaling == Fp8Scaling::kDelayed; })
      .def("current", [](const Fp8Recipe& r) { return r.scaling == Fp8Scaling::kCurrent; })
      .def("__eq__", [](const Fp8Recipe& a, const py::object& b) {
        return py::isinstance<Fp8Recipe>(b) && a == b.cast<Fp8Recipe>();
      })
      .def("__hash__", [](const Fp8Recipe& r) { return py::hash(py::str(r.describe())); })
      .def("__repr__", &Fp8Recipe::describe);

  py::class_<DelayedScaling, Fp8Recipe>(m, "DelayedScaling")
      .def(py::init([](const py::object& margin, Fp8Format format, const py::object& len, const std::string& algo) {
             return DelayedScaling(Fp8Recipe::delayed(
                 format, python_int(margin, "dwgraph.fp8.DelayedScaling: argument 'margin'"),
                 python_int(len, "dwgraph.fp8.DelayedScaling: argument 'amax_history_len'"), algo));
           }),
           py::arg("margin") = 0, py::arg("fp8_format") = Fp8Format::kHybrid, py::arg("amax_history_len") = 1024,
           py::arg("amax_compute_algo") = "max")
      .def_property_readonly("amax_history_len", [](const Fp8Recipe& r) { return r.amax_history_len; })
      .def_property_readonly("amax_compute_algo", [](const Fp8Recipe& r) { return std::string(algo_name(r)); })
      .def(py::pickle(
          [](const Fp8Recipe& r) { return py::make_tuple(r.margin, r.format, r.amax_history_len, algo_name(r)); },
          [](const py::tuple& t) {
            return DelayedScaling(Fp8Recipe::delayed(t[1].cast<Fp8Format>(), t[0].cast<int64_t>(),
                                                     t[2].cast<int64_t>(), t[3].cast<std::string>()));
          }));

  py::class_<Float8CurrentScaling, Fp8Recipe>(m, "Float8CurrentScaling")
      .def(py::init([](Fp8Format format, const py::object& margin) {
             return Float8CurrentScaling(
                 Fp8Recipe::current(format, python_int(margin, "dwgraph.fp8.Float8CurrentScaling: argument 'margin'")));
           }),
           py::arg("fp8_format") = Fp8Format::kHybrid, py::arg("margin") = 0)
      .def(py::pickle([](const Fp8Recipe& r) { return py::make_tuple(r.format, r.margin); },
                      [](const py::tuple& t) {
                        return Float8CurrentScaling(Fp8Recipe::current(t[0].cast<Fp8Format>(), t[1].cast<int64_t>()));
                      }));

  py::class_<Fp8State>(m, "State", py::dynamic_attr())
      .def_readonly("enabled", &Fp8State::enabled)
      .def_property_readonly("recipe", [](const Fp8State& s) { return s.enabled ? as_python(s.recipe) : py::none(); })
      .def_readonly("amax_reduction", &Fp8State::amax_reduction)
      .def("__eq__", [](const Fp8State& a, const Fp8State& b) { return a == b; })
      .def("__repr__", &Fp8State::describe);

  // The state fp8_autocast(enabled, recipe) sets: the recipe (None: DelayedScaling()) counts
  // only when enabled.
  m.def(
      "make_state",
      [](bool enabled, const py::object& recipe, std::optional<int64_t> amax_reduction_group) {
        const bool amax_reduction = amax_reduction_group.has_value();
        Fp8State s;
        s.enabled = enabled;
        if (enabled) s.recipe = recipe_of(recipe);
        // Note [Amax reduced across ranks]: the reduction sets scales from histories.
        DWGRAPH_CHECK_ARG(!amax_reduction || !enabled || s.recipe.scaling == Fp8Scaling::kDelayed,
                          "dwgraph.fp8: an amax_reduction_group needs delayed scaling (", s.recipe.describe(),
                          " scales each tensor by its own amax inside the forward, where a graph cannot reduce "
                          "across ranks)");
        s.amax_reduction = enabled && amax_reduction;
        s.amax_group = s.amax_reduction ? *amax_reduction_group : 0;
        return s;
      },
      py::arg("enabled"), py::arg("recipe") = py::none(), py::arg("amax_reduction_group") = py::none());
  m.def(
      "update_scales",
      [](const at::Tensor& amax_history, const at::Tensor& scale, const Fp8Recipe& recipe) {
        ops::Fp8Meta meta;
        meta.amax_history = amax_history;
        meta.scale = scale;
        ops::fp8::check_meta("dwgraph.fp8.reduce_amax", meta, recipe,
                            scale.dim() == 1 ? scale.size(0) / ops::fp8::kRoles : 0);
        const at::NoGradGuard no_grad;
        ops::fp8::update_scales(meta, recipe);
      },
      py::arg("amax_history"), py::arg("scale"), py::arg("recipe"));
  m.def("current_state", &Fp8State::current);
  m.def("check_not_recomputing", &ops::fp8::check_not_recomputing, py::arg("module"), py::arg("state"),
        py::arg("ran_fp8"), py::arg("ran_without_fp8"));
  m.def("exchange_state", &ops::exchange_fp8_state, py::arg("state"));

  // What a module passes to its C++ forward under fp8_autocast (ops::Fp8Meta): its
  // delayed-scaling buffers and, with weight caching, one (data, scale_inv) cache per GEMM
  // with the first-microbatch decision: `host_first` from an eager caller, else the
  // `first` flag tensor a graph reads.
  py::class_<ops::Fp8Meta>(m, "Meta")
      .def(py::init([](const std::optional<at::Tensor>& amax_history, const std::optional<at::Tensor>& scale,
                       const std::vector<std::pair<at::Tensor, at::Tensor>>& weight_cache,
                       const std::optional<at::Tensor>& first, std::optional<bool> host_first) {
             ops::Fp8Meta meta{amax_history.value_or(at::Tensor()), scale.value_or(at::Tensor()), {}};
             for (const auto& [data, scale_inv] : weight_cache) {
               meta.weight_cache.push_back(ops::Fp8WeightCache{data, scale_inv, first.value_or(at::Tensor()),
                                                               host_first});
             }
             return meta;
           }),
           py::kw_only(), py::arg("amax_history") = py::none(), py::arg("scale") = py::none(),
           py::arg("weight_cache") = std::vector<std::pair<at::Tensor, at::Tensor>>(), py::arg("first") = py::none(),
           py::arg("host_first") = py::none());

  // A module's fresh delayed-scaling state: (amax_history [len, 3 * gemms] zeros, scale [3 * gemms] ones).
  m.def(
      "make_meta",
      [](int64_t gemms, const Fp8Recipe& recipe, const c10::Device& device) {
        DWGRAPH_CHECK_ARG(recipe.scaling == Fp8Scaling::kDelayed, "dwgraph.fp8: only delayed scaling keeps state, "
                          "got ", recipe.describe());
        const ops::Fp8Meta meta = ops::fp8::make_meta(gemms, recipe.amax_history_len, device);
        return py::make_tuple(meta.amax_history, meta.scale);
      },
      py::arg("gemms"), py::arg("recipe"), py::arg("device"));
}

}  // namespace dwgraph::bindings
