// The parameter setter watch (dwgraph._C.graphs.watch_parameter_setters): Note [Checks paid
// when state changes] (graphs/state_epoch.h) needs to hear of every change of a captured
// parameter that a replay check reads. Assignments to `param.data`,
// `param.requires_grad`, `param.grad_dtype` and `param.main_grad` go through the type's
// tp_setattro slot; watching gives torch.Tensor a `__setattr__`/`__delattr__` (Note [One
// setattr slot for every tensor type]) that moves the state epoch when such an assignment
// to a watched instance changes something, then sets the attribute as before. Every other
// attribute (`param.grad = None`, zero_grad's hot path) costs a few pointer comparisons more.
//
// Parameter types are watched whole (every instance); the buffers and main_grads graphs
// captured are plain tensors, whose type (torch.Tensor) every tensor shares, so those are
// watched one instance at a time (`buffer.data = t`, `main_grad.data = t`,
// `buffer.requires_grad = True`); other tensors pay a set lookup for those four names only.
//
// Note [One setattr slot for every tensor type]: the watch is installed as CPython installs
// a C-level `__setattr__`: slot wrappers of the watching function set as torch.Tensor's
// `__setattr__` and `__delattr__`, so that CPython itself gives the slot to torch.Tensor and
// to every subclass without its own (those made later too). Writing the slot of a type
// directly instead (the first version) left `object.__setattr__` as the method that
// `super().__setattr__` finds, and Python refuses to apply that past a type whose C slot
// differs: every subclass with a Python `__setattr__` calling super() raised TypeError
// ("can't apply this __setattr__"), process-wide. Now super() finds the watching wrapper.
// `object.__setattr__(tensor, ...)` called by name still skips over the slot and is
// refused the same way; setattr() and super() are not.
#include "bindings/bindings.h"

#include "graphs/state_epoch.h"

#include <Python.h>

#include <array>
#include <unordered_map>
#include <unordered_set>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

// Interned: data, requires_grad, grad_dtype, main_grad, __class__ (a watched parameter made
// an instance of another type: what the checks read may follow other rules now).
std::array<PyObject*, 5> g_names{};
constexpr size_t kData = 0;
constexpr size_t kClass = 4;

// Guarded by the GIL (every caller holds it).
std::unordered_set<PyTypeObject*> g_every_instance;  // parameter types: all their instances
std::unordered_set<PyObject*> g_tensors;             // single tensors (removed when they die)

int name_index(PyObject* name) {
  for (size_t i = 0; i < g_names.size(); ++i) {
    if (name == g_names[i]) return static_cast<int>(i);
  }
  // Not interned (built at run time): compare the text. An interned name is one of ours by
  // identity or none of them.
  if (!PyUnicode_CheckExact(name) || PyUnicode_CHECK_INTERNED(name)) return -1;
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

bool watched(PyObject* obj) {
  PyTypeObject* t = Py_TYPE(obj);
  if (g_every_instance.count(t) > 0 || (!g_tensors.empty() && g_tensors.count(obj) > 0)) return true;
  // An instance of a subclass of a watched type (a type made later, or a parameter whose
  // __class__ was reassigned to one: its assignments reach this slot through the subclass's
  // own __setattr__ and super()): heard as well (a review found `p.__class__ = Sub` then
  // `p.data = t` unheard).
  PyObject* mro = t->tp_mro;
  if (mro == nullptr || !PyTuple_Check(mro)) return false;
  for (Py_ssize_t i = 1; i < PyTuple_GET_SIZE(mro); ++i) {
    if (g_every_instance.count(reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(mro, i))) > 0) return true;
  }
  return false;
}

// A watched object whose __class__ moved to a type outside the watched ones is watched by
// itself from then on, until it dies (a review found `p.__class__ = OtherTensor` then
// `p.data = t` unheard). weakref -> object; the weakrefs are owned here.
std::unordered_map<PyObject*, PyObject*> g_left_their_type;

PyObject* forget_watched(PyObject* /*self*/, PyObject* ref) {
  auto it = g_left_their_type.find(ref);
  if (it != g_left_their_type.end()) {
    g_tensors.erase(it->second);
    PyObject* owned = it->first;
    g_left_their_type.erase(it);
    Py_DECREF(owned);
  }
  Py_RETURN_NONE;
}

PyMethodDef g_forget_watched{"_dwgraph_forget_watched", forget_watched, METH_O, nullptr};

void watch_by_itself(PyObject* obj) {
  if (g_tensors.count(obj) > 0) return;
  static PyObject* const callback = PyCFunction_New(&g_forget_watched, nullptr);
  PyObject* ref = callback != nullptr ? PyWeakref_NewRef(obj, callback) : nullptr;
  if (ref == nullptr) {  // not weak-referenceable: its address could outlive it
    PyErr_Clear();
    return;
  }
  g_tensors.insert(obj);
  g_left_their_type.emplace(ref, obj);
}

