// dwgraph::distributed::DataParallelReducer on a process group whose backend simulates
// ranks with identical contributions (an all-reduce SUM multiplies each tensor by the
// group size), and WgradStore::take_after. The two-process runs against real gloo ranks
// are in tests/python/test_distributed_*.py.
#include "testing.h"

#include "common/check.h"
#include "distributed/data_parallel.h"
#include "ops/wgrad_store.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

using dwgraph::distributed::DataParallelReducer;
using dwgraph::distributed::ReducedModule;
using dwgraph::distributed::ReducedParameter;
using dwgraph::ops::WgradStore;

namespace {

class DoneWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
};

class UniformRanks : public c10d::Backend {
 public:
  UniformRanks(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "uniform"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    REQUIRE(opts.reduceOp == c10d::ReduceOp::SUM);
    for (auto& t : tensors) t.mul_(size_);
    return c10::make_intrusive<DoneWork>();
  }
};

c10::intrusive_ptr<c10d::ProcessGroup> uniform_group(int size) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(0, size);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                    c10::make_intrusive<UniformRanks>(0, size));
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  return group;
}

at::Tensor leaf(std::vector<int64_t> shape) { return at::zeros(shape).requires_grad_(true); }

// Three modules: a owns w0 and w1, b owns w2, c (not deferred) owns w3; w1 is tied into b.
struct Fixture {
  std::vector<at::Tensor> params{leaf({4, 4}), leaf({4}), leaf({8, 4}), leaf({2, 4})};
  std::vector<std::shared_ptr<WgradStore>> stores{std::make_shared<WgradStore>(), std::make_shared<WgradStore>()};
  std::unique_ptr<DataParallelReducer> reducer;

  explicit Fixture(int64_t cap_bytes) {
    std::vector<ReducedParameter> ps;
    const std::vector<std::vector<size_t>> owners{{0}, {0, 1}, {1}, {2}};
    for (size_t i = 0; i < params.size(); ++i) {
      ps.push_back(ReducedParameter{params[i], c10::str("w", i), /*fused=*/false, at::kFloat, owners[i]});
    }
    std::vector<ReducedModule> ms{{"a", stores[0], {0, 1}}, {"b", stores[1], {1, 2}}, {"c", nullptr, {3}}};
    reducer = std::make_unique<DataParallelReducer>(uniform_group(2), std::move(ps), std::move(ms), cap_bytes);
  }
  // Lands module m: each of its parameters' .grad gets `value` (tied: set once).
  std::vector<at::Tensor> buffers(const std::vector<size_t>& idx) {
    std::vector<at::Tensor> out;
    for (size_t i : idx) out.push_back(params[i].grad());
    return out;
  }
  void set_grads(float value) {
    for (auto& p : params) p.mutable_grad() = at::full(p.sizes(), value);
  }
  std::vector<std::vector<at::Tensor>> all_buffers() { return {buffers({0, 1}), buffers({1, 2}), buffers({3})}; }
};

}  // namespace

TEST_CASE("reducer: buckets launch in order once all their owners landed, and finish averages", "[distributed][cpu]") {
  Fixture f(/*cap_bytes=*/64);  // one parameter per bucket (reverse order: w3, w2, w1, w0)
  REQUIRE(f.reducer->num_buckets() == 4);
  f.set_grads(3.0F);
  f.reducer->begin_forward(true);
  // c lands first: bucket 0 (w3) can start.
  f.reducer->on_landed(2, f.buffers({3}));
  CHECK(f.reducer->num_launched() == 1);
  // a lands: w0's bucket is ready but waits behind w2 and w1 (b has not landed).
  f.reducer->on_landed(0, f.buffers({0, 1}));
  CHECK(f.reducer->num_launched() == 1);
  f.reducer->on_landed(1, f.buffers({1, 2}));
  CHECK(f.reducer->num_launched() == 4);
  f.reducer->finish(f.all_buffers());
  for (const auto& p : f.params) CHECK(at::equal(p.grad(), at::full(p.sizes(), 3.0F)));  // (3 + 3) / 2
  CHECK(f.reducer->ready_counts() == std::vector<int64_t>{1, 1, 1});
  CHECK_FALSE(f.reducer->pending());
}

