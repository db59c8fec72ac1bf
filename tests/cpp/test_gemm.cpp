// The GEMM ops (ops/gemm.h) against a float64 reference computed from the same input
// values, on every dtype, output dtype, accumulation mode and form; and their argument
// errors, which must name the argument and write nothing.
#include "testing.h"

#include "common/check.h"
#include "ops/gemm.h"

#include <tuple>
#include <vector>

using dwgraph::testing::randn;
using dwgraph::testing::rel_err;
using dwgraph::testing::to_double;
using dwgraph::testing::tolerance;

namespace {

const std::vector<at::ScalarType> kInputDtypes = {at::kFloat, at::kBFloat16, at::kHalf};

// (M, N, K) covering 1, 7, 33 and 128.
std::tuple<int64_t, int64_t, int64_t> some_shape() {
  return GENERATE(std::make_tuple(int64_t{1}, int64_t{7}, int64_t{33}),
                  std::make_tuple(int64_t{7}, int64_t{33}, int64_t{1}),
                  std::make_tuple(int64_t{33}, int64_t{128}, int64_t{7}),
                  std::make_tuple(int64_t{128}, int64_t{33}, int64_t{128}));
}

}  // namespace

DWGRAPH_DEVICE_TEST("fwd_gemm matches the float64 reference", "[ops][gemm]") {
  const auto dtype = GENERATE_COPY(from_range(kInputDtypes));
  const bool with_bias = GENERATE(false, true);
  const auto [m, n, k] = some_shape();
  CAPTURE(dtype, with_bias, m, n, k);
  const auto x = randn({m, k}, dtype, device);
  const auto w = randn({n, k}, dtype, device);
  const auto b = randn({n}, dtype, device);
  const auto y = dwgraph::ops::fwd_gemm(x, w, with_bias ? std::optional<at::Tensor>(b) : std::nullopt);
  auto ref = at::mm(to_double(x), to_double(w).t());
  if (with_bias) ref += to_double(b);
  REQUIRE(y.scalar_type() == dtype);
  REQUIRE(y.device() == device);
  REQUIRE(y.sizes() == at::IntArrayRef({m, n}));
  CHECK(rel_err(y, ref) < tolerance(dtype));
}

DWGRAPH_DEVICE_TEST("dgrad_gemm matches the float64 reference", "[ops][gemm]") {
  const auto dtype = GENERATE_COPY(from_range(kInputDtypes));
  const auto [m, n, k] = some_shape();
  CAPTURE(dtype, m, n, k);
  const auto dy = randn({m, n}, dtype, device);
  const auto w = randn({n, k}, dtype, device);
  const auto dx = dwgraph::ops::dgrad_gemm(dy, w);
  REQUIRE(dx.scalar_type() == dtype);
  REQUIRE(dx.sizes() == at::IntArrayRef({m, k}));
  CHECK(rel_err(dx, at::mm(to_double(dy), to_double(w))) < tolerance(dtype));
}

DWGRAPH_DEVICE_TEST("wgrad_gemm matches the float64 reference", "[ops][gemm]") {
  const auto dtype = GENERATE_COPY(from_range(kInputDtypes));
  const bool fp32_out = GENERATE(true, false);
  const bool accumulate = GENERATE(false, true);
  const bool with_bias = GENERATE(false, true);
  const auto [m, n, k] = some_shape();
  const auto out_dtype = fp32_out ? at::kFloat : dtype;
  CAPTURE(dtype, out_dtype, accumulate, with_bias, m, n, k);

  auto out = randn({n, k}, out_dtype, device);  // random, so "not accumulating" must overwrite
  auto bias_grad = randn({n}, out_dtype, device);
  auto ref = accumulate ? to_double(out) : at::zeros({n, k}, at::kDouble);
  // Accumulating: two calls, the result must be out0 + both products.
  const int calls = accumulate ? 2 : 1;
  at::Tensor last_dy;
  for (int i = 0; i < calls; ++i) {
    const auto dy = randn({m, n}, dtype, device);
    const auto x = randn({m, k}, dtype, device);
    dwgraph::ops::wgrad_gemm(dy, x, out, accumulate,
                             with_bias ? std::optional<at::Tensor>(bias_grad) : std::nullopt);
    ref += at::mm(to_double(dy).t(), to_double(x));
    last_dy = dy;
  }
  REQUIRE(out.scalar_type() == out_dtype);
  CHECK(rel_err(out, ref) < tolerance(out_dtype));
  if (with_bias) {
    // Written, not accumulated: the column sum of the last call's dy only.
    CHECK(rel_err(bias_grad, to_double(last_dy).sum(0)) < tolerance(out_dtype));
  }
}

DWGRAPH_DEVICE_TEST("wgrad_gemm accumulates into the caller's buffer in place", "[ops][gemm]") {
  auto out = randn({16, 8}, at::kFloat, device);
  const auto storage = out.data_ptr();
  const auto before = to_double(out);
  const auto dy = randn({5, 16}, at::kBFloat16, device);
  const auto x = randn({5, 8}, at::kBFloat16, device);
  dwgraph::ops::wgrad_gemm(dy, x, out, /*accumulate=*/true);
  CHECK(out.data_ptr() == storage);
  CHECK(rel_err(out, before + at::mm(to_double(dy).t(), to_double(x))) < 2e-6);
}