int watched_setattro(PyObject* obj, PyObject* name, PyObject* value) {
  const int which = PyUnicode_Check(name) ? name_index(name) : -1;
  const bool was_watched = which >= 0 && watched(obj);
  if (was_watched) {
    // main_grad and __class__ by identity (a new buffer with equal values is another buffer).
    if (which == static_cast<int>(kData) || changes(obj, name, value, /*identity=*/which >= 3)) {
      graphs::bump_state_epoch();
    }
  }
  const int rc = PyObject_GenericSetAttr(obj, name, value);
  if (rc == 0 && was_watched && which == static_cast<int>(kClass) && !watched(obj)) watch_by_itself(obj);
  return rc;
}

// Note [One setattr slot for every tensor type]. False (nothing changed) when torch.Tensor
// already has a `__setattr__` of someone else's.
bool install_on_tensor() {
  static bool installed = false;
  if (installed) return true;
  py::object tensor = py::module_::import("torch").attr("Tensor");
  auto* t = reinterpret_cast<PyTypeObject*>(tensor.ptr());
  if (t->tp_setattro != &PyObject_GenericSetAttr && t->tp_setattro != &watched_setattro) return false;
  for (const char* name : {"__setattr__", "__delattr__"}) {
    // object's slot wrapper names CPython's own wrapper of the slot (argument parsing and
    // its check against skipping C-level slots); only the function it wraps is ours.
    py::object base = py::reinterpret_steal<py::object>(
        PyObject_GetAttrString(reinterpret_cast<PyObject*>(&PyBaseObject_Type), name));
    if (!base || !PyObject_TypeCheck(base.ptr(), &PyWrapperDescr_Type)) throw py::error_already_set();
    auto* wrapper = reinterpret_cast<PyWrapperDescrObject*>(base.ptr())->d_base;
    py::object mine = py::reinterpret_steal<py::object>(
        PyDescr_NewWrapper(t, wrapper, reinterpret_cast<void*>(&watched_setattro)));
    if (!mine) throw py::error_already_set();
    // Through type's own setattr: CPython updates the slot of torch.Tensor and of its
    // subclasses that inherit it.
    if (PyObject_SetAttrString(tensor.ptr(), name, mine.ptr()) != 0) throw py::error_already_set();
  }
  // A metaclass that kept the slot from following (none known): the watch is not in place,
  // and the callers check at every call.
  installed = t->tp_setattro == &watched_setattro;
  return installed;
}

}  // namespace

void init_watch(py::module_& parent) {
  auto m = parent.attr("graphs").cast<py::module_>();
  const char* names[] = {"data", "requires_grad", "grad_dtype", "main_grad", "__class__"};
  for (size_t i = 0; i < g_names.size(); ++i) g_names[i] = PyUnicode_InternFromString(names[i]);
  // True when assignments on instances of `type` are watched now (or already were); false
  // for a type with its own __setattr__, whose parameters the caller must then check at
  // every call.
    // True when `type`'s instances' assignments go through the watching slot, once it is
  // installed on torch.Tensor (Note [One setattr slot for every tensor type]); false for a
  // type with its own __setattr__ (or a torch.Tensor that has one), whose parameters the
  // caller must then check at every call.
  auto install = [](PyTypeObject* t) {
    install_on_tensor();
    return t->tp_setattro == &watched_setattro;
  };
  m.def(
      "watch_parameter_setters",
      [install](py::type type) {
        auto* t = reinterpret_cast<PyTypeObject*>(type.ptr());
        if (!install(t)) return false;
        g_every_instance.insert(t);
        return true;
      },
      py::arg("type"));
  // One tensor (a captured buffer or main_grad); the caller removes it when it dies
  // (unwatch_tensor from a weakref callback). False when its type cannot be watched.
  m.def(
      "watch_tensor_setters",
      [install](py::object tensor) {
        if (!install(Py_TYPE(tensor.ptr()))) return false;
        g_tensors.insert(tensor.ptr());
        return true;
      },
      py::arg("tensor"));
  m.def(
      "unwatch_tensor", [](uintptr_t address) { g_tensors.erase(reinterpret_cast<PyObject*>(address)); },
      py::arg("address"));
  // Whether a change of `tensor` (set_(), requires_grad_()) moves the state epoch: a
  // parameter of a watched type, or a tensor watched by itself.
  m.def("is_watched_tensor", [](py::handle tensor) { return watched(tensor.ptr()); }, py::arg("tensor"));
}

}  // namespace dwgraph::bindings
