#pragma once
// The CUDA graph backend (namespace dwgraph::graphs): at::cuda::CUDAGraph on a PyTorch
// private pool (graph_pool_handle) that several graphs can share. Every graph of a pool
// is captured on the pool's one capture stream: autograd nodes created while a forward is
// captured remember that stream, and the backward capture must run them on the stream
// being captured (as torch.cuda.graph's shared default capture stream does). The recorder
// of the host graph runs during the capture too, only to fill the ledger, so a CUDA replay
// is checked for released storages and replay order as a host replay is. Compiled only
// with DWGRAPH_WITH_CUDA.

#include "graphs/graph.h"

#include <memory>

namespace dwgraph::graphs {

std::unique_ptr<Graph> make_cuda_graph(c10::Device device);
std::shared_ptr<GraphPool> make_cuda_pool(c10::Device device);
std::shared_ptr<GraphPool> make_cuda_pool_from_handle(std::pair<uint64_t, uint64_t> handle);
void run_on_cuda_capture_stream(const std::shared_ptr<GraphPool>& pool, const std::function<void()>& fn);

}  // namespace dwgraph::graphs
