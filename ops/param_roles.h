#pragma once
// How each parameter of a dwgraph module gets its gradient (namespace dwgraph::ops): the
// one rule the C++ modules (dwgraph::nn), the Python modules (dwgraph.nn) and the graph
// manager all ask, so they cannot disagree.
//  - LayerNorm parameters ("layer_norm*") and every parameter of a module without
//    deferral or fusion: in the main backward, through autograd.
//  - GEMM weights ("weight", "weight<N>", "*_weight") with fuse_wgrad_accumulation: into
//    their persistent main_grad, by the wgrad GEMM (in backward_dw() when deferred).
//  - other GEMM weights and the biases with delay_wgrad_compute: .grad, in backward_dw().

#include <string>

namespace dwgraph::ops {

enum class ParamRole { kMainBackward, kDeferred, kFused };

const char* to_string(ParamRole role);

// True for the names of GEMM weights.
bool is_gemm_weight(const std::string& name);

ParamRole classify_parameter(const std::string& name, bool delay_wgrad_compute, bool fuse_wgrad_accumulation);

}  // namespace dwgraph::ops
