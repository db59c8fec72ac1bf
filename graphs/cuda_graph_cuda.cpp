#include "graphs/cuda_graph.h"

#include "common/check.h"
#include "graphs/capture_dispatch.h"
#include "graphs/recorder.h"
#include "ops/gemm.h"

#include <ATen/core/grad_mode.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

namespace dwgraph::graphs {
namespace {

c10::Device with_index(c10::Device device) {
  return device.has_index() ? device : c10::Device(c10::kCUDA, c10::cuda::current_device());
}

// `waiter` waits for the work queued so far on `signaller`.
void stream_wait(cudaStream_t waiter, cudaStream_t signaller) {
  cudaEvent_t e;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(e, signaller));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0));
  C10_CUDA_CHECK(cudaEventDestroy(e));
}

// Note [torch's cuBLAS handles before a capture]: creating a cuBLAS handle is illegal
// while a stream captures (cublasCreate fails with CUBLAS_STATUS_NOT_INITIALIZED, and the
// capture is invalidated), and torch (2.11 at least) creates one per thread lazily at its
// first GEMM, with a workspace per (handle, stream). Two threads run a capture's GEMMs:
// the capturing thread (forward) and autograd's device thread (the captured backward, on
// the capture stream). torch's make_graphed_callables relies on its warmup for both; a
// Graph capture has none, so before each capture the capturing thread asks for its handles
// with the capture stream current, and once per (device, capture stream) a 1x1 GEMM's
// backward runs through the engine so the device thread does the same.
void prepare_torch_blas(c10::Device device, const c10::cuda::CUDAStream& capture_stream) {
  const c10::cuda::CUDAStreamGuard on(capture_stream);
  (void)at::cuda::getCurrentCUDABlasHandle();
  (void)at::cuda::getCurrentCUDABlasLtHandle();
  (void)at::cuda::getCUDABlasLtWorkspace();
  static std::mutex mu;
  static std::set<std::pair<int, c10::StreamId>> primed;
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (!primed.emplace(device.index(), capture_stream.id()).second) return;
  }
  const c10::InferenceMode not_inference(false);
  const at::AutoGradMode grad(true);
  const at::Tensor a = at::ones({1, 1}, at::TensorOptions().device(device).dtype(at::kFloat)).requires_grad_(true);
  (void)torch::autograd::grad({at::mm(a, a)}, {a}, {at::ones({1, 1}, a.options())});
}

class CudaGraphPool final : public GraphPool {
 public:
  explicit CudaGraphPool(c10::Device device, std::optional<c10::MempoolId_t> id = std::nullopt)
      : device_(device), stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {
    const c10::cuda::CUDAGuard guard(device);
    id_ = id ? *id : at::cuda::graph_pool_handle();
  }
  ~CudaGraphPool() override {
    if (!holds_use_) return;
    try {
      c10::cuda::CUDACachingAllocator::releasePool(device_.index(), id_);
    } catch (const std::exception& e) {
      TORCH_WARN("dwgraph CUDA pool: releasing the private pool failed: ", e.what());
    }
  }
  CudaGraphPool(const CudaGraphPool&) = delete;
  CudaGraphPool& operator=(const CudaGraphPool&) = delete;
  c10::Device device() const override { return device_; }
  const c10::MempoolId_t& id() const { return id_; }

