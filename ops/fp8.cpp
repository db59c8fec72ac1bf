// FP8 recipes, the thread's fp8_autocast state, quantization and the scaling-state update
// (ops/fp8.h, Note [FP8 scaling state lives in tensors]).
#include "ops/fp8.h"

#include "common/check.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/div.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/gt.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/roll.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/ones.h>

#include <torch/csrc/autograd/graph_task.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace dwgraph::ops {

namespace {
const char* format_name(Fp8Format f) { return f == Fp8Format::kHybrid ? "HYBRID" : "E4M3"; }

void check_format(const char* recipe, Fp8Format format, int64_t margin) {
  DWGRAPH_CHECK_ARG(format == Fp8Format::kHybrid || format == Fp8Format::kE4M3, "dwgraph.fp8.", recipe,
                    ": fp8_format must be Format.HYBRID or Format.E4M3, got ", static_cast<int>(format));
  DWGRAPH_CHECK_ARG(margin >= 0 && margin <= 64, "dwgraph.fp8.", recipe,
                    ": margin must be an integer in [0, 64] (scales are divided by 2^margin), got ", margin);
}

thread_local Fp8State tls_state;
}  // namespace

Fp8Recipe Fp8Recipe::delayed(Fp8Format format, int64_t margin, int64_t amax_history_len, const std::string& algo) {
  check_format("DelayedScaling", format, margin);
  DWGRAPH_CHECK_ARG(amax_history_len >= 1, "dwgraph.fp8.DelayedScaling: amax_history_len must be at least 1, got ",
                    amax_history_len);
  DWGRAPH_CHECK_ARG(algo == "max" || algo == "most_recent",
                    "dwgraph.fp8.DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', got '", algo, "'");
  Fp8Recipe r;
  r.scaling = Fp8Scaling::kDelayed;
  r.format = format;
  r.margin = margin;
  r.amax_history_len = amax_history_len;
  r.amax_compute_algo = algo == "max" ? AmaxAlgo::kMax : AmaxAlgo::kMostRecent;
  return r;
}

Fp8Recipe Fp8Recipe::current(Fp8Format format, int64_t margin) {
  check_format("Float8CurrentScaling", format, margin);
  Fp8Recipe r;
  r.scaling = Fp8Scaling::kCurrent;
  r.format = format;
  r.margin = margin;
  r.amax_history_len = 0;
  return r;
}

bool Fp8Recipe::operator==(const Fp8Recipe& o) const {
  if (scaling != o.scaling || format != o.format || margin != o.margin) return false;
  return scaling == Fp8Scaling::kCurrent ||
         (amax_history_len == o.amax_history_len && amax_compute_algo == o.amax_compute_algo);
}

std::string Fp8Recipe::describe() const {
  std::ostringstream s;
  if (scaling == Fp8Scaling::kDelayed) {
    s << "DelayedScaling(fp8_format=" << format_name(format) << ", margin=" << margin
      << ", amax_history_len=" << amax_history_len << ", amax_compute_algo='"
      << (amax_compute_algo == AmaxAlgo::kMax ? "max" : "most_recent") << "')";
  } else {
    s << "Float8CurrentScaling(fp8_format=" << format_name(format) << ", margin=" << margin << ")";
  }
  return s.str();
}

Fp8State Fp8State::current() { return tls_state; }

std::string Fp8State::describe() const {
  return enabled ? "on (" + recipe.describe() + (amax_reduction ? ", amax reduced over group " + std::to_string(amax_group) : std::string()) + ")" : "off";
}

Fp8State exchange_fp8_state(const Fp8State& state) {
  Fp8State previous = tls_state;
  tls_state = state;
  return previous;
}

Fp8StateGuard::Fp8StateGuard(const Fp8State& state) : saved_(exchange_fp8_state(state)) {}
Fp8StateGuard::~Fp8StateGuard() { tls_state = saved_; }

namespace fp8 {

Fp8Meta make_meta(int64_t gemms, int64_t history_len, const at::Device& device) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  Fp8Meta meta;
  meta.amax_history = at::zeros({history_len, kRoles * gemms}, opts);
  meta.scale = at::ones({kRoles * gemms}, opts);
  return meta;
}

