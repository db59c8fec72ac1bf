#include "ops/impl/cublaslt.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cublasLt.h>

#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#define DWGRAPH_CUBLAS_CHECK(call)                                                         \
  do {                                                                                     \
    const cublasStatus_t dwgraph_status_ = (call);                                         \
    TORCH_CHECK(dwgraph_status_ == CUBLAS_STATUS_SUCCESS, "dwgraph: ", #call, " failed: ", \
                cublasLtGetStatusString(dwgraph_status_), " (status ",                    \
                static_cast<int>(dwgraph_status_), ")");                                   \
  } while (0)

namespace dwgraph::ops::detail {
namespace {

// Hopper's recommended cuBLASLt workspace; smaller GPUs simply leave part of it unused.
constexpr size_t kWorkspaceBytes = 32u << 20;

struct LtState {
  std::mutex mu;
  std::unordered_map<int, cublasLtHandle_t> handles;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
  // key -> algorithm; a key with no algorithm (unsupported epilogue) maps to nullopt.
  std::map<std::array<int64_t, 20>, std::pair<bool, cublasLtMatmulAlgo_t>> algos;
};

// Leaked on purpose: handles and workspaces live for the process, and destroying them
// from a static destructor after the CUDA context is gone would fail.
LtState& state() {
  static auto* s = new LtState();
  return *s;
}

cublasLtHandle_t handle_locked(LtState& s, c10::DeviceIndex device) {
  auto it = s.handles.find(device);
  if (it != s.handles.end()) return it->second;
  const c10::cuda::CUDAGuard guard(device);
  cublasLtHandle_t h = nullptr;
  DWGRAPH_CUBLAS_CHECK(cublasLtCreate(&h));
  s.handles.emplace(device, h);
  return h;
}

void* workspace_locked(LtState& s, c10::DeviceIndex device, cudaStream_t stream) {
  auto key = std::make_pair(static_cast<int>(device), stream);
  auto it = s.workspaces.find(key);
  if (it != s.workspaces.end()) return it->second;
  const c10::cuda::CUDAGuard guard(device);
  // Legal even while this thread's stream is capturing; see Note [cuBLASLt under capture].
  const c10::cuda::CUDAStreamCaptureModeGuard mode(cudaStreamCaptureModeRelaxed);
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, kWorkspaceBytes));
  s.workspaces.emplace(key, ptr);
  return ptr;
}

int64_t alignment(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  int64_t a = 256;
  while (a > 1 && addr % static_cast<uintptr_t>(a) != 0) a /= 2;
  return a;
}

template <class T, void (*Destroy)(T)>
struct LtDeleter {
  void operator()(T p) const { Destroy(p); }
};
void destroy_desc(cublasLtMatmulDesc_t d) { cublasLtMatmulDescDestroy(d); }
void destroy_layout(cublasLtMatrixLayout_t l) { cublasLtMatrixLayoutDestroy(l); }
void destroy_pref(cublasLtMatmulPreference_t p) { cublasLtMatmulPreferenceDestroy(p); }
using DescPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                                LtDeleter<cublasLtMatmulDesc_t, destroy_desc>>;
using LayoutPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                                  LtDeleter<cublasLtMatrixLayout_t, destroy_layout>>;
using PrefPtr = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                LtDeleter<cublasLtMatmulPreference_t, destroy_pref>>;

LayoutPtr make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t l = nullptr;
  DWGRAPH_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                                  static_cast<uint64_t>(cols), ld));
  return LayoutPtr(l);
}

template <class T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  DWGRAPH_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}

}  // namespace

size_t cublaslt_workspace_size() { return kWorkspaceBytes; }

void prepare_cublaslt(c10::DeviceIndex device, cudaStream_t stream) {
  auto& s = state();
  const std::lock_guard<std::mutex> lock(s.mu);
  handle_locked(s, device);
  workspace_locked(s, device, stream);
}

