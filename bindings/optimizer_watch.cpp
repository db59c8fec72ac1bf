// The optimizer side of Note [What selects a graph, watched] (dwgraph/_optim.py): a graphed
// step's optimizers are compared with what their watches (OptimizerWatch) last saw, by
// identity, at C speed; where only numbers a routed replay reads moved (a schedule's
// learning rate), they are taken into the watch and the replay's buffer (Note
// [Hyperparameters a replay reads]). The front end's OptimizerWatch and the step's plain
// call (bindings/manager.cpp) ask the same functions, so one rule decides both.
#include "bindings/bindings.h"

#include "common/check.h"

#include <Python.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

// same_groups / take_numbers (below): `read` null: every value by identity; else values
// under a key in `read` may differ, each given to `on_moved(i, key, now, seen)`, which
// returns whether the comparison goes on.
template <typename OnMoved>
bool compare_groups(const py::handle& groups, const py::list& seen, const py::list& keys, const py::list& values,
                    const py::list& params, PyObject* read, OnMoved&& on_moved) {
  static PyObject* const params_name = PyUnicode_InternFromString("params");
  PyObject* pg = groups.ptr();
  if (!PyList_CheckExact(pg)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(pg);
  if (n != PyList_GET_SIZE(seen.ptr()) || n != PyList_GET_SIZE(keys.ptr()) || n != PyList_GET_SIZE(values.ptr()) ||
      n != PyList_GET_SIZE(params.ptr())) {
    return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* g = PyList_GET_ITEM(pg, i);
    PyObject* ks = PyList_GET_ITEM(keys.ptr(), i);
    PyObject* vs = PyList_GET_ITEM(values.ptr(), i);
    PyObject* ps = PyList_GET_ITEM(params.ptr(), i);
    if (g != PyList_GET_ITEM(seen.ptr(), i) || !PyDict_CheckExact(g) || !PyTuple_CheckExact(ks) ||
        !PyList_CheckExact(vs) || !PyList_CheckExact(ps)) {
      return false;
    }
    const Py_ssize_t size = PyDict_GET_SIZE(g);
    if (size != PyTuple_GET_SIZE(ks) || size != PyList_GET_SIZE(vs)) return false;
    Py_ssize_t pos = 0, j = 0;
    PyObject *k = nullptr, *v = nullptr;
    while (PyDict_Next(g, &pos, &k, &v)) {
      if (j >= size || k != PyTuple_GET_ITEM(ks, j)) return false;
      PyObject* before = PyList_GET_ITEM(vs, j);
      ++j;
      if (v == before) continue;
      if (read == nullptr || k == params_name) return false;
      const int in_read = PySet_Contains(read, k);  // str keys: no Python code runs
      if (in_read < 0) PyErr_Clear();
      if (in_read != 1) return false;
      if (!on_moved(i, k, v, before)) return false;
    }
    // The same list object may hold other parameters now (changed in place).
    PyObject* now = PyDict_GetItem(g, params_name);  // borrowed; no error for str keys
    if (now == nullptr || !PyList_CheckExact(now)) return false;
    const Py_ssize_t count = PyList_GET_SIZE(now);
    if (count != PyList_GET_SIZE(ps)) return false;
    for (Py_ssize_t p = 0; p < count; ++p) {
      if (PyList_GET_ITEM(now, p) != PyList_GET_ITEM(ps, p)) return false;
    }
  }
  return true;
}

// numpy.float64 (a float subclass), once numpy is imported: the type itself, not its name
// (a user's class may be called anything). Null while numpy is not imported: then no value
// can be one.
PyTypeObject* numpy_float64() {
  static PyObject* cached = nullptr;  // held for the process, as numpy is
  if (cached != nullptr) return reinterpret_cast<PyTypeObject*>(cached);
  PyObject* np = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy");  // borrowed
  if (np == nullptr || !PyModule_Check(np)) return nullptr;
  PyObject* t = PyDict_GetItemString(PyModule_GetDict(np), "float64");  // borrowed: no module __getattr__ runs
  if (t == nullptr || !PyType_Check(t) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(t), &PyFloat_Type)) {
    return nullptr;
  }
  Py_INCREF(t);
  cached = t;
  return reinterpret_cast<PyTypeObject*>(t);
}

