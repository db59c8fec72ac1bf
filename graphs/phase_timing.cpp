#include "graphs/phase_timing.h"

#include "common/check.h"

#include <linux/perf_event.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace dwgraph::graphs {
namespace {

std::atomic<bool> g_on{false};
std::atomic<PhaseClock> g_clock{PhaseClock::kWall};
struct Totals {
  std::atomic<uint64_t> count{0}, replay_ns{0}, copy_ns{0};
};
std::array<Totals, 4> g_totals;

// The calling thread's counter of retired user-space instructions; -errno when refused.
int instruction_counter() {
  struct Fd {
    int fd;
    Fd() {
      perf_event_attr attr{};
      attr.type = PERF_TYPE_HARDWARE;
      attr.size = sizeof(attr);
      attr.config = PERF_COUNT_HW_INSTRUCTIONS;
      attr.exclude_kernel = 1;  // the thread's own work, not the syscalls that read the clock
      attr.exclude_hv = 1;
      const long r = syscall(SYS_perf_event_open, &attr, 0 /*this thread*/, -1 /*any cpu*/, -1, 0);
      fd = r >= 0 ? static_cast<int>(r) : -errno;
    }
    ~Fd() {
      if (fd >= 0) close(fd);
    }
  };
  thread_local Fd counter;
  return counter.fd;
}

}  // namespace

void set_phase_timing(bool on, PhaseClock clock) {
  if (on && clock == PhaseClock::kInstructions) {
    const int fd = instruction_counter();
    DWGRAPH_CHECK_ARG(fd >= 0, "set_phase_timing(clock='instructions'): the kernel refused a perf-event "
                      "instruction counter for this thread (", std::strerror(-fd), "; "
                      "/proc/sys/kernel/perf_event_paranoid above 2, or no hardware counters in this VM); use "
                      "clock='thread_cpu'");
  }
  g_clock.store(clock, std::memory_order_relaxed);
  for (auto& t : g_totals) {
    t.count = 0;
    t.replay_ns = 0;
    t.copy_ns = 0;
  }
  g_on.store(on, std::memory_order_release);
}

bool phase_timing_on() { return g_on.load(std::memory_order_relaxed); }

uint64_t phase_clock_ns() {
  const PhaseClock clock = g_clock.load(std::memory_order_relaxed);
  if (clock == PhaseClock::kInstructions) {
    const int fd = instruction_counter();
    uint64_t n = 0;
    // A thread whose counter was refused reads 0: its phases add nothing, never garbage.
    if (fd < 0 || read(fd, &n, sizeof(n)) != static_cast<ssize_t>(sizeof(n))) return 0;
    return n;
  }
  if (clock == PhaseClock::kThreadCpu) {
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
