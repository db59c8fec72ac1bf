// dwgraph._C: the pybind11 extension. Loading it loads libdwgraph, whose static
// initialisers register the torch.ops.dwgraph.* operators.
#include "bindings/bindings.h"

#include "common/build_info.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "dwgraph native extension";
  m.def("version", &dwgraph::version);
  m.def("cuda_built", &dwgraph::cuda_built);
  m.def("cuda_available", &dwgraph::cuda_available);
  dwgraph::bindings::init_errors(m);
  dwgraph::bindings::init_log(m);
  dwgraph::bindings::init_nn(m);
  dwgraph::bindings::init_fp8(m);
  dwgraph::bindings::init_graphs(m);
  dwgraph::bindings::init_manager(m);
  dwgraph::bindings::init_watch(m);
  dwgraph::bindings::init_optimizer_watch(m);
  dwgraph::bindings::init_distributed(m);
}
