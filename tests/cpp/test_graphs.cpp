// The graph backends (graphs/graph.h): replay equals eager bitwise, capture changes
// nothing the caller sees, the shared-pool ordering hazard, pool counters after reset,
// a capture that raises can be retried, and DanglingCaptureError.
#include "testing.h"

#include "common/check.h"
#include "graphs/graph.h"
#include "graphs/recorder.h"
#include "ops/gemm.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/rand_like.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

using dwgraph::testing::randn;

namespace {

struct Mlp {
  at::Tensor w1, b1, w2;
  explicit Mlp(c10::Device d)
      : w1(randn({16, 8}, at::kFloat, d).requires_grad_()),
        b1(randn({16}, at::kFloat, d).requires_grad_()),
        w2(randn({4, 16}, at::kFloat, d).requires_grad_()) {}
  // A small training step: layer norm, GEMMs (ATen and dwgraph), GELU, reduction, backward.
  at::Tensor step(const at::Tensor& x) const {
    const auto h = at::gelu(at::linear(at::layer_norm(x, {8}), w1, b1));
    const auto y = dwgraph::ops::fwd_gemm(h.detach(), w2.detach()) + at::linear(h, w2);
    const auto loss = (y * y).mean();
    loss.backward();
    return loss.detach();
  }
};

// A C++ kernel with no autograd kernel that fills its output through the data pointer, as
// extension kernels do, and branches on argument identity, as native multi-head attention
// does (its self-attention path when query, key and value are one tensor): a + 1 when given
// one tensor twice, a + 0 for two.
at::Tensor marks_identity(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty_like(a);
  const float add = a.is_same(b) ? 1.f : 0.f;
  const float* in = a.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) o[i] = in[i] + add;
  return out;
}

// The same kind of kernel, which also calls ATen inside: it counts its calls in `calls`
// (in place) and fills its output (2a) itself.
at::Tensor counts_calls(const at::Tensor& a, at::Tensor& calls) {
  at::Tensor out = at::empty_like(a);
  calls.add_(1);
  const float* in = a.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) o[i] = 2.f * in[i];
  return out;
}

// a + noise, the noise drawn below autograd as torch's factory functions (torch::rand_like)
// draw it. Registered as a CompositeImplicitAutograd kernel (its body is its children) and
// as an autograd kernel of its own (ATen-like: an unboxed C++ kernel for Autograd).
at::Tensor adds_noise(const at::Tensor& a) {
  at::Tensor noise;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    noise = at::rand_like(a);
  }
  return a + noise;
}

}  // namespace

TORCH_LIBRARY(dwgraph_test_kernels, m) {
  m.def("marks_identity(Tensor a, Tensor b) -> Tensor");
  m.def("counts_calls(Tensor a, Tensor(a!) calls) -> Tensor");
  m.def("adds_noise_composite(Tensor a) -> Tensor");
  m.def("adds_noise_autograd(Tensor a) -> Tensor");
}
TORCH_LIBRARY_IMPL(dwgraph_test_kernels, CPU, m) {
  m.impl("marks_identity", TORCH_FN(marks_identity));
  m.impl("counts_calls", TORCH_FN(counts_calls));
}
TORCH_LIBRARY_IMPL(dwgraph_test_kernels, CompositeImplicitAutograd, m) {
  m.impl("adds_noise_composite", TORCH_FN(adds_noise));
}
TORCH_LIBRARY_IMPL(dwgraph_test_kernels, Autograd, m) {
  m.impl("adds_noise_autograd", TORCH_FN(adds_noise));
}

