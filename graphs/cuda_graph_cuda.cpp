#include "graphs/cuda_graph.h"

#include "common/check.h"
#include "graphs/recorder.h"
#include "ops/gemm.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <optional>

namespace dwgraph::graphs {
namespace {

class CudaGraphPool final : public GraphPool {
 public:
  explicit CudaGraphPool(c10::Device device) : device_(device) {
    const c10::cuda::CUDAGuard guard(device);
    id_ = at::cuda::graph_pool_handle();
  }
  c10::Device device() const override { return device_; }
  const c10::MempoolId_t& id() const { return id_; }
  // From the caching allocator's snapshot: the segments this private pool owns.
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

 private:
  c10::Device device_;
  c10::MempoolId_t id_;
  mutable int64_t peak_ = 0;
};

class CudaGraph final : public Graph {
 public:
  explicit CudaGraph(c10::Device device) : device_(device) {}
  ~CudaGraph() override {
    if (is_capturing()) capture_abort();
    reset();
  }
  c10::Device device() const override { return device_; }

  void capture_begin(std::shared_ptr<GraphPool> pool) override {
    DWGRAPH_CHECK_STATE(!is_capturing() && !captured_,
                        "dwgraph CUDA graph: capture_begin() on a graph that is capturing or holds a "
                        "capture; reset() it first");
    if (pool) {
      pool_ = std::dynamic_pointer_cast<CudaGraphPool>(pool);
      DWGRAPH_CHECK_ARG(pool_ != nullptr && pool->device() == device_,
                        "dwgraph CUDA graph: argument 'pool' must be a pool of ", device_, ", got one of ",
                        pool->device());
    } else {
      pool_ = std::make_shared<CudaGraphPool>(device_);
    }
    guard_.emplace(device_);
    // Capture on a side stream that first waits for the work already queued.
    ambient_ = c10::cuda::getCurrentCUDAStream(device_.index());
    side_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index());
    cudaEvent_t ready;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(ready, ambient_->stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(side_->stream(), ready, 0));
    C10_CUDA_CHECK(cudaEventDestroy(ready));
    c10::cuda::setCurrentCUDAStream(*side_);
    // Handles and workspaces before capture (Note [cuBLASLt under capture]).
    ops::prepare_for_capture(c10::Stream(*side_));
    graph_ = std::make_unique<at::cuda::CUDAGraph>();
    // Blocks of the private pool are the outputs the capture allocates: the recorder marks
    // every fresh output as the graph's; what it first sees as an input is the caller's.
    recorder_ = std::make_unique<detail::Recorder>(
        ledger_, [](const void*) { return false; }, /*execute=*/false);
    recorder_->only_device(c10::kCUDA);
    try {
      graph_->capture_begin(pool_->id(), cudaStreamCaptureModeThreadLocal);
    } catch (...) {
      capture_abort();
      throw;
    }
    record_guard_ = std::make_unique<detail::RecordingGuard>(recorder_.get());
  }

  void capture_end() override {
    DWGRAPH_CHECK_STATE(is_capturing(), "dwgraph CUDA graph: capture_end() without capture_begin()");
    record_guard_.reset();
    try {
      graph_->capture_end();
    } catch (...) {
      capture_abort();
      throw;
    }
    records_ = recorder_->take_records();
    recorder_.reset();
    restore_stream();
    captured_ = true;
  }

  void capture_abort() override {
    record_guard_.reset();
    if (graph_ && recorder_) {
      try {
        graph_->capture_end();  // ends the stream capture; the partial graph is dropped
      } catch (...) {
      }
    }
    recorder_.reset();
    restore_stream();
    reset();
  }

  void replay() override {
    DWGRAPH_CHECK_STATE(captured_, "dwgraph CUDA graph: replay() on a graph with no capture");
    detail::check_ledger(ledger_, records_, "CUDA graph");
    const c10::cuda::CUDAGuard guard(device_);
    graph_->replay();
  }

  void reset() noexcept override {
    if (graph_) {
      try {
        graph_->reset();
      } catch (...) {
      }
    }
    graph_.reset();
    records_.clear();
    ledger_.clear();
    pool_.reset();
    captured_ = false;
  }

  bool is_captured() const override { return captured_; }
  bool is_capturing() const override { return recorder_ != nullptr; }
  std::shared_ptr<GraphPool> pool() const override { return pool_; }
  size_t num_kernels() const override {
    size_t n = 0;
    for (const auto& r : records_) n += r.skip_at_replay ? 0 : 1;
    return n;
  }
  std::vector<std::string> recorded_calls() const override { return detail::describe_records(records_); }
  std::vector<StorageInfo> storages() const override {
    std::vector<StorageInfo> out;
    for (size_t i = 0; i < ledger_.size(); ++i) {
      const auto& e = ledger_.entry(i);
      out.push_back(StorageInfo{e.ownership, e.nbytes, e.role,
                                e.ownership == allocator::Ownership::kGraph || ledger_.lock(i).has_value()});
    }
    return out;
  }
  void set_role(const c10::Storage& storage, const std::string& role, bool persistent) override {
    ledger_.set_role(storage, role, persistent);
  }

 private:
  void restore_stream() {
    if (ambient_) {
      // Later work on the ambient stream sees everything the side stream did.
      cudaEvent_t done;
      if (cudaEventCreateWithFlags(&done, cudaEventDisableTiming) == cudaSuccess) {
        cudaEventRecord(done, side_->stream());
        cudaStreamWaitEvent(ambient_->stream(), done, 0);
        cudaEventDestroy(done);
      }
      c10::cuda::setCurrentCUDAStream(*ambient_);
      ambient_.reset();
    }
    guard_.reset();
  }

  c10::Device device_;
  std::shared_ptr<CudaGraphPool> pool_;
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  allocator::Ledger ledger_;
  std::unique_ptr<detail::Recorder> recorder_;
  std::unique_ptr<detail::RecordingGuard> record_guard_;
  std::vector<detail::OpRecord> records_;
  std::optional<c10::cuda::CUDAGuard> guard_;
  std::optional<c10::cuda::CUDAStream> ambient_;
  std::optional<c10::cuda::CUDAStream> side_;
  bool captured_ = false;
};

}  // namespace

std::unique_ptr<Graph> make_cuda_graph(c10::Device device) {
  DWGRAPH_CHECK_ARG(device.is_cuda(), "dwgraph CUDA graph: argument 'device' must be a CUDA device, got ", device);
  if (!device.has_index()) device = c10::Device(c10::kCUDA, c10::cuda::current_device());
  return std::make_unique<CudaGraph>(device);
}

void run_on_cuda_side_stream(c10::Device device, const std::function<void()>& fn) {
  if (!device.has_index()) device = c10::Device(c10::kCUDA, c10::cuda::current_device());
  const c10::cuda::CUDAGuard guard(device);
  const auto ambient = c10::cuda::getCurrentCUDAStream(device.index());
  const auto side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  auto wait = [](cudaStream_t waiter, cudaStream_t signaller) {
    cudaEvent_t e;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(e, signaller));
    C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0));
    C10_CUDA_CHECK(cudaEventDestroy(e));
  };
  wait(side.stream(), ambient.stream());
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    fn();
  }
  wait(ambient.stream(), side.stream());
}

std::shared_ptr<GraphPool> make_cuda_pool(c10::Device device) {
  if (!device.has_index()) device = c10::Device(c10::kCUDA, c10::cuda::current_device());
  return std::make_shared<CudaGraphPool>(device);
}

}  // namespace dwgraph::graphs