void check_meta(const std::string& module, const Fp8Meta& meta, const Fp8Recipe& recipe, int64_t gemms) {
  DWGRAPH_CHECK_ARG(meta.weight_cache.empty() || static_cast<int64_t>(meta.weight_cache.size()) == gemms, module,
                    ": expected one FP8 weight cache per GEMM (", gemms, "), got ", meta.weight_cache.size());
  if (recipe.scaling != Fp8Scaling::kDelayed) return;
  DWGRAPH_CHECK_ARG(meta.defined() && meta.amax_history.defined(), module,
                    ": delayed scaling needs the module's FP8 state (fp8_amax_history, fp8_scale), got none");
  const at::Tensor& h = meta.amax_history;
  const at::Tensor& s = meta.scale;
  DWGRAPH_CHECK_ARG(h.dim() == 2 && h.size(0) == recipe.amax_history_len && h.size(1) == kRoles * gemms &&
                        h.scalar_type() == at::kFloat,
                    module, ": fp8_amax_history must be a float32 [", recipe.amax_history_len, ", ", kRoles * gemms,
                    "] tensor for ", recipe.describe(), ", got ", h.scalar_type(), " ", h.sizes(),
                    " (a module keeps one history length: call reset_fp8_state() before changing it)");
  DWGRAPH_CHECK_ARG(s.dim() == 1 && s.size(0) == kRoles * gemms && s.scalar_type() == at::kFloat, module,
                    ": fp8_scale must be a float32 [", kRoles * gemms, "] tensor, got ", s.scalar_type(), " ",
                    s.sizes());
}

double max_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat8_e4m3fn:
      return 448.0;
    case at::kFloat8_e5m2:
      return 57344.0;
    default:
      DWGRAPH_CHECK_ARG(false, "dwgraph fp8: expected float8_e4m3fn or float8_e5m2, got ", dtype);
  }
  return 0.0;
}

namespace {

// amax(|t|) in FP32, 0-dim (0 for an empty tensor).
at::Tensor amax_of(const at::Tensor& t) {
  if (t.numel() == 0) return at::zeros({}, t.options().dtype(at::kFloat));
  return at::amax(at::abs(t)).to(at::kFloat);
}

// fp8_max / amax / 2^margin where amax is positive and finite, else `fallback`; kept
// within FP32's normal range: a tiny amax (below fp8_max / FLT_MAX) gives FLT_MAX, not an
// infinite scale (0 * inf is NaN; 1 / inf dequantizes to 0), as TransformerEngine turns an
// infinite scale into FLT_MAX; and (dwgraph's own bound) a huge margin gives FLT_MIN, not
// a subnormal scale whose inverse overflows.
at::Tensor scale_from(const at::Tensor& amax, double fp8_max, int64_t margin, const at::Tensor& fallback) {
  at::Tensor s = at::div(at::full({}, fp8_max, amax.options()), amax);
  if (margin > 0) s = at::div(s, std::ldexp(1.0, static_cast<int>(margin)));
  s = at::clamp(s, std::numeric_limits<float>::min(), std::numeric_limits<float>::max());
  return at::where(at::logical_and(at::gt(amax, 0), at::isfinite(amax)), s, fallback);
}

// The scale of one column from its history (max over it, or its newest row), as every
// update of the state sets it: after a quantization, and after an amax reduction.
void rescale(const at::Tensor& col, at::Tensor scale, double fp8_max, const Fp8Recipe& recipe) {
  const at::Tensor reduced = recipe.amax_compute_algo == AmaxAlgo::kMax ? at::amax(col) : col.select(0, 0);
  scale.copy_(scale_from(reduced, fp8_max, recipe.margin, scale));
}

at::Tensor cast(const at::Tensor& t, const at::Tensor& scale, at::ScalarType dtype, double fp8_max) {
  return at::clamp(at::mul(t.to(at::kFloat), scale), -fp8_max, fp8_max).to(dtype).contiguous();
}

}  // namespace

