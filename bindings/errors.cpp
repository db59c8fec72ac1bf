// dwgraph's errors in Python (see Note [Error types] in common/check.h): the raiser the
// core calls, which raises the Python class chosen by the error's code, and a translator
// for exceptions that reach dwgraph's own bindings as C++ exceptions.
#include "bindings/bindings.h"

#include "common/check.h"

#include <torch/csrc/Exceptions.h>

#include <unordered_map>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

const char* class_of(ErrorCode code) {
  switch (code) {
    case ErrorCode::kArgument:
      return "ArgumentError";
    case ErrorCode::kGraphState:
      return "GraphStateError";
    case ErrorCode::kDanglingCapture:
      return "DanglingCaptureError";
  }
  return "DwgraphError";
}

void set_python_error(ErrorCode code, const std::string& msg) {
  // Looked up per raise: dwgraph/__init__ imports the errors module before _C.
  const py::object cls = py::module_::import("dwgraph.errors").attr(class_of(code));
  PyErr_SetString(cls.ptr(), msg.c_str());
}

// Raises the Python class itself: torch's bindings (a torch op under a capture, the
// autograd engine under loss.backward()) pass error_already_set through unchanged.
[[noreturn]] void raise_python(ErrorCode code, const std::string& msg) {
  std::optional<py::error_already_set> error;
  {
    const py::gil_scoped_acquire gil;
    set_python_error(code, msg);
    error.emplace();
  }
  throw *error;
}

}  // namespace

int64_t python_int(const py::handle& v, const std::string& what) {
  const bool integer = PyIndex_Check(v.ptr()) && !py::isinstance<py::bool_>(v);
  DWGRAPH_CHECK_ARG(integer, what, " must be an int, got ", py::str(py::type::of(v).attr("__name__")).cast<std::string>(),
                    " ", py::repr(v).cast<std::string>());
  const py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  DWGRAPH_CHECK_ARG(overflow == 0, what, " (", py::str(v).cast<std::string>(), ") is out of range");
  return n;
}

py::object optional_attr(const py::handle& o, const char* name) {
  static std::unordered_map<const char*, PyObject*> interned;  // under the GIL
  PyObject*& key = interned[name];
  if (key == nullptr) key = PyUnicode_InternFromString(name);
  PyObject* v = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  const int found = PyObject_GetOptionalAttr(o.ptr(), key, &v);
#else
  const int found = _PyObject_LookupAttr(o.ptr(), key, &v);
#endif
  if (found <= 0) {
    if (found < 0) PyErr_Clear();
    return py::object();
  }
  return py::reinterpret_steal<py::object>(v);
}

void init_errors(py::module_& m) {
  set_error_raiser(&raise_python);
  set_error_indicator_clearer([] {
    const py::gil_scoped_acquire gil;
    PyErr_Clear();  // the python_error in flight keeps the exception; the translator restores it
  });
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (python_error& e) {
      e.restore();  // a Python exception raised inside the core's callbacks, with its own type
    } catch (const c10::Error& e) {
      const int code = error_code(e);
      if (code != 0) {
        set_python_error(static_cast<ErrorCode>(code), e.what_without_backtrace());
      } else {
        PyErr_SetString(dynamic_cast<const c10::ValueError*>(&e) != nullptr ? PyExc_ValueError : PyExc_RuntimeError,
                        e.what_without_backtrace());
      }
    }
  });
  // Lets tests prove the translation without reaching into a real failure path.
  m.def(
      "_raise_for_test",
      [](const std::string& kind, const std::string& msg) {
        if (kind == "argument") DWGRAPH_CHECK_ARG(false, msg);
        if (kind == "state") DWGRAPH_CHECK_STATE(false, msg);
        if (kind == "dangling") DWGRAPH_RAISE(ErrorCode::kDanglingCapture, msg);
        TORCH_CHECK(false, msg);
      },
      py::arg("kind"), py::arg("message"));
}

}  // namespace dwgraph::bindings
