#include "ops/linear.h"

#include "common/autograd_node.h"
#include "common/check.h"
#include "ops/autocast.h"
#include "ops/fp8.h"
#include "ops/gemm.h"
#include "ops/impl/wgrad_landing.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <array>
#include <type_traits>
#include <utility>

namespace dwgraph::ops {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

void check_config(const WgradConfig& cfg) {
  DWGRAPH_CHECK_ARG(!cfg.delay_wgrad_compute || cfg.store != nullptr, cfg.module_name,
                    ": delay_wgrad_compute=True needs a WgradStore, got none");
}

// `gemm_dtype`: the autocast dtype of the call (nullopt outside autocast).
void check_input(const WgradConfig& cfg, const at::Tensor& x, const at::Tensor& w, int64_t k,
                 std::optional<at::ScalarType> gemm_dtype) {
  DWGRAPH_CHECK_ARG(x.defined() && x.dim() >= 1 && x.size(-1) == k, cfg.module_name,
                    ": input must have in_features = ", k, " as its last dimension, got shape ",
                    x.defined() ? x.sizes() : at::IntArrayRef{});
  const at::ScalarType xt = autocast_operand_dtype(x, gemm_dtype);
  const at::ScalarType wt = autocast_operand_dtype(w, gemm_dtype);
  DWGRAPH_CHECK_ARG(xt == wt, cfg.module_name, ": input must have the weight's dtype ", w.scalar_type(), ", got ",
                    x.scalar_type(), gemm_dtype ? " (under autocast, where both would run in " : "",
                    gemm_dtype ? c10::toString(*gemm_dtype) : "", gemm_dtype ? ")" : "");
  DWGRAPH_CHECK_ARG(x.device() == w.device(), cfg.module_name, ": input must be on the weight's device ",
                    w.device(), ", got ", x.device());
}

// A weight gradient that lands later (deferred, or into main_grad) lands on a leaf
// parameter; a computed weight (torch.nn.utils.parametrize, weight_norm) must get its
// gradient through autograd, in the main backward. Checked when a backward may follow.
void check_leaf_parameters(const WgradConfig& cfg, const std::vector<WeightRefPtr>& weights,
                           const std::vector<WeightRefPtr>& biases) {
  if (!at::GradMode::is_enabled()) return;
  auto check = [&](const WeightRef& r, bool is_weight) {
    const bool later = cfg.delay_wgrad_compute || (is_weight && cfg.fuse_wgrad_accumulation);
    DWGRAPH_CHECK_ARG(!later || !r.param.requires_grad() || r.param.is_leaf(), cfg.module_name, ": parameter '",
                      r.name, "' is computed by autograd (a parametrization such as torch.nn.utils.parametrize or "
                      "weight_norm makes it a non-leaf tensor), so its gradient must flow back through that "
                      "computation in the main backward, but ",
                      cfg.delay_wgrad_compute ? "delay_wgrad_compute=True defers it to backward_dw()"
                                              : "fuse_wgrad_accumulation=True accumulates it into main_grad",
                      ", which can only land on a leaf parameter. Build this module with delay_wgrad_compute=False "
                      "and fuse_wgrad_accumulation=False (its gradient then flows through the parametrization), or "
                      "remove the parametrization");
  };
  for (const auto& w : weights) check(*w, true);
  for (const auto& b : biases) check(*b, false);
}

void check_fused_weights(const WgradConfig& cfg, const std::vector<WeightRefPtr>& weights) {
  if (!cfg.fuse_wgrad_accumulation) return;
  for (const auto& w : weights) {
    if (!w->finalize) detail::check_main_grad(*w, cfg.module_name);
  }
}

// The GEMMs run on plain tensors, below autograd (our node is the only history) and
// below autocast (operands are cast to the call's autocast dtype explicitly).
struct BelowAutograd {
  at::AutoDispatchBelowADInplaceOrView guard;
  NoAutocast no_autocast;
};

// wgrad_gemm writes FP32 or its operands' dtype. Any other gradient buffer (an FP16
// parameter's under a BF16 autocast region) takes the product through an FP32 buffer.
template <class Gemm>
void wgrad_into(at::ScalarType operands, const at::Tensor& out, bool accumulate, const at::Tensor& bias_out,
                Gemm&& gemm) {
  auto direct = [&](const at::Tensor& t) {
    return !t.defined() || t.scalar_type() == at::kFloat || t.scalar_type() == operands;
  };
  if (direct(out) && direct(bias_out)) {
    gemm(out, accumulate, bias_out);
    return;
  }
  const at::Tensor o = direct(out) ? out
                                   : (accumulate ? out.to(at::kFloat) : at::empty(out.sizes(), out.options().dtype(at::kFloat)));
  const at::Tensor b = direct(bias_out) ? bias_out : at::empty(bias_out.sizes(), bias_out.options().dtype(at::kFloat));
  gemm(o, accumulate, b);
  if (!o.is_same(out)) out.copy_(o);
  if (b.defined() && !b.is_same(bias_out)) bias_out.copy_(b);
}

std::optional<at::Tensor> maybe(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }

// Throws unless each fused weight's main_grad is still the buffer the forward bound (a
// replaced one would take the gradient unseen; putting the old one back fixes it).
void check_main_grads(const std::string& module, const std::vector<WeightRefPtr>& weights) {
  for (const auto& w : weights) {
    if (!w->main_grad.has_value() || !w->current_main_grad) continue;
    const std::optional<at::Tensor> now = w->current_main_grad();
    const at::Tensor& then = *w->main_grad;
    // The same memory seen through another tensor object (a re-taken view) is the same buffer.
    const bool same = now.has_value() && now->defined() && now->data_ptr() == then.data_ptr() &&
                      now->sizes() == then.sizes() && now->strides() == then.strides() &&
                      now->scalar_type() == then.scalar_type() && now->device() == then.device();
    DWGRAPH_CHECK_STATE(same, module,
                        ": main_grad of parameter '", w->name,
                        "' was replaced after the forward; its gradient would accumulate into the old buffer. "
                        "Put the forward's main_grad back, and replace it only with no work queued");
  }
}

// Throws unless the saved input and output gradient are unchanged since the backward:
// eager autograd computed the weight gradient from them then.
void check_not_stale(const std::string& module, const at::Tensor& x, int64_t x_version, const at::Tensor& dy,
                     int64_t dy_version) {
  DWGRAPH_CHECK_STATE(x._version() == x_version, module,
                      ".backward_dw(): the input this weight gradient is computed from was modified in place "
                      "after the backward (version ", x_version, ", now ", x._version(),
                      "), so eager's gradient cannot be computed any more; this backward's weight-gradient "
                      "work is dropped. Run backward_dw() before reusing the input's memory");
  DWGRAPH_CHECK_STATE(dy._version() == dy_version, module,
                      ".backward_dw(): the output gradient this weight gradient is computed from was modified "
                      "in place after the backward (version ", dy_version, ", now ", dy._version(),
                      "); this backward's weight-gradient work is dropped. Run backward_dw() before changing it");
}

// The shared part of the single and grouped backward: input gradient now, weight
// gradients now or queued.
class DeferredGemmNode : public torch::autograd::Node {
 public:
  DeferredGemmNode(WgradConfig cfg, std::vector<WeightRefPtr> weights, std::vector<WeightRefPtr> biases)
      : cfg_(std::move(cfg)), weights_(std::move(weights)), biases_(std::move(biases)) {}