Quantized quantize(const at::Tensor& t, at::ScalarType dtype, const Fp8Recipe& recipe, const Fp8Meta& meta,
                   int64_t column) {
  const double fp8_max = max_of(dtype);
  if (recipe.scaling == Fp8Scaling::kDelayed && meta.recompute_scale.defined() && column % kRoles != kGradOutput) {
    // Note [FP8 in a checkpoint's recomputation].
    const at::Tensor scale = meta.recompute_scale.select(0, column);
    return Quantized{cast(t, scale, dtype, fp8_max), at::reciprocal(scale)};
  }
  const at::Tensor amax = amax_of(t);
  if (recipe.scaling == Fp8Scaling::kCurrent) {
    const at::Tensor scale = scale_from(amax, fp8_max, recipe.margin, at::ones({}, amax.options()));
    return Quantized{cast(t, scale, dtype, fp8_max), at::reciprocal(scale)};
  }
  at::Tensor scale = meta.scale.select(0, column);
  Quantized q{cast(t, scale, dtype, fp8_max), at::reciprocal(scale)};
  at::Tensor col = meta.amax_history.select(1, column);
  if (col.size(0) > 1) col.copy_(at::roll(col, {1}, {0}));
  col.select(0, 0).copy_(amax);
  if (meta.hold_scale) return q;  // Note [Amax reduced across ranks]: set after the reduction
  rescale(col, scale, fp8_max, recipe);
  return q;
}

bool check_not_recomputing(const std::string& module, const Fp8State& state, bool ran_fp8,
                           bool ran_without_fp8) {
  // Neither rule can apply to a forward without FP8 of a module that never ran in FP8.
  if (!state.enabled && !ran_fp8) return false;
  if (!at::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() == -1) return false;
  DWGRAPH_CHECK_ARG(!state.enabled || state.recipe.scaling != Fp8Scaling::kDelayed, module,
                    ": an FP8 forward with delayed scaling ran inside a backward pass with grad mode on (torch.utils."
                    "checkpoint's recomputation); it would quantize with scales moved since the forward and move the "
                    "scaling state a second time, giving other gradients and scales than without checkpoint. Keep FP8 "
                    "modules with delayed scaling outside torch.utils.checkpoint (LayerNormMLP(checkpoint=True) "
                    "recomputes with its forward's scales), or use Float8CurrentScaling");
  DWGRAPH_CHECK_ARG(state.enabled || !ran_fp8, module,
                    ": a forward without FP8 ran inside a backward pass with grad mode on (torch.utils.checkpoint's "
                    "recomputation) in a module that has run forwards in FP8; the recomputation cannot tell whether "
                    "its forward was one of them, and would recompute in high precision what the forward may have "
                    "computed in FP8, giving other gradients. Run the backward inside the same fp8_autocast as the "
                    "forward with use_reentrant=False (on CUDA autograd runs a reentrant checkpoint's recomputation "
                    "on its own thread, outside the caller's fp8_autocast), or keep FP8 modules outside "
                    "torch.utils.checkpoint");
  DWGRAPH_CHECK_ARG(!state.enabled || !ran_without_fp8, module,
                    ": an FP8 forward ran inside a backward pass with grad mode on (torch.utils.checkpoint's "
                    "recomputation) in a module that has run forwards without FP8; the recomputation cannot tell "
                    "whether its forward was one of them, and would quantize what the forward may have computed in "
                    "high precision, giving other gradients. Run the forward and the backward under the same "
                    "fp8_autocast, and every forward of a checkpointed module in FP8");
  return true;
}

void update_scales(const Fp8Meta& meta, const Fp8Recipe& recipe) {
  DWGRAPH_CHECK_ARG(recipe.scaling == Fp8Scaling::kDelayed && meta.defined(),
                    "dwgraph.fp8: only delayed scaling keeps scales to update, got ", recipe.describe());
  for (int64_t c = 0; c < meta.scale.size(0); ++c) {
    const double fp8_max = max_of(c % kRoles == kGradOutput ? recipe.backward_dtype() : recipe.forward_dtype());
    rescale(meta.amax_history.select(1, c), meta.scale.select(0, c), fp8_max, recipe);
  }
}

