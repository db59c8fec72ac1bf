#include "graphs/graph.h"

#include "common/check.h"
#include "graphs/host_graph.h"

#ifdef DWGRAPH_WITH_CUDA
#include "graphs/cuda_graph.h"
#endif

namespace dwgraph::graphs {

std::shared_ptr<GraphPool> make_pool(c10::Device device) {
  if (device.is_cpu()) return std::make_shared<HostGraphPool>();
#ifdef DWGRAPH_WITH_CUDA
  if (device.is_cuda()) return make_cuda_pool(device);
#endif
  DWGRAPH_CHECK_ARG(false, "dwgraph.graph_pool_handle: argument 'device' must be cpu",
#ifdef DWGRAPH_WITH_CUDA
                    " or cuda",
#else
                    " (this build has no CUDA sources)",
#endif
                    ", got ", device);
  return nullptr;
}

void run_on_side_stream(c10::Device device, const std::function<void()>& fn) {
#ifdef DWGRAPH_WITH_CUDA
  if (device.is_cuda()) {
    run_on_cuda_side_stream(device, fn);
    return;
  }
#endif
  fn();
}

std::unique_ptr<Graph> make_graph(c10::Device device) {
  if (device.is_cpu()) return std::make_unique<HostGraph>();
#ifdef DWGRAPH_WITH_CUDA
  if (device.is_cuda()) return make_cuda_graph(device);
#endif
  DWGRAPH_CHECK_ARG(false, "dwgraph.Graph: argument 'device' must be cpu",
#ifdef DWGRAPH_WITH_CUDA
                    " or cuda",
#else
                    " (this build has no CUDA sources)",
#endif
                    ", got ", device);
  return nullptr;
}

}  // namespace dwgraph::graphs