  void release_variables() override { x_.reset_data(); }

  void save_input(const at::Tensor& x2d, std::vector<int64_t> x_sizes) {
    x_ = SavedVariable(x2d, /*is_output=*/false);
    x_sizes_ = std::move(x_sizes);
  }
  // Shapes of the weights the forward materialised (a distributed weight's parameter may
  // be a shard of it): the weight gradient has these.
  void set_weight_sizes(std::vector<std::vector<int64_t>> sizes) { weight_sizes_ = std::move(sizes); }
  // The forward's autocast dtype: the backward's GEMMs use the weights in it too.
  void set_gemm_dtype(std::optional<at::ScalarType> dtype) { gemm_dtype_ = dtype; }

 protected:
  // dx [M, K] from dy [M, N] and the weights materialised for backward.
  virtual at::Tensor dgrad(const at::Tensor& dy, const std::vector<at::Tensor>& w) = 0;
  // Weight gradient GEMM of weight ref `i` (or all weights for a packed grouped weight).
  virtual detail::WgradGemm wgrad_gemm_for(size_t i, const at::Tensor& dy, const at::Tensor& x) = 0;
  // Column sum of dy for bias `i` when the weight needs no gradient.
  virtual at::Tensor bias_only_grad(size_t i, const at::Tensor& dy) = 0;
  // Called once per backward with the output gradient, before any GEMM (an FP8 node
  // quantizes it here, once for dgrad and wgrad).
  virtual void begin_backward(const at::Tensor& /*dy*/) {}
  // The weights dgrad multiplies by: those materialised for backward, in the forward's
  // autocast dtype.
  virtual std::vector<at::Tensor> weights_for_dgrad() {
    std::vector<at::Tensor> wb;
    wb.reserve(weights_.size());
    for (const auto& w : weights_) wb.push_back(autocast_operand(w->for_backward(), gemm_dtype_).contiguous());
    return wb;
  }
  // The output gradient queued weight-gradient work keeps (checked for in-place changes).
  virtual at::Tensor wgrad_grad_output(const at::Tensor& dy) { return dy; }

  variable_list apply(variable_list&& grads) override {
    // The forward's precision, whatever autocast region the backward runs in.
    const NoAutocast no_autocast;
    const size_t nw = weights_.size();
    variable_list out(1 + nw + biases_.size());
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return out;
    const int64_t n = grad.size(-1);
    const at::Tensor dy = grad.reshape({-1, n}).contiguous();
    // Unpacking applies the saved-tensor hooks to the activation; the weights are ours.
    const at::Tensor x = x_.unpack();

    begin_backward(dy);
    if (task_should_compute_output(0)) out[0] = dgrad(dy, weights_for_dgrad()).view(x_sizes_);

    // Only what the engine asked for: a backward for the inputs alone (torch.autograd.grad
    // w.r.t. activations, as pipelining's shape inference and dI step run) has no weight
    // work, and queues no unit that a later backward_dw() would mistake for its own.
    std::vector<bool> need_w(nw), need_b(biases_.size());
    for (size_t i = 0; i < nw; ++i) need_w[i] = task_should_compute_output(1 + i);
    for (size_t i = 0; i < biases_.size(); ++i) need_b[i] = task_should_compute_output(1 + nw + i);

    // The GEMM closures hold the tensors the weight-gradient work needs (not this node),
    // so queued work keeps dy and x alive and nothing else.
    const bool deferred = cfg_.delay_wgrad_compute;
    std::vector<detail::WgradGemm> gemms(nw);
    std::vector<at::Tensor> bias_only(nw);
    bool any_work = false;
    for (size_t i = 0; i < nw; ++i) {
      if (need_w[i]) {
        gemms[i] = wgrad_gemm_for(i, dy, x);
        any_work = true;
      } else if (biases_.size() == nw && need_b[i]) {
        bias_only[i] = bias_only_grad(i, dy);  // frozen weight: just the column sum
        any_work = true;
      }
    }
    if (!any_work) return out;
    auto check = [module = cfg_.module_name, weights = weights_] { check_main_grads(module, weights); };
    const at::Tensor kept_dy = wgrad_grad_output(dy);
    auto stale = [module = cfg_.module_name, x, xv = x._version(), dy = kept_dy, dv = kept_dy._version()] {
      check_not_stale(module, x, xv, dy, dv);
    };
    auto work = [cfg = cfg_, weights = weights_, biases = biases_, need_b, gemms = std::move(gemms),
                 bias_only = std::move(bias_only), sizes = weight_sizes_](bool land, variable_list* result) {
      const size_t nw = weights.size();
      for (size_t i = 0; i < nw; ++i) {
        const WeightRef* bias = (biases.size() == nw && need_b[i]) ? biases[i].get() : nullptr;
        detail::WgradResult r;
        if (gemms[i]) {
          r = detail::compute_wgrad(*weights[i], bias, gemms[i], land, cfg.module_name, sizes[i]);
        } else if (bias != nullptr) {
          r.bias = bias_only[i];
          if (land) {
            detail::land_grad(bias->param, r.bias, cfg.module_name + ": parameter '" + bias->name + "'");
          }
        }
        if (result != nullptr) {
          (*result)[1 + i] = r.weight;
          if (bias != nullptr) (*result)[1 + nw + i] = r.bias;
        }
      }
    };
    if (deferred) {
      cfg_.store->push(
          cfg_.unit_id, cfg_.source != nullptr ? cfg_.source : this,
          [work = std::move(work)] {
            // backward_dw() runs outside the autograd engine, maybe with grad mode or autocast on.
            const at::NoGradGuard no_grad;
            const NoAutocast no_autocast;
            work(true, nullptr);
          },
          std::move(check), std::move(stale));
    } else {
      check();
      work(false, &out);
    }
    return out;
  }

  WgradConfig cfg_;
  std::vector<WeightRefPtr> weights_;
  std::vector<WeightRefPtr> biases_;
  SavedVariable x_;
  std::vector<int64_t> x_sizes_;
  std::vector<std::vector<int64_t>> weight_sizes_;
  std::optional<at::ScalarType> gemm_dtype_;
};

class LinearBackward final : public DeferredGemmNode {
 public:
  using DeferredGemmNode::DeferredGemmNode;
  std::string name() const override { return "dwgraph::LinearBackward"; }

