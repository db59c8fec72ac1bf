// The C++ API of the capture/replay manager (graphs/manager.h): a two-module model with
// deferred weight gradients, sequential schedule, three optimizer steps with the
// gradients reset to None between them: graphed equals the same modules run eagerly,
// bitwise; plus the state errors.
#include "testing.h"

#include "common/check.h"
#include "graphs/manager.h"
#include "nn/modules.h"


using dwgraph::nn::DeferredOptions;

namespace {

struct Model {
  std::shared_ptr<dwgraph::nn::Linear> a;
  std::shared_ptr<dwgraph::nn::LayerNormMLP> b;
  explicit Model(bool bias) {
    DeferredOptions o;
    o.bias = bias;
    o.delay_wgrad_compute = true;
    a = std::make_shared<dwgraph::nn::Linear>(8, 8, o);
    b = std::make_shared<dwgraph::nn::LayerNormMLP>(8, 16, o);
  }
  std::vector<at::Tensor> params() const {
    std::vector<at::Tensor> p;
    for (const auto& t : a->parameters()) p.push_back(t);
    for (const auto& t : b->parameters()) p.push_back(t);
    return p;
  }
  void copy_from(const Model& other) {
    const at::NoGradGuard no_grad;
    auto mine = params(), theirs = other.params();
    for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(theirs[i]);
  }
};

void sgd_step(const std::vector<at::Tensor>& params) {
  const at::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.sub_(p.grad(), 0.1);
    p.mutable_grad() = at::Tensor();  // zero_grad(set_to_none=True)
  }
}

}  // namespace

TEST_CASE("make_graphed_callables (C++): graphed equals eager over three steps", "[manager][cpu]") {
  const bool bias = GENERATE(false, true);
  CAPTURE(bias);
  at::manual_seed(31);
  Model graphed(bias), eager(bias);
  eager.copy_from(graphed);
  std::vector<dwgraph::GraphableCallable> callables = {
      dwgraph::nn::graphable("a", graphed.a, [m = graphed.a](const std::vector<at::Tensor>& x) {
        return std::vector<at::Tensor>{m->forward(x[0])};
      }),
      dwgraph::nn::graphable("b", graphed.b, [m = graphed.b](const std::vector<at::Tensor>& x) {
        return std::vector<at::Tensor>{m->forward(x[0])};
      })};
  const auto before = graphed.params();
  std::vector<at::Tensor> before_values;
  for (const auto& p : before) before_values.push_back(p.clone());
  auto g = dwgraph::make_graphed_callables(
      callables, {{at::randn({4, 8}).requires_grad_()}, {at::randn({4, 8}).requires_grad_()}});
  REQUIRE(g.size() == 2);
  for (size_t i = 0; i < before.size(); ++i) {  // capture changed nothing the caller sees
    CHECK(at::equal(before[i], before_values[i]));
    CHECK_FALSE(before[i].grad().defined());
  }
  CHECK(g[0]->need_backward_dw());
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    const auto x = at::randn({4, 8}).requires_grad_();
    const auto xe = x.detach().clone().requires_grad_();
    const auto y = (*g[1])((*g[0])({x}))[0];
    y.sum().backward();
    g[0]->backward_dw();
    g[1]->backward_dw();
    const auto ye = eager.b->forward(eager.a->forward(xe));
    ye.sum().backward();
    eager.a->backward_dw();
    eager.b->backward_dw();
    CHECK(at::equal(y, ye));
    CHECK(at::equal(x.grad(), xe.grad()));
    const auto gp = graphed.params(), ep = eager.params();
    for (size_t i = 0; i < gp.size(); ++i) {
      CAPTURE(i);
      REQUIRE(gp[i].grad().defined());
      CHECK(at::equal(gp[i].grad(), ep[i].grad()));
    }
    sgd_step(gp);
    sgd_step(ep);
  }
  CHECK(dwgraph::graphed_stats(*g[0]).contribution_bytes > 0);
  // State errors: backward_dw() with no backward pending; anything after reset().
  CHECK_THROWS_AS(g[0]->backward_dw(), dwgraph::GraphStateError);
  g[0]->reset();
  CHECK_THROWS_AS((*g[1])({at::randn({4, 8})}), dwgraph::GraphStateError);
}

TEST_CASE("make_graphed_callables (C++): a replaced child module is refused, never dangling", "[manager][cpu]") {
  // The graphed callable holds its modules: replacing one in the parent frees nothing the
  // graphs use, and the next call is refused naming the parameter.
  auto root = std::make_shared<torch::nn::Module>();
  DeferredOptions o;
  o.delay_wgrad_compute = true;
  auto child = std::make_shared<dwgraph::nn::Linear>(8, 8, o);
  root->register_module("lin", child);
  auto g = dwgraph::make_graphed_callables(
      {dwgraph::nn::graphable("root", root, [m = child.get()](const std::vector<at::Tensor>& x) {
        return std::vector<at::Tensor>{m->forward(x[0])};
      })},
      {{at::randn({4, 8}).requires_grad_()}});
  (*g[0])({at::randn({4, 8})})[0].sum().backward();
  g[0]->backward_dw();
  root->replace_module("lin", std::make_shared<dwgraph::nn::Linear>(8, 8, o));
  child.reset();  // the graphed callable still holds the old module
  try {
    (void)(*g[0])({at::randn({4, 8})});
    FAIL("no error");
  } catch (const dwgraph::GraphStateError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("parameter 'lin.weight' was replaced"));
  }
}
