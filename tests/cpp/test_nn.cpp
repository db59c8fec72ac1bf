// The C++ deferred-wgrad modules (nn/modules.h) against plain ATen autograd on the
// same weights and inputs: the C1 accumulation contract for Linear and a grouped case,
// LayerNormLinear, LayerNormMLP with checkpoint against without, fused main_grad, and the
// errors.
#include "testing.h"

#include "common/check.h"
#include "nn/modules.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/matmul.h>
#include <torch/csrc/autograd/function.h>  // Node::name(); older torch does not include it through TensorBase

using dwgraph::nn::DeferredOptions;

namespace {

at::Tensor leaf_copy(const at::Tensor& t) { return t.detach().clone().requires_grad_(true); }

}  // namespace

TEST_CASE("C++ Linear: deferred gradients equal plain autograd (tied, microbatches, both zero_grad modes)",
          "[nn][cpu]") {
  const bool tied = GENERATE(false, true);
  const int microbatches = GENERATE(1, 3);
  const bool set_to_none = GENERATE(true, false);
  const bool bias = GENERATE(false, true);
  const bool drain_b_first = GENERATE(false, true);
  CAPTURE(tied, microbatches, set_to_none, bias, drain_b_first);
  at::manual_seed(11);
  DeferredOptions opts;
  opts.bias = bias;
  opts.delay_wgrad_compute = true;
  dwgraph::nn::Linear a(8, 8, opts), b(8, 8, opts);
  if (tied) {
    b.weight = a.weight;
    if (bias) b.bias = a.bias;
  }
  // Reference: the same weights as plain leaves, through at::linear and ATen's autograd.
  const auto wa = leaf_copy(a.weight), wb = tied ? wa : leaf_copy(b.weight);
  const auto ba = bias ? leaf_copy(a.bias) : at::Tensor();
  const auto bb = bias ? (tied ? ba : leaf_copy(b.bias)) : at::Tensor();
  if (!set_to_none) {  // zero_grad(set_to_none=False): zero tensors instead of None
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&a.weight, &b.weight, &a.bias, &b.bias, &wa, &wb, &ba, &bb}) {
      if (t->defined()) t->mutable_grad() = at::zeros_like(*t);
    }
  }
  for (int mb = 0; mb < microbatches; ++mb) {
    const auto x = at::randn({4, 8});
    const auto g = at::randn({4, 8});
    b.forward(a.forward(x)).backward(g);
    at::linear(at::linear(x, wa, ba), wb, bb).backward(g);
  }
  if (set_to_none) CHECK_FALSE(a.weight.grad().defined());  // nothing landed before backward_dw
  CHECK(a.num_queued_wgrad_units() == static_cast<size_t>(microbatches));
  for (int mb = 0; mb < microbatches; ++mb) {
    if (drain_b_first) {
      b.backward_dw();
      a.backward_dw();
    } else {
      a.backward_dw();
      b.backward_dw();
    }
  }
  // FP32: one microbatch is bitwise; several add the same terms in another order.
  const double tol = microbatches == 1 ? 0.0 : 1e-5;
  auto close = [tol](const at::Tensor& got, const at::Tensor& ref) {
    return tol == 0.0 ? at::equal(got, ref) : at::allclose(got, ref, tol, tol);
  };
  CHECK(close(a.weight.grad(), wa.grad()));
  CHECK(close(b.weight.grad(), wb.grad()));
  if (bias) {
    CHECK(close(a.bias.grad(), ba.grad()));
    CHECK(close(b.bias.grad(), bb.grad()));
  }
  CHECK_THROWS_AS(a.backward_dw(), dwgraph::GraphStateError);
}

