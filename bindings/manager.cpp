// Bindings of the capture/replay manager and graphed_step (dwgraph._C.graphs): the spec
// structs as classes with fields (an unknown attribute is an AttributeError, never a
// silent default), the Schedule, the graphed callables and the step. The Python front
// ends that describe torch.nn.Modules to them are dwgraph/graphed.py and dwgraph/step.py.
#include "bindings/bindings.h"

#include "common/check.h"
#include "graphs/capture_dispatch.h"
#include "graphs/graphed_step.h"
#include "graphs/manager.h"
#include "graphs/recorder.h"
#include "graphs/replay_checks.h"
#include "graphs/phase_timing.h"
#include "graphs/state_epoch.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/GradMode.h>

#include <algorithm>
#include <climits>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

// len() of a weakref.WeakValueDictionary without running its Python: its dict's size, or -1
// (never a recorded count) while removals are pending or it is not one.
Py_ssize_t weak_count(const py::handle& d) {
  const py::object dict = optional_attr(d, "data"), removals = optional_attr(d, "_pending_removals");
  if (!dict || !removals || !PyDict_CheckExact(dict.ptr()) || !PyList_CheckExact(removals.ptr()) ||
      PyList_GET_SIZE(removals.ptr()) != 0) {
    return -1;
  }
  return PyDict_GET_SIZE(dict.ptr());
}

using namespace dwgraph::graphs;

