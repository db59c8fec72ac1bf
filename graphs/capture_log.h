#pragma once
// The log lines of a make_graphed_callables capture (docs/logging.md): one INFO line for
// the set (callables, graphs, kernels, pool bytes, time) and one DEBUG line per graph.
#include "graphs/manager.h"

#include <chrono>
#include <memory>
#include <vector>

namespace dwgraph::graphs {

// `graphed`: what make_graphed_callables returns; `started`: when it was called.
void log_capture(const std::vector<std::shared_ptr<GraphedCallable>>& graphed,
                 std::chrono::steady_clock::time_point started);

}  // namespace dwgraph::graphs