 protected:
  at::Tensor dgrad(const at::Tensor& dy, const std::vector<at::Tensor>& w) override {
    return dgrad_gemm(dy, w[0]);
  }
  detail::WgradGemm wgrad_gemm_for(size_t, const at::Tensor& dy, const at::Tensor& x) override {
    return [dy, x](const at::Tensor& out, bool accumulate, const at::Tensor& bias_out) {
      wgrad_into(dy.scalar_type(), out, accumulate, bias_out, [&](at::Tensor o, bool acc, const at::Tensor& b) {
        wgrad_gemm(dy, x, o, acc, maybe(b));
      });
    };
  }
  at::Tensor bias_only_grad(size_t i, const at::Tensor& dy) override {
    return at::sum(dy, {0}, false, biases_[i]->param.scalar_type());
  }
};

// Writes an FP32 weight-gradient product into `out`, or adds it: in FP32 into an FP32 buffer
// (main_grad), else in FP32 then rounded once.
void write_product(const at::Tensor& out, const at::Tensor& p, bool accumulate) {
  if (!accumulate) {
    out.copy_(p);
  } else if (out.scalar_type() == at::kFloat) {
    out.add_(p);
  } else {
    out.copy_(at::add(out.to(at::kFloat), p));
  }
}

// Note [FP8 Linear]: under fp8_autocast the forward quantizes its input and weight
// (E4M3) with the module's scaling state (ops/fp8.h) and multiplies them in FP8 into FP32.
// The node keeps the quantized input (as its saved activation, so saved-tensor hooks see
// it) and the quantized weight, never their high-precision forms; its backward quantizes
// the output gradient once (E5M2 under HYBRID) for both dgrad (dyq · wq) and the weight
// gradient (dyqᵀ · xq), which a deferred unit keeps in FP8 until backward_dw(). The bias
// gradient is the column sum of the unquantized output gradient, computed in the backward
// and kept as [N] FP32 by a deferred unit.
class Fp8LinearBackward final : public DeferredGemmNode {
 public:
  Fp8LinearBackward(WgradConfig cfg, std::vector<WeightRefPtr> weights, std::vector<WeightRefPtr> biases,
                    Fp8Recipe recipe, Fp8Meta meta, int64_t column0, at::Tensor x_scale_inv, fp8::Quantized wq,
                    at::ScalarType dx_dtype)
      : DeferredGemmNode(std::move(cfg), std::move(weights), std::move(biases)),
        recipe_(recipe),
        meta_(std::move(meta)),
        column0_(column0),
        x_scale_inv_(std::move(x_scale_inv)),
        wq_(std::move(wq)),
        dx_dtype_(dx_dtype) {}
  std::string name() const override { return "dwgraph::Fp8LinearBackward"; }
  void release_variables() override {
    DeferredGemmNode::release_variables();
    wq_ = {};
    dyq_ = {};
    dbias_ = at::Tensor();
  }

 protected:
  void begin_backward(const at::Tensor& dy) override {
    dyq_ = fp8::quantize(dy, recipe_.backward_dtype(), recipe_, meta_, column0_ + fp8::kGradOutput);
    dbias_ = biases_.empty() ? at::Tensor() : at::sum(dy, {0}, false, at::kFloat);
  }
  std::vector<at::Tensor> weights_for_dgrad() override { return {}; }
  at::Tensor wgrad_grad_output(const at::Tensor&) override { return dyq_.data; }
  at::Tensor dgrad(const at::Tensor&, const std::vector<at::Tensor>&) override {
    DWGRAPH_CHECK_STATE(wq_.defined(), cfg_.module_name, ": the FP8 backward ran a second time without "
                        "retain_graph=True; its quantized weight was released");
    return fp8::mm(dyq_, wq_).to(dx_dtype_);
  }
  detail::WgradGemm wgrad_gemm_for(size_t, const at::Tensor&, const at::Tensor& x) override {
    return [dyq = fp8::t(dyq_), xq = fp8::Quantized{x, x_scale_inv_}, dbias = dbias_](
               const at::Tensor& out, bool accumulate, const at::Tensor& bias_out) {
      write_product(out, fp8::mm(dyq, xq), accumulate);
      if (bias_out.defined()) bias_out.copy_(dbias);
    };
  }
  at::Tensor bias_only_grad(size_t i, const at::Tensor& dy) override {
    return at::sum(dy, {0}, false, biases_[i]->param.scalar_type());
  }

 private:
  Fp8Recipe recipe_;
  Fp8Meta meta_;
  int64_t column0_;
  at::Tensor x_scale_inv_;
  fp8::Quantized wq_;
  at::ScalarType dx_dtype_;
  fp8::Quantized dyq_;
  at::Tensor dbias_;
};

class GroupedLinearBackward : public DeferredGemmNode {
 public:
  GroupedLinearBackward(WgradConfig cfg, std::vector<WeightRefPtr> weights,
                        std::vector<WeightRefPtr> biases, std::vector<int64_t> m_splits)
      : DeferredGemmNode(std::move(cfg), std::move(weights), std::move(biases)),
        m_splits_(std::move(m_splits)) {
    offsets_.push_back(0);
    for (int64_t m : m_splits_) offsets_.push_back(offsets_.back() + m);
  }
  std::string name() const override { return "dwgraph::GroupedLinearBackward"; }

 protected:
  bool packed() const { return weights_.size() == 1 && weights_[0]->param.dim() == 3; }
  at::Tensor rows(const at::Tensor& t, size_t g) const {
    return t.narrow(0, offsets_[g], offsets_[g + 1] - offsets_[g]);
  }

  at::Tensor dgrad(const at::Tensor& dy, const std::vector<at::Tensor>& w) override {
    return packed() ? grouped_dgrad_gemm(dy, w[0], m_splits_) : grouped_dgrad_gemm(dy, at::TensorList(w), m_splits_);
  }
  detail::WgradGemm wgrad_gemm_for(size_t i, const at::Tensor& dy, const at::Tensor& x) override {
    if (packed()) {
      return [dy, x, splits = m_splits_](const at::Tensor& out, bool accumulate, const at::Tensor& bias_out) {
        wgrad_into(dy.scalar_type(), out, accumulate, bias_out, [&](at::Tensor o, bool acc, const at::Tensor& b) {
          grouped_wgrad_gemm(dy, x, o, splits, acc, maybe(b));
        });
      };
    }
    return [dy = rows(dy, i), x = rows(x, i)](const at::Tensor& out, bool accumulate, const at::Tensor& bias_out) {
      wgrad_into(dy.scalar_type(), out, accumulate, bias_out, [&](at::Tensor o, bool acc, const at::Tensor& b) {
        wgrad_gemm(dy, x, o, acc, maybe(b));
      });
    };
  }
  at::Tensor bias_only_grad(size_t i, const at::Tensor& dy) override {
    const at::ScalarType dtype = biases_[i]->param.scalar_type();
    if (!packed()) return at::sum(rows(dy, i), {0}, false, dtype);
    std::vector<at::Tensor> sums;
    for (size_t g = 0; g < m_splits_.size(); ++g) sums.push_back(at::sum(rows(dy, g), {0}, false, dtype));
    return at::stack(sums);
  }

