#pragma once
// FP8 training for dwgraph's GEMMs (issue 25): recipes, the calling thread's fp8_autocast
// state, per-tensor quantization and the scaling-state update, all as tensor ops.
//
// Note [FP8 scaling state lives in tensors]: a delayed-scaling module keeps its state in
// two FP32 buffers, amax_history [history_len, 3 * gemms] (row 0 the newest) and scale
// [3 * gemms]; column 3 * g + role belongs to GEMM g's input (role 0), weight (1) and
// output gradient (2). Each quantization of a tensor (each forward for the input and
// weight, each backward for the output gradient)
//   1. quantizes with scale[c] as it stands (set by earlier calls),
//   2. rolls column c of the history by one and writes amax(|t|) into row 0,
//   3. sets scale[c] = fp8_max / reduce(history[:, c]) / 2^margin (reduce: max over the
//      history, or row 0 for "most_recent"), keeping the old scale where that amax is 0
//      or not finite.
// Every step is an ATen op on those buffers: nothing is read back to the host, so a
// captured graph replays the bookkeeping with the GEMMs (TransformerEngine's graphs do it
// eagerly after each replay). Current scaling keeps no state: each tensor's scale comes
// from its own amax just before it is quantized.
//
// The GEMMs: operands quantized per tensor (E4M3 for the forward's input and weight; the
// output gradient E5M2 under HYBRID, E4M3 under E4M3), multiplied with at::_scaled_mm
// (ATen's CPU kernel, cuBLASLt FP8 on CUDA) into FP32, bias added in FP32, rounded once to
// the output dtype. The weight gradient's FP32 product accumulates into main_grad.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dwgraph::ops {

// TransformerEngine's recipe.Format: E4M3 everywhere, or HYBRID (E4M3 forward, E5M2 gradients).
enum class Fp8Format { kE4M3, kHybrid };
enum class Fp8Scaling { kDelayed, kCurrent };
enum class AmaxAlgo { kMax, kMostRecent };

struct Fp8Recipe {
  Fp8Scaling scaling = Fp8Scaling::kDelayed;
  Fp8Format format = Fp8Format::kHybrid;
  int64_t margin = 0;
  int64_t amax_history_len = 1024;  // delayed scaling only
  AmaxAlgo amax_compute_algo = AmaxAlgo::kMax;

  // TransformerEngine's DelayedScaling / Float8CurrentScaling; ArgumentError on a bad value.
  static Fp8Recipe delayed(Fp8Format format, int64_t margin, int64_t amax_history_len, const std::string& algo);
  static Fp8Recipe current(Fp8Format format, int64_t margin);

  bool operator==(const Fp8Recipe& o) const;
  bool operator!=(const Fp8Recipe& o) const { return !(*this == o); }
  // "DelayedScaling(fp8_format=HYBRID, margin=0, amax_history_len=16, amax_compute_algo='max')"
  std::string describe() const;

  // The FP8 dtype of the forward's operands and of the output gradient.
  at::ScalarType forward_dtype() const { return at::kFloat8_e4m3fn; }
  at::ScalarType backward_dtype() const {
    return format == Fp8Format::kHybrid ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn;
  }
};

// The calling thread's fp8_autocast state (dwgraph.fp8.fp8_autocast sets it). The modules'
// forwards read it, as they read torch.autocast's; a backward uses the recipe its forward
// saved, wherever it runs.
struct Fp8State {
  bool enabled = false;
  Fp8Recipe recipe;
  // Note [Amax reduced across ranks]: fp8_autocast(amax_reduction_group=...). Quantizations
  // record their amax in the history and keep the scales; dwgraph.fp8.reduce_amax, once per
  // step outside any graph, reduces the histories over the group and sets the scales
  // (update_scales), in eager and graphed code alike.
  bool amax_reduction = false;
  int64_t amax_group = 0;  // which group (Python's id of it): a state under another group is another state