DWGRAPH_DEVICE_TEST("grouped GEMMs match per-group float64 references", "[ops][gemm][grouped]") {
  const auto dtype = GENERATE_COPY(from_range(kInputDtypes));
  const bool packed = GENERATE(false, true);
  const bool with_bias = GENERATE(false, true);
  const bool accumulate = GENERATE(false, true);
  CAPTURE(dtype, packed, with_bias, accumulate);
  const std::vector<int64_t> splits = {7, 0, 1, 33};  // an empty group included
  const int64_t groups = 4, m = 41, n = 33, k = 7;
  const auto x = randn({m, k}, dtype, device);
  const auto dy = randn({m, n}, dtype, device);
  const auto w_packed = randn({groups, n, k}, dtype, device);
  const auto b_packed = randn({groups, n}, dtype, device);
  std::vector<at::Tensor> w_list, b_list;
  for (int64_t g = 0; g < groups; ++g) {
    w_list.push_back(w_packed[g].clone());
    b_list.push_back(b_packed[g].clone());
  }
  auto out_packed = randn({groups, n, k}, at::kFloat, device);
  auto bgrad_packed = randn({groups, n}, at::kFloat, device);
  std::vector<at::Tensor> out_list, bgrad_list;
  for (int64_t g = 0; g < groups; ++g) {
    out_list.push_back(out_packed[g].clone());
    bgrad_list.push_back(bgrad_packed[g].clone());
  }
  const auto out0 = to_double(out_packed);

  at::Tensor y, dx;
  if (packed) {
    y = dwgraph::ops::grouped_fwd_gemm(x, w_packed, splits,
                                       with_bias ? std::optional<at::Tensor>(b_packed) : std::nullopt);
    dx = dwgraph::ops::grouped_dgrad_gemm(dy, w_packed, splits);
    dwgraph::ops::grouped_wgrad_gemm(dy, x, out_packed, splits, accumulate,
                                     with_bias ? std::optional<at::Tensor>(bgrad_packed) : std::nullopt);
  } else {
    y = dwgraph::ops::grouped_fwd_gemm(x, w_list, splits,
                                       with_bias ? std::optional<at::TensorList>(b_list) : std::nullopt);
    dx = dwgraph::ops::grouped_dgrad_gemm(dy, w_list, splits);
    dwgraph::ops::grouped_wgrad_gemm(dy, x, out_list, splits, accumulate,
                                     with_bias ? std::optional<at::TensorList>(bgrad_list) : std::nullopt);
    out_packed = at::stack(out_list);
    bgrad_packed = at::stack(bgrad_list);
  }

  int64_t row = 0;
  for (int64_t g = 0; g < groups; ++g) {
    CAPTURE(g);
    const int64_t rows = splits[g];
    const auto xg = to_double(x).narrow(0, row, rows);
    const auto dyg = to_double(dy).narrow(0, row, rows);
    const auto wg = to_double(w_packed[g]);
    if (rows > 0) {
      auto y_ref = at::mm(xg, wg.t());
      if (with_bias) y_ref += to_double(b_packed[g]);
      CHECK(rel_err(y.narrow(0, row, rows), y_ref) < tolerance(dtype));
      CHECK(rel_err(dx.narrow(0, row, rows), at::mm(dyg, wg)) < tolerance(dtype));
    }
    auto w_ref = at::mm(dyg.t(), xg);
    if (accumulate) w_ref += out0[g];
    if (rows == 0 && !accumulate) {
      CHECK(to_double(out_packed[g]).abs().max().item<double>() == 0.0);
    } else {
      CHECK(rel_err(out_packed[g], w_ref) < 2e-6);
    }
    if (with_bias) {
      const auto b_ref = dyg.sum(0);
      if (rows == 0) {
        CHECK(to_double(bgrad_packed[g]).abs().max().item<double>() == 0.0);
      } else {
        CHECK(rel_err(bgrad_packed[g], b_ref) < 2e-6);
      }
    }
    row += rows;
  }
}

// ---- argument errors: named, and nothing written -----------------------------------

namespace {

// Runs `fn`, which must throw dwgraph::ArgumentError whose message contains every
// fragment, and checks that `outputs` are bitwise unchanged.
template <class Fn>
void expect_argument_error(Fn fn, const std::vector<std::string>& fragments,
                           const std::vector<at::Tensor>& outputs = {}) {
  std::vector<at::Tensor> before;
  for (const auto& o : outputs) before.push_back(o.clone());
  bool threw = false;
  try {
    fn();
  } catch (const dwgraph::ArgumentError& e) {
    threw = true;
    const std::string msg = e.what_without_backtrace();
    for (const auto& f : fragments) {
      CAPTURE(msg, f);
      CHECK(msg.find(f) != std::string::npos);
    }
  }
  CHECK(threw);
  for (size_t i = 0; i < outputs.size(); ++i) CHECK(at::equal(outputs[i], before[i]));
}

}  // namespace

