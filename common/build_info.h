#pragma once
// What this build of dwgraph contains (namespace dwgraph).
#include <string>

namespace dwgraph {

// The library version, "MAJOR.MINOR.PATCH".
std::string version();

// True when the CUDA sources (cuBLASLt GEMMs, the CUDA graph backend) were compiled.
bool cuda_built();

// True when CUDA was compiled in and a CUDA device is usable now.
bool cuda_available();

}  // namespace dwgraph