  std::vector<int64_t> m_splits_;
  std::vector<int64_t> offsets_;
};

// A tensor's row groups, each quantized per tensor with its own scale (GEMM g's column),
// the FP8 rows concatenated.
struct GroupedQuantized {
  at::Tensor data;
  std::vector<at::Tensor> scale_inv;
  fp8::Quantized group(const std::vector<int64_t>& offsets, size_t g) const {
    return fp8::Quantized{data.narrow(0, offsets[g], offsets[g + 1] - offsets[g]), scale_inv[g]};
  }
};

GroupedQuantized quantize_groups(const at::Tensor& t, const std::vector<int64_t>& offsets, at::ScalarType dtype,
                                 const Fp8Recipe& recipe, const Fp8Meta& meta, int64_t role) {
  GroupedQuantized out;
  std::vector<at::Tensor> parts;
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    fp8::Quantized q = fp8::quantize(t.narrow(0, offsets[g], offsets[g + 1] - offsets[g]), dtype, recipe, meta,
                                     fp8::kRoles * static_cast<int64_t>(g) + role);
    parts.push_back(q.data);
    out.scale_inv.push_back(q.scale_inv);
  }
  out.data = parts.size() == 1 ? parts[0] : at::cat(parts, 0);
  return out;
}

// Per group g: out rows of group g = a_g · b_g (FP32), [rows, cols].
at::Tensor grouped_products(const GroupedQuantized& a, const std::vector<fp8::Quantized>& b,
                            const std::vector<int64_t>& offsets, int64_t cols) {
  at::Tensor out = at::zeros({offsets.back(), cols}, a.data.options().dtype(at::kFloat));
  for (size_t g = 0; g < b.size(); ++g) {
    if (offsets[g + 1] == offsets[g]) continue;
    out.narrow(0, offsets[g], offsets[g + 1] - offsets[g]).copy_(fp8::mm(a.group(offsets, g), b[g]));
  }
  return out;
}

// Note [FP8 Linear], per group: group g's rows, weight and output-gradient rows use GEMM g's
// three columns of the scaling state.
class Fp8GroupedLinearBackward final : public GroupedLinearBackward {
 public:
  Fp8GroupedLinearBackward(WgradConfig cfg, std::vector<WeightRefPtr> weights, std::vector<WeightRefPtr> biases,
                           std::vector<int64_t> m_splits, Fp8Recipe recipe, Fp8Meta meta,
                           std::vector<at::Tensor> x_scale_inv, std::vector<fp8::Quantized> wq, at::ScalarType dx_dtype)
      : GroupedLinearBackward(std::move(cfg), std::move(weights), std::move(biases), std::move(m_splits)),
        recipe_(recipe),
        meta_(std::move(meta)),
        x_scale_inv_(std::move(x_scale_inv)),
        wq_(std::move(wq)),
        dx_dtype_(dx_dtype) {}
  std::string name() const override { return "dwgraph::Fp8GroupedLinearBackward"; }
  void release_variables() override {
    GroupedLinearBackward::release_variables();
    wq_.clear();
    dyq_ = {};
    dbias_.clear();
  }

 protected:
  void begin_backward(const at::Tensor& dy) override {
    dyq_ = quantize_groups(dy, offsets_, recipe_.backward_dtype(), recipe_, meta_, fp8::kGradOutput);
    dbias_.clear();
    if (!biases_.empty()) {
      for (size_t g = 0; g < m_splits_.size(); ++g) dbias_.push_back(at::sum(rows(dy, g), {0}, false, at::kFloat));
    }
  }
  std::vector<at::Tensor> weights_for_dgrad() override { return {}; }
  at::Tensor wgrad_grad_output(const at::Tensor&) override { return dyq_.data; }
  at::Tensor dgrad(const at::Tensor&, const std::vector<at::Tensor>&) override {
    DWGRAPH_CHECK_STATE(!wq_.empty(), cfg_.module_name, ": the FP8 backward ran a second time without "
                        "retain_graph=True; its quantized weights were released");
    return grouped_products(dyq_, wq_, offsets_, wq_[0].data.size(1)).to(dx_dtype_);
  }
  detail::WgradGemm wgrad_gemm_for(size_t i, const at::Tensor&, const at::Tensor& x) override {
    const GroupedQuantized xq{x, x_scale_inv_};
    // The groups this closure computes: all of a packed weight's, or weight i's.
    std::vector<size_t> groups;
    if (packed()) {
      for (size_t g = 0; g < m_splits_.size(); ++g) groups.push_back(g);
    } else {
      groups.push_back(i);
    }
    std::vector<fp8::Quantized> dys, xs;
    std::vector<at::Tensor> dbias;
    for (size_t g : groups) {
      dys.push_back(fp8::t(dyq_.group(offsets_, g)));
      xs.push_back(xq.group(offsets_, g));
      if (!dbias_.empty()) dbias.push_back(dbias_[g]);
    }
    return [dys, xs, dbias, packed = packed()](const at::Tensor& out, bool accumulate, const at::Tensor& bias_out) {
      for (size_t k = 0; k < dys.size(); ++k) {
        const at::Tensor o = packed ? out.select(0, static_cast<int64_t>(k)) : out;
        if (dys[k].data.size(1) == 0) {  // an empty group: a zero product
          if (!accumulate) o.zero_();
        } else {
          write_product(o, fp8::mm(dys[k], xs[k]), accumulate);
        }
        if (bias_out.defined()) (packed ? bias_out.select(0, static_cast<int64_t>(k)) : bias_out).copy_(dbias[k]);
      }
    };
  }

 private:
  Fp8Recipe recipe_;
  Fp8Meta meta_;
  std::vector<at::Tensor> x_scale_inv_;
  std::vector<fp8::Quantized> wq_;
  at::ScalarType dx_dtype_;
  GroupedQuantized dyq_;
  std::vector<at::Tensor> dbias_;
};

