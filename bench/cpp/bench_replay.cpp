// C++ side of the manager benchmarks, measured side by side in one run:
//  1. wrapper overhead per replay: a one-kernel graph (host graph replay, and a graphed
//     callable's call-to-return) against an eager call of the same kernel;
//  2. the gradient hand-off (clone into None / add into .grad) against a bare add_ of the
//     same tensors (target: at most 1.1x).
// Prints a markdown table; `--quick` runs fewer iterations.
#include "graphs/graph.h"
#include "graphs/landing.h"
#include "graphs/manager.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

namespace {

double median_us(const std::function<void()>& fn, int iters, int samples) {
  for (int i = 0; i < iters; ++i) fn();  // warm up
  std::vector<double> t;
  for (int s = 0; s < samples; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) fn();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int iters = quick ? 200 : 2000, samples = quick ? 5 : 9;
  at::manual_seed(0);
  std::printf("# C++ replay overhead and hand-off cost (cpu)\n\n");
  std::printf("| case | eager us | graphed us | graphed / eager |\n|---|---:|---:|---:|\n");
  for (int64_t n : {int64_t{16}, int64_t{65536}}) {
    // One kernel: y = x * 2 into a static output.
    auto x = at::randn({n});
    auto y = at::empty({n});
    auto graph = dwgraph::graphs::make_graph(c10::Device(c10::kCPU));
    graph->capture_begin();
    at::mul_out(y, x, 2);
    graph->capture_end();
    const double eager = median_us([&] { at::mul_out(y, x, 2); }, iters, samples);
    const double replay = median_us([&] { graph->replay(); }, iters, samples);
    std::printf("| host graph replay, one mul of %lld floats | %.2f | %.2f | %.2f |\n", static_cast<long long>(n), eager,
                replay, replay / eager);
    // The same kernel as a graphed callable (input copy skipped: same storage).
    dwgraph::GraphableCallable c;
    c.name = "mul";
    c.forward = [](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{in[0] * 2}; };
    auto g = dwgraph::make_graphed_callables({c}, {{x}});
    auto& callable = *g[0];
    const std::vector<at::Tensor> args = {x};
    const double eager_fn = median_us([&] { (void)(x * 2); }, iters, samples);
    const double call = median_us([&] { (void)callable(args); }, iters, samples);
    std::printf("| graphed callable call-to-return, one mul of %lld floats | %.2f | %.2f | %.2f |\n",
                static_cast<long long>(n), eager_fn, call, call / eager_fn);
  }
  std::printf("\n| hand-off of | bare add_ us | hand_off us | hand_off / add_ |\n|---|---:|---:|---:|\n");
  for (int64_t n : {int64_t{1} << 10, int64_t{1} << 20}) {
    dwgraph::graphs::Landing landing;
    auto& contribs = landing.contributions;
    std::vector<at::Tensor> grads, bufs;
    for (int i = 0; i < 8; ++i) {
      auto p = at::randn({n});
      p.mutable_grad() = at::randn({n});
      auto buf = at::randn({n});
      grads.push_back(p.grad());
      bufs.push_back(buf);
      contribs.push_back(dwgraph::graphs::Contribution{p, buf, "p"});
    }
    const double bare = median_us([&] {
      for (size_t i = 0; i < grads.size(); ++i) grads[i].add_(bufs[i]);
    }, iters / 10 + 1, samples);
    const double ho = median_us([&] {
      landing.check("bench");
      landing.land();
    }, iters / 10 + 1, samples);
    std::printf("| 8 params x %lld floats (add path) | %.2f | %.2f | %.2f |\n", static_cast<long long>(n), bare, ho,
                ho / bare);
  }
  return 0;
}
