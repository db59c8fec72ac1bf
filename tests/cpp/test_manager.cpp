// The C++ API of the capture/replay manager (graphs/manager.h): a two-module model with
// deferred weight gradients (Linear and LayerNormMLP, or TransformerEngine's pair:
// LayerNormLinear and a checkpointed LayerNormMLP), sequential schedule, three optimizer
// steps with the gradients reset to None between them: graphed equals the same modules run
// eagerly, bitwise; plus the state errors.
#include "testing.h"

#include "common/check.h"
#include "graphs/manager.h"
#include "nn/modules.h"
#include "ops/autocast.h"

#include <functional>


using dwgraph::nn::DeferredOptions;

namespace {

struct Model {
  using Forward = std::function<at::Tensor(const at::Tensor&)>;
  std::shared_ptr<dwgraph::nn::DeferredWgradModule> a, b;
  Forward fa, fb;
  Model(bool bias, bool te) {
    DeferredOptions o;
    o.bias = bias;
    o.delay_wgrad_compute = true;
    if (te) {
      auto lnl = std::make_shared<dwgraph::nn::LayerNormLinear>(8, 8, o);
      a = lnl;
      fa = [lnl](const at::Tensor& x) { return lnl->forward(x); };
    } else {
      auto lin = std::make_shared<dwgraph::nn::Linear>(8, 8, o);
      a = lin;
      fa = [lin](const at::Tensor& x) { return lin->forward(x); };
    }
    auto mlp = std::make_shared<dwgraph::nn::LayerNormMLP>(8, 16, o, "gelu", 1e-5, /*checkpoint=*/te);
    b = mlp;
    fb = [mlp](const at::Tensor& x) { return mlp->forward(x); };
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
  const bool te = GENERATE(false, true);
  CAPTURE(bias, te);
  at::manual_seed(31);
  Model graphed(bias, te), eager(bias, te);
  eager.copy_from(graphed);
  std::vector<dwgraph::GraphableCallable> callables = {
      dwgraph::nn::graphable("a", graphed.a, [f = graphed.fa](const std::vector<at::Tensor>& x) {
        return std::vector<at::Tensor>{f(x[0])};
      }),
      dwgraph::nn::graphable("b", graphed.b, [f = graphed.fb](const std::vector<at::Tensor>& x) {
        return std::vector<at::Tensor>{f(x[0])};
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
    const auto ye = eager.fb(eager.fa(xe));
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

namespace {

std::vector<std::shared_ptr<dwgraph::GraphedCallable>> graph_one(std::shared_ptr<torch::nn::Module> root,
                                                                  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> fwd,
                                                                  const std::vector<at::Tensor>& samples) {
  return dwgraph::make_graphed_callables({dwgraph::nn::graphable("root", std::move(root), std::move(fwd))}, {samples});
}

}  // namespace

TEST_CASE("make_graphed_callables (C++): a module used twice lands both units, as eager", "[manager][cpu]") {
  // Eager queues one unit per use of the module; the backward-dw graph runs both, each
  // into its own contribution handed over in turn, so the sums round as eager's.
  at::manual_seed(33);
  DeferredOptions o;
  o.delay_wgrad_compute = true;
  auto lin = std::make_shared<dwgraph::nn::Linear>(8, 8, o);
  auto twin = std::make_shared<dwgraph::nn::Linear>(8, 8, o);
  {
    const at::NoGradGuard no_grad;
    twin->weight.copy_(lin->weight);
    twin->bias.copy_(lin->bias);
  }
  auto twice = [](dwgraph::nn::Linear* m) {
    return [m](const std::vector<at::Tensor>& x) { return std::vector<at::Tensor>{m->forward(at::tanh(m->forward(x[0])))}; };
  };
  auto g = graph_one(lin, twice(lin.get()), {at::randn({4, 8})});
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    const auto x = at::randn({4, 8});
    (*g[0])({x})[0].square().sum().backward();
    g[0]->backward_dw();
    twice(twin.get())({x})[0].square().sum().backward();
    REQUIRE(twin->num_queued_wgrad_units() == 2);
    twin->backward_dw();
    twin->backward_dw();
    CHECK(at::equal(lin->weight.grad(), twin->weight.grad()));
    CHECK(at::equal(lin->bias.grad(), twin->bias.grad()));
    CHECK(lin->num_queued_wgrad_units() == 0);
  }
}

TEST_CASE("make_graphed_callables (C++): a deferred module shared by two callables is refused", "[manager][cpu]") {
  // Its units are one FIFO: each callable's backward-dw graph would be captured on the
  // other's unit (the Python API asks the same core check).
  DeferredOptions o;
  o.delay_wgrad_compute = true;
  auto lin = std::make_shared<dwgraph::nn::Linear>(8, 8, o);
  auto fwd = [m = lin.get()](const std::vector<at::Tensor>& x) { return std::vector<at::Tensor>{at::tanh(m->forward(x[0]))}; };
  try {
    (void)dwgraph::make_graphed_callables(
        {dwgraph::nn::graphable("first", lin, fwd), dwgraph::nn::graphable("second", lin, fwd)},
        {{at::randn({4, 8})}, {at::randn({4, 8}, at::requires_grad())}});
    FAIL("no error");
  } catch (const dwgraph::ArgumentError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("of callable 0 ('first') is also module"));
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("one FIFO"));
  }
  CHECK(lin->num_queued_wgrad_units() == 0);
  CHECK(!lin->weight.grad().defined());
}

TEST_CASE("make_graphed_callables (C++): the same checks as Python at the call", "[manager][cpu]") {
  // The core decides, so the C++ API refuses what Python refuses: arguments in another
  // layout, arguments sharing memory where the forward writes one in place, another
  // autocast state than the capture's.
  auto root = std::make_shared<torch::nn::Module>();
  auto writes = [](const std::vector<at::Tensor>& x) {
    x[0].mul_(2);
    return std::vector<at::Tensor>{x[0] + x[1]};
  };
  auto g = graph_one(root, writes, {at::randn({4, 8}), at::randn({4, 8})});
  const auto a = at::randn({4, 8});
  try {
    (void)(*g[0])({a, a});
    FAIL("no error");
  } catch (const dwgraph::ArgumentError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("arguments 0 and 1 are the same tensor, and the graph "
                                                           "writes argument 0 in place"));
  }
  try {
    (void)(*g[0])({at::randn({8, 4}).t(), at::randn({4, 8})});
    FAIL("no error");
  } catch (const dwgraph::ArgumentError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("argument 0 has strides [1, 4] but its sample had [8, 1]"));
  }
  {
    const dwgraph::ops::AutocastStateGuard autocast([] {
      auto s = dwgraph::ops::AutocastState::current();
      s.cpu = true;
      return s;
    }());
    CHECK_THROWS_AS((*g[0])({at::randn({4, 8}), at::randn({4, 8})}), dwgraph::ArgumentError);
  }
  const auto b = at::randn({4, 8}), c = at::randn({4, 8});
  const auto expect = b * 2 + c;
  CHECK(at::equal((*g[0])({b.clone(), c})[0], expect));
}

TEST_CASE("make_graphed_callables (C++): outputs the loss does not use give no gradient", "[manager][cpu]") {
  // Note [What a backward asked for]: a parameter only an unused output reaches keeps
  // .grad undefined and queues nothing, as eager.
  DeferredOptions o;
  o.delay_wgrad_compute = true;
  auto root = std::make_shared<torch::nn::Module>();
  auto a = root->register_module("a", std::make_shared<dwgraph::nn::Linear>(8, 8, o));
  auto b = root->register_module("b", std::make_shared<dwgraph::nn::Linear>(8, 4, o));
  auto g = graph_one(root, [a, b](const std::vector<at::Tensor>& x) { return std::vector<at::Tensor>{a->forward(x[0]), b->forward(x[0])}; },
                     {at::randn({4, 8})});
  for (int step = 0; step < 2; ++step) {
    const auto outs = (*g[0])({at::randn({4, 8})});
    outs[0].sum().backward();
    g[0]->backward_dw();
    CHECK(a->weight.grad().defined());
    CHECK_FALSE(b->weight.grad().defined());
    CHECK_FALSE(b->bias.grad().defined());
  }
}

TEST_CASE("make_graphed_callables (C++): a hook a store-less module hook registers on a later module runs, as eager",
          "[manager][cpu]") {
  // Another library's module (a spec with run_hooks and no store: its hooks run whenever
  // live) registers a wgrad hook on a later dwgraph Linear from its own hook. Eagerly, that
  // Linear's backward_dw() runs right after and calls it; graphed, whether a module's hooks
  // run is asked at its turn. No store has a hook when backward_dw() starts (a review found
  // the later module's landing dropped up front, so its new hook never ran).
  struct Root : torch::nn::Module {
    std::shared_ptr<dwgraph::nn::Linear> a, b;
    Root() {
      DeferredOptions o;
      o.delay_wgrad_compute = true;
      a = register_module("a", std::make_shared<dwgraph::nn::Linear>(4, 4, o));
      b = register_module("b", std::make_shared<dwgraph::nn::Linear>(4, 4, o));
    }
  };
  auto run = [](bool graphed) {
    at::manual_seed(5);
    auto root = std::make_shared<Root>();
    int foreign_calls = 0, b_calls = 0;
    bool armed = false, registered = false;
    auto foreign_hooks = [&] {
      ++foreign_calls;
      if (armed && !registered) {
        registered = true;
        root->b->register_wgrad_hook([&](dwgraph::nn::DeferredWgradModule&) { ++b_calls; });
      }
    };
    const auto x = at::randn({3, 4});
    if (!graphed) {
      armed = true;
      root->b->forward(root->a->forward(x)).sum().backward();
      foreign_hooks();  // the foreign module's backward_dw(): its hooks
      root->a->backward_dw();
      root->b->backward_dw();
      return std::make_pair(foreign_calls, b_calls);
    }
    // The foreign module wraps Linear a, outside the dwgraph module tree of the callable.
    auto tree = std::make_shared<torch::nn::Module>();
    tree->register_module("b", root->b);
    auto c = dwgraph::nn::graphable("m", tree, [root](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{root->b->forward(root->a->forward(in[0]))};
    });
    auto a = root->a;
    dwgraph::ModuleSpec f;
    f.name = "foreign";
    f.defers = true;
    f.backward_dw = [a] { a->backward_dw(); };
    f.inner.push_back(dwgraph::ModuleSpec::Inner{a->wgrad_spec("a", a).store, nullptr, true});
    f.deferred = {a->weight, a->bias};
    f.deferred_names = {"foreign.weight", "foreign.bias"};
    f.run_hooks = foreign_hooks;
    c.parameters.insert(c.parameters.begin(), {a->weight, a->bias});
    c.parameter_names.insert(c.parameter_names.begin(), {"foreign.weight", "foreign.bias"});
    c.current_parameters = nullptr;
    c.modules.insert(c.modules.begin(), f);
    auto g = dwgraph::make_graphed_callables({c}, {{x}});
    armed = true;
    foreign_calls = 0;
    (*g[0])({x})[0].sum().backward();
    g[0]->backward_dw();
    return std::make_pair(foreign_calls, b_calls);
  };
  const auto eager = run(false);
  const auto graphed = run(true);
  CHECK(eager == std::make_pair(1, 1));
  CHECK(graphed == eager);
}