bool lt_matmul(const LtMatmul& p, c10::DeviceIndex device, cudaStream_t stream) {
  auto& s = state();
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  {
    const std::lock_guard<std::mutex> lock(s.mu);
    handle = handle_locked(s, device);
    workspace = workspace_locked(s, device, stream);
  }

  DescPtr desc;
  {
    cublasLtMatmulDesc_t d = nullptr;
    DWGRAPH_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    desc.reset(d);
  }
  const cublasOperation_t ta = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_desc(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, ta);
  set_desc(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, tb);
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  if (p.epilogue == LtEpilogue::kBias) epi = CUBLASLT_EPILOGUE_BIAS;
  if (p.epilogue == LtEpilogue::kBgradB) epi = CUBLASLT_EPILOGUE_BGRADB;
  set_desc(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
  if (p.epilogue != LtEpilogue::kNone) {
    set_desc(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
    set_desc(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, p.bias_type);
  }

  // Stored shapes: op(A) is m x k, so A is stored k x m when transposed.
  auto a_layout = p.trans_a ? make_layout(p.a_type, p.k, p.m, p.lda) : make_layout(p.a_type, p.m, p.k, p.lda);
  auto b_layout = p.trans_b ? make_layout(p.b_type, p.n, p.k, p.ldb) : make_layout(p.b_type, p.k, p.n, p.ldb);
  auto d_layout = make_layout(p.d_type, p.m, p.n, p.ldd);

  const std::array<int64_t, 20> key = {
      p.trans_a, p.trans_b, p.m, p.n, p.k, p.lda, p.ldb, p.ldd, p.a_type, p.b_type, p.d_type,
      p.accumulate, static_cast<int64_t>(p.epilogue), p.bias_type, alignment(p.a),
      alignment(p.b), alignment(p.d), p.bias ? alignment(p.bias) : 0, device, 0};

  cublasLtMatmulAlgo_t algo{};
  bool have_algo = false;
  bool cached = false;
  {
    const std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.algos.find(key);
    if (it != s.algos.end()) {
      cached = true;
      have_algo = it->second.first;
      algo = it->second.second;
    }
  }
  if (!cached) {
    cublasLtMatmulPreference_t pref_raw = nullptr;
    DWGRAPH_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref_raw));
    PrefPtr pref(pref_raw);
    const uint64_t ws = kWorkspaceBytes;
    DWGRAPH_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    const std::array<std::pair<cublasLtMatmulPreferenceAttributes_t, const void*>, 3> aligns = {{
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.d}}};
    for (const auto& [attr, ptr] : aligns) {
      const uint32_t a = static_cast<uint32_t>(alignment(ptr));
      DWGRAPH_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.get(), attr, &a, sizeof(a)));
    }
    const uint32_t c_align = static_cast<uint32_t>(alignment(p.d));
    DWGRAPH_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c_align, sizeof(c_align)));

    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int returned = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
        handle, desc.get(), a_layout.get(), b_layout.get(), d_layout.get(), d_layout.get(),
        pref.get(), 1, &result, &returned);
    if (st == CUBLAS_STATUS_SUCCESS && returned > 0) {
      have_algo = true;
      algo = result.algo;
    } else if (p.epilogue == LtEpilogue::kNone || st != CUBLAS_STATUS_NOT_SUPPORTED) {
      // A plain GEMM must always have an algorithm; an epilogue may legitimately have none.
      TORCH_CHECK(p.epilogue != LtEpilogue::kNone && st == CUBLAS_STATUS_SUCCESS,
                  "dwgraph: cublasLtMatmulAlgoGetHeuristic failed: ", cublasLtGetStatusString(st),
                  " (status ", static_cast<int>(st), ", ", returned, " algorithms) for m=", p.m,
                  " n=", p.n, " k=", p.k);
    }
    const std::lock_guard<std::mutex> lock(s.mu);
    s.algos[key] = {have_algo, algo};
  }
  if (!have_algo) return false;

  const float alpha = 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  DWGRAPH_CUBLAS_CHECK(cublasLtMatmul(handle, desc.get(), &alpha, p.a, a_layout.get(), p.b,
                                      b_layout.get(), &beta, p.d, d_layout.get(), p.d,
                                      d_layout.get(), &algo, workspace, kWorkspaceBytes, stream));
  return true;
}

}  // namespace dwgraph::ops::detail
