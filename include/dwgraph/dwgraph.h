#pragma once
// dwgraph's C++ API in one include: #include <dwgraph/dwgraph.h>, link dwgraph::dwgraph
// (find_package(dwgraph); docs/install.md). The headers below are installed under
// include/dwgraph/ in this layout; in the build tree they are generated there too.
#include "dwgraph/common/build_info.h"    // version(), cuda_built(), cuda_available()
#include "dwgraph/common/check.h"         // ArgumentError, GraphStateError, DanglingCaptureError
#include "dwgraph/common/log.h"           // dwgraph::log: where the log lines go
#include "dwgraph/ops/gemm.h"             // the fused-accumulation GEMMs (dwgraph::ops)
#include "dwgraph/ops/linear.h"           // deferred-wgrad autograd functions
#include "dwgraph/graphs/graph.h"         // Graph, GraphPool: the CUDA and host graph backends
#include "dwgraph/graphs/manager.h"       // make_graphed_callables, GraphedCallable
#include "dwgraph/graphs/graphed_step.h"  // GraphedStep: a whole training step as graphs
#include "dwgraph/nn/modules.h"           // dwgraph::nn::Linear, GroupedLinear, LayerNormLinear, LayerNormMLP
#include "dwgraph/distributed/data_parallel.h"  // DataParallelReducer: deferred gradients, all-reduced
