// A small model with deferred weight gradients (dwgraph::nn::Linear -> LayerNormMLP ->
// Linear), trained eagerly and graphed side by side with the C++ API. Each backward
// computes input gradients only; each module's backward_dw() computes its weight
// gradients later. The graphed copy is captured once with dwgraph::make_graphed_callables
// and replayed every step; gradients are reset to None (zero_grad(set_to_none=True))
// between steps. The two loss curves must be identical, bit for bit.
#include <dwgraph/dwgraph.h>  // as an installed dwgraph is used (docs/install.md)

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <memory>

namespace {

struct Model {
  std::shared_ptr<dwgraph::nn::Linear> l1, l3;
  std::shared_ptr<dwgraph::nn::LayerNormMLP> l2;
  Model() {
    dwgraph::nn::DeferredOptions o;
    o.delay_wgrad_compute = true;
    l1 = std::make_shared<dwgraph::nn::Linear>(32, 64, o);
    l2 = std::make_shared<dwgraph::nn::LayerNormMLP>(64, 128, o);
    l3 = std::make_shared<dwgraph::nn::Linear>(64, 8, o);
  }
  std::vector<at::Tensor> params() const {
    std::vector<at::Tensor> out;
    for (const auto* m : {static_cast<torch::nn::Module*>(l1.get()), static_cast<torch::nn::Module*>(l2.get()),
                          static_cast<torch::nn::Module*>(l3.get())}) {
      for (const auto& p : m->parameters()) out.push_back(p);
    }
    return out;
  }
};

void sgd(const std::vector<at::Tensor>& params, double lr) {
  const at::NoGradGuard no_grad;
  for (const auto& p : params) {
    p.sub_(p.grad(), lr);
    p.mutable_grad() = at::Tensor();  // zero_grad(set_to_none=True)
  }
}

using Fn = std::function<at::Tensor(const at::Tensor&)>;

at::Tensor step(const std::vector<Fn>& stages, const std::vector<std::function<void()>>& backward_dw,
                const at::Tensor& x, const at::Tensor& target) {
  at::Tensor h = x;
  for (const auto& s : stages) h = s(h);
  const at::Tensor loss = (h - target).pow(2).mean();
  loss.backward();
  for (const auto& dw : backward_dw) dw();
  return loss.detach();
}

}  // namespace

int main() {
  at::manual_seed(0);
  Model eager, graphed_model;
  {
    const at::NoGradGuard no_grad;
    auto dst = graphed_model.params(), src = eager.params();
    for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
  }
  const auto teacher = at::randn({8, 32});
  auto wrap = [](auto module) {
    return [module](const std::vector<at::Tensor>& x) { return std::vector<at::Tensor>{module->forward(x[0])}; };
  };
  auto g = dwgraph::make_graphed_callables(
      {dwgraph::nn::graphable("l1", graphed_model.l1, wrap(graphed_model.l1)),
       dwgraph::nn::graphable("l2", graphed_model.l2, wrap(graphed_model.l2)),
       dwgraph::nn::graphable("l3", graphed_model.l3, wrap(graphed_model.l3))},
      {{at::randn({64, 32})}, {at::randn({64, 64}).requires_grad_()}, {at::randn({64, 64}).requires_grad_()}});

  const std::vector<Fn> eager_stages = {[&](const at::Tensor& x) { return eager.l1->forward(x); },
                                        [&](const at::Tensor& x) { return eager.l2->forward(x); },
                                        [&](const at::Tensor& x) { return eager.l3->forward(x); }};
  const std::vector<std::function<void()>> eager_dw = {[&] { eager.l1->backward_dw(); },
                                                       [&] { eager.l2->backward_dw(); },
                                                       [&] { eager.l3->backward_dw(); }};
  std::vector<Fn> graphed_stages;
  std::vector<std::function<void()>> graphed_dw;
  for (const auto& c : g) {
    graphed_stages.push_back([c](const at::Tensor& x) { return (*c)({x})[0]; });
    graphed_dw.push_back([c] { c->backward_dw(); });
  }

  std::printf("dwgraph %s C++ sample (CUDA built: %s)\n", dwgraph::version().c_str(),
              dwgraph::cuda_built() ? "yes" : "no");
  std::printf("step    eager loss  graphed loss  identical\n");
  double t_eager = 0, t_graphed = 0;
  const int steps = 30;
  for (int s = 0; s < steps; ++s) {
    const auto x = at::randn({64, 32});
    const auto target = at::mm(x, teacher.t());
    const auto t0 = std::chrono::steady_clock::now();
    const auto le = step(eager_stages, eager_dw, x, target);
    sgd(eager.params(), 0.05);
    const auto t1 = std::chrono::steady_clock::now();
    const auto lg = step(graphed_stages, graphed_dw, x, target);
    sgd(graphed_model.params(), 0.05);
    const auto t2 = std::chrono::steady_clock::now();
    if (s >= 3) {
      t_eager += std::chrono::duration<double>(t1 - t0).count();
      t_graphed += std::chrono::duration<double>(t2 - t1).count();
    }
    const bool same = at::equal(le, lg);
    if (s % 5 == 0 || s == steps - 1 || !same) {
      std::printf("%4d  %12.6f  %12.6f  %s\n", s, le.item<double>(), lg.item<double>(), same ? "yes" : "NO");
    }
    if (!same) {
      std::fprintf(stderr, "the graphed run diverged from the eager run\n");
      return 1;
    }
  }
  const auto st = dwgraph::graphed_stats(*g[0]);
  std::printf("step time: eager %.3f ms, graphed %.3f ms, replay/eager %.2f\n", 1e3 * t_eager / (steps - 3),
              1e3 * t_graphed / (steps - 3), t_graphed / t_eager);
  std::printf("graph pool: %lld B reserved, %lld B live; contributions %lld B; static buffers %lld B; %zu graphs\n",
              static_cast<long long>(st.pool.reserved_bytes), static_cast<long long>(st.pool.allocated_bytes),
              static_cast<long long>(st.contribution_bytes), static_cast<long long>(st.static_bytes), st.num_graphs);
  return 0;
}