// Note [Hyperparameters a replay reads] (dwgraph/_optim.py): a value the ops read as the
// eager step's Python arithmetic computes with it: exactly an int that a double holds
// exactly (|v| <= 2**53: the replay's buffer is float64), a float, or numpy's float64 (IEEE
// double arithmetic, as float's). Not a subclass (its own arithmetic, a __neg__, is not
// what a replay computes); not bool.
bool is_number(PyObject* v) {
  if (PyLong_CheckExact(v)) {
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (PyErr_Occurred()) PyErr_Clear();
    constexpr long long kExact = 1LL << 53;
    return overflow == 0 && x >= -kExact && x <= kExact;
  }
  if (PyFloat_CheckExact(v)) return true;
  PyTypeObject* const f64 = numpy_float64();
  return f64 != nullptr && Py_TYPE(v) == f64;
}

// A number (is_number) as a double; runs no Python code (no __float__: the types are
// exact). False where `v` is not one.
bool as_double(PyObject* v, double* out) {
  if (PyFloat_Check(v) && is_number(v)) {
    *out = PyFloat_AS_DOUBLE(v);
    return true;
  }
  if (PyLong_CheckExact(v) && is_number(v)) {
    *out = PyLong_AsDouble(v);  // exact: |v| <= 2**53
    return true;
  }
  return false;
}

// A value a routed replay reads in place of torch's Python arithmetic: a number, and Adam's
// betas in the range torch's constructor allows, [0, 1). Beyond it torch's step computes in
// Python what the replay computes with tensors, differently: beta1 = 1 divides by zero
// (ZeroDivisionError), a negative 1 - beta2**step under a square root is a complex number.
bool routable(PyObject* name, PyObject* v) {
  static PyObject* const beta1 = PyUnicode_InternFromString("beta1");
  static PyObject* const beta2 = PyUnicode_InternFromString("beta2");
  double d = 0;
  if (!as_double(v, &d)) return false;
  const bool beta = name == beta1 || name == beta2 ||
                    (PyUnicode_Check(name) && (PyUnicode_Compare(name, beta1) == 0 || PyUnicode_Compare(name, beta2) == 0));
  return !beta || (d >= 0 && d < 1);
}

// `group[name]`, the betas' items under "beta1"/"beta2" (borrowed; null when absent).
PyObject* read_value(PyObject* group, PyObject* name) {
  static PyObject* const beta1 = PyUnicode_InternFromString("beta1");
  static PyObject* const beta2 = PyUnicode_InternFromString("beta2");
  static PyObject* const betas = PyUnicode_InternFromString("betas");
  if (name == beta1 || name == beta2) {
    PyObject* b = PyDict_GetItem(group, betas);
    if (b == nullptr || !PyTuple_CheckExact(b) || PyTuple_GET_SIZE(b) != 2) return nullptr;
    return PyTuple_GET_ITEM(b, name == beta1 ? 0 : 1);
  }
  return PyDict_GetItem(group, name);
}

// Whether `now` replaced `seen` under `key` only as a number the replay reads: both
// numbers of one type and, under a key torch branches on (in `branches`), zero or not
// alike; the betas as a pair of such numbers.
bool moved_as_number(PyObject* key, PyObject* now, PyObject* seen, PyObject* branches) {
  static PyObject* const betas = PyUnicode_InternFromString("betas");
  if (key == betas || PyUnicode_Compare(key, betas) == 0) {
    if (!PyTuple_CheckExact(now) || !PyTuple_CheckExact(seen) || PyTuple_GET_SIZE(now) != 2 ||
        PyTuple_GET_SIZE(seen) != 2) {
      return false;
    }
    for (Py_ssize_t i = 0; i < 2; ++i) {
      PyObject* a = PyTuple_GET_ITEM(now, i);
      if (!is_number(a) || Py_TYPE(a) != Py_TYPE(PyTuple_GET_ITEM(seen, i))) return false;
    }
    return true;
  }
  if (!is_number(now) || Py_TYPE(now) != Py_TYPE(seen)) return false;
  const int branch = PySet_Contains(branches, key);  // str keys: no Python code runs
  if (branch < 0) {
    PyErr_Clear();
    return false;
  }
  if (branch == 0) return true;
  double a = 0, b = 0;
  return as_double(now, &a) && as_double(seen, &b) && (a == 0) == (b == 0);
}

