#pragma once
// The CUDA graph backend (namespace dwgraph::graphs): at::cuda::CUDAGraph, captured on a
// side stream in thread-local capture mode, on a PyTorch private pool (graph_pool_handle)
// that several graphs can share. The recorder of the host graph runs during the capture
// too, only to fill the ledger, so a CUDA replay is checked for released storages as a
// host replay is. Compiled only with DWGRAPH_WITH_CUDA.

#include "graphs/graph.h"

#include <memory>

namespace dwgraph::graphs {

std::unique_ptr<Graph> make_cuda_graph(c10::Device device);
std::shared_ptr<GraphPool> make_cuda_pool(c10::Device device);
void run_on_cuda_side_stream(c10::Device device, const std::function<void()>& fn);

}  // namespace dwgraph::graphs