TEST_CASE("C++ GroupedLinear: deferred grouped gradients equal per-group autograd", "[nn][grouped][cpu]") {
  const bool packed = GENERATE(false, true);
  CAPTURE(packed);
  at::manual_seed(12);
  DeferredOptions opts;
  opts.delay_wgrad_compute = true;
  dwgraph::nn::GroupedLinear grp(3, 8, 4, opts, packed);
  const std::vector<int64_t> splits = {3, 0, 4};
  const auto x = at::randn({7, 8});
  const auto g = at::randn({7, 4});
  grp.forward(x, splits).backward(g);
  CHECK_FALSE(grp.weights[0].grad().defined());
  grp.backward_dw();
  int64_t row = 0;
  for (int64_t k = 0; k < 3; ++k) {
    const at::Tensor w = packed ? grp.weights[0][k] : grp.weights[k];
    const at::Tensor b = packed ? grp.biases[0][k] : grp.biases[k];
    const auto wl = leaf_copy(w), bl = leaf_copy(b);
    at::linear(x.narrow(0, row, splits[k]), wl, bl).backward(g.narrow(0, row, splits[k]));
    const at::Tensor wg = packed ? grp.weights[0].grad()[k] : grp.weights[k].grad();
    const at::Tensor bg = packed ? grp.biases[0].grad()[k] : grp.biases[k].grad();
    CAPTURE(k);
    if (splits[k] == 0) {
      CHECK(wg.abs().max().item<float>() == 0.0f);  // an empty group contributes zero
    } else {
      CHECK(at::equal(wg, wl.grad()));
      CHECK(at::equal(bg, bl.grad()));
    }
    row += splits[k];
  }
}

TEST_CASE("C++ Linear: fused main_grad accumulates over microbatches, .grad stays undefined", "[nn][cpu]") {
  at::manual_seed(13);
  DeferredOptions opts;
  opts.delay_wgrad_compute = true;
  opts.fuse_wgrad_accumulation = true;
  dwgraph::nn::Linear lin(8, 4, opts);
  at::Tensor& mg = lin.main_grad("weight");
  const auto ptr = mg.data_ptr();
  auto ref = at::zeros({4, 8}, at::kDouble);
  for (int mb = 0; mb < 3; ++mb) {
    const auto x = at::randn({5, 8});
    const auto g = at::randn({5, 4});
    lin.forward(x).backward(g);
    lin.backward_dw();
    ref += at::mm(g.to(at::kDouble).t(), x.to(at::kDouble));
  }
  CHECK(mg.data_ptr() == ptr);
  CHECK_FALSE(lin.weight.grad().defined());
  CHECK(dwgraph::testing::rel_err(mg, ref) < 2e-6);
}

TEST_CASE("C++ modules: errors name the module and the parameter", "[nn][errors][cpu]") {
  DeferredOptions opts;
  opts.delay_wgrad_compute = true;
  dwgraph::nn::Linear lin(8, 4, opts);
  try {
    lin.backward_dw();
    FAIL("backward_dw() with nothing queued did not throw");
  } catch (const dwgraph::GraphStateError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("dwgraph::nn::Linear(in_features=8") &&
                                               Catch::Contains("no deferred weight-gradient work"));
  }
  dwgraph::nn::GroupedLinear grp(2, 8, 4, opts);
  try {
    grp.forward(at::randn({5, 8}), {2, 2});
    FAIL("bad m_splits did not throw");
  } catch (const dwgraph::ArgumentError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("GroupedLinear") && Catch::Contains("m_splits") &&
                                               Catch::Contains("summing to 4"));
  }
  opts.fuse_wgrad_accumulation = true;
  dwgraph::nn::LayerNormMLP mlp(8, 12, opts);
  mlp.main_grad("fc2_weight") = at::zeros({12, 8});
  try {
    mlp.forward(at::randn({3, 8}));
    FAIL("a mis-shaped main_grad did not throw");
  } catch (const dwgraph::ArgumentError& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("LayerNormMLP") && Catch::Contains("'fc2_weight'") &&
                                               Catch::Contains("[12, 8]"));
  }
}