// `x`: the GEMM's input as autograd sees it (after its autocast cast, which autograd
// differentiates back to the caller's dtype).
template <class NodeT, class... Extra>
void connect(const at::Tensor& y, const at::Tensor& x, const at::Tensor& x2d, const WgradConfig& cfg,
             std::optional<at::ScalarType> gemm_dtype, const std::vector<WeightRefPtr>& weights,
             const std::vector<at::Tensor>& materialized, const std::vector<WeightRefPtr>& biases,
             Extra&&... extra) {
  std::vector<const at::Tensor*> inputs = {&x};
  for (const auto& w : weights) inputs.push_back(&w->differentiated());
  for (const auto& b : biases) inputs.push_back(&b->differentiated());
  bool needs_grad = false;
  if (at::GradMode::is_enabled()) {
    for (const auto* t : inputs) needs_grad = needs_grad || (t->defined() && t->requires_grad());
  }
  if (!needs_grad) {
    // Nothing will call backward, so no unit is queued either.
    return;
  }
  auto node = dwgraph::detail::make_node<NodeT>(cfg, weights, biases, std::forward<Extra>(extra)...);
  dwgraph::detail::NodePtr base = node;
  torch::autograd::edge_list edges;
  for (const auto* t : inputs) edges.push_back(torch::autograd::impl::gradient_edge(*t));
  // An input that does not require grad gets an invalid edge (no gradient flows there).
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i]->requires_grad()) edges[i] = torch::autograd::Edge();
  }
  node->set_next_edges(std::move(edges));
  // The GEMM input was made below autograd; when it is x's memory it must also carry x's
  // version counter, so changing x in place before the backward is refused as for any
  // saved tensor (eager torch.nn.Linear refuses it too).
  if (x2d.is_alias_of(x)) torch::autograd::impl::set_version_counter(x2d, torch::autograd::impl::version_counter(x));
  node->save_input(x2d, x.sizes().vec());
  std::vector<std::vector<int64_t>> sizes;
  for (const auto& w : materialized) sizes.push_back(w.sizes().vec());
  node->set_weight_sizes(std::move(sizes));
  node->set_gemm_dtype(gemm_dtype);
  torch::autograd::set_history(y, base);
}

std::vector<WeightRefPtr> non_null(std::initializer_list<WeightRefPtr> refs) {
  std::vector<WeightRefPtr> r;
  for (const auto& p : refs) {
    if (p) r.push_back(p);
  }
  return r;
}

}  // namespace

