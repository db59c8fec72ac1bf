#include "graphs/graph.h"

#include "common/check.h"
#include "graphs/host_graph.h"

#ifdef DWGRAPH_WITH_CUDA
#include "graphs/cuda_graph.h"
#endif

namespace dwgraph::graphs {
namespace {

[[noreturn]] void unsupported_device(const char* api, c10::Device device) {
#ifdef DWGRAPH_WITH_CUDA
  constexpr const char* kSupported = "cpu or cuda";
#else
  constexpr const char* kSupported = "cpu (this build has no CUDA sources)";
#endif
  DWGRAPH_CHECK_ARG(false, api, ": argument 'device' must be ", kSupported, ", got ", device);
  TORCH_INTERNAL_ASSERT(false);
}

}  // namespace

std::shared_ptr<GraphPool> make_pool(c10::Device device) {
  if (device.is_cpu()) return std::make_shared<HostGraphPool>();
#ifdef DWGRAPH_WITH_CUDA
  if (device.is_cuda()) return make_cuda_pool(device);
#endif
  unsupported_device("dwgraph.graph_pool_handle", device);
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
  unsupported_device("dwgraph.Graph", device);
}

}  // namespace dwgraph::graphs
