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
// figures hold on a loaded machine.

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

void set_phase_timing(bool on, bool thread_cpu = false);  // on: also resets the totals
bool phase_timing_on();
uint64_t phase_clock_ns();  // the clock set_phase_timing chose
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