void fill_buffer(const at::Tensor& buffer, const double* values, size_t n) {
  DWGRAPH_CHECK_ARG(buffer.device().is_cpu() && buffer.scalar_type() == at::kDouble && buffer.is_contiguous(),
                    "fill_hyper: buffer must be a contiguous float64 CPU tensor, got ", buffer.scalar_type(), " on ",
                    buffer.device());
  DWGRAPH_CHECK_ARG(buffer.numel() == static_cast<int64_t>(n), "fill_hyper: buffer holds ", buffer.numel(),
                    " values, got ", n);
  std::copy(values, values + n, buffer.data_ptr<double>());
  if (!buffer.is_inference()) buffer.unsafeGetTensorImpl()->bump_version();  // as copy_ would
}

// The same comparison as same_groups where values under the keys in `read` (a set of str)
// may be other objects, each only as a number the replay reads (moved_as_number). Then it
// takes them: `hyper` (a list of floats, one per group and name in `names`), the buffer and
// the seen values (`values`: lists, `tuples`: the same as tuples) are updated, and true is
// returned. Anything else (something else changed, or nothing did, or a value is not
// routable): false, and nothing is written. Runs no Python code while it holds the groups.
bool take_numbers(const py::handle& groups, const py::handle& seen, const py::handle& keys, const py::handle& values,
                  const py::handle& tuples, const py::handle& params, const py::handle& read,
                  const py::handle& branches, const py::handle& names, const py::handle& hyper,
                  const at::Tensor& buffer) {
  for (const auto& l : {seen, keys, values, tuples, params, hyper}) {
    if (!l || !PyList_CheckExact(l.ptr())) return false;
  }
  if (!groups || !read || !branches || !names || !PyAnySet_Check(read.ptr()) || !PyAnySet_Check(branches.ptr()) ||
      !PyTuple_CheckExact(names.ptr())) {
    return false;
  }
  std::vector<Py_ssize_t> moved;
  const bool same = compare_groups(groups, py::reinterpret_borrow<py::list>(seen), py::reinterpret_borrow<py::list>(keys),
                                   py::reinterpret_borrow<py::list>(values), py::reinterpret_borrow<py::list>(params),
                                   read.ptr(), [&](Py_ssize_t i, PyObject* k, PyObject* now, PyObject* before) {
                                     if (!moved_as_number(k, now, before, branches.ptr())) return false;
                                     if (moved.empty() || moved.back() != i) moved.push_back(i);
                                     return true;
                                   });
  if (!same || moved.empty()) return false;
  PyObject* pg = groups.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(pg), per = PyTuple_GET_SIZE(names.ptr());
  if (PyList_GET_SIZE(hyper.ptr()) != n * per || PyList_GET_SIZE(tuples.ptr()) != n) return false;
  std::vector<double> now(static_cast<size_t>(n * per));
  for (Py_ssize_t i = 0; i < n; ++i) {
    for (Py_ssize_t j = 0; j < per; ++j) {
      PyObject* name = PyTuple_GET_ITEM(names.ptr(), j);
      PyObject* v = read_value(PyList_GET_ITEM(pg, i), name);
      // First, so that nothing is taken where one is not routable.
      if (v == nullptr || !routable(name, v) || !as_double(v, &now[i * per + j])) return false;
    }
  }
  fill_buffer(buffer, now.data(), now.size());
  for (Py_ssize_t i = 0; i < n * per; ++i) {
    PyObject* f = PyFloat_FromDouble(now[i]);
    if (f == nullptr) throw py::error_already_set();
    PyList_SetItem(hyper.ptr(), i, f);  // steals f
  }
  for (Py_ssize_t i : moved) {
    PyObject* vs = PyDict_Values(PyList_GET_ITEM(pg, i));
    if (vs == nullptr) throw py::error_already_set();
    PyObject* t = PyList_AsTuple(vs);
    if (t == nullptr) {
      Py_DECREF(vs);
      throw py::error_already_set();
    }
    PyList_SetItem(values.ptr(), i, vs);  // steal
    PyList_SetItem(tuples.ptr(), i, t);
  }
  return true;
}

