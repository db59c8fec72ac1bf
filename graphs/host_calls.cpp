#include "graphs/host_calls.h"

#include "allocator/capture_allocator.h"
#include "common/check.h"
#include "graphs/capture_dispatch.h"
#include "graphs/graph.h"
#include "graphs/recorder.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace dwgraph::graphs {
namespace {

detail::Recorder& active(const char* api) {
  detail::Recorder* rec = detail::claiming_recorder();
  DWGRAPH_CHECK_STATE(rec != nullptr && rec->pool() != nullptr, api,
                      ": no dwgraph capture is running on this thread or stream; ask dwgraph.graphs.capturing() first");
  return *rec;
}

}  // namespace

bool capturing() { return detail::claiming_recorder() != nullptr; }

at::Tensor replay_buffer(const at::Tensor& owner, const std::string& tag, at::IntArrayRef sizes, at::ScalarType dtype,
                         std::function<void(const at::Tensor&)> fill) {
  constexpr const char* kApi = "dwgraph.graphs.replay_buffer";
  detail::Recorder& rec = active(kApi);
  DWGRAPH_CHECK_ARG(owner.defined(), kApi, ": argument 'owner' must be a tensor, got an undefined one");
  DWGRAPH_CHECK_ARG(fill != nullptr, kApi, ": argument 'fill' must be callable, got none");
  GraphPool& pool = *rec.pool();
  DWGRAPH_CHECK_ARG(owner.device().type() == pool.device().type(), kApi, ": argument 'owner' is on ", owner.device(),
                    " but the capture is on ", pool.device());
  for (int64_t s : sizes) DWGRAPH_CHECK_ARG(s >= 0, kApi, ": argument 'sizes' must be non-negative, got ", sizes);
  auto& cache = pool.replay_buffers();
  // Entries of owners that died go (graphs that read them keep their own reference): a
  // long-lived pool does not hold every buffer it ever handed out, and a new owner at a dead
  // one's address never shares its buffer.
  for (auto e = cache.begin(); e != cache.end();) e = e->second.owner.expired() ? cache.erase(e) : std::next(e);
  const auto key = std::make_pair(static_cast<const void*>(owner.unsafeGetTensorImpl()), tag);
  auto it = cache.find(key);
  const auto& held = it == cache.end() ? at::Tensor() : it->second.buffer;
  if (!held.defined() || held.sizes() != sizes || held.scalar_type() != dtype || held.device() != owner.device()) {
    // Not a call of the region: the allocation must not be recorded. On the host it is
    // not a block of the graph's pool either (the recorder would otherwise keep its
    // capture-time bytes as a constant and restore them over the fill); on CUDA it is a
    // block of the private pool, like any allocation on the capture stream, and no kernel
    // touches it at allocation.
    const c10::impl::ExcludeDispatchKeyGuard unrecorded(detail::kCaptureModeKey);
    at::Tensor buffer;
    if (owner.device().is_cpu()) {
      const allocator::CaptureAllocationGuard outside_pool(nullptr);
      buffer = at::empty(sizes, owner.options().dtype(dtype));
      buffer.zero_();  // deterministic capture-time values (they are never replayed)
    } else {
      buffer = at::empty(sizes, owner.options().dtype(dtype));
    }
    it = cache.insert_or_assign(key, ReplayBuffer{decltype(ReplayBuffer::owner)(owner.getIntrusivePtr()), buffer}).first;
  }
  at::Tensor buffer = it->second.buffer;
  rec.host_calls().before.push_back([buffer, fill = std::move(fill)] { fill(buffer); });
  if (owner.has_storage()) {
    rec.host_calls().filled_from.emplace_back(
        owner.storage(), c10::str("a ", owner.scalar_type(), " tensor of shape ", owner.sizes(), " ('", tag, "')"));
  }
  return buffer;
}

void after_replay(std::function<void()> fn, bool state_only) {
  constexpr const char* kApi = "dwgraph.graphs.after_replay";
  detail::Recorder& rec = active(kApi);
  DWGRAPH_CHECK_ARG(fn != nullptr, kApi, ": argument 'fn' must be callable, got none");
  DWGRAPH_CHECK_ARG(state_only || rec.host_calls().refuse_after.empty(), rec.host_calls().refuse_after);
  rec.host_calls().after.push_back(std::move(fn));
}

}  // namespace dwgraph::graphs
