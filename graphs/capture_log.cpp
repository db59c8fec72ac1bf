#include "graphs/capture_log.h"

#include "common/log.h"

namespace dwgraph::graphs {

void log_capture(const std::vector<std::shared_ptr<GraphedCallable>>& graphed,
                 std::chrono::steady_clock::time_point started) {
  if (graphed.empty() || !log::enabled(log::Level::kInfo)) return;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const GraphedStats st = graphed_stats(*graphed.front());
  size_t kernels = 0;
  for (const auto& g : st.graphs) kernels += g.num_kernels;
  char time[32];
  std::snprintf(time, sizeof(time), "%.3f s", seconds);
  log::info("make_graphed_callables: captured ", graphed.size(), " callables in ", time, ": ", st.num_graphs,
            " graphs, ", kernels, " kernels; pool ", log::format_bytes(st.pool.reserved_bytes), " reserved, ",
            log::format_bytes(st.pool.allocated_bytes), " live; contributions ",
            log::format_bytes(st.contribution_bytes), ", static buffers ", log::format_bytes(st.static_bytes));
  for (const auto& g : st.graphs) log::debug("make_graphed_callables: ", g.kind, " graph of ", g.callable, ": ", g.num_kernels, " kernels");
}

}  // namespace dwgraph::graphs
