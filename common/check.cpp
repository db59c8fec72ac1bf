#include "common/check.h"

namespace dwgraph::detail {

void throw_argument_error(const char* func, const char* file, uint32_t line,
                          const std::string& msg) {
  throw ArgumentError(c10::SourceLocation{func, file, line}, msg);
}

void throw_state_error(const char* func, const char* file, uint32_t line,
                       const std::string& msg) {
  throw GraphStateError(c10::SourceLocation{func, file, line}, msg);
}

}  // namespace dwgraph::detail
