#include "common/check.h"

#include <atomic>

namespace dwgraph {
namespace {
std::atomic<ErrorRaiser> g_raiser{nullptr};
std::atomic<ErrorIndicatorClearer> g_clearer{nullptr};
}  // namespace

void set_error_raiser(ErrorRaiser raiser) { g_raiser.store(raiser); }

void set_error_indicator_clearer(ErrorIndicatorClearer clearer) { g_clearer.store(clearer); }

void clear_error_indicator() noexcept {
  if (ErrorIndicatorClearer clear = g_clearer.load()) clear();
}

int error_code(const std::exception& e) {
  if (dynamic_cast<const ArgumentError*>(&e) != nullptr) return static_cast<int>(ErrorCode::kArgument);
  if (dynamic_cast<const GraphStateError*>(&e) != nullptr) return static_cast<int>(ErrorCode::kGraphState);
  if (dynamic_cast<const DanglingCaptureError*>(&e) != nullptr) return static_cast<int>(ErrorCode::kDanglingCapture);
  return 0;
}

namespace detail {

void throw_error(ErrorCode code, const char* func, const char* file, uint32_t line, const std::string& msg) {
  if (ErrorRaiser raise = g_raiser.load()) raise(code, msg);  // throws
  const c10::SourceLocation loc{func, file, line};
  switch (code) {
    case ErrorCode::kArgument:
      throw ArgumentError(loc, msg);
    case ErrorCode::kGraphState:
      throw GraphStateError(loc, msg);
    case ErrorCode::kDanglingCapture:
      throw DanglingCaptureError(loc, msg);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown dwgraph error code ", static_cast<int>(code));
}

}  // namespace detail
}  // namespace dwgraph