bool truthy(const py::object& v) {
  if (!v) return false;
  const int r = PyObject_IsTrue(v.ptr());
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// A GradScaler's state on `opt`: grad_scale (i = 0) or found_inf (1), None where missing.
// Set, torch's step unscales or skips, which a graph captured without it does not; a fused
// optimizer's graph reads the tensors it captured.
py::object scaler_attr(const py::handle& opt, int i) {
  py::object v = optional_attr(opt, i == 0 ? "grad_scale" : "found_inf");
  return v ? v : py::none();
}

py::tuple scaler_state(const py::handle& opt) { return py::make_tuple(scaler_attr(opt, 0), scaler_attr(opt, 1)); }

bool optimizer_scaled(const py::handle& opt) { return !scaler_attr(opt, 0).is_none() || !scaler_attr(opt, 1).is_none(); }

// Whether the GradScaler state on `opt` is not the objects the watch last saw
// (`scaler_seen`, scaler_state() then): set, removed or replaced since.
bool scaler_moved(const py::handle& opt, const py::handle& w) {
  const py::object seen = optional_attr(w, "scaler_seen");
  if (!seen || !PyTuple_CheckExact(seen.ptr()) || PyTuple_GET_SIZE(seen.ptr()) != 2) return true;
  for (int i = 0; i < 2; ++i) {
    if (scaler_attr(opt, i).ptr() != PyTuple_GET_ITEM(seen.ptr(), i)) return true;
  }
  return false;
}

// Note [An optimizer's step hooks, watched]: an optimizer's step() runs its own step hooks
// (register_step_pre_hook, register_step_post_hook) and torch's global ones around the step,
// so a capture runs them and a replay runs what they did then: which hooks there are selects
// a graph. Each of the four dicts as (the dict, its size, the sum of its keys): a hook is
// added or removed through its handle, whose id is never reused and larger than every id
// issued before, so an added hook and a removed one never leave both the size and the sum
// as they were. (A dict written by hand is not told apart; a key that is not an int counts
// by its address.)
constexpr int kStepHookDicts = 4;

py::object global_step_hooks(const char* name) {
  // Held for the process's life (never released at exit, when Python may be gone).
  static const py::object* optim = new py::object(py::module_::import("torch.optim.optimizer"));
  return optional_attr(*optim, name);
}

void step_hook_dicts(const py::handle& opt, py::object (&dicts)[kStepHookDicts]) {
  dicts[0] = optional_attr(opt, "_optimizer_step_pre_hooks");
  dicts[1] = optional_attr(opt, "_optimizer_step_post_hooks");
  dicts[2] = global_step_hooks("_global_optimizer_pre_hooks");
  dicts[3] = global_step_hooks("_global_optimizer_post_hooks");
}

// (size, sum of keys) of a dict of hooks; (-1, 0) for anything else.
std::pair<long long, long long> hooks_signature(const py::object& d) {
  if (!d || !PyDict_Check(d.ptr())) return {-1, 0};
  long long sum = 0;
  Py_ssize_t pos = 0;
  PyObject *key = nullptr, *value = nullptr;
  while (PyDict_Next(d.ptr(), &pos, &key, &value)) {
    long long k = PyLong_CheckExact(key) ? PyLong_AsLongLong(key) : -1;
    if (k == -1 && (!PyLong_CheckExact(key) || PyErr_Occurred())) {
      if (PyErr_Occurred()) PyErr_Clear();
      k = static_cast<long long>(reinterpret_cast<intptr_t>(key));
    }
    sum += k;
  }
  return {static_cast<long long>(PyDict_Size(d.ptr())), sum};
}

// What the watch records (`step_hooks_seen`): per dict, the dict, its size and its sum.
py::tuple step_hooks_state(const py::handle& opt) {
  py::object dicts[kStepHookDicts];
  step_hook_dicts(opt, dicts);
  py::tuple out(3 * kStepHookDicts);
  for (int i = 0; i < kStepHookDicts; ++i) {
    const auto [n, sum] = hooks_signature(dicts[i]);
    out[3 * i] = dicts[i] ? dicts[i] : py::none();
    out[3 * i + 1] = py::int_(n);
    out[3 * i + 2] = py::int_(sum);
  }
  return out;
}

// Whether the step hooks of `opt` are not those `seen` records (step_hooks_state then).
bool step_hooks_differ(const py::handle& opt, const py::handle& seen) {
  if (!seen || !PyTuple_CheckExact(seen.ptr()) || PyTuple_GET_SIZE(seen.ptr()) != 3 * kStepHookDicts) return true;
  py::object dicts[kStepHookDicts];
  step_hook_dicts(opt, dicts);
  for (int i = 0; i < kStepHookDicts; ++i) {
    PyObject* was = PyTuple_GET_ITEM(seen.ptr(), 3 * i);
    if ((dicts[i] ? dicts[i].ptr() : Py_None) != was) return true;
    const auto [n, sum] = hooks_signature(dicts[i]);
    const long long was_n = PyLong_AsLongLong(PyTuple_GET_ITEM(seen.ptr(), 3 * i + 1));
    const long long was_sum = PyLong_AsLongLong(PyTuple_GET_ITEM(seen.ptr(), 3 * i + 2));
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return true;
    }
    if (n != was_n || sum != was_sum) return true;
  }
  return false;
}

