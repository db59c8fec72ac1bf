#include "graphs/phase_timing.h"

#include <time.h>

namespace dwgraph::graphs {
namespace {

std::atomic<bool> g_on{false};
std::atomic<bool> g_thread_cpu{false};
struct Totals {
  std::atomic<uint64_t> count{0}, replay_ns{0}, copy_ns{0};
};
std::array<Totals, 4> g_totals;

}  // namespace

void set_phase_timing(bool on, bool thread_cpu) {
  g_thread_cpu.store(thread_cpu, std::memory_order_relaxed);
  for (auto& t : g_totals) {
    t.count = 0;
    t.replay_ns = 0;
    t.copy_ns = 0;
  }
  g_on.store(on, std::memory_order_release);
}

bool phase_timing_on() { return g_on.load(std::memory_order_relaxed); }

uint64_t phase_clock_ns() {
  if (g_thread_cpu.load(std::memory_order_relaxed)) {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  }
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

PhaseTotals phase_totals(TimedPhase phase) {
  const auto& t = g_totals[static_cast<size_t>(phase)];
  return PhaseTotals{t.count.load(), t.replay_ns.load(), t.copy_ns.load()};
}

void add_phase_time(TimedPhase phase, uint64_t replay_ns, uint64_t copy_ns, bool count) {
  if (!phase_timing_on()) return;
  auto& t = g_totals[static_cast<size_t>(phase)];
  if (count) t.count.fetch_add(1, std::memory_order_relaxed);
  t.replay_ns.fetch_add(replay_ns, std::memory_order_relaxed);
  t.copy_ns.fetch_add(copy_ns, std::memory_order_relaxed);
}

}  // namespace dwgraph::graphs