void check_weight_cache(const std::string& module, const std::string& name, const Fp8WeightCache& cache,
                        const at::Tensor& w, const Fp8Recipe& recipe) {
  DWGRAPH_CHECK_ARG(cache.data.defined() && cache.data.sizes() == w.sizes() &&
                        cache.data.scalar_type() == recipe.forward_dtype() && cache.data.is_contiguous() &&
                        cache.data.device() == w.device(),
                    module, ": the FP8 weight cache of '", name, "' must be a contiguous ", recipe.forward_dtype(), " ",
                    w.sizes(), " tensor on ", w.device(), ", got ",
                    cache.data.defined() ? cache.data.sizes() : at::IntArrayRef{});
  DWGRAPH_CHECK_ARG(cache.scale_inv.defined() && cache.scale_inv.dim() == 0 &&
                        cache.scale_inv.scalar_type() == at::kFloat,
                    module, ": the FP8 weight cache of '", name, "' needs a float32 0-dim scale_inv");
  DWGRAPH_CHECK_ARG(cache.host_first.has_value() || (cache.first.defined() && cache.first.dim() == 0 &&
                                                     cache.first.scalar_type() == at::kBool),
                    module, ": the FP8 weight cache of '", name, "' needs a bool 0-dim first-microbatch flag");
}

Quantized quantize_weight(const at::Tensor& w, const Fp8Recipe& recipe, const Fp8Meta& meta, int64_t column,
                          const Fp8WeightCache& cache) {
  if (!cache.defined()) return quantize(w, recipe.forward_dtype(), recipe, meta, column);
  if (cache.host_first.has_value()) {
    if (!*cache.host_first) return Quantized{cache.data.clone(), cache.scale_inv.clone()};
    Quantized q = quantize(w, recipe.forward_dtype(), recipe, meta, column);
    cache.data.copy_(q.data);
    cache.scale_inv.copy_(q.scale_inv);
    return q;
  }
  // In a graph: quantize, then keep the fresh results only where `first` holds.
  const bool delayed = recipe.scaling == Fp8Scaling::kDelayed;
  at::Tensor col, scale, old_col, old_scale;
  if (delayed) {
    col = meta.amax_history.select(1, column);
    scale = meta.scale.select(0, column);
    old_col = col.clone();
    old_scale = scale.clone();
  }
  const Quantized q = quantize(w, recipe.forward_dtype(), recipe, meta, column);
  if (delayed) {
    col.copy_(at::where(cache.first, col, old_col));
    scale.copy_(at::where(cache.first, scale, old_scale));
  }
  // Selected as bytes: where() on FP8 elements is not available on every backend.
  const at::Tensor data =
      at::where(cache.first, q.data.view(at::kByte), cache.data.view(at::kByte)).view(cache.data.scalar_type());
  const at::Tensor scale_inv = at::where(cache.first, q.scale_inv, cache.scale_inv);
  cache.data.copy_(data);
  cache.scale_inv.copy_(scale_inv);
  return Quantized{data, scale_inv};
}

Quantized t(const Quantized& a) { return Quantized{a.data.t(), a.scale_inv}; }

at::Tensor mm(const Quantized& a, const Quantized& b) {
  at::Tensor x = a.data;
  at::Tensor y = b.data;
  if (x.is_cuda()) {
    // cuBLASLt's FP8 GEMM: a row-major, b column-major, inner and outer sizes multiples of 16.
    DWGRAPH_CHECK_ARG(x.size(1) % 16 == 0 && y.size(1) % 16 == 0, "dwgraph fp8: CUDA FP8 GEMMs need K and N "
                      "multiples of 16 (cuBLASLt), got a ", x.sizes(), " by ", y.sizes(), " product");
    if (!x.is_contiguous()) x = x.contiguous();
    if (!(y.stride(0) == 1 && y.stride(1) == y.size(0))) y = y.t().contiguous().t();
  }
  return at::_scaled_mm(x, y, a.scale_inv, b.scale_inv, std::nullopt, std::nullopt, at::kFloat);
}

}  // namespace fp8
}  // namespace dwgraph::ops
