#include "common/build_info.h"

#include <ATen/Context.h>

#ifndef DWGRAPH_VERSION
#error "DWGRAPH_VERSION must be defined by the build"
#endif

namespace dwgraph {

std::string version() { return DWGRAPH_VERSION; }

bool cuda_built() {
#ifdef DWGRAPH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool cuda_available() { return cuda_built() && at::hasCUDA(); }

}  // namespace dwgraph
