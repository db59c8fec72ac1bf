// The parameter setter watch (dwgraph._C.graphs.watch_parameter_setters): Note [Checks paid
// when state changes] (graphs/state_epoch.h) needs to hear of every change of a captured
// parameter that a replay check reads. Assignments to `param.data`,
// `param.requires_grad`, `param.grad_dtype` and `param.main_grad` go through the type's
// tp_setattro slot; for parameter types that use Python's generic attribute setter this
// replaces the slot with one that moves the state epoch when such an assignment changes
// something, then sets the attribute as before. Every other attribute (`param.grad = None`,
// zero_grad's hot path) costs one pointer comparison more.
#include "bindings/bindings.h"

#include "graphs/state_epoch.h"

#include <Python.h>

#include <array>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

std::array<PyObject*, 4> g_names{};  // interned: data, requires_grad, grad_dtype, main_grad
constexpr size_t kData = 0;

int name_index(PyObject* name) {
  for (size_t i = 0; i < g_names.size(); ++i) {
    if (name == g_names[i]) return static_cast<int>(i);
  }
  // Not interned (built at run time): compare the text.
  if (!PyUnicode_CheckExact(name)) return -1;
  for (size_t i = 0; i < g_names.size(); ++i) {
    if (PyUnicode_Compare(name, g_names[i]) == 0) return static_cast<int>(i);
  }
  if (PyErr_Occurred()) PyErr_Clear();
  return -1;
}

// Whether setting `name` to `value` (nullptr: deleting it) changes what obj has now.
bool changes(PyObject* obj, PyObject* name, PyObject* value, bool identity) {
  if (value == nullptr) return true;
  PyObject* now = PyObject_GetAttr(obj, name);
  if (now == nullptr) {
    PyErr_Clear();
    return true;
  }
  bool changed = true;
  if (now == value) {
    changed = false;
  } else if (!identity) {
    const int eq = PyObject_RichCompareBool(now, value, Py_EQ);
    if (eq < 0) PyErr_Clear();
    changed = eq != 1;
  }
  Py_DECREF(now);
  return changed;
}

int watched_setattro(PyObject* obj, PyObject* name, PyObject* value) {
  const int which = PyUnicode_Check(name) ? name_index(name) : -1;
  if (which >= 0) {
    // main_grad by identity (a new buffer with equal values is another buffer).
    if (which == static_cast<int>(kData) || changes(obj, name, value, /*identity=*/which == 3)) {
      graphs::bump_state_epoch();
    }
  }
  return PyObject_GenericSetAttr(obj, name, value);
}

}  // namespace

void init_watch(py::module_& parent) {
  auto m = parent.attr("graphs").cast<py::module_>();
  const char* names[] = {"data", "requires_grad", "grad_dtype", "main_grad"};
  for (size_t i = 0; i < g_names.size(); ++i) g_names[i] = PyUnicode_InternFromString(names[i]);
  // True when assignments on instances of `type` are watched now (or already were); false
  // for a type with its own __setattr__, whose parameters the caller must then check at
  // every call.
  m.def(
      "watch_parameter_setters",
      [](py::type type) {
        auto* t = reinterpret_cast<PyTypeObject*>(type.ptr());
        if (t->tp_setattro == &watched_setattro) return true;
        if (t->tp_setattro != &PyObject_GenericSetAttr || !(t->tp_flags & Py_TPFLAGS_HEAPTYPE)) return false;
        t->tp_setattro = &watched_setattro;
        PyType_Modified(t);
        return true;
      },
      py::arg("type"));
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
}

}  // namespace dwgraph::bindings