namespace {

// Which FP8 state a GEMM of a module uses: the thread's fp8_autocast state when the forward
// ran, the module's scaling state and the GEMM's index in it.
struct Fp8Slot {
  Fp8State state;
  Fp8Meta meta;
  int64_t gemm = 0;
};

Fp8Slot fp8_slot(const std::string& module, const Fp8Meta& meta, int64_t gemms) {
  Fp8Slot slot{Fp8State::current(), meta, 0};
  if (slot.state.enabled) fp8::check_meta(module, meta, slot.state.recipe, gemms);
  (void)fp8::check_not_recomputing(module, slot.state, /*ran_fp8=*/false, /*ran_without_fp8=*/false);  // Note [A forward recomputed inside a backward]
  slot.meta.hold_scale = slot.state.enabled && slot.state.amax_reduction;  // Note [Amax reduced across ranks]
  return slot;
}

at::Tensor linear_impl(const at::Tensor& x, const WeightRefPtr& weight, const WeightRefPtr& bias,
                       const WgradConfig& cfg, const Fp8Slot& fp8) {
  check_config(cfg);
  DWGRAPH_CHECK_ARG(weight != nullptr && weight->param.defined() && weight->param.dim() == 2,
                    cfg.module_name, ": weight must be a 2-D [out_features, in_features] parameter");
  const at::Tensor& wp = weight->param;
  const auto gemm_dtype = autocast_gemm_dtype(x.device().type());
  check_input(cfg, x, wp, wp.size(1), gemm_dtype);
  check_leaf_parameters(cfg, {weight}, non_null({bias}));
  check_fused_weights(cfg, {weight});
  const at::Tensor xin = autocast_operand(x, gemm_dtype);
  at::Tensor w, x2d, y;
  if (fp8.state.enabled) {
    // Note [FP8 Linear].
    const Fp8Recipe& recipe = fp8.state.recipe;
    const int64_t c0 = fp8::kRoles * fp8.gemm;
    fp8::Quantized xq, wq;
    {
      BelowAutograd below;
      w = weight->for_forward();
      x2d = xin.reshape({-1, xin.size(-1)});
      xq = fp8::quantize(x2d, recipe.forward_dtype(), recipe, fp8.meta, c0 + fp8::kInput);
      if (fp8.meta.weight_cache.empty()) {
        wq = fp8::quantize(w, recipe.forward_dtype(), recipe, fp8.meta, c0 + fp8::kWeight);
      } else {
        const Fp8WeightCache& cache = fp8.meta.weight_cache[fp8.gemm];
        fp8::check_weight_cache(cfg.module_name, weight->name, cache, w, recipe);
        wq = fp8::quantize_weight(w, recipe, fp8.meta, c0 + fp8::kWeight, cache);
      }
      at::Tensor y32 = fp8::mm(xq, fp8::t(wq));
      if (bias) y32.add_(bias->param.to(at::kFloat));
      std::vector<int64_t> shape = xin.sizes().vec();
      shape.back() = w.size(0);
      y = y32.to(xin.scalar_type()).view(shape);
    }
    connect<Fp8LinearBackward>(y, xin, xq.data, cfg, gemm_dtype, {weight}, {w}, non_null({bias}), recipe,
                               fp8.meta, c0, xq.scale_inv, wq, xin.scalar_type());
    return y;
  }
  {
    BelowAutograd below;
    w = autocast_operand(weight->for_forward(), gemm_dtype).contiguous();
    x2d = xin.reshape({-1, xin.size(-1)}).contiguous();
    y = fwd_gemm(x2d, w, bias ? std::optional<at::Tensor>(autocast_operand(bias->param, gemm_dtype)) : std::nullopt);
    std::vector<int64_t> shape = xin.sizes().vec();
    shape.back() = w.size(0);
    y = y.view(shape);
  }
  connect<LinearBackward>(y, xin, x2d, cfg, gemm_dtype, {weight}, {w}, non_null({bias}));
  return y;
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const WeightRefPtr& weight, const WeightRefPtr& bias, const WgradConfig& cfg,
                  const Fp8Meta& fp8_meta) {
  return linear_impl(x, weight, bias, cfg, fp8_slot(cfg.module_name, fp8_meta, 1));
}

at::Tensor grouped_linear(const at::Tensor& x, const std::vector<int64_t>& m_splits,
                          const std::vector<WeightRefPtr>& weights,
                          const std::vector<WeightRefPtr>& biases, const WgradConfig& cfg, const Fp8Meta& fp8_meta) {
  check_config(cfg);
  DWGRAPH_CHECK_ARG(!weights.empty(), cfg.module_name, ": at least one weight is required");
  const bool packed = weights.size() == 1 && weights[0]->param.dim() == 3;
  const at::Tensor& w0 = weights[0]->param;
  // The group count of a packed weight is its first dimension, which a distributed weight's
  // parameter (a shard) does not hold whole.
  DWGRAPH_CHECK_ARG(!packed || !weights[0]->materialize_forward, cfg.module_name, ": the packed weight '",
                    weights[0]->name, "' is a DistributedWeight (a shard of shape ", w0.sizes(),
                    "); packed weights cannot be distributed: use packed_weights=False (one weight per group)");
  const int64_t groups = packed ? w0.size(0) : static_cast<int64_t>(weights.size());
  const auto gemm_dtype = autocast_gemm_dtype(x.device().type());
  check_input(cfg, x, w0, w0.size(-1), gemm_dtype);
  DWGRAPH_CHECK_ARG(x.dim() == 2, cfg.module_name, ": input must be 2-D [tokens, in_features], got shape ",
                    x.sizes());
  int64_t total = 0;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    // Checked here for both paths: the FP8 one slices the input by these offsets.
    DWGRAPH_CHECK_ARG(m_splits[g] >= 0, cfg.module_name, ": m_splits entry ", g, " must be >= 0, got ",
                      at::IntArrayRef(m_splits));
    total += m_splits[g];
  }
  DWGRAPH_CHECK_ARG(static_cast<int64_t>(m_splits.size()) == groups && total == x.size(0),
                    cfg.module_name, ": m_splits must have num_gemms = ", groups,
                    " entries summing to the batch (", x.size(0), " rows), got ", at::IntArrayRef(m_splits),
                    " (", m_splits.size(), " entries summing to ", total, ")");
  DWGRAPH_CHECK_ARG(biases.empty() || biases.size() == weights.size(), cfg.module_name,
                    ": expected one bias per weight (", weights.size(), "), got ", biases.size());
  check_leaf_parameters(cfg, weights, biases);
  check_fused_weights(cfg, weights);
  const at::Tensor xin = autocast_operand(x, gemm_dtype);
  at::Tensor y, x2d;
  std::vector<at::Tensor> w;
  const Fp8Slot fp8 = fp8_slot(cfg.module_name, fp8_meta, groups);
  if (fp8.state.enabled) {
    // Note [FP8 Linear], per group.
    const Fp8Recipe& recipe = fp8.state.recipe;
    std::vector<int64_t> offsets{0};
    for (int64_t m : m_splits) offsets.push_back(offsets.back() + m);
    GroupedQuantized xq;
    std::vector<fp8::Quantized> wq;
    {
      BelowAutograd below;
      for (const auto& r : weights) w.push_back(r->for_forward());
      x2d = xin.contiguous();
      xq = quantize_groups(x2d, offsets, recipe.forward_dtype(), recipe, fp8.meta, fp8::kInput);
      for (int64_t g = 0; g < groups; ++g) {
        const at::Tensor wg = packed ? w[0].select(0, g) : w[g];
        const int64_t column = fp8::kRoles * g + fp8::kWeight;
        if (fp8.meta.weight_cache.empty()) {
          wq.push_back(fp8::quantize(wg, recipe.forward_dtype(), recipe, fp8.meta, column));
        } else {
          const Fp8WeightCache& cache = fp8.meta.weight_cache[g];
          const std::string name = packed ? weights[0]->name + "[" + std::to_string(g) + "]" : weights[g]->name;
          fp8::check_weight_cache(cfg.module_name, name, cache, wg, recipe);
          wq.push_back(fp8::quantize_weight(wg, recipe, fp8.meta, column, cache));
        }
      }
      std::vector<fp8::Quantized> wt;
      for (const auto& q : wq) wt.push_back(fp8::t(q));
      at::Tensor y32 = grouped_products(xq, wt, offsets, wq[0].data.size(0));
      for (int64_t g = 0; g < groups && !biases.empty(); ++g) {
        const at::Tensor bg = packed ? biases[0]->param.select(0, g) : biases[g]->param;
        y32.narrow(0, offsets[g], offsets[g + 1] - offsets[g]).add_(bg.to(at::kFloat));
      }
      y = y32.to(xin.scalar_type());
    }
    connect<Fp8GroupedLinearBackward>(y, xin, xq.data, cfg, gemm_dtype, weights, w, biases, m_splits, recipe,
                                      fp8.meta, xq.scale_inv, wq, xin.scalar_type());
    return y;
  }
  {
    BelowAutograd below;
    for (const auto& r : weights) w.push_back(autocast_operand(r->for_forward(), gemm_dtype).contiguous());
    std::vector<at::Tensor> b;
    for (const auto& r : biases) b.push_back(autocast_operand(r->param, gemm_dtype));
    x2d = xin.contiguous();
    if (packed) {
      y = grouped_fwd_gemm(x2d, w[0], m_splits, biases.empty() ? std::nullopt : std::optional<at::Tensor>(b[0]));
    } else {
      y = grouped_fwd_gemm(x2d, at::TensorList(w), m_splits,
                           biases.empty() ? std::nullopt : std::optional<at::TensorList>(at::TensorList(b)));
    }
  }
  connect<GroupedLinearBackward>(y, xin, x2d, cfg, gemm_dtype, weights, w, biases, m_splits);
  return y;
}

void check_activation(const std::string& module, const std::string& activation) {
  DWGRAPH_CHECK_ARG(activation == "gelu" || activation == "gelu_tanh" || activation == "relu", module,
                    ": activation must be one of 'gelu', 'gelu_tanh', 'relu', got '", activation, "'");
}

void check_normalization(const std::string& module, const std::string& normalization) {
  DWGRAPH_CHECK_ARG(normalization == "LayerNorm" || normalization == "RMSNorm", module,
                    ": normalization must be 'LayerNorm' or 'RMSNorm', got '", normalization, "'");
}

namespace {

// The normalisation in front of a module's first GEMM: an ordinary autograd op, its weight
// (and LayerNorm's bias) plain references (Note [Weights are plain references]).
struct Norm {
  at::Tensor weight, bias;  // bias: undefined for RMSNorm
  double eps = 1e-5;
  bool rms = false;