  // Allocations of the calling thread's current stream on this device go to the private
  // pool while the scope lives (the caching allocator's own routing, as a capture uses it).
  std::unique_ptr<AllocationScope> allocation_scope() override {
    // From the first scope on, this pool holds a use of the allocator's private pool until
    // it is destroyed, as torch.cuda.MemPool does: each scope's own use (taken by
    // beginAllocateToPool, given back at its end) then never drops the count to zero
    // between captures, where the next capture's incref would assert. Taken here, not at
    // construction, because the allocator is initialized by then (the manager calls this
    // with device tensors in hand).
    std::call_once(use_taken_, [this] {
      c10::cuda::CUDACachingAllocator::createOrIncrefPool(device_.index(), id_);
      holds_use_ = true;
    });
    struct Scope final : AllocationScope {
      Scope(const CudaGraphPool& o, c10::Device d, c10::MempoolId_t pool) : owner(o), device(d), id(pool) {
        const cudaStream_t mine = c10::cuda::getCurrentCUDAStream(device.index()).stream();
        c10::cuda::CUDACachingAllocator::beginAllocateToPool(device.index(), id,
                                                             [mine](cudaStream_t s) { return s == mine; });
      }
      ~Scope() override {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device.index(), id);
        // beginAllocateToPool took a use of the pool (as a capture does); give it back, as
        // torch.cuda.use_mem_pool does, or the pool's memory is never freeable.
        c10::cuda::CUDACachingAllocator::releasePool(device.index(), id);
        owner.note_peak();
      }
      const CudaGraphPool& owner;
      c10::Device device;
      c10::MempoolId_t id;
    };
    return std::make_unique<Scope>(*this, device_, id_);
  }

  c10::cuda::CUDAStream capture_stream() const { return stream_; }
  // From the caching allocator's snapshot: the segments this private pool owns. The
  // allocator keeps no per-pool high-water mark, so peak_allocated_bytes is the highest
  // live byte count seen here: at every stats() call, capture end and allocation scope end
  // (note_peak), where this pool's live bytes settle; a temporary freed inside one capture
  // can push the true peak above it (reserved_bytes bounds it).
  allocator::PoolStats stats() const override {
    allocator::PoolStats s;
    const auto snap = c10::cuda::CUDACachingAllocator::snapshot();
    for (const auto& seg : snap.segments) {
      if (seg.owner_private_pool_id != id_ || seg.device != device_.index()) continue;
      s.reserved_bytes += static_cast<int64_t>(seg.total_size);
      s.allocated_bytes += static_cast<int64_t>(seg.allocated_size);
    }
    peak_ = std::max(peak_, s.allocated_bytes);
    s.peak_allocated_bytes = peak_;
    return s;
  }
  // Samples the live bytes for peak_allocated_bytes; a failure to read them only warns
  // (it ends a capture or a scope, which must not fail for it).
  void note_peak() const noexcept {
    try {
      (void)stats();
    } catch (const std::exception& e) {
      TORCH_WARN("dwgraph CUDA pool: reading the pool's live bytes failed: ", e.what());
    }
  }

 private:
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  c10::MempoolId_t id_;
  mutable int64_t peak_ = 0;
  std::once_flag use_taken_;
  bool holds_use_ = false;
};

class CudaGraph final : public Graph {
 public:
  explicit CudaGraph(c10::Device device) : Graph(device) {}
  ~CudaGraph() override {
    if (is_capturing()) capture_abort();
    reset();
  }

 protected:
  std::shared_ptr<GraphPool> adopt_pool(std::shared_ptr<GraphPool> requested) override {
    if (!requested) return std::make_shared<CudaGraphPool>(device_);
    DWGRAPH_CHECK_ARG(std::dynamic_pointer_cast<CudaGraphPool>(requested) != nullptr &&
                          requested->device() == device_,
                      "dwgraph CUDA graph: argument 'pool' must be a pool of ", device_, ", got one of ",
                      requested->device());
    return requested;
  }

  std::unique_ptr<detail::Recorder> make_recorder() override {
    // Blocks of the private pool are the outputs the capture allocates: the recorder marks
    // every fresh output as the graph's; what it first sees as an input is the caller's.
    auto rec = std::make_unique<detail::Recorder>(ledger_, [](const void*) { return false; }, /*execute=*/false);
    rec->only_device(c10::kCUDA);
    return rec;
  }

  std::function<bool()> claim() override {
    // Note [Captures are found by stream, not by thread]: autograd's device thread runs the
    // captured backward's kernels on the capture stream.
    return [index = device_.index(), stream = pool().stream_id()] {
      return c10::cuda::getCurrentCUDAStream(index).id() == stream;
    };
  }

  void begin_backend() override {
    guard_.emplace(device_);
    const auto stream = pool().capture_stream();
    ambient_ = c10::cuda::getCurrentCUDAStream(device_.index());
    stream_wait(stream.stream(), ambient_->stream());  // the capture follows the work queued so far
    on_capture_stream_.emplace(stream);
    // Handles and workspaces before capture (Note [cuBLASLt under capture], Note [torch's
    // cuBLAS handles before a capture]).
    ops::prepare_for_capture(c10::Stream(stream));
    prepare_torch_blas(device_, stream);
    graph_ = std::make_unique<at::cuda::CUDAGraph>();
    graph_->capture_begin(pool().id(), cudaStreamCaptureModeThreadLocal);
  }

