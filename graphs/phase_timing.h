#pragma once
// Host time of the graphed entry points, for the overhead benchmarks (namespace
// dwgraph::graphs; bench/bench_manager.py, bench/bench_step.py, contract C10): while
// switched on, each call, backward and backward_dw() of a graphed callable, and each
// replaying call of a graphed step (kStep), adds the time spent in its graph's replay and
// in its copies (static inputs in and out, outputs cloned, gradients copied and handed
// over, with the hand-off's checks and flags) to process-wide totals, so the benchmark can subtract them from the wall
// time of the same calls and what is left is the manager's own host work. Off (the
// default) it costs one relaxed load per phase. The clock is the wall clock, or the calling
// thread's CPU time: on CPU, where the whole call (the autograd backward included) runs on
// the calling thread, CPU time does not count the time the thread waits for a core, so the
// figures hold on a loaded machine. Or the calling thread's retired user-space instructions
// (Linux perf events): a count no load or cache state changes, which tells "does this grow
// with the model" where a difference of two large times is lost in their noise.

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace dwgraph::graphs {

enum class TimedPhase { kCall = 0, kBackward = 1, kBackwardDw = 2, kStep = 3 };

struct PhaseTotals {
  uint64_t count = 0;
  uint64_t replay_ns = 0;
  uint64_t copy_ns = 0;
};

enum class PhaseClock { kWall, kThreadCpu, kInstructions };

// on: also resets the totals. kInstructions throws (a dwgraph error naming the reason)
// where the kernel refuses a perf-event counter for this thread.
void set_phase_timing(bool on, PhaseClock clock = PhaseClock::kWall);
bool phase_timing_on();
// The clock set_phase_timing chose, read on the calling thread: nanoseconds, or
// instructions (each thread reads its own counter, opened on its first read).
uint64_t phase_clock_ns();
PhaseTotals phase_totals(TimedPhase phase);
void add_phase_time(TimedPhase phase, uint64_t replay_ns, uint64_t copy_ns, bool count);

// Adds the time of its scope to `*into` while timing is on.
class ScopedNs {
 public:
  explicit ScopedNs(uint64_t* into) : into_(phase_timing_on() ? into : nullptr) {
    if (into_ != nullptr) start_ = phase_clock_ns();
  }
  ~ScopedNs() {
    if (into_ != nullptr) *into_ += phase_clock_ns() - start_;
  }
  ScopedNs(const ScopedNs&) = delete;
  ScopedNs& operator=(const ScopedNs&) = delete;

 private:
  uint64_t* into_;
  uint64_t start_ = 0;
};

}  // namespace dwgraph::graphs
