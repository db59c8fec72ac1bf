// Translates dwgraph's C++ error types into the Python classes of dwgraph/errors.py
// (see Note [Error types] in common/check.h).
#include "bindings/bindings.h"

#include "common/check.h"

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

// Sets the Python error; a translator must return normally after PyErr_SetString.
void raise(const char* cls, const c10::Error& e) {
  // Looked up per raise: the errors module is imported by dwgraph/__init__ before _C.
  py::object type = py::module_::import("dwgraph.errors").attr(cls);
  PyErr_SetString(type.ptr(), e.what_without_backtrace());
}

}  // namespace

void init_errors(py::module_& m) {
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ArgumentError& e) {
      raise("ArgumentError", e);
    } catch (const GraphStateError& e) {
      raise("GraphStateError", e);
    } catch (const DanglingCaptureError& e) {
      raise("DanglingCaptureError", e);
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  // Lets tests prove the translation without reaching into a real failure path.
  m.def(
      "_raise_for_test",
      [](const std::string& kind, const std::string& msg) {
        if (kind == "argument") DWGRAPH_CHECK_ARG(false, msg);
        if (kind == "state") DWGRAPH_CHECK_STATE(false, msg);
        if (kind == "dangling") throw DanglingCaptureError(c10::SourceLocation{__func__, __FILE__, __LINE__}, msg);
        TORCH_CHECK(false, msg);
      },
      py::arg("kind"), py::arg("message"));
}

}  // namespace dwgraph::bindings
