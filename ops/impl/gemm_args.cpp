#include "ops/impl/gemm_args.h"

#include "common/check.h"

#include <numeric>
#include <string>

namespace dwgraph::ops::detail {
namespace {

bool supported_input_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_defined(const char* op, const std::string& arg, const at::Tensor& t) {
  DWGRAPH_CHECK_ARG(t.defined(), "dwgraph.", op, ": argument '", arg,
                    "' must be a tensor, got an undefined tensor");
}

// A dense row-major matrix (or [G, N, K] stack) of a supported dtype.
void check_matrix(const char* op, const std::string& arg, const at::Tensor& t, int64_t dim,
                  const char* dims_desc) {
  check_defined(op, arg, t);
  DWGRAPH_CHECK_ARG(t.dim() == dim, "dwgraph.", op, ": argument '", arg, "' must be a ", dim,
                    "-D tensor ", dims_desc, ", got a ", t.dim(), "-D tensor of shape ",
                    t.sizes());
  DWGRAPH_CHECK_ARG(supported_input_dtype(t.scalar_type()), "dwgraph.", op, ": argument '", arg,
                    "' must be float32, bfloat16 or float16, got ", t.scalar_type());
  DWGRAPH_CHECK_ARG(t.is_contiguous(), "dwgraph.", op, ": argument '", arg,
                    "' must be contiguous (row-major) ", dims_desc, ", got strides ", t.strides(),
                    " for shape ", t.sizes());
}

void check_same_dtype(const char* op, const std::string& arg, const at::Tensor& t,
                      const char* ref_arg, at::ScalarType expected) {
  DWGRAPH_CHECK_ARG(t.scalar_type() == expected, "dwgraph.", op, ": argument '", arg,
                    "' must have dtype ", expected, " (the dtype of '", ref_arg, "'), got ",
                    t.scalar_type());
}

void check_same_device(const char* op, const std::string& arg, const at::Tensor& t,
                       const char* ref_arg, const at::Tensor& ref) {
  DWGRAPH_CHECK_ARG(t.device() == ref.device(), "dwgraph.", op, ": argument '", arg,
                    "' must be on device ", ref.device(), " (the device of '", ref_arg,
                    "'), got ", t.device());
}

void check_shape(const char* op, const std::string& arg, const at::Tensor& t,
                 at::IntArrayRef expected, const char* dims_desc) {
  DWGRAPH_CHECK_ARG(t.sizes() == expected, "dwgraph.", op, ": argument '", arg,
                    "' must have shape ", expected, " ", dims_desc, ", got ", t.sizes());
}

// An operand of the same dtype and device as the reference input `ref_arg`.
void check_operand(const char* op, const std::string& arg, const at::Tensor& t, int64_t dim,
                   const char* dims_desc, const char* ref_arg, const at::Tensor& ref) {
  check_matrix(op, arg, t, dim, dims_desc);
  check_same_dtype(op, arg, t, ref_arg, ref.scalar_type());
  check_same_device(op, arg, t, ref_arg, ref);
}

// Bias [N] (or [G, N] packed) of the input dtype: not required to be contiguous in
// general, but we keep one rule for every backend.
void check_bias(const char* op, const std::string& arg, const at::Tensor& b,
                at::IntArrayRef expected, const char* dims_desc, const char* ref_arg,
                const at::Tensor& ref, at::ScalarType dtype) {
  check_defined(op, arg, b);
  check_shape(op, arg, b, expected, dims_desc);
  check_same_dtype(op, arg, b, ref_arg, dtype);
  check_same_device(op, arg, b, ref_arg, ref);
  DWGRAPH_CHECK_ARG(b.is_contiguous(), "dwgraph.", op, ": argument '", arg,
                    "' must be contiguous, got strides ", b.strides(), " for shape ", b.sizes());
}

// wgrad outputs are float32 or the input dtype.
void check_wgrad_out_dtype(const char* op, const std::string& arg, const at::Tensor& out,
                           at::ScalarType input) {
  DWGRAPH_CHECK_ARG(out.scalar_type() == at::kFloat || out.scalar_type() == input, "dwgraph.",
                    op, ": argument '", arg, "' must be float32 or the input dtype ", input,
                    ", got ", out.scalar_type());
}

std::vector<int64_t> check_splits(const char* op, at::IntArrayRef m_splits, int64_t groups,
                                  int64_t m, const char* rows_arg) {
  DWGRAPH_CHECK_ARG(groups > 0, "dwgraph.", op, ": at least one group is required, got 0 weights");
  DWGRAPH_CHECK_ARG(static_cast<int64_t>(m_splits.size()) == groups, "dwgraph.", op,
                    ": argument 'm_splits' must have one entry per weight (", groups,
                    "), got ", m_splits.size(), " entries ", m_splits);
  std::vector<int64_t> offsets(1, 0);
  offsets.reserve(m_splits.size() + 1);
  for (size_t g = 0; g < m_splits.size(); ++g) {
    DWGRAPH_CHECK_ARG(m_splits[g] >= 0, "dwgraph.", op, ": argument 'm_splits' entry ", g,
                      " must be >= 0, got ", m_splits[g]);
    offsets.push_back(offsets.back() + m_splits[g]);
  }
  DWGRAPH_CHECK_ARG(offsets.back() == m, "dwgraph.", op, ": argument 'm_splits' must sum to M = ",
                    m, " (the rows of '", rows_arg, "'), got ", m_splits, " which sums to ",
                    offsets.back());
  return offsets;
}

std::string indexed(const char* arg, size_t g) { return std::string(arg) + "[" + std::to_string(g) + "]"; }

// List weights: G tensors [N, K], all alike; returns (N, K) of w[0].
void check_weight_list(const char* op, at::TensorList w, const char* ref_arg,
                       const at::Tensor& ref, int64_t k, bool k_known) {
  DWGRAPH_CHECK_ARG(!w.empty(), "dwgraph.", op,
                    ": argument 'w' must hold one [N, K] weight per group, got an empty list");
  check_operand(op, "w[0]", w[0], 2, "[N, K]", ref_arg, ref);
  if (k_known) {
    DWGRAPH_CHECK_ARG(w[0].size(1) == k, "dwgraph.", op, ": argument 'w[0]' must have K = ", k,
                      " columns (the columns of '", ref_arg, "'), got shape ", w[0].sizes());
  }
  for (size_t g = 1; g < w.size(); ++g) {
    check_operand(op, indexed("w", g), w[g], 2, "[N, K]", ref_arg, ref);
    check_shape(op, indexed("w", g), w[g], w[0].sizes(), "(the shape of 'w[0]')");
  }
}

}  // namespace

GemmDims check_fwd(const char* op, const at::Tensor& x, const at::Tensor& w,
                   const std::optional<at::Tensor>& bias) {
  check_matrix(op, "x", x, 2, "[M, K]");
  check_operand(op, "w", w, 2, "[N, K]", "x", x);
  GemmDims d{x.size(0), w.size(0), x.size(1)};
  DWGRAPH_CHECK_ARG(w.size(1) == d.k, "dwgraph.", op, ": argument 'w' must have K = ", d.k,
                    " columns (x is [M, K] = ", x.sizes(), "), got shape ", w.sizes());
  if (bias.has_value()) {
    check_bias(op, "bias", *bias, {d.n}, "[N]", "x", x, x.scalar_type());
  }
  return d;
}

GemmDims check_dgrad(const char* op, const at::Tensor& dy, const at::Tensor& w) {
  check_matrix(op, "dy", dy, 2, "[M, N]");
  check_operand(op, "w", w, 2, "[N, K]", "dy", dy);
  GemmDims d{dy.size(0), dy.size(1), w.size(1)};
  DWGRAPH_CHECK_ARG(w.size(0) == d.n, "dwgraph.", op, ": argument 'w' must have N = ", d.n,
                    " rows (dy is [M, N] = ", dy.sizes(), "), got shape ", w.sizes());
  return d;
}

GemmDims check_wgrad(const char* op, const at::Tensor& dy, const at::Tensor& x,
                     const at::Tensor& out, const std::optional<at::Tensor>& bias_grad_out) {
  check_matrix(op, "dy", dy, 2, "[M, N]");
  check_operand(op, "x", x, 2, "[M, K]", "dy", dy);
  GemmDims d{dy.size(0), dy.size(1), x.size(1)};
  DWGRAPH_CHECK_ARG(x.size(0) == d.m, "dwgraph.", op, ": argument 'x' must have M = ", d.m,
                    " rows (dy is [M, N] = ", dy.sizes(), "), got shape ", x.sizes());
  check_defined(op, "out", out);
  check_shape(op, "out", out, {d.n, d.k}, "[N, K]");
  check_wgrad_out_dtype(op, "out", out, dy.scalar_type());
  check_same_device(op, "out", out, "dy", dy);
  DWGRAPH_CHECK_ARG(out.is_contiguous(), "dwgraph.", op,
                    ": argument 'out' must be contiguous (row-major) [N, K], got strides ",
                    out.strides(), " for shape ", out.sizes());
  if (bias_grad_out.has_value()) {
    check_bias(op, "bias_grad_out", *bias_grad_out, {d.n}, "[N]", "out", out, out.scalar_type());
  }
  return d;
}

GroupedOperands check_grouped_fwd(const char* op, const at::Tensor& x, at::TensorList w,
                                  at::IntArrayRef m_splits, std::optional<at::TensorList> bias) {
  check_matrix(op, "x", x, 2, "[M, K]");
  check_weight_list(op, w, "x", x, x.size(1), /*k_known=*/true);
  GroupedOperands r;
  r.dims = {x.size(0), w[0].size(0), x.size(1)};
  r.offsets = check_splits(op, m_splits, static_cast<int64_t>(w.size()), r.dims.m, "x");
  r.weights.assign(w.begin(), w.end());
  if (bias.has_value()) {
    DWGRAPH_CHECK_ARG(bias->size() == w.size(), "dwgraph.", op,
                      ": argument 'bias' must hold one [N] bias per group (", w.size(),
                      "), got ", bias->size());
    for (size_t g = 0; g < bias->size(); ++g) {
      check_bias(op, indexed("bias", g), (*bias)[g], {r.dims.n}, "[N]", "x", x, x.scalar_type());
    }
    r.biases.assign(bias->begin(), bias->end());
  }
  return r;
}

GroupedOperands check_grouped_fwd_packed(const char* op, const at::Tensor& x,
                                         const at::Tensor& w, at::IntArrayRef m_splits,
                                         const std::optional<at::Tensor>& bias) {
  check_matrix(op, "x", x, 2, "[M, K]");
  check_operand(op, "w", w, 3, "[G, N, K]", "x", x);
  GroupedOperands r;
  r.dims = {x.size(0), w.size(1), x.size(1)};
  DWGRAPH_CHECK_ARG(w.size(2) == r.dims.k, "dwgraph.", op, ": argument 'w' must have K = ",
                    r.dims.k, " columns (x is [M, K] = ", x.sizes(), "), got shape ", w.sizes());
  r.offsets = check_splits(op, m_splits, w.size(0), r.dims.m, "x");
  r.weights = w.unbind(0);
  if (bias.has_value()) {
    check_bias(op, "bias", *bias, {w.size(0), r.dims.n}, "[G, N]", "x", x, x.scalar_type());
    r.biases = bias->unbind(0);
  }
  return r;
}

GroupedOperands check_grouped_dgrad(const char* op, const at::Tensor& dy, at::TensorList w,
                                    at::IntArrayRef m_splits) {
  check_matrix(op, "dy", dy, 2, "[M, N]");
  check_weight_list(op, w, "dy", dy, 0, /*k_known=*/false);
  GroupedOperands r;
  r.dims = {dy.size(0), dy.size(1), w[0].size(1)};
  DWGRAPH_CHECK_ARG(w[0].size(0) == r.dims.n, "dwgraph.", op, ": argument 'w[0]' must have N = ",
                    r.dims.n, " rows (dy is [M, N] = ", dy.sizes(), "), got shape ", w[0].sizes());
  r.offsets = check_splits(op, m_splits, static_cast<int64_t>(w.size()), r.dims.m, "dy");
  r.weights.assign(w.begin(), w.end());
  return r;
}

GroupedOperands check_grouped_dgrad_packed(const char* op, const at::Tensor& dy,
                                           const at::Tensor& w, at::IntArrayRef m_splits) {
  check_matrix(op, "dy", dy, 2, "[M, N]");
  check_operand(op, "w", w, 3, "[G, N, K]", "dy", dy);
  GroupedOperands r;
  r.dims = {dy.size(0), dy.size(1), w.size(2)};
  DWGRAPH_CHECK_ARG(w.size(1) == r.dims.n, "dwgraph.", op, ": argument 'w' must have N = ",
                    r.dims.n, " rows per group (dy is [M, N] = ", dy.sizes(), "), got shape ",
                    w.sizes());
  r.offsets = check_splits(op, m_splits, w.size(0), r.dims.m, "dy");
  r.weights = w.unbind(0);
  return r;
}

namespace {
GemmDims check_wgrad_inputs(const char* op, const at::Tensor& dy, const at::Tensor& x) {
  check_matrix(op, "dy", dy, 2, "[M, N]");
  check_operand(op, "x", x, 2, "[M, K]", "dy", dy);
  GemmDims d{dy.size(0), dy.size(1), x.size(1)};
  DWGRAPH_CHECK_ARG(x.size(0) == d.m, "dwgraph.", op, ": argument 'x' must have M = ", d.m,
                    " rows (dy is [M, N] = ", dy.sizes(), "), got shape ", x.sizes());
  return d;
}

void check_wgrad_output(const char* op, const std::string& arg, const at::Tensor& out,
                        at::IntArrayRef shape, const char* dims_desc, const at::Tensor& dy,
                        at::ScalarType out_dtype) {
  check_defined(op, arg, out);
  check_shape(op, arg, out, shape, dims_desc);
  check_wgrad_out_dtype(op, arg, out, dy.scalar_type());
  DWGRAPH_CHECK_ARG(out.scalar_type() == out_dtype, "dwgraph.", op, ": argument '", arg,
                    "' must have dtype ", out_dtype, " (the dtype of the first output), got ",
                    out.scalar_type());
  check_same_device(op, arg, out, "dy", dy);
  DWGRAPH_CHECK_ARG(out.is_contiguous(), "dwgraph.", op, ": argument '", arg,
                    "' must be contiguous (row-major) ", dims_desc, ", got strides ",
                    out.strides(), " for shape ", out.sizes());
}
}  // namespace

GroupedOperands check_grouped_wgrad(const char* op, const at::Tensor& dy, const at::Tensor& x,
                                    at::TensorList out, at::IntArrayRef m_splits,
                                    std::optional<at::TensorList> bias_grad_out) {
  GroupedOperands r;
  r.dims = check_wgrad_inputs(op, dy, x);
  DWGRAPH_CHECK_ARG(!out.empty(), "dwgraph.", op,
                    ": argument 'out' must hold one [N, K] output per group, got an empty list");
  check_defined(op, "out[0]", out[0]);
  const auto out_dtype = out[0].scalar_type();
  for (size_t g = 0; g < out.size(); ++g) {
    check_wgrad_output(op, indexed("out", g), out[g], {r.dims.n, r.dims.k}, "[N, K]", dy,
                       out_dtype);
  }
  r.offsets = check_splits(op, m_splits, static_cast<int64_t>(out.size()), r.dims.m, "dy");
  r.weights.assign(out.begin(), out.end());
  if (bias_grad_out.has_value()) {
    DWGRAPH_CHECK_ARG(bias_grad_out->size() == out.size(), "dwgraph.", op,
                      ": argument 'bias_grad_out' must hold one [N] tensor per group (",
                      out.size(), "), got ", bias_grad_out->size());
    for (size_t g = 0; g < bias_grad_out->size(); ++g) {
      check_bias(op, indexed("bias_grad_out", g), (*bias_grad_out)[g], {r.dims.n}, "[N]", "out[0]",
                 out[0], out_dtype);
    }
    r.biases.assign(bias_grad_out->begin(), bias_grad_out->end());
  }
  return r;
}

GroupedOperands check_grouped_wgrad_packed(const char* op, const at::Tensor& dy,
                                           const at::Tensor& x, const at::Tensor& out,
                                           at::IntArrayRef m_splits,
                                           const std::optional<at::Tensor>& bias_grad_out) {
  GroupedOperands r;
  r.dims = check_wgrad_inputs(op, dy, x);
  check_defined(op, "out", out);
  DWGRAPH_CHECK_ARG(out.dim() == 3, "dwgraph.", op,
                    ": argument 'out' must be a 3-D tensor [G, N, K], got a ", out.dim(),
                    "-D tensor of shape ", out.sizes());
  check_wgrad_output(op, "out", out, {out.size(0), r.dims.n, r.dims.k}, "[G, N, K]", dy,
                     out.scalar_type());
  r.offsets = check_splits(op, m_splits, out.size(0), r.dims.m, "dy");
  r.weights = out.unbind(0);
  if (bias_grad_out.has_value()) {
    check_bias(op, "bias_grad_out", *bias_grad_out, {out.size(0), r.dims.n}, "[G, N]", "out", out,
               out.scalar_type());
    r.biases = bias_grad_out->unbind(0);
  }
  return r;
}

}  // namespace dwgraph::ops::detail
