// CPU kernels of the GEMM ops: ATen, with FP32 accumulation for BF16/FP16 inputs.
//
// fwd and dgrad call ATen's GEMM in the input dtype (its CPU GEMM accumulates BF16/FP16
// in FP32 and rounds once), which also makes them bitwise equal to torch.nn.functional's
// linear on the same operands. wgrad into an FP32 `out` widens BF16/FP16 inputs (exactly)
// and lets the BLAS GEMM accumulate into `out` with beta = 1: no product temporary.
#include "ops/gemm.h"

#include "ops/impl/gemm_generic.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

namespace dwgraph::ops {
namespace {

struct CpuKernels {
  static void fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                  const at::Tensor& y) {
    at::Tensor out = y;
    if (bias.defined()) {
      at::addmm_out(out, bias, x, w.t());
    } else {
      at::mm_out(out, x, w.t());
    }
  }

  static void dgrad(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& dx) {
    at::Tensor out = dx;
    at::mm_out(out, dy, w);
  }

  static void wgrad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& out,
                    bool accumulate, const at::Tensor& bias_grad) {
    at::Tensor o = out;
    const bool widen = dy.scalar_type() != at::kFloat;
    if (o.scalar_type() == at::kFloat) {
      const at::Tensor dyf = widen ? dy.to(at::kFloat) : dy;
      const at::Tensor xf = widen ? x.to(at::kFloat) : x;
      if (accumulate) {
        o.addmm_(dyf.t(), xf);  // beta = 1: the BLAS call accumulates into out
      } else {
        at::mm_out(o, dyf.t(), xf);
      }
    } else if (!accumulate) {
      at::mm_out(o, dy.t(), x);
    } else {
      // Low-precision out: add in FP32 and round once, not twice.
      at::Tensor acc = o.to(at::kFloat);
      acc.addmm_(dy.to(at::kFloat).t(), x.to(at::kFloat));
      o.copy_(acc);
    }
    if (bias_grad.defined()) detail::column_sum_into(bias_grad, dy);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(dwgraph, CPU, m) { detail::register_gemm_kernels<CpuKernels>(m); }

}  // namespace dwgraph::ops
