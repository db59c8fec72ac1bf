// dwgraph::log (common/log.h): the sink API, the default sink's threshold, byte
// formatting, and the capture log make_graphed_callables writes (graphs/capture_log.h).
#include "testing.h"

#include "common/log.h"
#include "graphs/manager.h"
#include "nn/modules.h"

#include <regex>
#include <stdexcept>
#include <utility>

using dwgraph::log::Level;

namespace {

// Installs a sink that keeps every line at or above `min`; restores the default one.
struct KeepLines {
  std::vector<std::pair<Level, std::string>> lines;
  explicit KeepLines(Level min) {
    auto sink = std::make_shared<dwgraph::log::Sink>();
    sink->enabled = [min](Level l) { return static_cast<int>(l) >= static_cast<int>(min); };
    sink->write = [this](Level l, const std::string& m) { lines.emplace_back(l, m); };
    dwgraph::log::set_sink(sink);
  }
  ~KeepLines() { dwgraph::log::set_sink(nullptr); }
};

std::vector<std::shared_ptr<dwgraph::GraphedCallable>> capture_one_linear() {
  dwgraph::nn::DeferredOptions o;
  o.delay_wgrad_compute = true;
  auto lin = std::make_shared<dwgraph::nn::Linear>(8, 4, o);
  return dwgraph::make_graphed_callables(
      {dwgraph::nn::graphable("lin", lin, [lin](const std::vector<at::Tensor>& x) {
        return std::vector<at::Tensor>{lin->forward(x[0])};
      })},
      {{at::randn({3, 8}).requires_grad_()}});
}

}  // namespace

TEST_CASE("log: a capture writes one INFO line and one DEBUG line per graph", "[log]") {
  KeepLines keep(Level::kDebug);
  const auto g = capture_one_linear();
  const auto st = dwgraph::graphed_stats(*g[0]);
  REQUIRE(st.graphs.size() == 3);
  REQUIRE(keep.lines.size() == 4);
  CHECK(keep.lines[0].first == Level::kInfo);
  size_t kernels = 0;
  for (const auto& gi : st.graphs) kernels += gi.num_kernels;
  const std::regex info(
      "make_graphed_callables: captured 1 callables in [0-9]+\\.[0-9]{3} s: 3 graphs, ([0-9]+) kernels; "
      "pool (.+) reserved, (.+) live; contributions (.+), static buffers (.+)");
  std::smatch m;
  REQUIRE(std::regex_match(keep.lines[0].second, m, info));
  CHECK(std::stoul(m[1]) == kernels);
  CHECK(m[2] == dwgraph::log::format_bytes(st.pool.reserved_bytes));
  CHECK(m[3] == dwgraph::log::format_bytes(st.pool.allocated_bytes));
  CHECK(m[4] == dwgraph::log::format_bytes(st.contribution_bytes));
  CHECK(m[5] == dwgraph::log::format_bytes(st.static_bytes));
  const char* kinds[] = {"forward", "backward", "backward-dw"};
  for (size_t i = 0; i < 3; ++i) {
    CHECK(keep.lines[i + 1].first == Level::kDebug);
    CHECK(st.graphs[i].kind == kinds[i]);
    CHECK(keep.lines[i + 1].second == "make_graphed_callables: " + st.graphs[i].kind + " graph of " +
                                          st.graphs[i].callable + ": " + std::to_string(st.graphs[i].num_kernels) +
                                          " kernels");
  }
}

TEST_CASE("log: lines below the sink's level are neither formatted nor written", "[log]") {
  KeepLines keep(Level::kWarning);
  capture_one_linear();
  dwgraph::log::info("not written");
  CHECK(keep.lines.empty());
  dwgraph::log::warning("written ", 3);
  REQUIRE(keep.lines.size() == 1);
  CHECK(keep.lines[0].first == Level::kWarning);
  CHECK(keep.lines[0].second == "written 3");
}

TEST_CASE("log: the default sink's threshold", "[log]") {
  const Level before = dwgraph::log::level();
  dwgraph::log::set_level(Level::kInfo);
  CHECK(dwgraph::log::enabled(Level::kInfo));
  CHECK(dwgraph::log::enabled(Level::kWarning));
  CHECK_FALSE(dwgraph::log::enabled(Level::kDebug));
  dwgraph::log::set_level(Level::kOff);
  CHECK_FALSE(dwgraph::log::enabled(Level::kError));
  dwgraph::log::set_level(before);
}

TEST_CASE("log: a throwing sink never fails the caller", "[log]") {
  auto sink = std::make_shared<dwgraph::log::Sink>();
  sink->enabled = [](Level) -> bool { throw std::runtime_error("enabled failed"); };
  sink->write = [](Level, const std::string&) { throw std::runtime_error("write failed"); };
  dwgraph::log::set_sink(sink);
  CHECK_FALSE(dwgraph::log::enabled(Level::kError));
  CHECK_NOTHROW(dwgraph::log::write(Level::kError, "x"));
  CHECK(capture_one_linear().size() == 1);
  dwgraph::log::set_sink(nullptr);
}

TEST_CASE("log: format_bytes", "[log]") {
  CHECK(dwgraph::log::format_bytes(0) == "0 B");
  CHECK(dwgraph::log::format_bytes(1023) == "1023 B");
  CHECK(dwgraph::log::format_bytes(1536) == "1.5 KiB");
  CHECK(dwgraph::log::format_bytes(int64_t{5} << 20) == "5.0 MiB");
  CHECK(dwgraph::log::format_bytes((int64_t{7} << 30) / 2) == "3.5 GiB");
}