TEST_CASE("C++ Linear under autocast runs its GEMMs in the autocast dtype, as at::linear", "[nn][cpu]") {
  at::manual_seed(12);
  DeferredOptions opts;
  opts.delay_wgrad_compute = GENERATE(false, true);
  CAPTURE(opts.delay_wgrad_compute);
  dwgraph::nn::Linear a(8, 4, opts);
  const auto w = leaf_copy(a.weight), b = leaf_copy(a.bias);
  const auto x = at::randn({3, 8}).requires_grad_(true);
  const auto xr = leaf_copy(x);
  at::Tensor y, yr;
  {
    // What torch.autocast("cpu", dtype=torch.bfloat16) sets, restored at scope exit.
    const bool was = at::autocast::is_autocast_enabled(at::kCPU);
    const auto dtype = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    y = a.forward(x);
    yr = at::linear(xr, w, b);
    at::autocast::set_autocast_enabled(at::kCPU, was);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
    at::autocast::clear_cache();
  }
  CHECK(y.scalar_type() == at::kBFloat16);
  CHECK(yr.scalar_type() == at::kBFloat16);
  CHECK(at::equal(y, yr));
  const auto g = at::randn({3, 4}, at::kBFloat16);
  y.backward(g);
  yr.backward(g);
  if (opts.delay_wgrad_compute) a.backward_dw();
  CHECK(x.grad().scalar_type() == at::kFloat);
  CHECK(at::equal(x.grad(), xr.grad()));
  // FP32 from the bf16 operands (torch rounds to bf16 first): compare in float64.
  const auto ref = at::matmul(g.to(at::kDouble).t(), x.detach().to(at::kBFloat16).to(at::kDouble));
  CHECK(a.weight.grad().scalar_type() == at::kFloat);
  CHECK(dwgraph::testing::rel_err(a.weight.grad(), ref) < 2e-6);
}

TEST_CASE("WgradStore: the process counts the stores with wgrad hooks, so landings skip an empty scan",
          "[nn][hooks][cpu]") {
  using dwgraph::ops::num_stores_with_hooks;
  const size_t before = num_stores_with_hooks();
  {
    auto a = std::make_shared<dwgraph::ops::WgradStore>();
    auto b = std::make_shared<dwgraph::ops::WgradStore>();
    a->set_num_hooks(2);
    CHECK(num_stores_with_hooks() == before + 1);
    a->set_num_hooks(3);  // still one store with hooks
    CHECK(num_stores_with_hooks() == before + 1);
    b->set_num_hooks(1);
    CHECK(num_stores_with_hooks() == before + 2);
    a->set_num_hooks(0);
    CHECK(num_stores_with_hooks() == before + 1);
    // b is destroyed with its hook: the count drops with it.
  }
  CHECK(num_stores_with_hooks() == before);
}

TEST_CASE("C++ LayerNormLinear equals at::layer_norm (at::rms_norm) + at::linear autograd", "[nn][cpu]") {
  DeferredOptions opts;
  opts.delay_wgrad_compute = GENERATE(false, true);
  opts.fuse_wgrad_accumulation = GENERATE(false, true);
  opts.bias = GENERATE(false, true);
  const std::string norm = GENERATE("LayerNorm", "RMSNorm");
  const bool rms = norm == "RMSNorm";
  CAPTURE(opts.delay_wgrad_compute, opts.fuse_wgrad_accumulation, opts.bias, norm);
  at::manual_seed(14);
  dwgraph::nn::LayerNormLinear m(8, 6, opts, 1e-5, norm);
  std::vector<std::string> names = {"layer_norm_weight"};
  if (!rms) names.push_back("layer_norm_bias");
  names.push_back("weight");
  if (opts.bias) names.push_back("bias");
  CHECK(m.named_parameters().keys() == names);
  const auto lw = leaf_copy(m.layer_norm_weight), w = leaf_copy(m.weight);
  const auto lb = rms ? at::Tensor() : leaf_copy(m.layer_norm_bias);
  const auto b = opts.bias ? leaf_copy(m.bias) : at::Tensor();
  const auto x = at::randn({5, 8}).requires_grad_(true);
  const auto xr = leaf_copy(x);
  const auto [y, ln_out] = m.forward_with_layernorm_output(x);
  const auto hr = rms ? at::rms_norm(xr, {8}, lw, m.eps) : at::layer_norm(xr, {8}, lw, lb, m.eps);
  const auto yr = at::linear(hr, w, b);
  CHECK(at::equal(y, yr));
  CHECK(at::equal(ln_out, hr));
  const auto g = at::randn({5, 6});
  y.backward(g);
  yr.backward(g);
  CHECK(m.num_queued_wgrad_units() == (opts.delay_wgrad_compute ? 1u : 0u));
  if (opts.delay_wgrad_compute) {
    if (opts.bias) CHECK_FALSE(m.bias.grad().defined());
    m.backward_dw();
  }
  CHECK(at::equal(x.grad(), xr.grad()));
  CHECK(at::equal(m.layer_norm_weight.grad(), lw.grad()));
  if (!rms) CHECK(at::equal(m.layer_norm_bias.grad(), lb.grad()));
  if (opts.fuse_wgrad_accumulation) {
    CHECK_FALSE(m.weight.grad().defined());
    CHECK(dwgraph::testing::rel_err(m.main_grad("weight"), w.grad().to(at::kDouble)) < 2e-6);
  } else {
    CHECK(at::equal(m.weight.grad(), w.grad()));
  }
  if (opts.bias) CHECK(at::equal(m.bias.grad(), b.grad()));
  CHECK_THROWS_AS(dwgraph::nn::LayerNormLinear(8, 6, opts, 1e-5, "BatchNorm"), dwgraph::ArgumentError);
}