TEST_CASE("GEMM ops reject bad arguments by name and write nothing", "[ops][gemm][errors][cpu]") {
  using namespace dwgraph::ops;
  const auto dev = c10::Device(c10::kCPU);
  const auto x = randn({7, 16}, at::kFloat, dev);
  const auto w = randn({8, 16}, at::kFloat, dev);
  const auto dy = randn({7, 8}, at::kFloat, dev);
  auto out = randn({8, 16}, at::kFloat, dev);
  auto bgrad = randn({8}, at::kFloat, dev);

  SECTION("mismatched K") {
    expect_argument_error([&] { fwd_gemm(x, randn({8, 15}, at::kFloat, dev)); },
                          {"fwd_gemm", "argument 'w'", "K = 16", "[8, 15]"});
  }
  SECTION("mismatched N") {
    expect_argument_error([&] { dgrad_gemm(dy, randn({9, 16}, at::kFloat, dev)); },
                          {"dgrad_gemm", "argument 'w'", "N = 8", "[9, 16]"});
  }
  SECTION("mismatched M") {
    expect_argument_error([&] { wgrad_gemm(dy, randn({6, 16}, at::kFloat, dev), out, true); },
                          {"wgrad_gemm", "argument 'x'", "M = 7", "[6, 16]"}, {out});
  }
  SECTION("out of the wrong shape") {
    auto bad = randn({8, 15}, at::kFloat, dev);
    expect_argument_error([&] { wgrad_gemm(dy, x, bad, false); },
                          {"argument 'out'", "[8, 16]", "[8, 15]"}, {bad});
  }
  SECTION("out of the wrong dtype") {
    auto bad = randn({8, 16}, at::kHalf, dev);
    expect_argument_error(
        [&] { wgrad_gemm(dy.to(at::kBFloat16), x.to(at::kBFloat16), bad, false); },
        {"argument 'out'", "float32 or the input dtype BFloat16", "Half"}, {bad});
  }
  SECTION("bias gradient of the wrong shape") {
    auto bad = randn({7}, at::kFloat, dev);
    expect_argument_error(
        [&] { wgrad_gemm(dy, x, out, true, bad); },
        {"argument 'bias_grad_out'", "[8]", "[7]"}, {out, bad});
  }
  SECTION("unsupported dtype") {
    expect_argument_error([&] { fwd_gemm(x.to(at::kDouble), w.to(at::kDouble)); },
                          {"argument 'x'", "float32, bfloat16 or float16", "Double"});
    expect_argument_error([&] { dgrad_gemm(dy.to(at::kInt), w); },
                          {"argument 'dy'", "Int"});
  }
  SECTION("mixed dtypes") {
    expect_argument_error([&] { fwd_gemm(x, w.to(at::kBFloat16)); },
                          {"argument 'w'", "dtype Float", "BFloat16"});
  }
  SECTION("wrong device") {
    expect_argument_error([&] { wgrad_gemm(dy, x.to(at::kMeta), out, false); },
                          {"argument 'x'", "device cpu", "meta"}, {out});
  }
  SECTION("non-contiguous operand") {
    const auto wt = randn({16, 8}, at::kFloat, dev).t();
    expect_argument_error([&] { fwd_gemm(x, wt); }, {"argument 'w'", "contiguous", "strides"});
  }
  SECTION("m_splits that do not sum to M") {
    auto outs = randn({2, 8, 16}, at::kFloat, dev);
    expect_argument_error([&] { grouped_wgrad_gemm(dy, x, outs, std::vector<int64_t>{3, 3}, false); },
                          {"argument 'm_splits'", "sum to M = 7", "sums to 6"}, {outs});
  }
  SECTION("m_splits of the wrong length or sign") {
    const auto wp = randn({2, 8, 16}, at::kFloat, dev);
    expect_argument_error([&] { grouped_fwd_gemm(x, wp, std::vector<int64_t>{7}); },
                          {"argument 'm_splits'", "one entry per weight (2)", "got 1"});
    expect_argument_error([&] { grouped_fwd_gemm(x, wp, std::vector<int64_t>{8, -1}); },
                          {"argument 'm_splits' entry 1", ">= 0", "-1"});
  }
  SECTION("a list weight unlike the first") {
    std::vector<at::Tensor> ws = {w, randn({8, 15}, at::kFloat, dev)};
    expect_argument_error([&] { grouped_dgrad_gemm(dy, ws, std::vector<int64_t>{3, 4}); },
                          {"argument 'w[1]'", "[8, 16]", "[8, 15]"});
  }
  SECTION("a grouped output list with one bad entry writes no group") {
    std::vector<at::Tensor> outs = {randn({8, 16}, at::kFloat, dev), randn({8, 16}, at::kHalf, dev)};
    expect_argument_error(
        [&] { grouped_wgrad_gemm(dy, x, outs, std::vector<int64_t>{3, 4}, false); },
        {"argument 'out[1]'"}, outs);
  }
}
