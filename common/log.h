#pragma once
// dwgraph's log (namespace dwgraph::log): a few lines about what the library did (one
// INFO line per make_graphed_callables capture, one DEBUG line per graph), sent to a
// replaceable sink.
//
// Note [Where the log goes]: the Python extension, when loaded, installs a sink that
// forwards every line to logging.getLogger("dwgraph"), so Python's logging configuration
// decides what is shown. Without it (a pure C++ program) the default sink writes lines at
// or above a threshold to stderr as "[dwgraph] INFO: ..."; the threshold is WARNING unless
// the environment variable DWGRAPH_LOG_LEVEL (DEBUG, INFO, WARNING, ERROR or OFF) or
// set_level() says otherwise. See docs/logging.md.

#include <c10/util/StringUtil.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace dwgraph::log {

// Python logging's level numbers, so a sink can pass them on unchanged.
enum class Level : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40, kOff = 100 };

struct Sink {
  std::function<bool(Level)> enabled;  // whether lines of this level are wanted now
  std::function<void(Level, const std::string&)> write;
};

// Replaces the sink; nullptr restores the default one (stderr, with the threshold).
void set_sink(std::shared_ptr<const Sink> sink);
// The default sink's threshold (initially from DWGRAPH_LOG_LEVEL, else WARNING).
void set_level(Level level);
Level level();

bool enabled(Level level);
// Hands one line to the sink. Never throws: a log line must not fail what it reports on.
void write(Level level, const std::string& message);

template <class... Args>
void debug(const Args&... args) {
  if (enabled(Level::kDebug)) write(Level::kDebug, c10::str(args...));
}
template <class... Args>
void info(const Args&... args) {
  if (enabled(Level::kInfo)) write(Level::kInfo, c10::str(args...));
}
template <class... Args>
void warning(const Args&... args) {
  if (enabled(Level::kWarning)) write(Level::kWarning, c10::str(args...));
}

// "512 B", "1.5 KiB", "12.0 MiB": bytes in binary units, one decimal.
std::string format_bytes(int64_t bytes);

}  // namespace dwgraph::log
