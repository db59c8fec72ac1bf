#pragma once
// Errors and argument checks shared by every dwgraph directory (namespace dwgraph).
//
// Note [Error types]: user mistakes throw one of the classes below. Each derives from the
// c10 type torch already translates for Python (c10::ValueError -> ValueError,
// c10::Error -> RuntimeError) and carries a stable ErrorCode. The Python extension maps
// codes (never message text) to dwgraph's Python classes (dwgraph.ArgumentError,
// GraphStateError, DanglingCaptureError).
//
// An error can reach Python through torch's own bindings instead of dwgraph's: raised
// inside loss.backward() by a graphed backward node, or inside a captured region by the
// host graph's recorder, under some torch op's Python binding. Those bindings only know
// c10 types. So every dwgraph error is thrown through detail::throw_error, which asks the
// installed ErrorRaiser first: the extension installs one that raises the Python class
// itself (a pybind11 error_already_set, which torch's bindings and the autograd engine
// pass through unchanged). Pure C++ users install none and catch the C++ types.
// Broken internal invariants use TORCH_INTERNAL_ASSERT.

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <string>

namespace dwgraph {

// Stable across releases: the Python extension maps these to exception classes.
enum class ErrorCode : int { kArgument = 1, kGraphState = 2, kDanglingCapture = 3 };

// A bad argument: wrong shape, dtype, device, layout or value.
class ArgumentError : public c10::ValueError {
 public:
  using c10::ValueError::ValueError;
  static constexpr ErrorCode kCode = ErrorCode::kArgument;
};

// An API used in a state that does not allow it (after reset, backward_dw with nothing
// queued or before its backward, a replay order that would corrupt pool memory).
class GraphStateError : public c10::Error {
 public:
  using c10::Error::Error;
  static constexpr ErrorCode kCode = ErrorCode::kGraphState;
};

// A graph replay would read or write a storage its owner has released.
class DanglingCaptureError : public c10::Error {
 public:
  using c10::Error::Error;
  static constexpr ErrorCode kCode = ErrorCode::kDanglingCapture;
};

// Raises the error for (code, message); must throw. Installed by the Python extension.
using ErrorRaiser = void (*)(ErrorCode code, const std::string& message);
void set_error_raiser(ErrorRaiser raiser);

// The code of a dwgraph error, or 0 when `e` is not one.
int error_code(const std::exception& e);

// torch's Python autograd engine, when Python code inside a backward raises, throws
// python_error and also leaves the Python error indicator set: it expects to return to
// Python at once. Code that runs the engine from C++ and then calls Python again (a failed
// capture rolls back through Python callbacks) must clear the indicator first, or CPython
// misreads the stale error in those calls (it can even drop a class's __getattr__ hook for
// good). The exception object keeps the error. Installed by the Python extension.
using ErrorIndicatorClearer = void (*)();
void set_error_indicator_clearer(ErrorIndicatorClearer clearer);
void clear_error_indicator() noexcept;

// Runs an autograd engine call; when it throws, clears the indicator and rethrows.
template <class Fn>
decltype(auto) run_autograd_engine(Fn&& fn) {
  try {
    return fn();
  } catch (...) {
    clear_error_indicator();
    throw;
  }
}

namespace detail {
[[noreturn]] void throw_error(ErrorCode code, const char* func, const char* file, uint32_t line,
                              const std::string& msg);
}  // namespace detail

}  // namespace dwgraph

// DWGRAPH_CHECK_ARG(cond, msg...): a user-facing argument check. The message must name
// the function, the argument, the expected and the actual value, e.g.
//   "dwgraph.wgrad_gemm: argument 'out' must have shape [8, 16] (N, K), got [8, 15]".
#define DWGRAPH_CHECK_ARG(cond, ...)                                                       \
  do {                                                                                     \
    if (C10_UNLIKELY(!(cond))) {                                                           \
      ::dwgraph::detail::throw_error(::dwgraph::ErrorCode::kArgument, __func__, __FILE__,  \
                                     static_cast<uint32_t>(__LINE__), ::c10::str(__VA_ARGS__)); \
    }                                                                                      \
  } while (0)

// DWGRAPH_CHECK_STATE(cond, msg...): a user-facing state check (GraphStateError).
#define DWGRAPH_CHECK_STATE(cond, ...)                                                       \
  do {                                                                                       \
    if (C10_UNLIKELY(!(cond))) {                                                             \
      ::dwgraph::detail::throw_error(::dwgraph::ErrorCode::kGraphState, __func__, __FILE__,  \
                                     static_cast<uint32_t>(__LINE__), ::c10::str(__VA_ARGS__)); \
    }                                                                                        \
  } while (0)

// DWGRAPH_RAISE(code, msg...): an unconditional dwgraph error of `code`.
#define DWGRAPH_RAISE(code, ...)                                                     \
  ::dwgraph::detail::throw_error(code, __func__, __FILE__, static_cast<uint32_t>(__LINE__), \
                                 ::c10::str(__VA_ARGS__))