TEST_CASE("C++ LayerNormMLP with checkpoint: the gradients and units of checkpoint=false, bitwise", "[nn][cpu]") {
  DeferredOptions opts;
  opts.delay_wgrad_compute = GENERATE(false, true);
  opts.fuse_wgrad_accumulation = GENERATE(false, true);
  CAPTURE(opts.delay_wgrad_compute, opts.fuse_wgrad_accumulation);
  at::manual_seed(15);
  dwgraph::nn::LayerNormMLP plain(8, 16, opts, "gelu_tanh");
  dwgraph::nn::LayerNormMLP ckpt(8, 16, opts, "gelu_tanh", 1e-5, /*checkpoint=*/true);
  {
    const at::NoGradGuard no_grad;
    auto src = plain.parameters(), dst = ckpt.parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  const std::vector<at::Tensor> xs = {at::randn({4, 8}), at::randn({4, 8})};
  std::vector<at::Tensor> dx[2];
  size_t k = 0;
  for (auto* m : {&plain, &ckpt}) {
    std::vector<at::Tensor> ys, inputs;
    for (const auto& x : xs) {  // both forwards, then both backwards (a pipeline's order)
      inputs.push_back(x.clone().requires_grad_(true));
      ys.push_back(m->forward(inputs.back()));
    }
    for (const auto& y : ys) y.square().sum().backward();
    if (opts.delay_wgrad_compute) {
      CHECK(m->num_queued_wgrad_units() == 2);
      m->backward_dw();
      m->backward_dw();
    }
    for (const auto& x : inputs) dx[k].push_back(x.grad());
    ++k;
  }
  CHECK(ckpt.forward(xs[0].clone().requires_grad_(true)).grad_fn()->name() ==
        "dwgraph::LayerNormMLPCheckpointBackward");
  for (size_t i = 0; i < 2; ++i) CHECK(at::equal(dx[0][i], dx[1][i]));
  const auto pp = plain.named_parameters(), cp = ckpt.named_parameters();
  for (const auto& item : pp) {
    CAPTURE(item.key());
    const at::Tensor& a = item.value();
    const at::Tensor& c = cp[item.key()];
    CHECK(a.grad().defined() == c.grad().defined());
    if (a.grad().defined()) CHECK(at::equal(a.grad(), c.grad()));
  }
  if (opts.fuse_wgrad_accumulation) {
    CHECK(at::equal(plain.main_grad("fc1_weight"), ckpt.main_grad("fc1_weight")));
    CHECK(at::equal(plain.main_grad("fc2_weight"), ckpt.main_grad("fc2_weight")));
  }
}
