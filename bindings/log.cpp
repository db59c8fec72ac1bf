// Routes dwgraph's C++ log (common/log.h) to logging.getLogger("dwgraph") while the
// extension is loaded (Note [Where the log goes]).
#include "bindings/bindings.h"

#include "common/log.h"

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

// Looked up per line rather than held: no Python object may outlive the interpreter.
py::object logger() { return py::module_::import("logging").attr("getLogger")("dwgraph"); }

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() != 0 && Py_IsFinalizing() == 0;
#else
  return Py_IsInitialized() != 0 && !_Py_IsFinalizing();
#endif
}

std::shared_ptr<const log::Sink> python_sink() {
  auto sink = std::make_shared<log::Sink>();
  // Lines may come from threads without the GIL (capture runs with it released).
  sink->enabled = [](log::Level level) {
    if (!python_alive()) return false;
    const py::gil_scoped_acquire gil;
    return logger().attr("isEnabledFor")(static_cast<int>(level)).cast<bool>();
  };
  sink->write = [](log::Level level, const std::string& message) {
    if (!python_alive()) return;
    const py::gil_scoped_acquire gil;
    try {
      logger().attr("log")(static_cast<int>(level), message);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("dwgraph log sink");
    }
  };
  return sink;
}

}  // namespace

void init_log(py::module_& m) {
  log::set_sink(python_sink());
  // Back to the default sink before the interpreter goes away.
  py::module_::import("atexit").attr("register")(py::cpp_function([] { log::set_sink(nullptr); }));
  m.def("format_bytes", &log::format_bytes, py::arg("bytes"));
  // Lets tests prove the routing C++ -> logging without a capture.
  m.def(
      "_log_for_test",
      [](int level, const std::string& message) {
        const auto l = static_cast<log::Level>(level);
        if (log::enabled(l)) log::write(l, message);
      },
      py::arg("level"), py::arg("message"));
}

}  // namespace dwgraph::bindings