  static Fp8State current();
  bool operator==(const Fp8State& o) const {
    return enabled == o.enabled && (!enabled || (recipe == o.recipe && amax_reduction == o.amax_reduction &&
                                                      amax_group == o.amax_group));
  }
  bool operator!=(const Fp8State& o) const { return !(*this == o); }
  std::string describe() const;  // "off", "on (DelayedScaling(...))"
};

// Sets the calling thread's FP8 state while alive and puts the previous one back.
class Fp8StateGuard {
 public:
  explicit Fp8StateGuard(const Fp8State& state);
  ~Fp8StateGuard();
  Fp8StateGuard(const Fp8StateGuard&) = delete;
  Fp8StateGuard& operator=(const Fp8StateGuard&) = delete;

 private:
  Fp8State saved_;
};

// Sets the calling thread's state and returns the previous one (the Python context
// manager's enter and exit; C++ callers use the guard).
Fp8State exchange_fp8_state(const Fp8State& state);

// Note [FP8 weight cache]: with cache_quantized_params (TransformerEngine's weight caching)
// a module quantizes its weight on a step's first microbatch and reuses that quantized
// weight on the others. The cache is the module's own (data, scale_inv), never process-wide
// state. Eager calls decide on the host (`host_first`: quantize and store, or reuse, with
// no work for the weight otherwise); inside a graph the decision is the module's 0-dim
// bool tensor `first`, written before each replay by the graphed callable from its
// is_first_microbatch argument: the graph quantizes, then selects the fresh or the cached
// weight and the updated or the old weight scaling state with at::where, so one captured
// graph serves both kinds of microbatch and the results equal the eager ones bitwise.
// Whether a reuse would be stale (the weight changed in place since the cache was filled)
// is checked by the caller, on the host, before the call.
struct Fp8WeightCache {
  at::Tensor data;       // FP8, the weight's shape
  at::Tensor scale_inv;  // FP32, 0-dim
  at::Tensor first;      // bool, 0-dim: read inside a graph when host_first is unset
  std::optional<bool> host_first;
  bool defined() const { return data.defined(); }
};

// A module's FP8 state: its delayed-scaling state (Note [FP8 scaling state lives in
// tensors]; undefined tensors under current scaling) and, with weight caching, one weight
// cache per GEMM (empty: no caching).
struct Fp8Meta {
  at::Tensor amax_history;  // [history_len, 3 * gemms], FP32
  at::Tensor scale;         // [3 * gemms], FP32
  std::vector<Fp8WeightCache> weight_cache;
  // Note [FP8 in a checkpoint's recomputation]: set only on the state a checkpointed
  // LayerNormMLP's backward recomputes its forward with: the scales its forward quantized
  // the inputs and weights with (a copy taken before that forward moved them). Those
  // quantizations read it and leave the state alone, so they give the forward's FP8
  // operands bit for bit and the state moves once per call, as without checkpoint; the
  // output gradients' quantizations update the state as always.
  at::Tensor recompute_scale;
  // Note [Amax reduced across ranks]: quantizations record their amax, the scale stays.
  bool hold_scale = false;
  bool defined() const { return scale.defined(); }
};