  at::Tensor operator()(const at::Tensor& x) const {
    return rms ? at::rms_norm(x, {weight.size(0)}, weight, eps) : at::layer_norm(x, {weight.size(0)}, weight, bias, eps);
  }
};

// `width`: what the module calls the normalised width ("in_features", "hidden_size").
Norm make_norm(const std::string& module, const at::Tensor& x, const at::Tensor& ln_weight, const at::Tensor& ln_bias,
               double eps, const std::string& normalization, const char* width) {
  check_normalization(module, normalization);
  DWGRAPH_CHECK_ARG(ln_weight.defined() && ln_weight.dim() == 1, module,
                    ": layer_norm_weight must be a 1-D parameter, got ",
                    ln_weight.defined() ? ln_weight.sizes() : at::IntArrayRef{});
  DWGRAPH_CHECK_ARG(normalization == "LayerNorm" || !ln_bias.defined(), module,
                    ": RMSNorm has no bias, got a layer_norm_bias of shape ", ln_bias.defined() ? ln_bias.sizes()
                                                                                                : at::IntArrayRef{});
  DWGRAPH_CHECK_ARG(x.defined() && x.dim() >= 1 && x.size(-1) == ln_weight.size(0), module, ": input must have ",
                    width, " = ", ln_weight.size(0), " as its last dimension, got shape ",
                    x.defined() ? x.sizes() : at::IntArrayRef{});
  return Norm{ln_weight, ln_bias, eps, normalization == "RMSNorm"};
}

// The normalisation then the deferred-wgrad linear: (output, normalised input).
std::pair<at::Tensor, at::Tensor> norm_then_linear(const at::Tensor& x, const Norm& norm, const WeightRefPtr& weight,
                                                   const WeightRefPtr& bias, const WgradConfig& cfg,
                                                   const Fp8Slot& fp8) {
  at::Tensor h = norm(x);
  at::Tensor y = linear_impl(h, weight, bias, cfg, fp8);
  return {std::move(y), std::move(h)};
}

// Normalisation, fc1, activation, fc2: fc1 queues its work under `fc1_cfg`, fc2 under
// `fc2_cfg` (one config, outside a checkpoint's recomputation: fc2 shares fc1's unit, so one
// backward queues one unit for the module).
at::Tensor mlp_forward(const at::Tensor& x, const Norm& norm, const WeightRefPtr& fc1_weight,
                       const WeightRefPtr& fc1_bias, const std::string& activation, const WeightRefPtr& fc2_weight,
                       const WeightRefPtr& fc2_bias, const WgradConfig& fc1_cfg, const WgradConfig& fc2_cfg,
                       const Fp8Slot& fp8 = {}) {
  const at::Tensor a = norm_then_linear(x, norm, fc1_weight, fc1_bias, fc1_cfg, fp8).first;
  const at::Tensor act = activation == "relu" ? at::relu(a) : at::gelu(a, activation == "gelu_tanh" ? "tanh" : "none");
  Fp8Slot fc2 = fp8;
  fc2.gemm = 1;
  return linear_impl(act, fc2_weight, fc2_bias, fc2_cfg, fc2);
}

// An alias of `t` outside its autograd graph, a leaf requiring grad when `grad`, with the
// gradient dtype `t`'s accumulator expects (torch's grad_dtype).
at::Tensor detached_alias(const at::Tensor& t, bool grad) {
  at::Tensor a = t.detach();
  if (grad) {
    a.requires_grad_(true);
    if (t.is_leaf()) a.set_grad_dtype(t.grad_dtype());
  }
  return a;
}

// Note [Checkpointed LayerNormMLP]: with checkpoint=True the forward runs LayerNorm, fc1, the
// activation and fc2 without autograd and connects this one node, which saves the input
// alone (LayerNorm's statistics, fc1's output and the activation are not kept). Its backward
// recomputes the same composite (mlp_forward: the same kernels on the same values, hence the
// same activations bit for bit) with autograd on, under the forward's autocast state, and
// differentiates it with a nested autograd pass whose recomputed fc2 and fc1 nodes compute
// dgrad and return or queue their wgrads exactly as the non-checkpointed nodes do; the
// queued unit holds the recomputed activation (fc2's wgrad input) and LayerNorm output
// (fc1's). The recomputation runs on detached aliases of the input and the parameters: the
// nested pass captures their gradients without running the parameters' hooks, which run
// once, when this node hands the gradients to the outer backward, and gradients nobody
// asked for (torch.autograd.grad w.r.t. the input alone) are not computed or queued. The
// recomputed nodes live for one backward, so they queue their work under keys of this node:
// a second backward of a retained graph is a new unit, as with the non-checkpointed nodes.
class CheckpointedMLPBackward final : public torch::autograd::Node {
 public:
  // Edges, in order: x, layer_norm_weight, layer_norm_bias, fc1 weight, fc1 bias, fc2 weight,
  // fc2 bias (invalid where absent or not requiring grad).
  static constexpr size_t kInputs = 7;
  struct Parts {
    Norm norm;
    WeightRefPtr fc1_weight, fc1_bias, fc2_weight, fc2_bias;
    std::string activation;
    WgradConfig cfg;
    Fp8Slot fp8;  // the forward's FP8 state (Note [FP8 in a checkpoint's recomputation], ops/fp8.h)
  };

  CheckpointedMLPBackward(Parts parts, const at::Tensor& x)
      : parts_(std::move(parts)), x_(x, /*is_output=*/false), autocast_(AutocastState::current()) {
    for (size_t i = 0; i < 2; ++i) {
      const at::Tensor& p = i == 0 ? parts_.norm.weight : parts_.norm.bias;
      ln_versions_[i] = p.defined() ? p._version() : 0;
    }
    const std::array<WeightRefPtr, 4> fc = {parts_.fc1_weight, parts_.fc1_bias, parts_.fc2_weight, parts_.fc2_bias};
    for (size_t i = 0; i < fc.size(); ++i) fc_versions_[i] = fc[i] ? fc[i]->param._version() : 0;
  }
  std::string name() const override { return "dwgraph::LayerNormMLPCheckpointBackward"; }
  void release_variables() override { x_.reset_data(); }

  // The tensors autograd differentiates with respect to, in edge order (undefined: absent).
  std::array<at::Tensor, kInputs> inputs(const at::Tensor& x) const {
    auto p = [](const WeightRefPtr& r) { return r ? r->param : at::Tensor(); };
    return {x, parts_.norm.weight, parts_.norm.bias, p(parts_.fc1_weight), p(parts_.fc1_bias), p(parts_.fc2_weight),
            p(parts_.fc2_bias)};
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(kInputs);
    const at::Tensor& dy = grads[0];
    if (!dy.defined()) return out;
    std::array<bool, kInputs> need{};
    bool any = false;
    for (size_t i = 0; i < kInputs; ++i) any = (need[i] = task_should_compute_output(i)) || any;
    if (!any) return out;
    const at::Tensor x = x_.unpack();  // refuses an input changed in place since the forward
    check_layer_norm_versions();
    check_fp8_operand_versions();
    const std::array<at::Tensor, kInputs> original = inputs(x);
    std::array<at::Tensor, kInputs> alias;
    for (size_t i = 0; i < kInputs; ++i) {
      if (original[i].defined()) alias[i] = detached_alias(original[i], need[i]);
    }
    auto ref = [&](const WeightRefPtr& r, size_t i) -> WeightRefPtr {
      if (!r) return nullptr;
      auto copy = std::make_shared<WeightRef>(*r);
      copy->autograd_input = alias[i];
      return copy;
    };
    WgradConfig fc1_cfg = parts_.cfg;
    WgradConfig fc2_cfg = parts_.cfg;
    fc1_cfg.source = &keys_[0];
    fc2_cfg.source = &keys_[1];
    at::Tensor y;
    {
      const at::AutoGradMode grad_on(true);
      const AutocastStateGuard forward_precision(autocast_);
      const Norm norm{alias[1], alias[2], parts_.norm.eps, parts_.norm.rms};
      y = mlp_forward(alias[0], norm, ref(parts_.fc1_weight, 3), ref(parts_.fc1_bias, 4), parts_.activation,
                      ref(parts_.fc2_weight, 5), ref(parts_.fc2_bias, 6), fc1_cfg, fc2_cfg, parts_.fp8);
    }
    variable_list wrt;
    std::vector<size_t> where;
    for (size_t i = 0; i < kInputs; ++i) {
      if (need[i]) {
        wrt.push_back(alias[i]);
        where.push_back(i);
      }
    }
    // The backward runs in the autocast state it was called in, as the non-checkpointed one.
    const variable_list g = torch::autograd::grad({y}, wrt, {dy}, /*retain_graph=*/false, /*create_graph=*/false,
                                                  /*allow_unused=*/true);
    for (size_t k = 0; k < where.size(); ++k) out[where[k]] = g[k];
    return out;
  }

