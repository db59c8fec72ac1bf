// The one parser of pipeline orders and owner of the slot layout (graphs/schedule.h):
// every bad entry is an ArgumentError naming it, checked before any conversion; the slot
// layout and the capture steps.
#include "testing.h"

#include "common/check.h"
#include "graphs/schedule.h"

#include <cmath>
#include <limits>

using dwgraph::graphs::CaptureStep;
using dwgraph::graphs::Phase;
using dwgraph::graphs::Schedule;

TEST_CASE("Schedule: bad order entries are refused naming the entry", "[schedule][cpu]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  struct Bad {
    std::vector<double> order;
    const char* says;
  };
  const std::vector<Bad> cases = {
      {{1, -1, 1e19}, "entry 2 (1e+19)"},
      {{1, -1, -1e9}, "entry 2"},
      {{1, nan, -1}, "entry 1"},
      {{1, -1, inf}, "entry 2"},
      {{1, 1.3, -1}, "entry 1 (1.3) must be an integer"},
      {{1, -1.7, -1}, "entry 1"},
      {{1, 0.5, -1}, "entry 1"},
      {{0, -1}, "entry 0"},
      {{1, -2}, "backward 1 of chunk 2 but only 0 forwards"},
      {{1, -1.5, -1}, "backward-dw 1 of chunk 1 but only 0 backwards"},
      {{1, 1, -1}, "1 backwards of chunk 1; expected 2"},
      {{}, "empty order"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.says);
    try {
      (void)Schedule::pipeline(c.order, std::nullopt, 2);
      FAIL("no error");
    } catch (const dwgraph::ArgumentError& e) {
      CHECK_THAT(e.what_without_backtrace(), Catch::Contains(c.says));
    }
  }
  CHECK_THROWS_AS(Schedule::pipeline({1, 2, -2, -1}, std::vector<int64_t>{1, 2}, 2), dwgraph::ArgumentError);
  CHECK_THROWS_AS(Schedule::pipeline({1, 2, -2, -1}, std::nullopt, 3), dwgraph::ArgumentError);  // 3 over 2 chunks
}

namespace {
std::string steps_of(const std::vector<CaptureStep>& steps) {
  std::string out;
  for (const auto& st : steps) {
    if (!out.empty()) out += ' ';
    out += st.phase == Phase::kForward ? 'F' : st.phase == Phase::kBackward ? 'B' : 'W';
    out += std::to_string(st.slot);
  }
  return out;
}
}  // namespace

TEST_CASE("Schedule: pipeline slot layout and capture steps", "[schedule][cpu]") {
  // Two chunks (1 and 2 layers), two microbatches, 1F1B-like with backward-dw entries.
  const std::vector<double> order = {1, 1, 2, -2, -2.5, 2, -2, -2.5, -1, -1.5, -1, -1.5};
  const Schedule s = Schedule::pipeline(order, std::vector<int64_t>{1, 2}, 3);
  REQUIRE(s.num_slots() == 6);
  CHECK(s.num_microbatches() == 2);
  // chunk 1: callable 0 for microbatches 0, 1; chunk 2: callables 1, 2 for microbatch 0 then 1.
  const std::vector<size_t> callables = {0, 0, 1, 2, 1, 2};
  for (size_t slot = 0; slot < 6; ++slot) CHECK(s.callable_of_slot(slot) == callables[slot]);
  CHECK(s.slot(3).chunk == 2);
  CHECK(s.slot(3).microbatch == 0);
  CHECK(s.slot(4).microbatch == 1);
  CHECK_NOTHROW(s.check_deferred({true, false, true}));
  CHECK_THROWS_AS(s.check_deferred({true, false, false}), dwgraph::ArgumentError);  // chunk 2 defers nothing
  // Backwards run a chunk's layers in reverse; backward-dw only for deferring callables.
  CHECK(steps_of(s.capture_steps({true, false, true})) == "F0 F1 F2 F3 B3 B2 W3 F4 F5 B5 B4 W5 B0 W0 B1 W1");
  // Sequential: forwards, backwards reversed, then backward-dw.
  CHECK(steps_of(Schedule::sequential(3).capture_steps({true, false, true})) == "F0 F1 F2 B2 B1 B0 W0 W2");
}