namespace {

// A test kernel of this file, by name, typed as `Sig`.
template <typename Sig>
c10::TypedOperatorHandle<Sig> test_kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace

TEST_CASE("host replay draws as eager where a composite draws below autograd", "[graphs][cpu]") {
  // Note [Calls in a kernel's body]: the draw, below autograd, passed as part of a kernel;
  // its output replayed as a constant, the same numbers every replay.
  const auto op = test_kernel<at::Tensor(const at::Tensor&)>("dwgraph_test_kernels::adds_noise_composite");
  const c10::Device cpu(c10::kCPU);
  auto static_x = randn({6}, at::kFloat, cpu);
  auto graph = dwgraph::graphs::make_graph(cpu);
  graph->capture_begin();
  const at::Tensor out = op.call(static_x);
  graph->capture_end();
  for (int seed = 0; seed < 3; ++seed) {
    const auto x = randn({6}, at::kFloat, cpu);
    static_x.copy_(x);
    at::manual_seed(seed);
    graph->replay();
    const at::Tensor next_after_replay = at::rand({1});
    at::manual_seed(seed);
    CHECK(at::equal(out, op.call(x)));
    CHECK(at::equal(at::rand({1}), next_after_replay));
  }
}

TEST_CASE("host capture refuses a draw in an autograd kernel that its children replay", "[graphs][cpu]") {
  // The kernel's add, recorded as its child, writes all it returns, so the call replays
  // through it alone; the draw below autograd would repeat the capture's numbers.
  const auto op = test_kernel<at::Tensor(const at::Tensor&)>("dwgraph_test_kernels::adds_noise_autograd");
  const c10::Device cpu(c10::kCPU);
  auto static_x = randn({6}, at::kFloat, cpu);
  auto graph = dwgraph::graphs::make_graph(cpu);
  graph->capture_begin();
  try {
    op.call(static_x);
    FAIL("the capture recorded the call");
  } catch (const dwgraph::GraphStateError& e) {
    CHECK_THAT(e.what(), Catch::Contains("moved inside dwgraph_test_kernels::adds_noise_autograd outside the calls"));
    graph->capture_abort();
  }
  CHECK_FALSE(graph->is_captured());
}

TEST_CASE("host replay reruns a kernel that writes its own output, given the same tensors", "[graphs][cpu]") {
  // Note [A kernel's own writes]: recorded as a composite of its aten::empty_like, it was
  // skipped, and its output kept the capture's values at every replay. Note [The same tensor
  // twice in a call]: each argument rebuilt as its own tensor took the kernel's other path.
  const auto op = test_kernel<at::Tensor(const at::Tensor&, const at::Tensor&)>("dwgraph_test_kernels::marks_identity");
  const c10::Device cpu(c10::kCPU);
  for (const bool twice : {true, false}) {
    INFO("one tensor twice: " << twice);
    auto static_x = randn({4}, at::kFloat, cpu);
    const auto other = randn({4}, at::kFloat, cpu);
    auto graph = dwgraph::graphs::make_graph(cpu);
    graph->capture_begin();
    const at::Tensor out = op.call(static_x, twice ? static_x : other);
    graph->capture_end();
    CHECK(graph->num_kernels() == 1);
    for (int round = 0; round < 2; ++round) {
      const auto x = randn({4}, at::kFloat, cpu);
      static_x.copy_(x);
      graph->replay();
      CHECK(at::equal(out, op.call(x, twice ? x : other)));
    }
  }
}

TEST_CASE("host replay reruns such a kernel once, not its inner calls again", "[graphs][cpu]") {
  // Note [A kernel's own writes]: the kernel replays whole; its inner calls, recorded as its
  // children, do not replay on their own (the count would move by two a replay).
  const auto op = test_kernel<at::Tensor(const at::Tensor&, at::Tensor&)>("dwgraph_test_kernels::counts_calls");
  const c10::Device cpu(c10::kCPU);
  auto static_x = randn({4}, at::kFloat, cpu);
  auto calls = at::zeros({1});
  auto graph = dwgraph::graphs::make_graph(cpu);
  graph->capture_begin();
  const at::Tensor out = op.call(static_x, calls);
  graph->capture_end();
  CHECK(calls.item<float>() == 0.f);  // a capture changes nothing the caller sees
  for (int round = 1; round <= 3; ++round) {
    const auto x = randn({4}, at::kFloat, cpu);
    static_x.copy_(x);
    graph->replay();
    CHECK(at::equal(out, 2 * x));
    CHECK(calls.item<float>() == static_cast<float>(round));
  }
}

DWGRAPH_DEVICE_TEST("graph replay equals eager, bitwise, on fresh inputs", "[graphs]") {
  at::manual_seed(21);
  Mlp m(device);
  auto static_x = randn({5, 8}, at::kFloat, device);
  auto graph = dwgraph::graphs::make_graph(device);
  graph->capture_begin();
  const at::Tensor loss = m.step(static_x);
  graph->capture_end();
  // The gradients captured were written into tensors the graph owns.
  const at::Tensor g1 = m.w1.grad(), g2 = m.w2.grad();
  REQUIRE(g1.defined());
  CHECK(graph->num_kernels() > 10);
  for (int round = 0; round < 3; ++round) {
    const auto fresh = randn({5, 8}, at::kFloat, device);
    static_x.copy_(fresh);
    graph->replay();
    Mlp ref(device);
    for (auto [dst, src] : {std::pair{&ref.w1, &m.w1}, {&ref.b1, &m.b1}, {&ref.w2, &m.w2}}) {
      *dst = src->detach().clone().requires_grad_();
    }
    const auto ref_loss = ref.step(fresh);
    CHECK(at::equal(loss, ref_loss));
    CHECK(at::equal(g1, ref.w1.grad()));
    CHECK(at::equal(g2, ref.w2.grad()));
  }
}

TEST_CASE("host capture changes nothing the caller sees, replay applies the writes", "[graphs][cpu]") {
  const auto cpu = c10::Device(c10::kCPU);
  auto param = randn({4, 4}, at::kFloat, cpu);
  auto main_grad = at::zeros({4, 4});
  const auto x = randn({3, 4}, at::kFloat, cpu);
  const auto param0 = param.clone();
  const auto dy = randn({3, 4}, at::kFloat, cpu);  // before capture: randn would replay too
  auto graph = dwgraph::graphs::make_graph(cpu);
  graph->capture_begin();
  dwgraph::ops::wgrad_gemm(dy, x, main_grad, /*accumulate=*/true);
  param.sub_(main_grad, 0.5);
  graph->capture_end();
  CHECK(at::equal(param, param0));                   // restored
  CHECK(main_grad.abs().sum().item<float>() == 0);   // restored
  graph->replay();
  const auto expected_grad = at::mm(dy.t(), x);
  CHECK(at::allclose(main_grad, expected_grad));
  CHECK(at::allclose(param, param0 - 0.5 * expected_grad));
  graph->replay();  // accumulates again, as a replayed kernel would
  CHECK(at::allclose(main_grad, 2 * expected_grad));
}

TEST_CASE("graphs on one pool: right in capture order, corrupted out of order", "[graphs][cpu][hazard]") {
  // The documented CUDA-graph hazard: a later capture on the same pool may reuse memory
  // an earlier capture freed. Here g1's temporary is freed when its capture ends and g2's
  // output takes the same block. Replayed in capture order (g1, then g2) g2's output is
  // right; replaying g1 after g2 rewrites g1's temporary, which is g2's output.
  const auto cpu = c10::Device(c10::kCPU);
  auto pool = dwgraph::graphs::make_pool(cpu);
  auto a = at::full({64}, 1.0f), b = at::full({64}, 2.0f);
  auto out_a = at::empty({64});
  auto g1 = dwgraph::graphs::make_graph(cpu);
  auto g2 = dwgraph::graphs::make_graph(cpu);
  g1->capture_begin(pool);
  {
    const auto tmp = a * 3;  // pool memory, freed at the end of this block
    out_a.copy_(tmp);
    out_a.add_(1);
  }
  g1->capture_end();
  g2->capture_begin(pool);
  const auto out_b = b * 5;  // reuses tmp's block
  g2->capture_end();
  const void* tmp_block = nullptr;
  for (const auto& s : g1->storages()) {
    if (s.ownership == dwgraph::allocator::Ownership::kGraph) tmp_block = &s;
  }
  REQUIRE(tmp_block != nullptr);
  g1->replay();
  g2->replay();
  CHECK(at::equal(out_a, at::full({64}, 4.0f)));
  CHECK(at::equal(out_b, at::full({64}, 10.0f)));
  g1->replay();  // out of order: g1's temporary is written over g2's output
  CHECK(at::equal(out_a, at::full({64}, 4.0f)));
  CHECK(at::equal(out_b, at::full({64}, 3.0f)));
}

TEST_CASE("pool counters return to their start after reset", "[graphs][cpu]") {
  const auto cpu = c10::Device(c10::kCPU);
  auto pool = dwgraph::graphs::make_pool(cpu);
  const auto start = pool->stats();
  CHECK(start.allocated_bytes == 0);
  {
    auto graph = dwgraph::graphs::make_graph(cpu);
    const auto x = randn({32, 32}, at::kFloat, cpu);
    graph->capture_begin(pool);
    auto y = at::mm(x, x).relu();
    graph->capture_end();
    CHECK(pool->stats().allocated_bytes > 0);  // y lives in the pool
    graph->replay();
    y = at::Tensor();
    graph->reset();
    CHECK_FALSE(graph->is_captured());
    CHECK(graph->pool() == nullptr);
  }
  CHECK(pool->stats().allocated_bytes == start.allocated_bytes);
  CHECK(pool->stats().live_blocks == 0);
}

TEST_CASE("a capture that raises leaves nothing behind and can be retried", "[graphs][cpu]") {
  const auto cpu = c10::Device(c10::kCPU);
  auto graph = dwgraph::graphs::make_graph(cpu);
  auto x = randn({4, 4}, at::kFloat, cpu);
  auto acc = at::zeros({4, 4});
  graph->capture_begin();
  acc.add_(x);
  try {
    DWGRAPH_CHECK_ARG(false, "the region failed");
  } catch (const dwgraph::ArgumentError&) {
    graph->capture_abort();
  }
  CHECK_FALSE(graph->is_capturing());
  CHECK_FALSE(graph->is_captured());
  CHECK(graph->pool() == nullptr);
  CHECK(acc.abs().sum().item<float>() == 0);  // the aborted capture's write was undone
  const auto probe = at::ones({2}) + 1;       // no capture mode left: not recorded
  CHECK(graph->num_kernels() == 0);
  graph->capture_begin();
  acc.add_(x);
  graph->capture_end();
  graph->replay();
  graph->replay();
  CHECK(at::equal(acc, 2 * x));
  CHECK(probe.sum().item<float>() == 4.0f);
}

TEST_CASE("replay after the caller released a captured tensor raises DanglingCaptureError",
          "[graphs][cpu][safety]") {
  const auto cpu = c10::Device(c10::kCPU);
  auto graph = dwgraph::graphs::make_graph(cpu);
  auto w = randn({64, 64}, at::kFloat, cpu);
  auto out = at::zeros({64, 64});
  graph->capture_begin();
  at::mm_out(out, w, w);
  graph->capture_end();
  graph->set_role(out.storage(), "static output", false);
  w = at::Tensor();  // the caller releases it
  // Fresh allocations of the same size, one of which likely takes the released block.
  std::vector<at::Tensor> burst;
  for (int i = 0; i < 8; ++i) burst.push_back(at::full({64, 64}, 7.0f));
  const auto out_before = out.clone();
  try {
    graph->replay();
    FAIL("replay did not raise");
  } catch (const dwgraph::DanglingCaptureError& e) {
    const std::string msg = e.what_without_backtrace();
    CHECK_THAT(msg, Catch::Contains("aten::mm") && Catch::Contains("Float") &&
                        Catch::Contains("[64, 64]") && Catch::Contains("released"));
  }
  for (const auto& t : burst) CHECK(at::equal(t, at::full({64, 64}, 7.0f)));
  CHECK(at::equal(out, out_before));  // nothing ran
}

TEST_CASE("host work hoisted around a replay: buffers refilled before, calls after, shared on a pool",
          "[graphs][cpu][host_calls]") {
  namespace g = dwgraph::graphs;
  const c10::Device cpu(c10::kCPU);
  auto source = at::arange(6, at::kFloat).reshape({2, 3});  // what a collective would gather
  at::Tensor target = at::zeros({2, 3});                    // what it would reduce into
  int fills = 0, afters = 0;
  auto fill = [&](const at::Tensor& buf) {
    ++fills;
    buf.copy_(source);
  };
  CHECK_FALSE(g::capturing());
  CHECK_THROWS_AS(g::after_replay([] {}), dwgraph::GraphStateError);
  auto pool = g::make_pool(cpu);
  auto first = g::make_graph(cpu), second = g::make_graph(cpu);
  at::Tensor out1, out2;
  first->capture_begin(pool);
  CHECK(g::capturing());
  const at::Tensor buf = g::replay_buffer(source, "gather", {2, 3}, at::kFloat, fill);
  out1 = buf * 2;
  g::after_replay([&, out1] {
    ++afters;
    target.add_(out1);
  });
  first->capture_end();
  second->capture_begin(pool);
  const at::Tensor again = g::replay_buffer(source, "gather", {2, 3}, at::kFloat, fill);
  out2 = again + 1;
  second->capture_end();
  CHECK_FALSE(g::capturing());
  // Nothing ran at capture; one buffer for both graphs; not a block of the pool (its
  // capture-time bytes are no constant the replay would restore over the fill).
  CHECK(fills == 0);
  CHECK(afters == 0);
  CHECK(again.data_ptr() == buf.data_ptr());
  CHECK(first->num_before_calls() == 1);
  CHECK(first->num_after_calls() == 1);
  CHECK(second->num_after_calls() == 0);
  at::Tensor expected = at::zeros({2, 3});
  for (int round = 1; round <= 3; ++round) {
    source.add_(10);
    first->replay();
    expected.add_(source * 2);
    CHECK(at::equal(out1, source * 2));
    CHECK(at::equal(target, expected));
    source.add_(1);
    second->replay();  // refills the shared buffer with the newer values
    CHECK(at::equal(out2, source + 1));
    CHECK(fills == 2 * round);
    CHECK(afters == round);
  }
}

TEST_CASE("a graph that refuses after-calls fails its capture at the request", "[graphs][cpu][host_calls]") {
  namespace g = dwgraph::graphs;
  const c10::Device cpu(c10::kCPU);
  auto graph = g::make_graph(cpu);
  graph->refuse_after_calls("the step's optimizer reads it");
  graph->capture_begin();
  CHECK_THROWS_WITH(g::after_replay([] {}), Catch::Contains("optimizer reads it"));
  graph->capture_abort();
  CHECK_FALSE(graph->is_captured());
  CHECK_FALSE(g::capturing());
}

TEST_CASE("a graph that refuses after-calls takes host bookkeeping after its replays", "[graphs][cpu][host_calls]") {
  // state_only: the call keeps host state (a count of optimizer steps) and touches no
  // tensor, so nothing a graph reads can be written behind it.
  namespace g = dwgraph::graphs;
  const c10::Device cpu(c10::kCPU);
  auto graph = g::make_graph(cpu);
  graph->refuse_after_calls("the step's optimizer reads it");
  int count = 0;
  const at::Tensor x = at::ones({4});
  graph->capture_begin();
  x.mul_(2);
  g::after_replay([&count] { ++count; }, /*state_only=*/true);
  graph->capture_end();
  CHECK(count == 0);
  for (int i = 1; i <= 3; ++i) {
    graph->replay();
    CHECK(count == i);
  }
  CHECK(graph->num_after_calls() == 1);
}

TEST_CASE("torch gives ATen's non-differentiable operators one boxed autograd kernel", "[graphs][cpu]") {
  // Note [Calls in a kernel's body]: the recorder tells that kernel (calls below it are
  // inside an ATen kernel) from a Python autograd kernel (a body of calls) by comparing
  // with randperm's. Should torch register them otherwise, this fails first. (Differentiable
  // operators' out= overloads have generated, unboxed autograd kernels.)
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto& ref = dwgraph::graphs::detail::not_implemented_autograd_kernel();
  CHECK_FALSE(ref.isValidUnboxed());
  for (const auto& [name, overload] : std::vector<std::pair<const char*, const char*>>{
           {"aten::bitwise_and", "Tensor_out"}, {"aten::randperm", "generator_out"}, {"aten::randint", ""},
           {"aten::_fused_adam", ""}}) {
    INFO(name << "." << overload);
    const auto op = dispatcher.findSchemaOrThrow(name, overload);
    CHECK(op.lookup(c10::DispatchKeySet(c10::DispatchKey::AutogradCPU))._equalsBoxedAndUnboxed(ref));
  }
  const auto add = dispatcher.findSchemaOrThrow("aten::add", "Tensor");
  CHECK_FALSE(add.lookup(c10::DispatchKeySet(c10::DispatchKey::AutogradCPU))._equalsBoxedAndUnboxed(ref));
}