TEST_CASE("reducer: a module with queued work or under no_sync starts nothing, and finish reduces it",
          "[distributed][cpu]") {
  Fixture f(1 << 20);  // one bucket
  f.set_grads(1.0F);
  f.stores[0]->push(f.stores[0]->new_unit_id(), nullptr, [] {});
  f.reducer->begin_forward(true);
  f.reducer->on_landed(1, f.buffers({1, 2}));
  f.reducer->on_landed(2, f.buffers({3}));
  f.reducer->on_landed(0, f.buffers({0, 1}));  // one more unit of a is queued
  CHECK(f.reducer->num_launched() == 0);
  f.stores[0]->run_oldest("a");
  f.reducer->on_landed(0, f.buffers({0, 1}));
  CHECK(f.reducer->num_launched() == 1);
  f.reducer->finish(f.all_buffers());
  // no_sync: nothing starts, finish() still reduces everything.
  f.set_grads(2.0F);
  f.reducer->begin_forward(false);
  for (size_t m = 0; m < 3; ++m) f.reducer->on_landed(m, f.all_buffers()[m]);
  CHECK(f.reducer->num_launched() == 0);
  f.reducer->finish(f.all_buffers());
  CHECK(at::equal(f.params[2].grad(), at::full({8, 4}, 2.0F)));
}

TEST_CASE("reducer: typed errors, and nothing written when a contribution is missing", "[distributed][cpu]") {
  Fixture f(64);
  f.set_grads(5.0F);
  f.reducer->begin_forward(true);
  for (size_t m = 0; m < 3; ++m) f.reducer->on_landed(m, f.all_buffers()[m]);
  SECTION("a landing after its bucket started") {
    CHECK_THROWS_AS(f.reducer->on_landed(1, f.buffers({1, 2})), dwgraph::GraphStateError);
  }
  SECTION("a new step before finish()") {
    CHECK_THROWS_AS(f.reducer->begin_forward(true), dwgraph::GraphStateError);
  }
  SECTION("a gradient of the wrong shape") {
    f.reducer->finish(f.all_buffers());
    f.reducer->begin_forward(true);
    CHECK_THROWS_AS(f.reducer->on_landed(2, {at::zeros({3})}), dwgraph::ArgumentError);
  }
  SECTION("finish() with a module that did not land: every bucket still runs, no .grad is written") {
    f.reducer->finish(f.all_buffers());
    f.set_grads(7.0F);
    f.reducer->begin_forward(true);
    f.reducer->on_landed(0, f.buffers({0, 1}));
    f.reducer->on_landed(2, f.buffers({3}));
    CHECK_THROWS_WITH(f.reducer->finish(f.all_buffers()), Catch::Contains("module 'b': no weight gradient landed"));
    for (const auto& p : f.params) CHECK(at::equal(p.grad(), at::full(p.sizes(), 7.0F)));
    CHECK_FALSE(f.reducer->pending());  // the step was dropped; the next one starts clean
    f.reducer->begin_forward(true);
  }
}

TEST_CASE("WgradStore::take_after takes the units one backward queued, for its own weight step",
          "[distributed][cpu]") {
  WgradStore store;
  std::vector<int> ran;
  const auto push = [&](int tag) { store.push(store.new_unit_id(), nullptr, [&ran, tag] { ran.push_back(tag); }); };
  push(0);
  const size_t keep = store.num_units();
  push(1);
  auto taken = store.take_after(keep);
  CHECK(taken.size() == 1);
  CHECK(store.num_units() == 1);
  push(2);
  store.run_oldest("m");  // the FIFO no longer sees unit 1
  taken.run("m");
  CHECK(ran == std::vector<int>{0, 1});
  CHECK_THROWS_AS(taken.run("m"), dwgraph::GraphStateError);
  CHECK(store.num_units() == 1);
}
