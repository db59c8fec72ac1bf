// CUDA kernels of the GEMM ops: cuBLASLt, compute type 32F (no TF32), on the current
// stream, so every call can be captured in a CUDA graph (see ops/impl/cublaslt.h).
//
// Row-major operands are read as their column-major transposes:
//   fwd   y[M,N]  = x·wᵀ   ->  yᵀ[N,M]  = (wᵀ)ᵀ[N,K] · xᵀ[K,M]   (A = w, T; B = x, N)
//   dgrad dx[M,K] = dy·w   ->  dxᵀ[K,M] = wᵀ[K,N] · dyᵀ[N,M]     (A = w, N; B = dy, N)
//   wgrad o[N,K]  = dyᵀ·x  ->  oᵀ[K,N]  = xᵀ[K,M] · dy[M,N]       (A = x, N; B = dy, T)
// so the bias of fwd is the BIAS epilogue over m = N, and the bias gradient of wgrad is
// the BGRADB epilogue (reduction of B over k = M, one value per column n = N).
#include "ops/gemm.h"

#include "ops/impl/cublaslt.h"
#include "ops/impl/gemm_generic.h"

#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace dwgraph::ops {
namespace {

cudaDataType_t cuda_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return CUDA_R_32F;
    case at::kBFloat16:
      return CUDA_R_16BF;
    case at::kHalf:
      return CUDA_R_16F;
    default:
      TORCH_INTERNAL_ASSERT(false, "dtype ", t.scalar_type(), " passed argument validation");
  }
}

void run(const detail::LtMatmul& p, const at::Tensor& like) {
  const auto device = like.device().index();
  const bool ok = detail::lt_matmul(p, device, c10::cuda::getCurrentCUDAStream(device).stream());
  TORCH_INTERNAL_ASSERT(ok, "cuBLASLt refused a matmul without epilogue");
}

struct CudaKernels {
  static void fwd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                  const at::Tensor& y) {
    detail::LtMatmul p;
    p.trans_a = true;
    p.m = w.size(0);
    p.n = x.size(0);
    p.k = x.size(1);
    p.a = w.data_ptr();
    p.lda = p.k;
    p.a_type = cuda_type(w);
    p.b = x.data_ptr();
    p.ldb = p.k;
    p.b_type = cuda_type(x);
    p.d = y.data_ptr();
    p.ldd = p.m;
    p.d_type = cuda_type(y);
    if (bias.defined()) {
      p.epilogue = detail::LtEpilogue::kBias;
      p.bias = bias.data_ptr();
      p.bias_type = cuda_type(bias);
    }
    const auto device = x.device().index();
    const auto stream = c10::cuda::getCurrentCUDAStream(device).stream();
    if (detail::lt_matmul(p, device, stream)) return;
    // No algorithm with the bias epilogue: GEMM, then add the bias.
    p.epilogue = detail::LtEpilogue::kNone;
    run(p, x);
    y.add_(bias);
  }

  static void dgrad(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& dx) {
    detail::LtMatmul p;
    p.m = w.size(1);
    p.n = dy.size(0);
    p.k = dy.size(1);
    p.a = w.data_ptr();
    p.lda = p.m;
    p.a_type = cuda_type(w);
    p.b = dy.data_ptr();
    p.ldb = p.k;
    p.b_type = cuda_type(dy);
    p.d = dx.data_ptr();
    p.ldd = p.m;
    p.d_type = cuda_type(dx);
    run(p, dy);
  }

  static void wgrad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& out,
                    bool accumulate, const at::Tensor& bias_grad) {
    detail::LtMatmul p;
    p.trans_b = true;
    p.m = x.size(1);
    p.n = dy.size(1);
    p.k = dy.size(0);
    p.a = x.data_ptr();
    p.lda = p.m;
    p.a_type = cuda_type(x);
    p.b = dy.data_ptr();
    p.ldb = p.n;
    p.b_type = cuda_type(dy);
    p.d = out.data_ptr();
    p.ldd = p.m;
    p.d_type = cuda_type(out);
    p.accumulate = accumulate;  // beta = 1 into out itself: no temporary, no add kernel
    if (bias_grad.defined()) {
      p.epilogue = detail::LtEpilogue::kBgradB;
      p.bias = bias_grad.data_ptr();
      p.bias_type = cuda_type(bias_grad);
    }
    const auto device = dy.device().index();
    const auto stream = c10::cuda::getCurrentCUDAStream(device).stream();
    if (detail::lt_matmul(p, device, stream)) return;
    // No algorithm with BGRADB for this layout/dtype: GEMM, then a column sum.
    p.epilogue = detail::LtEpilogue::kNone;
    run(p, dy);
    detail::column_sum_into(bias_grad, dy);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(dwgraph, CUDA, m) { detail::register_gemm_kernels<CudaKernels>(m); }

namespace detail {
void prepare_cuda_capture(c10::Stream stream) {
  const c10::cuda::CUDAStream cuda(stream);
  prepare_cublaslt(cuda.device_index(), cuda.stream());
}
}  // namespace detail

}  // namespace dwgraph::ops
