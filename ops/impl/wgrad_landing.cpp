#include "ops/impl/wgrad_landing.h"

#include "common/check.h"
#include "ops/grad_accumulation.h"

#include <ATen/ops/empty.h>

namespace dwgraph::ops::detail {

void land_grad(const at::Tensor& param, const at::Tensor& g, const std::string& what) {
  accumulate_grad(param, g, Take::kSteal, what);  // `g` is a fresh buffer nobody else holds
}

void check_main_grad(const WeightRef& w, const std::string& module) {
  DWGRAPH_CHECK_ARG(w.main_grad.has_value() && w.main_grad->defined(), module, ": parameter '",
                    w.name, "' has fuse_wgrad_accumulation=True but no main_grad; expected a ",
                    w.param.sizes(), " buffer in param.main_grad, got None");
  const at::Tensor& mg = *w.main_grad;
  DWGRAPH_CHECK_ARG(mg.sizes() == w.param.sizes(), module, ": main_grad of parameter '", w.name,
                    "' must have the parameter's shape ", w.param.sizes(), ", got ", mg.sizes());
  DWGRAPH_CHECK_ARG(mg.scalar_type() == at::kFloat || mg.scalar_type() == w.param.scalar_type(),
                    module, ": main_grad of parameter '", w.name,
                    "' must be float32 or the parameter's dtype ", w.param.scalar_type(), ", got ",
                    mg.scalar_type());
  DWGRAPH_CHECK_ARG(mg.device() == w.param.device(), module, ": main_grad of parameter '", w.name,
                    "' must be on the parameter's device ", w.param.device(), ", got ", mg.device());
  DWGRAPH_CHECK_ARG(mg.is_contiguous(), module, ": main_grad of parameter '", w.name,
                    "' must be contiguous, got strides ", mg.strides());
}

namespace {

at::ScalarType grad_dtype_of(const WeightRef& w) {
  return w.grad_dtype.value_or(w.param.scalar_type());
}

at::Tensor fresh_like(const WeightRef& w, at::ScalarType dtype) {
  return at::empty(w.param.sizes(), w.param.options().dtype(dtype));
}

}  // namespace

WgradResult compute_wgrad(const WeightRef& w, const WeightRef* bias, const WgradGemm& gemm,
                          bool deferred, const std::string& module, at::IntArrayRef materialized_sizes) {
  WgradResult r;
  // The GEMM writes the bias gradient in its output's dtype; `bias_out` is made to match
  // and converted to the bias's own gradient dtype afterwards when they differ.
  at::Tensor bias_out;
  auto make_bias_out = [&](at::ScalarType out_dtype) {
    if (bias != nullptr) bias_out = at::empty(bias->param.sizes(), bias->param.options().dtype(out_dtype));
  };

  if (w.finalize) {
    at::Tensor g = at::empty(materialized_sizes, w.param.options());
    make_bias_out(g.scalar_type());
    gemm(g, /*accumulate=*/false, bias_out);
    w.finalize(g);
  } else if (w.main_grad.has_value()) {
    check_main_grad(w, module);
    make_bias_out(w.main_grad->scalar_type());
    gemm(*w.main_grad, /*accumulate=*/true, bias_out);
    if (w.on_main_grad_accumulated) w.on_main_grad_accumulated();
  } else if (w.grad_dtype.has_value() && *w.grad_dtype != w.param.scalar_type()) {
    // Note [grad_dtype]: the GEMM writes a fresh buffer of grad_dtype (beta = 0) from the
    // low-precision operands; an existing .grad gets it added (deferred: here; otherwise
    // AccumulateGrad). Never accumulated by the GEMM itself (beta = 1), which rounds
    // differently on large problems: a graph, which cannot write the caller's .grad, adds
    // its fresh buffer afterwards, and both must give the same bits.
    make_bias_out(*w.grad_dtype);
    at::Tensor g = fresh_like(w, *w.grad_dtype);
    gemm(g, /*accumulate=*/false, bias_out);
    if (deferred) {
      land_grad(w.param, g, module + ": parameter '" + w.name + "'");
    } else {
      r.weight = g;
    }
  } else {
    at::Tensor g = fresh_like(w, w.param.scalar_type());
    make_bias_out(g.scalar_type());
    gemm(g, false, bias_out);
    if (deferred) {
      land_grad(w.param, g, module + ": parameter '" + w.name + "'");
    } else {
      r.weight = g;
    }
  }

  if (bias != nullptr) {
    const at::ScalarType bias_dtype = grad_dtype_of(*bias);
    at::Tensor bg = bias_out.scalar_type() == bias_dtype ? bias_out : bias_out.to(bias_dtype);
    if (deferred) {
      land_grad(bias->param, bg, module + ": parameter '" + bias->name + "'");
    } else {
      r.bias = bg;
    }
  }
  return r;
}

}  // namespace dwgraph::ops::detail