// Whether the step hooks of `opt` moved since the watch recorded them (`step_hooks_seen`).
bool step_hooks_moved(const py::handle& opt, const py::handle& w) {
  return step_hooks_differ(opt, optional_attr(w, "step_hooks_seen"));
}

// OptimizerWatch.take_numbers (dwgraph/_optim.py): a routed optimizer (no GradScaler state
// on it, no mutable group value) whose groups moved only in numbers its replay reads:
// takes them (take_numbers above) into the watch and its buffer. The caller has checked
// scaler_moved().
bool take_numbers_of(const py::handle& opt, const py::handle& w) {
  // Routed implies no GradScaler state as of the last refresh, and both callers check
  // scaler_moved() first.
  if (!truthy(optional_attr(w, "routed")) || truthy(optional_attr(w, "volatile"))) return false;
  const py::object hyper = optional_attr(w, "hyper");
  const py::object buffers = optional_attr(w, "hyper_buffers");
  if (!hyper || !PyList_CheckExact(hyper.ptr()) || !buffers || !PyDict_CheckExact(buffers.ptr())) return false;
  const py::int_ count(PyList_GET_SIZE(hyper.ptr()));
  py::object buffer = py::reinterpret_borrow<py::object>(PyDict_GetItem(buffers.ptr(), count.ptr()));
  if (!buffer) buffer = w.attr("hyper_buffer")();  // made once per layout
  const py::object groups = optional_attr(opt, "param_groups");
  if (!groups) return false;
  return take_numbers(groups, optional_attr(w, "groups"), optional_attr(w, "keys"), optional_attr(w, "value_list"), optional_attr(w, "values"),
                      optional_attr(w, "params"), optional_attr(w, "read_from"), optional_attr(w, "branches"), optional_attr(w, "value_names"), hyper,
                      py::cast<at::Tensor>(buffer));
}

}  // namespace

// OptimizerWatch.steady (bindings.h).
bool optimizer_steady(const py::handle& opt, const py::handle& w) {
  const py::object groups = optional_attr(opt, "param_groups");
  const py::object seen = optional_attr(w, "groups_list");
  if (!groups || !seen || !groups.is(seen) || truthy(optional_attr(w, "volatile"))) return false;
  if (scaler_moved(opt, w) || step_hooks_moved(opt, w)) return false;
  const py::object state = optional_attr(opt, "state");
  const py::object state_obj = optional_attr(w, "state_obj");
  if (!state || !state_obj || !state.is(state_obj)) return false;
  // -1: not a watching dict when last looked at, so asked again at every call.
  const py::object seen_version = optional_attr(w, "state_version");
  const py::object version = optional_attr(state, "version");
  if (!seen_version || !version || !PyLong_CheckExact(seen_version.ptr()) || !PyLong_CheckExact(version.ptr())) {
    return false;
  }
  const long long v = PyLong_AsLongLong(seen_version.ptr());
  if (v == -1 || v != PyLong_AsLongLong(version.ptr())) {
    if (PyErr_Occurred()) PyErr_Clear();
    return false;
  }
  const py::object keys = optional_attr(w, "keys"), values = optional_attr(w, "value_list"), params = optional_attr(w, "params"),
                   seen_groups = optional_attr(w, "groups");
  for (const auto* l : {&keys, &values, &params, &seen_groups}) {
    if (!*l || !PyList_CheckExact(l->ptr())) return false;
  }
  if (compare_groups(groups, py::reinterpret_borrow<py::list>(seen_groups), py::reinterpret_borrow<py::list>(keys),
                     py::reinterpret_borrow<py::list>(values), py::reinterpret_borrow<py::list>(params), nullptr,
                     [](Py_ssize_t, PyObject*, PyObject*, PyObject*) { return false; })) {
    return true;
  }
  return take_numbers_of(opt, w);
}

