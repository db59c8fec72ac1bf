// The C++ training-step wrapper (graphs/graphed_step.h): a step with a deferred and a
// non-deferred layer, trained eagerly and graphed side by side with the gradients reset
// to None between steps: identical losses and parameters, bitwise; graphs per input shape;
// a frozen parameter selects a new graph.
#include "testing.h"

#include "common/check.h"
#include "graphs/graphed_step.h"
#include "nn/modules.h"

#include <ATen/ops/linear.h>

namespace {

struct Net {
  std::shared_ptr<dwgraph::nn::Linear> a;
  at::Tensor w, b;  // a plain (non-deferred) layer
  Net() {
    dwgraph::nn::DeferredOptions o;
    o.delay_wgrad_compute = true;
    a = std::make_shared<dwgraph::nn::Linear>(8, 16, o);
    w = (at::randn({4, 16}) * 0.1).requires_grad_();
    b = at::zeros({4}).requires_grad_();
  }
  std::vector<at::Tensor> params() const { return {a->weight, a->bias, w, b}; }
  dwgraph::graphs::NamedTensors named() const { return {{"a.weight", a->weight}, {"a.bias", a->bias}, {"w", w}, {"b", b}}; }
  void copy_from(const Net& other) const {
    const at::NoGradGuard no_grad;
    const auto dst = params(), src = other.params();
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
  }
  // forward, backward, backward_dw: returns the loss.
  at::Tensor step(const at::Tensor& x, const at::Tensor& y) const {
    const auto loss = (at::linear(at::relu(a->forward(x)), w, b) - y).pow(2).mean();
    loss.backward();
    a->backward_dw();
    return loss.detach();
  }
};

void sgd(const std::vector<at::Tensor>& params) {
  const at::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.sub_(p.grad(), 0.1);
    p.mutable_grad() = at::Tensor();
  }
}

}  // namespace

TEST_CASE("GraphedStep (C++): graphed training equals eager, bitwise", "[graphed_step][cpu]") {
  at::manual_seed(41);
  Net eager, graphed;
  graphed.copy_from(eager);
  dwgraph::GraphedStepOptions opts;
  opts.warmup_iters = 2;
  opts.params = [&] { return graphed.named(); };
  dwgraph::GraphedStep step(
      [&](const std::vector<at::Tensor>& t) { return std::vector<at::Tensor>{graphed.step(t[0], t[1])}; }, opts);
  for (int i = 0; i < 8; ++i) {
    CAPTURE(i);
    const int64_t batch = i % 2 == 0 ? 4 : 6;  // two shapes: two graphs
    const auto x = at::randn({batch, 8}), y = at::randn({batch, 4});
    const auto le = eager.step(x, y);
    const auto lg = step({x, y})[0];
    CHECK(at::equal(le, lg));
    const auto pe = eager.params(), pg = graphed.params();
    for (size_t k = 0; k < pe.size(); ++k) CHECK(at::equal(pe[k].grad(), pg[k].grad()));
    sgd(pe);
    sgd(pg);
  }
  CHECK(step.num_graphs() == 2);
  CHECK(step.num_captures() == 2);
  const auto pe = eager.params(), pg = graphed.params();
  for (size_t k = 0; k < pe.size(); ++k) CHECK(at::equal(pe[k], pg[k]));

  // A parameter that stops requiring grad changes what the graph would give gradients to:
  // another variant is captured, which trains what eager trains.
  graphed.w.requires_grad_(false);
  eager.w.requires_grad_(false);
  const auto x = at::randn({4, 8}), y = at::randn({4, 4});
  CHECK(at::equal(step({x, y})[0], eager.step(x, y)));
  CHECK(step.num_captures() == 3);
  CHECK_FALSE(graphed.w.grad().defined());
  for (size_t k = 0; k < pe.size(); ++k) {
    if (pe[k].grad().defined()) CHECK(at::equal(pe[k].grad(), pg[k].grad()));
  }
  step.reset();
  CHECK(step.num_graphs() == 0);
}

// Note [A step's plain call]: replay_if_captured() replays only where the call's key and
// variant have a graph, and otherwise runs, counts and makes nothing, so that operator()
// then decides the call exactly as without it.
TEST_CASE("GraphedStep (C++): replay_if_captured replays captured calls only", "[graphed_step][cpu]") {
  at::manual_seed(43);
  Net eager, graphed;
  graphed.copy_from(eager);
  dwgraph::GraphedStepOptions opts;
  opts.warmup_iters = 2;
  int asked = 0;  // what the step trains, asked before a capture
  opts.params = [&] {
    ++asked;
    return graphed.named();
  };
  int runs = 0;
  dwgraph::GraphedStep step(
      [&](const std::vector<at::Tensor>& t) {
        ++runs;
        return std::vector<at::Tensor>{graphed.step(t[0], t[1])};
      },
      opts);
  auto train = [&](const at::Tensor& x, const at::Tensor& y, bool fast) {
    const auto le = eager.step(x, y);
    std::optional<std::vector<at::Tensor>> got;
    if (fast) got = step.replay_if_captured({x, y}, "k");
    const auto lg = got ? (*got)[0] : step({x, y}, "k")[0];
    CHECK(at::equal(le, lg));
    sgd(eager.params());
    sgd(graphed.params());
    return got.has_value();
  };
  const auto x = at::randn({4, 8}), y = at::randn({4, 4});
  // Unknown key, then warmup calls: nothing replayed, nothing counted or run.
  for (int i = 0; i < 2; ++i) {
    CHECK_FALSE(step.replay_if_captured({x, y}, "k").has_value());
    CHECK(runs == i);
    CHECK_FALSE(train(x, y, false));
  }
  CHECK(step.stats().eager_calls == 2);
  // The next call would capture: still nothing, and nothing asked.
  CHECK_FALSE(step.replay_if_captured({x, y}, "k").has_value());
  CHECK(asked == 0);
  CHECK(step.num_captures() == 0);
  CHECK_FALSE(train(x, y, false));  // captures
  CHECK(step.num_captures() == 1);
  for (int i = 0; i < 3; ++i) CHECK(train(at::randn({4, 8}), at::randn({4, 4}), true));
  CHECK(step.stats().replays == 4);
  // Another shape is another key; another gradient pattern another variant: both declined.
  CHECK_FALSE(step.replay_if_captured({at::randn({6, 8}), at::randn({6, 4})}, "k").has_value());
  graphed.w.requires_grad_(false);
  eager.w.requires_grad_(false);
  CHECK_FALSE(step.replay_if_captured({x, y}, "k").has_value());
  CHECK(step.num_captures() == 1);
  CHECK(runs == 3);  // two warmup calls and the capture
  const auto pe = eager.params(), pg = graphed.params();
  for (size_t k = 0; k < pe.size(); ++k) CHECK(at::equal(pe[k], pg[k]));
}