  void end_backend() override {
    graph_->capture_end();
    restore_stream();
    static_cast<const CudaGraphPool&>(*pool_).note_peak();
    // Note [A call that raised]: a refusal the region caught (the recorder refused the host
    // read before CUDA could invalidate the capture).
    recorder_->check_none_raised("at the end of the captured region");
  }

  void abort_backend() noexcept override {
    if (graph_) {
      try {
        graph_->capture_end();  // ends the stream capture; the partial graph is dropped
      } catch (const std::exception& e) {
        TORCH_WARN("dwgraph CUDA graph: ending an abandoned capture failed: ", e.what());
      }
    }
    try {
      restore_stream();
    } catch (const std::exception& e) {
      TORCH_WARN("dwgraph CUDA graph: restoring the stream after an abandoned capture failed: ", e.what());
    }
    graph_.reset();
  }

  void launch() override {
    const c10::cuda::CUDAGuard guard(device_);
    graph_->replay();
  }

  void release_backend() noexcept override {
    if (graph_) {
      try {
        graph_->reset();
      } catch (const std::exception& e) {
        TORCH_WARN("dwgraph CUDA graph: reset failed: ", e.what());
      }
    }
    graph_.reset();
  }

 private:
  struct PoolView {
    const CudaGraphPool& p;
    c10::cuda::CUDAStream capture_stream() const { return p.capture_stream(); }
    c10::StreamId stream_id() const { return p.capture_stream().id(); }
    const c10::MempoolId_t& id() const { return p.id(); }
  };
  PoolView pool() const { return PoolView{static_cast<const CudaGraphPool&>(*pool_)}; }

  void restore_stream() {
    on_capture_stream_.reset();
    if (ambient_) {
      // Later work on the ambient stream sees everything the capture stream did.
      const auto ambient = *ambient_;
      ambient_.reset();
      stream_wait(ambient.stream(), pool().capture_stream().stream());
    }
    guard_.reset();
  }

  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  std::optional<c10::cuda::CUDAGuard> guard_;
  std::optional<c10::cuda::CUDAStream> ambient_;
  std::optional<c10::cuda::CUDAStreamGuard> on_capture_stream_;
};

}  // namespace

std::unique_ptr<Graph> make_cuda_graph(c10::Device device) {
  DWGRAPH_CHECK_ARG(device.is_cuda(), "dwgraph CUDA graph: argument 'device' must be a CUDA device, got ", device);
  return std::make_unique<CudaGraph>(with_index(device));
}

std::shared_ptr<GraphPool> make_cuda_pool(c10::Device device) {
  return std::make_shared<CudaGraphPool>(with_index(device));
}

std::shared_ptr<GraphPool> make_cuda_pool_from_handle(std::pair<uint64_t, uint64_t> handle) {
  DWGRAPH_CHECK_ARG(c10::cuda::device_count() > 0, "dwgraph: argument 'pool' is a torch CUDA pool handle (",
                    handle.first, ", ", handle.second, ") but no CUDA device is available; host graphs take "
                    "dwgraph.graphs.graph_pool_handle('cpu')");
  return std::make_shared<CudaGraphPool>(with_index(c10::Device(c10::kCUDA)), c10::MempoolId_t{handle.first, handle.second});
}

void run_on_cuda_capture_stream(const std::shared_ptr<GraphPool>& pool, const std::function<void()>& fn) {
  const auto& cuda_pool = dynamic_cast<const CudaGraphPool&>(*pool);
  const c10::Device device = pool->device();
  const c10::cuda::CUDAGuard guard(device);
  const auto ambient = c10::cuda::getCurrentCUDAStream(device.index());
  const auto side = cuda_pool.capture_stream();
  stream_wait(side.stream(), ambient.stream());
  try {
    const c10::cuda::CUDAStreamGuard on_side(side);
    fn();
  } catch (...) {
    stream_wait(ambient.stream(), side.stream());
    throw;
  }
  stream_wait(ambient.stream(), side.stream());
}

}  // namespace dwgraph::graphs