 private:
  // LayerNorm's own node saves its weight and bias (a change in place is refused at the
  // backward); the recomputation reads them, so a change would go unseen: refused too.
  void check_layer_norm_versions() const {
    const char* names[2] = {"layer_norm_weight", "layer_norm_bias"};
    for (size_t i = 0; i < 2; ++i) {
      const at::Tensor& p = i == 0 ? parts_.norm.weight : parts_.norm.bias;
      if (!p.defined()) continue;
      DWGRAPH_CHECK_STATE(p._version() == ln_versions_[i], parts_.cfg.module_name, ": parameter '", names[i],
                          "' was modified in place after the forward (version ", ln_versions_[i], ", now ",
                          p._version(), "); checkpoint=True recomputes the forward from it in the backward, "
                          "which would no longer give the forward's values. Run the backward before changing it");
    }
  }

  // In FP8 the non-checkpointed nodes keep the forward's quantized operands; the
  // recomputation would quantize the parameters as they are now: refused if they changed.
  void check_fp8_operand_versions() const {
    if (!parts_.fp8.state.enabled) return;
    const std::array<WeightRefPtr, 4> fc = {parts_.fc1_weight, parts_.fc1_bias, parts_.fc2_weight, parts_.fc2_bias};
    for (size_t i = 0; i < fc.size(); ++i) {
      if (!fc[i]) continue;
      DWGRAPH_CHECK_STATE(fc[i]->param._version() == fc_versions_[i], parts_.cfg.module_name, ": parameter '",
                          fc[i]->name, "' was modified in place after the FP8 forward (version ", fc_versions_[i],
                          ", now ", fc[i]->param._version(), "); checkpoint=True recomputes the forward from it in "
                          "the backward, which would no longer give the forward's FP8 operands. Run the backward "
                          "before changing it");
    }
  }

  Parts parts_;
  SavedVariable x_;
  AutocastState autocast_;
  std::array<uint32_t, 2> ln_versions_{};
  std::array<uint32_t, 4> fc_versions_{};
  char keys_[2] = {0, 0};  // the recomputed fc1's and fc2's WgradStore keys
};

}  // namespace

std::pair<at::Tensor, at::Tensor> layernorm_linear(const at::Tensor& x, const at::Tensor& ln_weight,
                                                   const at::Tensor& ln_bias, double eps, const WeightRefPtr& weight,
                                                   const WeightRefPtr& bias, const WgradConfig& cfg,
                                                   const std::string& normalization, const Fp8Meta& fp8_meta) {
  const Norm norm = make_norm(cfg.module_name, x, ln_weight, ln_bias, eps, normalization, "in_features");
  return norm_then_linear(x, norm, weight, bias, cfg, fp8_slot(cfg.module_name, fp8_meta, 1));
}

at::Tensor layernorm_mlp(const at::Tensor& x, const at::Tensor& ln_weight, const at::Tensor& ln_bias,
                         double eps, const WeightRefPtr& fc1_weight, const WeightRefPtr& fc1_bias,
                         const std::string& activation, const WeightRefPtr& fc2_weight,
                         const WeightRefPtr& fc2_bias, const WgradConfig& cfg, bool checkpoint,
                         const std::string& normalization, const Fp8Meta& fp8_meta) {
  check_activation(cfg.module_name, activation);
  const Norm norm = make_norm(cfg.module_name, x, ln_weight, ln_bias, eps, normalization, "hidden_size");
  const Fp8Slot fp8 = fp8_slot(cfg.module_name, fp8_meta, 2);
  // A cached weight is refilled or reused by the microbatch's flag at the forward; the
  // recomputation would have to reuse exactly what that forward multiplied by.
  DWGRAPH_CHECK_ARG(!checkpoint || !fp8.state.enabled || fp8.meta.weight_cache.empty(), cfg.module_name,
                    ": checkpoint=True is not supported with FP8 weight caching (cache_quantized_params / "
                    "is_first_microbatch); build it with checkpoint=False, or quantize the weights on every call");
  if (!checkpoint || !at::GradMode::is_enabled()) {
    return mlp_forward(x, norm, fc1_weight, fc1_bias, activation, fc2_weight, fc2_bias, cfg, cfg, fp8);
  }
  Fp8Slot recompute = fp8;
  if (fp8.state.enabled && fp8.meta.defined()) {
    const at::NoGradGuard no_grad;
    recompute.meta.recompute_scale = fp8.meta.scale.clone();  // before this forward moves it
  }
  CheckpointedMLPBackward::Parts parts{norm, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, cfg, recompute};
  // Checked here what the recomputation would refuse only in the backward.
  check_config(cfg);
  check_leaf_parameters(cfg, {fc1_weight, fc2_weight}, non_null({fc1_bias, fc2_bias}));
  at::Tensor y;
  {
    const at::NoGradGuard no_grad;  // nothing saved: the backward recomputes it
    y = mlp_forward(x, norm, fc1_weight, fc1_bias, activation, fc2_weight, fc2_bias, cfg, cfg, fp8);
  }
  auto node = dwgraph::detail::make_node<CheckpointedMLPBackward>(std::move(parts), x);
  const auto inputs = node->inputs(x);
  torch::autograd::edge_list edges;
  bool needs_grad = false;
  for (const auto& t : inputs) {
    const bool grad = t.defined() && t.requires_grad();
    edges.push_back(grad ? torch::autograd::impl::gradient_edge(t) : torch::autograd::Edge());
    needs_grad = needs_grad || grad;
  }
  if (!needs_grad) return y;  // nothing will call backward
  node->set_next_edges(std::move(edges));
  dwgraph::detail::NodePtr base = node;
  torch::autograd::set_history(y, base);
  return y;
}

}  // namespace dwgraph::ops
