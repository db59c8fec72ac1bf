// A two-layer MLP trained with dwgraph's GEMM ops directly, the way a deferred-wgrad
// pipeline schedule uses them: each microbatch's backward computes only the input
// gradient (dgrad_gemm) and queues its weight-gradient work; the queued work later runs
// as fused accumulation (wgrad_gemm with accumulate=true) into FP32 main_grad buffers,
// and an SGD step consumes them. A plain ATen computation of the same step checks the
// gradients every step.
#include "common/build_info.h"
#include "ops/gemm.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <deque>
#include <functional>

int main() {
  at::manual_seed(0);
  const int64_t batch = 64, in = 32, hidden = 64, out = 8, microbatches = 4, steps = 30;
  const float lr = 0.05f;
  auto w1 = at::randn({hidden, in}) * (1.0 / std::sqrt(in));
  auto w2 = at::randn({out, hidden}) * (1.0 / std::sqrt(hidden));
  auto main_grad1 = at::zeros_like(w1);
  auto main_grad2 = at::zeros_like(w2);
  const auto teacher = at::randn({out, in});

  std::printf("dwgraph %s sample (CUDA built: %s)\n", dwgraph::version().c_str(),
              dwgraph::cuda_built() ? "yes" : "no");
  for (int64_t step = 0; step < steps; ++step) {
    const auto x = at::randn({batch * microbatches, in});
    const auto target = at::mm(x, teacher.t());
    main_grad1.zero_();
    main_grad2.zero_();
    std::deque<std::function<void()>> wgrad_queue;  // deferred weight-gradient work
    double loss = 0;
    for (int64_t mb = 0; mb < microbatches; ++mb) {
      const auto xm = x.narrow(0, mb * batch, batch).contiguous();
      const auto tm = target.narrow(0, mb * batch, batch);
      const auto h = at::relu(dwgraph::ops::fwd_gemm(xm, w1));
      const auto y = dwgraph::ops::fwd_gemm(h, w2);
      const auto diff = y - tm;
      loss += diff.pow(2).mean().item<double>() / microbatches;
      const auto dy = (diff * (2.0 / (diff.numel() * microbatches))).contiguous();
      const auto dh = (dwgraph::ops::dgrad_gemm(dy, w2) * (h > 0)).contiguous();
      wgrad_queue.emplace_back([&, dy, h] { dwgraph::ops::wgrad_gemm(dy, h, main_grad2, true); });
      wgrad_queue.emplace_back([&, dh, xm] { dwgraph::ops::wgrad_gemm(dh, xm, main_grad1, true); });
    }
    while (!wgrad_queue.empty()) {  // the "backward_dw" phase
      wgrad_queue.front()();
      wgrad_queue.pop_front();
    }
    // Reference: the same full-batch gradient with plain ATen.
    const auto h = at::relu(at::mm(x, w1.t()));
    const auto dy = (at::mm(h, w2.t()) - target) * (2.0 / (batch * out * microbatches));
    const auto ref2 = at::mm(dy.t(), h);
    const auto ref1 = at::mm((at::mm(dy, w2) * (h > 0)).t(), x);
    const double err = std::max((main_grad1 - ref1).abs().max().item<double>(),
                                (main_grad2 - ref2).abs().max().item<double>());
    if (step % 5 == 0 || step == steps - 1) {
      std::printf("step %2lld  loss %.6f  max |grad - reference| %.2e\n",
                  static_cast<long long>(step), loss, err);
    }
    if (err > 1e-4) {
      std::fprintf(stderr, "gradient mismatch at step %lld: %g\n", static_cast<long long>(step), err);
      return 1;
    }
    w1.sub_(main_grad1, lr);
    w2.sub_(main_grad2, lr);
  }
  return 0;
}
