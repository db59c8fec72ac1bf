// FP8 core (ops/fp8.h): recipes and the thread's state, quantization and the delayed-scaling
// update against values computed by hand, and the FP8 GEMM (at::_scaled_mm: ATen on the CPU,
// cuBLASLt on CUDA) against the dequantized FP32 product, in the three layouts the modules
// use (forward, dgrad, wgrad).
#include "testing.h"

#include "common/check.h"
#include "ops/fp8.h"

using dwgraph::ops::Fp8Format;
using dwgraph::ops::Fp8Recipe;
using dwgraph::ops::Fp8State;
using dwgraph::ops::Fp8StateGuard;
namespace fp8 = dwgraph::ops::fp8;

TEST_CASE("FP8 recipes validate their arguments and the state guard restores", "[ops][fp8]") {
  CHECK_THROWS_AS(Fp8Recipe::delayed(Fp8Format::kHybrid, 0, 0, "max"), dwgraph::ArgumentError);
  CHECK_THROWS_AS(Fp8Recipe::delayed(Fp8Format::kHybrid, 0, 4, "mean"), dwgraph::ArgumentError);
  CHECK_THROWS_AS(Fp8Recipe::current(Fp8Format::kE4M3, -1), dwgraph::ArgumentError);
  const Fp8Recipe r = Fp8Recipe::delayed(Fp8Format::kHybrid, 1, 4, "most_recent");
  CHECK(r.backward_dtype() == at::kFloat8_e5m2);
  CHECK(Fp8Recipe::current(Fp8Format::kE4M3, 0).backward_dtype() == at::kFloat8_e4m3fn);
  CHECK(!Fp8State::current().enabled);
  {
    const Fp8StateGuard on(Fp8State{true, r});
    CHECK(Fp8State::current() == (Fp8State{true, r}));
    CHECK(Fp8State::current().describe() ==
          "on (DelayedScaling(fp8_format=HYBRID, margin=1, amax_history_len=4, amax_compute_algo='most_recent'))");
  }
  CHECK(!Fp8State::current().enabled);
}

DWGRAPH_DEVICE_TEST("delayed scaling quantizes with the old scale, then rolls the history and updates it",
                    "[ops][fp8]") {
  const Fp8Recipe r = Fp8Recipe::delayed(Fp8Format::kHybrid, /*margin=*/1, /*history=*/3, "max");
  const dwgraph::ops::Fp8Meta meta = fp8::make_meta(1, 3, device);
  meta.scale.fill_(2.0);
  const at::Tensor t = at::tensor({1.0f, -3.0f, 0.25f}).to(device);
  const fp8::Quantized q = fp8::quantize(t, at::kFloat8_e4m3fn, r, meta, fp8::kWeight);
  // 2 * t is exact in E4M3; 1 / 2 is exact in FP32.
  CHECK(at::equal(q.data.to(at::kCPU).to(at::kFloat), at::tensor({2.0f, -6.0f, 0.5f})));
  CHECK(q.scale_inv.item<float>() == 0.5f);
  const at::Tensor h = meta.amax_history.to(at::kCPU);
  CHECK(h[0][1].item<float>() == 3.0f);
  CHECK(h[1][1].item<float>() == 0.0f);
  CHECK(meta.scale.to(at::kCPU)[1].item<float>() == 448.0f / 3.0f / 2.0f);  // fp8_max / amax / 2^margin
  CHECK(meta.scale.to(at::kCPU)[0].item<float>() == 2.0f);                  // other columns untouched
  // An all-zero tensor keeps the scale; the history rolls.
  fp8::quantize(at::zeros({4}, t.options()), at::kFloat8_e4m3fn, r, meta, fp8::kInput);
  CHECK(meta.scale.to(at::kCPU)[0].item<float>() == 2.0f);
}

DWGRAPH_DEVICE_TEST("the FP8 GEMM equals the dequantized FP32 product in every module layout", "[ops][fp8]") {
  // Multiples of 16, as cuBLASLt's FP8 GEMM needs.
  const int64_t m = 32, n = 48, k = 64;
  const Fp8Recipe r = Fp8Recipe::current(Fp8Format::kHybrid, 0);
  const dwgraph::ops::Fp8Meta none;
  const at::Tensor x = at::randn({m, k}).to(device), w = at::randn({n, k}).to(device), dy = at::randn({m, n}).to(device);
  const fp8::Quantized xq = fp8::quantize(x, at::kFloat8_e4m3fn, r, none, 0);
  const fp8::Quantized wq = fp8::quantize(w, at::kFloat8_e4m3fn, r, none, 1);
  const fp8::Quantized dyq = fp8::quantize(dy, at::kFloat8_e5m2, r, none, 2);
  auto deq = [](const fp8::Quantized& q) { return q.data.to(at::kFloat) * q.scale_inv; };
  auto check = [&](const at::Tensor& got, const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor ref = at::mm(a, b).to(at::kCPU).to(at::kDouble);
    // Per added term: FP32's 2^-23 on CPU. Hopper's FP8 tensor cores accumulate with
    // about 14 significant bits before cuBLASLt promotes to FP32 (measured on an H200,
    // 2026-12-04: max |error| / (|a| @ |b|) 1.7e-4, 7.3e-5, 5.8e-5 for the three layouts at
    // K = 64, against FP32's 7.6e-6 bound), so 2^-13 there; a layout error is O(1).
    const double unit = device.is_cuda() ? std::ldexp(1.0, -13) : std::ldexp(1.0, -23);
    const at::Tensor mag = (a.abs().mm(b.abs())).to(at::kCPU).to(at::kDouble);
    const at::Tensor bound = mag * (a.size(1) * unit);
    const at::Tensor err = (got.to(at::kCPU).to(at::kDouble) - ref).abs();
    INFO("max |error| / (|a| @ |b|) = " << (err / mag.clamp_min(1e-30)).max().item<double>() << ", bound "
                                        << a.size(1) * unit);
    CHECK(err.le(bound).all().item<bool>());
  };
  check(fp8::mm(xq, fp8::t(wq)), deq(xq), deq(wq).t());   // forward
  check(fp8::mm(dyq, wq), deq(dyq), deq(wq));             // dgrad
  check(fp8::mm(fp8::t(dyq), xq), deq(dyq).t(), deq(xq)); // wgrad
}
