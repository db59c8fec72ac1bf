#pragma once
// Errors and argument checks shared by every dwgraph directory (namespace dwgraph).
//
// Note [Error types]: user mistakes throw one of the classes below. Each derives from the
// c10 type torch already translates for Python (c10::ValueError -> ValueError,
// c10::Error -> RuntimeError), so a dispatcher call through torch.ops still raises a
// sensible builtin type, and the dwgraph bindings translate them into dwgraph's own
// Python exceptions (dwgraph.ArgumentError, dwgraph.GraphStateError,
// dwgraph.DanglingCaptureError). Broken internal invariants use TORCH_INTERNAL_ASSERT.

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <string>

namespace dwgraph {

// A bad argument: wrong shape, dtype, device, layout or value.
class ArgumentError : public c10::ValueError {
 public:
  using c10::ValueError::ValueError;
};

// An API used in a state that does not allow it (after reset, backward_dw with nothing
// queued or before its backward, capture inside capture).
class GraphStateError : public c10::Error {
 public:
  using c10::Error::Error;
};

// A graph replay would read or write a storage its owner has released.
class DanglingCaptureError : public c10::Error {
 public:
  using c10::Error::Error;
};

namespace detail {
[[noreturn]] void throw_argument_error(const char* func, const char* file, uint32_t line,
                                       const std::string& msg);
[[noreturn]] void throw_state_error(const char* func, const char* file, uint32_t line,
                                    const std::string& msg);
}  // namespace detail

}  // namespace dwgraph

// DWGRAPH_CHECK_ARG(cond, msg...): a user-facing argument check. The message must name
// the function, the argument, the expected and the actual value, e.g.
//   "dwgraph.wgrad_gemm: argument 'out' must have shape [8, 16] (N, K), got [8, 15]".
#define DWGRAPH_CHECK_ARG(cond, ...)                                                   \
  do {                                                                                 \
    if (C10_UNLIKELY(!(cond))) {                                                       \
      ::dwgraph::detail::throw_argument_error(__func__, __FILE__,                      \
                                              static_cast<uint32_t>(__LINE__),         \
                                              ::c10::str(__VA_ARGS__));                \
    }                                                                                  \
  } while (0)

// DWGRAPH_CHECK_STATE(cond, msg...): a user-facing state check (GraphStateError).
#define DWGRAPH_CHECK_STATE(cond, ...)                                                 \
  do {                                                                                 \
    if (C10_UNLIKELY(!(cond))) {                                                       \
      ::dwgraph::detail::throw_state_error(__func__, __FILE__,                         \
                                           static_cast<uint32_t>(__LINE__),            \
                                           ::c10::str(__VA_ARGS__));                   \
    }                                                                                  \
  } while (0)