namespace fp8 {

constexpr int64_t kInput = 0, kWeight = 1, kGradOutput = 2, kRoles = 3;

// Zero history, unit scales for `gemms` GEMMs on `device` (the state of a module that has
// not quantized yet; TransformerEngine's initial state).
Fp8Meta make_meta(int64_t gemms, int64_t history_len, const at::Device& device);

// Checks that `meta` holds state for `gemms` GEMMs under `recipe` (ArgumentError naming
// `module` otherwise).
void check_meta(const std::string& module, const Fp8Meta& meta, const Fp8Recipe& recipe, int64_t gemms);

// The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2).
double max_of(at::ScalarType dtype);

// A tensor quantized per tensor: data (FP8, contiguous) and 1 / scale (FP32, 0-dim).
struct Quantized {
  at::Tensor data;
  at::Tensor scale_inv;
  bool defined() const { return data.defined(); }
};

// Quantizes `t` into `dtype` for column `column` of `meta` under `recipe`: delayed scaling
// uses meta's scale then updates the state (the three steps of the Note); current scaling
// scales by t's own amax. No host read either way.
Quantized quantize(const at::Tensor& t, at::ScalarType dtype, const Fp8Recipe& recipe, const Fp8Meta& meta,
                   int64_t column);

// The weight quantized through `cache` (Note [FP8 weight cache]); the returned tensors are
// fresh, so a later refresh of the cache never changes what an earlier forward's backward
// multiplies by.
Quantized quantize_weight(const at::Tensor& w, const Fp8Recipe& recipe, const Fp8Meta& meta, int64_t column,
                          const Fp8WeightCache& cache);

// Sets every column's scale from its (reduced) amax history under `recipe`, as a
// quantization does after recording: fp8_max of the column's role / reduce(history) / 2^margin,
// keeping the old scale where that amax is zero or not finite (Note [Amax reduced across ranks]).
void update_scales(const Fp8Meta& meta, const Fp8Recipe& recipe);

// Note [A forward recomputed inside a backward]: torch.utils.checkpoint (either kind) runs
// a module's forward again inside the backward, with grad mode on. Nothing links torch's
// two calls, and two recomputations give silently other results than the forward:
//  * under delayed scaling, one that quantizes with the scales the forward had just moved
//    and moves the state a second time (other weight gradients; a step later other scales);
//  * one without FP8 in a module that has run forwards in FP8 (the backward outside
//    fp8_autocast with use_reentrant=True, and on CUDA any reentrant one: autograd runs it on
//    its device thread, where the caller's fp8_autocast is not active): a high-precision
//    recomputation of what may have been an FP8 forward. Which forward a recomputation
//    repeats is not known, so the module's whole history counts (`ran_fp8`: a forward of it
//    ever ran in FP8, kept through reset_fp8_state(), which may come between a forward and
//    its backward; a flag of the last forward alone was cleared by an evaluation forward in
//    between, found by review); false where unknown. A module that once ran in FP8 is
//    therefore never recomputed without FP8.
// So a forward while an autograd graph task runs on the thread with grad mode on is refused
// in those two cases (ArgumentError naming `module`), before it writes anything; a forward
// from a backward hook runs with grad mode off and is not concerned. Current scaling depends
// only on the tensors: its recomputation quantizes bit for bit, and is allowed when every
// forward of the module ran in FP8 (`ran_without_fp8`: one ran without, ever: an FP8
// recomputation of a forward outside fp8_autocast would quantize what ran in high precision,
// found by review). So a module checkpointed under current scaling runs all its forwards in
// FP8, evaluation too.
// Returns whether this forward is a recomputation (one that is allowed): with weight caching
// it then reuses the copy its forward filled rather than deciding again (a first-microbatch
// flag would refill it, and a recomputation stopped early would leave it counted as
// unfilled).
bool check_not_recomputing(const std::string& module, const Fp8State& state, bool ran_fp8, bool ran_without_fp8);

// Checks that `cache` fits weight `w` (ArgumentError naming `module` and `name`).
void check_weight_cache(const std::string& module, const std::string& name, const Fp8WeightCache& cache,
                        const at::Tensor& w, const Fp8Recipe& recipe);

// FP32 a · b for quantized a [M, K] and b [K, N] (any strides): at::_scaled_mm with the
// operands' inverse scales, arranged as cuBLASLt needs them on CUDA.
at::Tensor mm(const Quantized& a, const Quantized& b);

// a.data transposed, still quantized with a's scale.
Quantized t(const Quantized& a);

}  // namespace fp8
}  // namespace dwgraph::ops