// The entries of a Python `order` as doubles, refusing what is not a real number before
// any conversion can overflow (bool, str, None, an int beyond 64 bits).
std::vector<double> order_values(const py::sequence& order) {
  std::vector<double> out;
  out.reserve(py::len(order));
  for (size_t k = 0; k < py::len(order); ++k) {
    const py::object v = order[k];
    DWGRAPH_CHECK_ARG(!py::isinstance<py::bool_>(v), "dwgraph.make_graphed_callables: argument 'order' entry ", k,
                      " must be a number, got a bool");
    if (PyLong_Check(v.ptr())) {
      int overflow = 0;
      const long long i = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
      DWGRAPH_CHECK_ARG(overflow == 0, "dwgraph.make_graphed_callables: argument 'order' entry ", k, " (",
                        py::str(v).cast<std::string>(), ") is out of range");
      out.push_back(static_cast<double>(i));
      continue;
    }
    const bool number = PyFloat_Check(v.ptr()) || PyIndex_Check(v.ptr()) || py::hasattr(v, "__float__");
    DWGRAPH_CHECK_ARG(number, "dwgraph.make_graphed_callables: argument 'order' entry ", k, " must be a number, got ",
                      py::str(py::type::of(v).attr("__name__")).cast<std::string>());
    const double d = PyFloat_AsDouble(v.ptr());
    if (d == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    out.push_back(d);
  }
  return out;
}

// num_layers_per_chunk as TransformerEngine takes it: one int for every chunk, or one per
// chunk; checked before any conversion, as the order entries are (a bool, a float or a
// string is not a layer count).
struct LayerCounts {
  std::optional<std::vector<int64_t>> per_chunk;
  std::optional<int64_t> each;
};

bool is_integer(const py::handle& v) { return PyIndex_Check(v.ptr()) && !py::isinstance<py::bool_>(v); }

int64_t layer_count(const py::handle& v, const std::string& what) {
  return python_int(v, "dwgraph.make_graphed_callables: argument 'num_layers_per_chunk' " + what);
}

LayerCounts layer_counts(const py::object& v) {
  LayerCounts out;
  if (v.is_none()) return out;
  if (is_integer(v)) {
    out.each = layer_count(v, "(one int for every chunk)");
    return out;
  }
  const bool sequence = PySequence_Check(v.ptr()) && !PyUnicode_Check(v.ptr()) && !PyBytes_Check(v.ptr());
  DWGRAPH_CHECK_ARG(sequence, "dwgraph.make_graphed_callables: argument 'num_layers_per_chunk' must be a list of "
                    "ints (one per chunk) or one int for every chunk, got ",
                    py::str(py::type::of(v).attr("__name__")).cast<std::string>());
  std::vector<int64_t> counts;
  const py::sequence seq = v;
  for (size_t k = 0; k < py::len(seq); ++k) counts.push_back(layer_count(seq[k], c10::str("entry ", k)));
  out.per_chunk = std::move(counts);
  return out;
}

py::dict stats_dict(const GraphedStats& s) {
  py::dict d = pool_stats_dict(s.pool, "pool_");
  d["contribution_bytes"] = s.contribution_bytes;
  d["static_bytes"] = s.static_bytes;
  d["num_graphs"] = s.num_graphs;
  d["num_kernels"] = s.num_kernels;
  d["eager_peak_bytes"] = s.eager_peak_bytes ? py::object(py::int_(*s.eager_peak_bytes)) : py::none();
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

// Whether `e` overlaps one of the disjoint ranges sorted by start.
bool overlaps(const std::pair<uintptr_t, uintptr_t>& e, const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges) {
  auto it = std::lower_bound(ranges.begin(), ranges.end(), std::make_pair(e.second, uintptr_t{0}));
  return it != ranges.begin() && std::prev(it)->second > e.first;
}

// Whether attribute `name` of `obj` is a non-empty container (a tensor's hook dicts).
bool has_items(const py::handle& obj, const char* name) {
  const py::object v = optional_attr(obj, name);
  if (!v || v.is_none()) return false;
  const int truth = PyObject_IsTrue(v.ptr());
  if (truth < 0) PyErr_Clear();
  return truth != 0;  // an error: as if it had hooks (the general path decides)
}

}  // namespace

void init_manager(py::module_& parent) {
  auto m = parent.attr("graphs").cast<py::module_>();

  // Note [Checks paid when state changes] (graphs/state_epoch.h): dwgraph._watch moves the
  // epoch; graphed_step reads it to know when to look at its modules again.
  m.def("state_epoch", &state_epoch);
  m.def("bump_state_epoch", &bump_state_epoch);
  m.def("bump_registration_epoch", &bump_registration_epoch);
  m.def("bump_tensor_hook_epoch", &bump_tensor_hook_epoch);
  m.def("tensor_hook_epoch", &tensor_hook_epoch);
  m.def("registration_version", &state_epoch);  // graphed_step's older name for the same epoch
  // What a graphed step's key holds besides its arguments (docs/graphed-step.md, "The key"):
  // grad mode, autocast state (its dtypes too, ops/autocast.h) and fp8 state, read in one
  // call; and whether autocast is on (the caller then refuses the autocast weight cache).
  m.def("step_ambient", [] {
    bool autocast_on = false;
    std::string text = graphs::step_ambient(&autocast_on);
    return py::make_tuple(std::move(text), autocast_on);
  });
  // True while the calling thread (or, on CUDA, its current stream) is inside a capture.
  m.def("capturing", [] { return graphs::detail::this_thread_records(); });
  m.def("note_reseed", &graphs::detail::note_reseed);
  // The overhead benchmark's clock (graphs/phase_timing.h).
  // clock: "wall", "thread_cpu" or "instructions" (the totals' "_s" fields then hold
  // instruction counts / 1e9); thread_cpu=True is the older spelling of clock="thread_cpu".
  m.def(
      "set_phase_timing",
      [](bool on, bool thread_cpu, const std::optional<std::string>& clock) {
        PhaseClock c = thread_cpu ? PhaseClock::kThreadCpu : PhaseClock::kWall;
        if (clock) {
          DWGRAPH_CHECK_ARG(*clock == "wall" || *clock == "thread_cpu" || *clock == "instructions",
                            "set_phase_timing: clock must be 'wall', 'thread_cpu' or 'instructions', got '", *clock,
                            "'");
          DWGRAPH_CHECK_ARG(!thread_cpu || *clock == "thread_cpu", "set_phase_timing: thread_cpu=True and clock='",
                            *clock, "' ask for two clocks");
          c = *clock == "wall" ? PhaseClock::kWall
              : *clock == "thread_cpu" ? PhaseClock::kThreadCpu : PhaseClock::kInstructions;
        }
        set_phase_timing(on, c);
      },
      py::arg("on"), py::arg("thread_cpu") = false, py::arg("clock") = py::none());
  // The chosen clock read now on the calling thread (ns or instructions), so a benchmark
  // measures its whole phases with the same clock as the core's parts.
  m.def("phase_clock", &phase_clock_ns);
  m.def("phase_totals", [] {
    py::dict d;
    const std::pair<const char*, TimedPhase> phases[] = {
        {"call", TimedPhase::kCall},
        {"backward", TimedPhase::kBackward},
        {"backward_dw", TimedPhase::kBackwardDw},
        {"step", TimedPhase::kStep}};
    for (const auto& [name, phase] : phases) {
      const PhaseTotals t = phase_totals(phase);
      py::dict e;
      e["count"] = t.count;
      e["replay_s"] = static_cast<double>(t.replay_ns) * 1e-9;
      e["copy_s"] = static_cast<double>(t.copy_ns) * 1e-9;
      d[name] = e;
    }
    return d;
  });
  m.def(
      "check_distinct_memory",
      [](const std::vector<at::Tensor>& tensors, const std::string& where, const std::string& what) {
        check_distinct_memory(tensors, {}, where, what.c_str());
      },
      py::arg("tensors"), py::arg("where"), py::arg("what") = "argument");

  py::class_<FusedParameter>(m, "FusedParameter")
      .def(py::init<>())
      .def_readwrite("name", &FusedParameter::name)
      .def_readwrite("param", &FusedParameter::param)
      .def_readwrite("main_grad", &FusedParameter::main_grad)
      .def_readwrite("get_flag", &FusedParameter::get_flag)
      .def_readwrite("set_flag", &FusedParameter::set_flag);

  py::class_<ModuleSpec>(m, "ModuleSpec")
      .def(py::init<>())
      .def_readwrite("name", &ModuleSpec::name)
      .def_readwrite("defers", &ModuleSpec::defers)
      .def_readwrite("backward_dw", &ModuleSpec::backward_dw)
      .def_readwrite("run_hooks", &ModuleSpec::run_hooks)
      .def_readwrite("deferred_names", &ModuleSpec::deferred_names)
      .def_readwrite("deferred", &ModuleSpec::deferred)
      .def_readwrite("fused", &ModuleSpec::fused)
      .def_readwrite("store", &ModuleSpec::store)
      .def(
          "add_inner",
          [](ModuleSpec& spec, std::shared_ptr<ops::WgradStore> store, std::function<void()> run_hooks, bool defers) {
            spec.inner.push_back(ModuleSpec::Inner{std::move(store), std::move(run_hooks), defers});
          },
          py::arg("store"), py::arg("run_hooks"), py::arg("defers"));

  py::class_<DwgraphModuleInfo>(m, "DwgraphModuleInfo")
      .def(py::init<>())
      .def_readwrite("name", &DwgraphModuleInfo::name)
      .def_readwrite("display_name", &DwgraphModuleInfo::display_name)
      .def_readwrite("store", &DwgraphModuleInfo::store)
      .def_readwrite("delay_wgrad_compute", &DwgraphModuleInfo::delay_wgrad_compute)
      .def_readwrite("fuse_wgrad_accumulation", &DwgraphModuleInfo::fuse_wgrad_accumulation)
      .def_readwrite("parameter_names", &DwgraphModuleInfo::parameter_names)
      .def_readwrite("parameters", &DwgraphModuleInfo::parameters)
      .def_readwrite("run_hooks", &DwgraphModuleInfo::run_hooks)
      .def_readwrite("main_grad", &DwgraphModuleInfo::main_grad)
      .def_readwrite("get_flag", &DwgraphModuleInfo::get_flag)
      .def_readwrite("set_flag", &DwgraphModuleInfo::set_flag);
  m.def("dwgraph_module_spec", &dwgraph_module_spec, py::arg("info"));

  py::class_<GraphableCallable>(m, "GraphableCallable")
      .def(py::init<>())
      .def_readwrite("name", &GraphableCallable::name)
      .def_readwrite("forward", &GraphableCallable::forward)
      .def_readwrite("parameters", &GraphableCallable::parameters)
      .def_readwrite("parameter_names", &GraphableCallable::parameter_names)
      .def_readwrite("current_parameters", &GraphableCallable::current_parameters)
      .def_readwrite("registered_parameters", &GraphableCallable::registered_parameters)
      .def_readwrite("check_state", &GraphableCallable::check_state)
      .def_readwrite("state_watched", &GraphableCallable::state_watched)
      .def_readwrite("modules", &GraphableCallable::modules)
      .def_readwrite("training_mode", &GraphableCallable::training_mode)
      .def_readwrite("buffer_names", &GraphableCallable::buffer_names)
      .def_readwrite("current_buffers", &GraphableCallable::current_buffers)
      .def_readwrite("saved_state", &GraphableCallable::saved_state)
      .def_readwrite("capture_time_hook", &GraphableCallable::capture_time_hook)
      .def_readwrite("buffers", &GraphableCallable::buffers);

  py::class_<Schedule>(m, "Schedule")
      .def_static("sequential", &Schedule::sequential, py::arg("num_callables"))
      .def_static(
          "pipeline",
          [](const py::sequence& order, std::optional<std::vector<int64_t>> num_layers_per_chunk, size_t num_callables) {
            return Schedule::pipeline(order_values(order), num_layers_per_chunk, num_callables);
          },
          py::arg("order"), py::arg("num_layers_per_chunk"), py::arg("num_callables"))
      .def_static(
          "from_arguments",
          // num_layers_per_chunk: None, one int for every chunk or a list of ints (layer_counts).
          [](const std::optional<py::sequence>& order, const py::object& num_layers_per_chunk, size_t num_callables) {
            const LayerCounts layers = layer_counts(num_layers_per_chunk);
            return Schedule::from_arguments(order ? std::optional<std::vector<double>>(order_values(*order)) : std::nullopt,
                                            layers.per_chunk, num_callables, layers.each);
          },
          py::arg("order"), py::arg("num_layers_per_chunk"), py::arg("num_callables"))
      .def("check_per_slot", &Schedule::check_per_slot, py::arg("n"), py::arg("what"))
      .def_property_readonly("pipelined", &Schedule::pipelined)
      .def_property_readonly("num_slots", &Schedule::num_slots)
      .def_property_readonly("num_callables", &Schedule::num_callables)
      .def_property_readonly("num_microbatches", &Schedule::num_microbatches)
      .def("callable_of_slot", &Schedule::callable_of_slot, py::arg("slot"));

  py::class_<GraphedCallable, std::shared_ptr<GraphedCallable>>(m, "GraphedCallable")
      // None when the callable is in a mode its graphs were not captured in: the front end
      // then runs it eagerly with the caller's own arguments.
      .def("__call__", &GraphedCallable::replay_or_nothing, py::arg("inputs"), py::call_guard<py::gil_scoped_release>())
      // The front end's common path (contract C10): positional tensor arguments as the
      // caller's tuple, converted here without a Python-level pass over them.
      // NotImplemented when one is not a tensor (the front end's general path decides),
      // None for a mode the graphs were not captured in, else the one output or the list.
      .def(
          "call_tensors",
          [](GraphedCallable& self, const py::tuple& args, bool single) -> py::object {
            std::vector<at::Tensor> inputs;
            inputs.reserve(args.size());
            for (const auto& a : args) {
              if (!THPVariable_Check(a.ptr())) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
              inputs.push_back(THPVariable_Unpack(a.ptr()));
            }
            std::optional<std::vector<at::Tensor>> outs;
            {
              const py::gil_scoped_release no_gil;
              outs = self.replay_or_nothing(inputs);
            }
            if (!outs) return py::none();
            if (single && outs->size() == 1) return py::cast((*outs)[0]);
            return py::cast(*outs);
          },
          py::arg("args"), py::arg("single"))
      .def("replays", &GraphedCallable::replays)
      .def("backward_dw", &GraphedCallable::backward_dw, py::call_guard<py::gil_scoped_release>())
      .def("need_backward_dw", &GraphedCallable::need_backward_dw)
      .def("reset", &GraphedCallable::reset, py::call_guard<py::gil_scoped_release>())
      .def("contribution_bytes", &GraphedCallable::contribution_bytes)
      .def("stats", [](const GraphedCallable& g) { return stats_dict(g.stats()); })
      .def("record_eager_peak", &GraphedCallable::record_eager_peak, py::arg("nbytes"))
      .def("same_set", &GraphedCallable::same_set, py::arg("other"))
      .def_property_readonly("device", &GraphedCallable::device)
      // Test-only: the negative controls turn the pool's replay-order checks off.
      .def_property_readonly("_pool", &GraphedCallable::pool)
      .def_property_readonly("index", &GraphedCallable::index)
      .def_property_readonly("callable_index", &GraphedCallable::callable_index)
      .def_property_readonly("name", &GraphedCallable::name);

  m.def(
      "make_graphed_callables",
      [](std::vector<GraphableCallable> callables, const std::vector<std::vector<at::Tensor>>& sample_args,
         int num_warmup_iters, bool allow_unused_input, std::optional<Schedule> schedule,
         std::shared_ptr<GraphPool> pool, bool retain_graph_in_backward, bool reuse_static_buffers,
         bool clone_outputs, bool backward_under_autocast, std::function<void()> pre_warmup_hook,
         std::function<void()> post_warmup_hook, bool plan_placement, bool unsafe_capture_with_caller_grad) {
        GraphedCallableOptions o;
        o.num_warmup_iters = num_warmup_iters;
        o.allow_unused_input = allow_unused_input;
        o.schedule = std::move(schedule);
        o.pool = std::move(pool);
        o.retain_graph_in_backward = retain_graph_in_backward;
        o.reuse_static_buffers = reuse_static_buffers;
        o.clone_outputs = clone_outputs;
        o.backward_under_autocast = backward_under_autocast;
        o.pre_warmup_hook = std::move(pre_warmup_hook);
        o.post_warmup_hook = std::move(post_warmup_hook);
        o.plan_placement = plan_placement;
        o.unsafe_capture_with_caller_grad = unsafe_capture_with_caller_grad;
        // Warmup and capture run the autograd engine, which must not hold the GIL; the
        // Python forward functions and hooks take it back when they are called.
        const py::gil_scoped_release no_gil;
        return make_graphed_callables(std::move(callables), sample_args, std::move(o));
      },
      py::arg("callables"), py::arg("sample_args"), py::kw_only(), py::arg("num_warmup_iters"),
      py::arg("allow_unused_input"), py::arg("schedule"), py::arg("pool"), py::arg("retain_graph_in_backward"),
      py::arg("reuse_static_buffers"), py::arg("clone_outputs"), py::arg("backward_under_autocast"),
      py::arg("pre_warmup_hook"), py::arg("post_warmup_hook"), py::arg("plan_placement"),
      py::arg("unsafe_capture_with_caller_grad"));

  py::class_<GraphedStep>(m, "GraphedStep")
      .def(py::init([](StepFn step, int warmup_iters, std::shared_ptr<GraphPool> pool, int64_t max_graphs,
                       std::function<NamedTensors()> params, std::function<std::vector<ModuleSpec>()> modules,
                       std::function<std::vector<at::Tensor>()> buffers, std::function<std::string()> variant_state,
                       std::string name, std::function<std::string()> describe_state, int64_t max_captures) {
             GraphedStepOptions o;
             o.warmup_iters = warmup_iters;
             o.pool = std::move(pool);
             o.max_graphs = max_graphs;
             o.params = std::move(params);
             o.modules = std::move(modules);
             o.buffers = std::move(buffers);
             o.variant_state = std::move(variant_state);
             o.describe_state = std::move(describe_state);
             o.max_captures = max_captures;
             auto g = std::make_unique<GraphedStep>(std::move(step), std::move(o));
             g->set_name(std::move(name));
             return g;
           }),
           py::arg("step"), py::kw_only(), py::arg("warmup_iters"), py::arg("pool"), py::arg("max_graphs"),
           py::arg("params"), py::arg("modules"), py::arg("buffers"), py::arg("variant_state"), py::arg("name"),
           py::arg("describe_state") = nullptr, py::arg("max_captures") = 128)
      // Warmup and capture run the autograd engine: no GIL (the step takes it back).
      .def("__call__", &GraphedStep::operator(), py::arg("tensors"), py::arg("key"),
           py::call_guard<py::gil_scoped_release>())
      .def("run_eagerly", &GraphedStep::run_eagerly, py::arg("tensors"), py::call_guard<py::gil_scoped_release>())
      // Note [A step's plain call] (graphs/graphed_step.h): the front end's common path
      // (contract C10). A call whose arguments are distinct plain tensors, as many as in the
      // recorded plain call, none the step trains or sharing its memory, none sharing memory
      // with another, under the recorded
      // ambient state and state epoch, has the recorded key: replayed here when its graph
      // exists. None otherwise (the front end's general path decides the call).
      .def(
          "replay_plain",
          [](GraphedStep& self, const py::tuple& args, const py::object& probe) -> py::object {
            const auto& plain = self.plain_call();
            if (!plain || args.size() != plain->num_tensors || state_epoch() != plain->epoch) return py::none();
            bool autocast_on = false;
            if (graphs::step_ambient(&autocast_on) != plain->ambient || autocast_on) return py::none();
            std::vector<at::Tensor> tensors;
            tensors.reserve(args.size());
            std::vector<const void*> memory;
            for (const auto& a : args) {
              // torch.Tensor itself: a Parameter or a subclass takes the general path.
              if (Py_TYPE(a.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return py::none();
              const auto id = reinterpret_cast<uintptr_t>(a.ptr());
              if (std::binary_search(plain->refused.begin(), plain->refused.end(), id)) return py::none();
              const at::Tensor& t = THPVariable_Unpack(a.ptr());
              if (t.layout() != at::kStrided) return py::none();
              if (t.numel() > 0) {
                const void* m = t.storage().data();
                if (std::find(memory.begin(), memory.end(), m) != memory.end() ||
                    overlaps(graphs::byte_span(t), plain->refused_memory)) {
                  return py::none();
                }
                memory.push_back(m);
              }
              // A leaf argument with tensor hooks: the general path refuses it (a static
              // input has none).
              if (t.requires_grad() && (has_items(a, "_backward_hooks") || has_items(a, "_post_accumulate_grad_hooks"))) {
                return py::none();
              }
              for (const auto& u : tensors) {
                if (u.is_same(t)) return py::none();
              }
              tensors.push_back(t);
            }
            // A copy: with the GIL released another thread's call may record another key.
            const std::string key = plain->key;
            // Note [A step's plain call]: the front end's probe, (tensor hook epoch, variant
            // state text, [(optimizer ref, watch ref)], the modules it runs (a
            // WeakValueDictionary), their number): while the hook epoch stands, no module
            // died and each optimizer is steady (its schedule's numbers taken), the variant
            // state is that text, and the core need not ask the front end for it.
            std::optional<std::string> state;
            PyObject* p = probe.ptr();
            if (PyTuple_CheckExact(p) && PyTuple_GET_SIZE(p) == 5 && PyList_CheckExact(PyTuple_GET_ITEM(p, 2)) &&
                PyUnicode_CheckExact(PyTuple_GET_ITEM(p, 1)) &&
                py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(p, 0)).cast<uint64_t>() == tensor_hook_epoch() &&
                weak_count(PyTuple_GET_ITEM(p, 3)) == py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(p, 4)).cast<Py_ssize_t>()) {
              const py::list entries = py::reinterpret_borrow<py::list>(PyTuple_GET_ITEM(p, 2));
              bool steady = true;
              for (Py_ssize_t i = 0; steady && i < PyList_GET_SIZE(entries.ptr()); ++i) {
                PyObject* refs = PyList_GET_ITEM(entries.ptr(), i);
                steady = PyTuple_CheckExact(refs) && PyTuple_GET_SIZE(refs) == 2 &&
                         PyWeakref_CheckRef(PyTuple_GET_ITEM(refs, 0)) && PyWeakref_CheckRef(PyTuple_GET_ITEM(refs, 1));
                if (!steady) break;
                // Held while asked: the optimizer's own code (a param_groups property) may run.
                const auto opt = py::reinterpret_borrow<py::object>(PyWeakref_GetObject(PyTuple_GET_ITEM(refs, 0)));
                const auto watch = py::reinterpret_borrow<py::object>(PyWeakref_GetObject(PyTuple_GET_ITEM(refs, 1)));
                steady = !opt.is_none() && !watch.is_none() && optimizer_steady(opt, watch);
              }
              if (steady) state = py::reinterpret_borrow<py::str>(PyTuple_GET_ITEM(p, 1)).cast<std::string>();
            }
            std::optional<std::vector<at::Tensor>> outs;
            {
              const py::gil_scoped_release no_gil;
              outs = self.replay_if_captured(tensors, key, state ? &*state : nullptr);
            }
            if (!outs) return py::none();
            return py::cast(std::move(*outs));
          },
          py::arg("args"), py::arg("probe") = py::none())
      .def(
          "set_plain_call",
          [](GraphedStep& self, size_t num_tensors, std::string ambient, uint64_t epoch, std::string key,
             std::vector<uintptr_t> refused, std::vector<std::pair<uintptr_t, uintptr_t>> refused_memory) {
            GraphedStep::PlainCall c;
            c.num_tensors = num_tensors;
            c.ambient = std::move(ambient);
            c.epoch = epoch;
            c.key = std::move(key);
            std::sort(refused.begin(), refused.end());
            c.refused = std::move(refused);
            std::sort(refused_memory.begin(), refused_memory.end());  // disjoint ranges, from the front end
            c.refused_memory = std::move(refused_memory);
            self.set_plain_call(std::move(c));
          },
          py::arg("num_tensors"), py::arg("ambient"), py::arg("epoch"), py::arg("key"), py::arg("refused"),
          py::arg("refused_memory"))
      .def("clear_plain_call", [](GraphedStep& self) { self.set_plain_call(std::nullopt); })
      .def_property_readonly("num_graphs", &GraphedStep::num_graphs)
      .def_property_readonly("num_captures", &GraphedStep::num_captures)
      .def_property_readonly("last_variant", &GraphedStep::last_variant)
      .def_property_readonly("live_variants", &GraphedStep::live_variants)
      .def("set_state_tensors", &GraphedStep::set_state_tensors, py::arg("tensors"))
      .def_property("watched", &GraphedStep::watched, &GraphedStep::set_watched)
      .def("stats",
           [](const GraphedStep& g) {
             const GraphedStepStats s = g.stats();
             py::dict d;
             d["num_graphs"] = s.num_graphs;
             d["num_captures"] = s.num_captures;
             d["captures_since_reset"] = s.captures_since_reset;
             d["num_variants"] = s.num_variants;
             d["num_keys"] = s.num_keys;
             d["replays"] = s.replays;
             d["eager_calls"] = s.eager_calls;
             d["capture_limited_calls"] = s.capture_limited_calls;
             d["released"] = s.released;
             d["dropped_keys"] = s.dropped_keys;
             d["max_graphs"] = s.max_graphs;
             d["max_captures"] = s.max_captures;
             d["max_idle_keys"] = g.max_idle_keys();
             d["pool_reserved_bytes"] = s.pool_reserved_bytes;
             d["pool_allocated_bytes"] = s.pool_allocated_bytes;
             d["pool_peak_allocated_bytes"] = s.pool_peak_allocated_bytes;
             return d;
           })
      .def("reset", &GraphedStep::reset);
}

}  // namespace dwgraph::bindings
