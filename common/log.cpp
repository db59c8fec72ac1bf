#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace dwgraph::log {
namespace {

Level level_from_env() {
  const char* v = std::getenv("DWGRAPH_LOG_LEVEL");
  if (v == nullptr) return Level::kWarning;
  const std::pair<const char*, Level> names[] = {{"DEBUG", Level::kDebug}, {"INFO", Level::kInfo},
                                                 {"WARNING", Level::kWarning}, {"ERROR", Level::kError},
                                                 {"OFF", Level::kOff}};
  for (const auto& [name, l] : names) {
    if (std::strcmp(v, name) == 0) return l;
  }
  std::fprintf(stderr, "[dwgraph] WARNING: DWGRAPH_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or OFF, got '%s'; using WARNING\n", v);
  return Level::kWarning;
}

const char* name(Level l) {
  switch (l) {
    case Level::kDebug: return "DEBUG";
    case Level::kInfo: return "INFO";
    case Level::kWarning: return "WARNING";
    case Level::kError: return "ERROR";
    case Level::kOff: break;
  }
  return "OFF";
}

struct State {
  std::mutex mutex;
  std::shared_ptr<const Sink> sink;  // null: the default sink
  Level threshold = level_from_env();
};

State& state() {
  static State s;
  return s;
}

std::shared_ptr<const Sink> current_sink() {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mutex);
  return s.sink;
}

}  // namespace

void set_sink(std::shared_ptr<const Sink> sink) {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mutex);
  s.sink = std::move(sink);
}

void set_level(Level l) {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mutex);
  s.threshold = l;
}

Level level() {
  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mutex);
  return s.threshold;
}

bool enabled(Level l) {
  try {
    if (auto sink = current_sink()) return sink->enabled(l);
  } catch (...) {
    return false;
  }
  return static_cast<int>(l) >= static_cast<int>(level());
}

void write(Level l, const std::string& message) {
  try {
    if (auto sink = current_sink()) {
      sink->write(l, message);
      return;
    }
    std::fprintf(stderr, "[dwgraph] %s: %s\n", name(l), message.c_str());
  } catch (...) {  // see the header
  }
}

std::string format_bytes(int64_t bytes) {
  if (bytes < 1024 && bytes > -1024) return c10::str(bytes, " B");
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes) / 1024.0;
  size_t u = 0;
  while ((v >= 1024.0 || v <= -1024.0) && u + 1 < sizeof(units) / sizeof(units[0])) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace dwgraph::log