void init_optimizer_watch(py::module_& parent) {
  auto m = parent.attr("graphs").cast<py::module_>();
  // Note [What selects a graph, watched] (dwgraph/_optim.py): whether two lists hold the
  // same objects, in order, by identity; one pointer comparison per element, no __eq__.
  m.def(
      "same_objects",
      [](const py::list& a, const py::list& b) {
        const Py_ssize_t n = PyList_GET_SIZE(a.ptr());
        if (n != PyList_GET_SIZE(b.ptr())) return false;
        for (Py_ssize_t i = 0; i < n; ++i) {
          if (PyList_GET_ITEM(a.ptr(), i) != PyList_GET_ITEM(b.ptr(), i)) return false;
        }
        return true;
      },
      py::arg("a"), py::arg("b"));
  // The same for an optimizer's param_groups, whole, in one call: `groups` is the list object
  // seen last and holds the same group dicts, each with the same keys and value objects in
  // order (`keys[i]`, `values[i]`), its "params" list holding the same parameters
  // (`params[i]`). False for anything else, a dict subclass included: the caller then
  // compares the values themselves. Runs no Python code (identity only).
  m.def(
      "same_groups",
      [](const py::handle& groups, const py::list& seen, const py::list& keys, const py::list& values,
         const py::list& params) { return compare_groups(groups, seen, keys, values, params, nullptr,
                                                   [](Py_ssize_t, PyObject*, PyObject*, PyObject*) { return false; }); },
      py::arg("groups"), py::arg("seen"), py::arg("keys"), py::arg("values"), py::arg("params"));
  m.def(
      "routable", [](const py::handle& name, const py::handle& v) { return routable(name.ptr(), v.ptr()); },
      py::arg("name"), py::arg("value"));
  // Note [Hyperparameters a replay reads] (dwgraph/_optim.py): writes a routed optimizer's
  // numbers into its buffer in place (no host tensor per call); bumps its version.
  m.def(
      "fill_hyper",
      [](const at::Tensor& buffer, const std::vector<double>& values) {
        fill_buffer(buffer, values.data(), values.size());
      },
      py::arg("buffer"), py::arg("values"));
  // Note [What selects a graph, watched] (dwgraph/_optim.py): OptimizerWatch.take_numbers
  // and .steady, decided here for the front end and for the step's plain call alike.
  m.def(
      "take_numbers_of", [](const py::handle& opt, const py::handle& watch) { return take_numbers_of(opt, watch); },
      py::arg("optimizer"), py::arg("watch"));
  m.def("optimizer_scaled", [](const py::handle& opt) { return optimizer_scaled(opt); }, py::arg("optimizer"));
  m.def("scaler_state", [](const py::handle& opt) { return scaler_state(opt); }, py::arg("optimizer"));
  m.def(
      "scaler_moved", [](const py::handle& opt, const py::handle& watch) { return scaler_moved(opt, watch); },
      py::arg("optimizer"), py::arg("watch"));
  m.def("step_hooks_state", [](const py::handle& opt) { return step_hooks_state(opt); }, py::arg("optimizer"));
  m.def(
      "step_hooks_differ", [](const py::handle& opt, const py::handle& seen) { return step_hooks_differ(opt, seen); },
      py::arg("optimizer"), py::arg("seen"));
  m.def(
      "step_hooks_moved", [](const py::handle& opt, const py::handle& watch) { return step_hooks_moved(opt, watch); },
      py::arg("optimizer"), py::arg("watch"));
  m.def(
      "optimizer_steady", [](const py::handle& opt, const py::handle& watch) { return optimizer_steady(opt, watch); },
      py::arg("optimizer"), py::arg("watch"));
}

}  // namespace dwgraph::bindings
