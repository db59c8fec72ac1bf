#include "ops/param_roles.h"

#include <cctype>

namespace dwgraph::ops {

const char* to_string(ParamRole role) {
  switch (role) {
    case ParamRole::kMainBackward:
      return "main backward";
    case ParamRole::kDeferred:
      return "deferred";
    case ParamRole::kFused:
      return "fused";
  }
  return "?";
}

bool is_gemm_weight(const std::string& name) {
  if (name.rfind("layer_norm", 0) == 0) return false;
  static const std::string kWeight = "weight";
  static const std::string kSuffix = "_weight";
  if (name.rfind(kWeight, 0) == 0) {
    for (size_t i = kWeight.size(); i < name.size(); ++i) {
      if (!std::isdigit(static_cast<unsigned char>(name[i]))) return false;
    }
    return true;
  }
  return name.size() > kSuffix.size() && name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0;
}

ParamRole classify_parameter(const std::string& name, bool delay, bool fuse) {
  if (name.rfind("layer_norm", 0) == 0) return ParamRole::kMainBackward;
  if (is_gemm_weight(name) && fuse) return ParamRole::kFused;
  return delay ? ParamRole::kDeferred : ParamRole::kMainBackward;
}

}  // namespace dwgraph::ops
