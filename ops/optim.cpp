// Optimizer steps whose hyperparameters are read from a tensor when they run
// (dwgraph::optim_sgd_, dwgraph::optim_adam_; CPU).
//
// Note [Hyperparameters a replay reads] (contract C10): a learning rate that a schedule
// moves is data, not code. torch.optim's CPU implementations take it as a Python number
// and bake it into their kernels' arguments (param.add_(grad, alpha=-lr)), and read
// Adam's step count with .item(); a host graph replays the recorded calls with the values
// of its capture. These ops are the same algorithms, line for line, with every Python
// number the algorithm computes with (lr, momentum, dampening, weight_decay, betas, eps)
// read from a float64 buffer and the step counts read from the state tensors each time
// the op runs. The host graph records the op as one dispatcher call, like any kernel (its
// own ATen calls run below autograd and are not recorded), so a replay runs it again:
// with the values in the buffer at that moment. dwgraph.graphed_step fills the buffer
// from the optimizer's param_groups before each call and routes torch.optim's SGD and
// Adam/AdamW implementations (single tensor, foreach, fused) through these ops while it
// captures (bindings/python/dwgraph/_optim.py).
//
// Exactness: each op calls the ATen functions torch's Python code calls, with the same
// Scalar values. The scalar arithmetic torch does in Python (1 - dampening, -lr,
// 1 - beta1 ** step, (lr / bc) * -1, bc ** 0.5, 1 - lr * weight_decay) is done here in
// double, the type of a Python float, operation by operation (this file is compiled
// without floating-point contraction), and a value that is a Python int in the param
// group stays an integer Scalar where Python keeps int arithmetic. So a replay is bitwise
// the eager step with the same values (tests/python/test_graphed_step_optim.py).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DefaultDtype.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace dwgraph::ops {
namespace {

// A Python number as torch's optimizer code holds it: a double, and whether Python
// would hold it as an int (int op int stays int, true division and ** with a float
// exponent give floats).
struct Num {
  double v = 0;
  bool is_int = false;
};
Num sub(Num a, Num b) { return {a.v - b.v, a.is_int && b.is_int}; }
Num mul(Num a, Num b) { return {a.v * b.v, a.is_int && b.is_int}; }
Num neg(Num a) { return {-a.v, a.is_int}; }
Num div(Num a, Num b) { return {a.v / b.v, false}; }
Num pow_float(Num a, double exponent) { return {std::pow(a.v, exponent), false}; }  // float ** float
constexpr Num kOne{1.0, true};
at::Scalar scalar(Num n) {
  return n.is_int ? at::Scalar(static_cast<int64_t>(n.v)) : at::Scalar(n.v);
}

// The hyperparameters of one call: buffer[slots[i]], an int in Python where ints[i].
struct Hyper {
  Hyper(const at::Tensor& buffer, at::IntArrayRef slots, at::IntArrayRef ints, size_t n, const char* op) {
    TORCH_CHECK(buffer.scalar_type() == at::kDouble && buffer.is_contiguous() && buffer.device().is_cpu(), op,
                ": the hyperparameter buffer must be a contiguous float64 CPU tensor");
    TORCH_CHECK(slots.size() == n && ints.size() == n, op, ": expected ", n, " hyperparameter slots, got ",
                slots.size(), " and ", ints.size(), " int flags");
    const double* data = buffer.data_ptr<double>();
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(slots[i] >= 0 && slots[i] < buffer.numel(), op, ": hyperparameter slot ", slots[i],
                  " is outside the buffer of ", buffer.numel());
      values.push_back(Num{data[slots[i]], ints[i] != 0});
    }
  }
  std::vector<Num> values;
};

std::vector<at::Tensor> vec(at::TensorList l) { return std::vector<at::Tensor>(l.begin(), l.end()); }

// The ATen calls below are the op's own kernels: below autograd (a capture records the
// op, not them) and without gradient tracking, as torch.optim's step runs under no_grad.
struct Below {
  at::AutoDispatchBelowADInplaceOrView below;
  at::NoGradGuard no_grad;
};

enum Impl : int64_t { kSingle = 0, kForeach = 1, kFused = 2 };

// torch.optim.sgd: _single_tensor_sgd, _multi_tensor_sgd (one device/dtype group, its
// momentum buffers existing) and _fused_sgd, for Python-number hyperparameters and
// neither grad_scale nor found_inf. Slots: lr, momentum, dampening, weight_decay.
void optim_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                const at::Tensor& hyper, at::IntArrayRef slots, at::IntArrayRef ints, bool has_momentum,
                bool has_weight_decay, bool nesterov, bool maximize, int64_t impl) {
  const char* op = "dwgraph::optim_sgd_";
  const Hyper h(hyper, slots, ints, 4, op);
  const Num lr = h.values[0], momentum = h.values[1], dampening = h.values[2], weight_decay = h.values[3];
  // The branches torch takes on these values are part of the captured graph's key.
  TORCH_CHECK((momentum.v != 0) == has_momentum && (weight_decay.v != 0) == has_weight_decay, op,
              ": momentum or weight_decay changed between zero and non-zero since this step was captured");
  TORCH_CHECK(grads.size() == params.size() && (!has_momentum || momentum_buffers.size() == params.size()), op,
              ": expected one gradient", has_momentum ? " and one momentum buffer" : "", " per parameter");
  if (params.empty()) return;
  const Below below;
  if (impl == kSingle) {
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor param = params[i];
      at::Tensor grad = maximize ? at::neg(grads[i]) : grads[i];
      if (has_weight_decay) grad = grad.add(param, scalar(weight_decay));
      if (has_momentum) {
        at::Tensor buf = momentum_buffers[i];
        buf.mul_(scalar(momentum)).add_(grad, scalar(sub(kOne, dampening)));
        grad = nesterov ? grad.add(buf, scalar(momentum)) : buf;
      }
      param.add_(grad, scalar(neg(lr)));
    }
  } else if (impl == kForeach) {
    std::vector<at::Tensor> g = vec(grads);
    if (maximize) g = at::_foreach_neg(grads);
    if (has_weight_decay) {
      if (maximize) {
        at::_foreach_add_(g, params, scalar(weight_decay));
      } else {
        g = at::_foreach_add(g, params, scalar(weight_decay));
      }
    }
    if (has_momentum) {
      at::_foreach_mul_(momentum_buffers, scalar(momentum));
      at::_foreach_add_(momentum_buffers, g, scalar(sub(kOne, dampening)));
      if (nesterov) {
        at::_foreach_add_(g, momentum_buffers, scalar(momentum));
      } else {
        g = vec(momentum_buffers);
      }
    }
    at::_foreach_add_(params, g, scalar(neg(lr)));
  } else {
    TORCH_CHECK(impl == kFused, op, ": unknown implementation ", impl);
    at::_fused_sgd_(params, grads, has_momentum ? momentum_buffers : at::TensorList(), weight_decay.v, momentum.v,
                    lr.v, dampening.v, nesterov, maximize, /*is_first_step=*/false);
  }
}

// torch.optim.adam (Adam, and AdamW as decoupled_weight_decay): _single_tensor_adam,
// _multi_tensor_adam (one device/dtype group) and _fused_adam, with capturable=False,
// differentiable=False, real parameters, Python-number hyperparameters and neither
// grad_scale nor found_inf. Slots: lr, beta1, beta2, eps, weight_decay.
void optim_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList state_steps, const at::Tensor& hyper,
                 at::IntArrayRef slots, at::IntArrayRef ints, bool has_weight_decay, bool amsgrad, bool maximize,
                 bool decoupled_weight_decay, int64_t impl) {
  const char* op = "dwgraph::optim_adam_";
  const Hyper h(hyper, slots, ints, 5, op);
  const Num lr = h.values[0], beta1 = h.values[1], beta2 = h.values[2], eps = h.values[3],
            weight_decay = h.values[4];
  TORCH_CHECK((weight_decay.v != 0) == has_weight_decay, op,
              ": weight_decay changed between zero and non-zero since this step was captured");
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && state_steps.size() == n &&
                  (!amsgrad || max_exp_avg_sqs.size() == n),
              op, ": expected one gradient, state tensor and step per parameter");
  if (n == 0) return;
  const Below below;
  auto step_of = [](const at::Tensor& t) { return t.item<double>(); };  // _get_value(step): step.item()
  if (impl == kSingle) {
    for (size_t i = 0; i < n; ++i) {
      at::Tensor param = params[i];
      at::Tensor grad = maximize ? at::neg(grads[i]) : grads[i];
      at::Tensor exp_avg = exp_avgs[i], exp_avg_sq = exp_avg_sqs[i], step_t = state_steps[i];
      step_t.add_(1);
      if (has_weight_decay) {
        if (decoupled_weight_decay) {
          param.mul_(scalar(sub(kOne, mul(lr, weight_decay))));
        } else {
          grad = grad.add(param, scalar(weight_decay));
        }
      }
      exp_avg.lerp_(grad, scalar(sub(kOne, beta1)));
      exp_avg_sq.mul_(scalar(beta2)).addcmul_(grad, grad, scalar(sub(kOne, beta2)));
      const double step = step_of(step_t);
      const Num bias_correction1 = sub(kOne, pow_float(beta1, step));
      const Num bias_correction2 = sub(kOne, pow_float(beta2, step));
      const Num step_size = div(lr, bias_correction1);
      const Num bias_correction2_sqrt = pow_float(bias_correction2, 0.5);  // Python: bc ** 0.5
      at::Tensor denom;
      if (amsgrad) {
        at::Tensor max_sq = max_exp_avg_sqs[i];
        at::maximum_out(max_sq, max_sq, exp_avg_sq);
        denom = at::div(max_sq.sqrt(), scalar(bias_correction2_sqrt)).add_(scalar(eps));
      } else {
        denom = at::div(exp_avg_sq.sqrt(), scalar(bias_correction2_sqrt)).add_(scalar(eps));
      }
      param.addcdiv_(exp_avg, denom, scalar(neg(step_size)));
    }
  } else if (impl == kForeach) {
    std::vector<at::Tensor> g = vec(grads);
    if (maximize) g = at::_foreach_neg(grads);
    if (state_steps[0].is_cpu()) {
      // torch: _foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
      at::_foreach_add_(state_steps, at::scalar_tensor(1.0, at::TensorOptions().dtype(c10::get_default_dtype_as_scalartype())), 1.0);
    } else {
      at::_foreach_add_(state_steps, 1);
    }
    if (has_weight_decay) {
      if (decoupled_weight_decay) {
        at::_foreach_mul_(params, scalar(sub(kOne, mul(lr, weight_decay))));
      } else if (maximize) {
        at::_foreach_add_(g, params, scalar(weight_decay));
      } else {
        g = at::_foreach_add(g, params, scalar(weight_decay));
      }
    }
    at::_foreach_lerp_(exp_avgs, g, scalar(sub(kOne, beta1)));
    at::_foreach_mul_(exp_avg_sqs, scalar(beta2));
    at::_foreach_addcmul_(exp_avg_sqs, g, g, scalar(sub(kOne, beta2)));
    g.clear();
    std::vector<at::Scalar> step_size, bias_correction2_sqrt;
    for (const auto& s : state_steps) {
      const double step = step_of(s);
      const Num bc1 = sub(kOne, pow_float(beta1, step));
      const Num bc2 = sub(kOne, pow_float(beta2, step));
      step_size.push_back(scalar(mul(div(lr, bc1), Num{-1.0, true})));  // (lr / bc) * -1
      bias_correction2_sqrt.push_back(scalar(pow_float(bc2, 0.5)));
    }
    std::vector<at::Tensor> sq;
    if (amsgrad) {
      at::_foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs);
      sq = at::_foreach_sqrt(max_exp_avg_sqs);
    } else {
      sq = at::_foreach_sqrt(exp_avg_sqs);
    }
    at::_foreach_div_(sq, bias_correction2_sqrt);
    at::_foreach_add_(sq, scalar(eps));
    at::_foreach_addcdiv_(params, exp_avgs, sq, step_size);
  } else {
    TORCH_CHECK(impl == kFused, op, ": unknown implementation ", impl);
    at::_foreach_add_(state_steps, 1);
    if (decoupled_weight_decay) {
      at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr.v, beta1.v, beta2.v,
                        weight_decay.v, eps.v, amsgrad, maximize);
    } else {
      at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr.v, beta1.v, beta2.v,
                       weight_decay.v, eps.v, amsgrad, maximize);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dwgraph, m) {
  m.def("optim_sgd_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] momentum_buffers, Tensor hyper, "
        "int[] slots, int[] ints, bool has_momentum, bool has_weight_decay, bool nesterov, bool maximize, "
        "int impl) -> ()");
  m.def("optim_adam_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, "
        "Tensor(e!)[] max_exp_avg_sqs, Tensor(f!)[] state_steps, Tensor hyper, int[] slots, int[] ints, "
        "bool has_weight_decay, bool amsgrad, bool maximize, bool decoupled_weight_decay, int impl) -> ()");
}

TORCH_LIBRARY_IMPL(dwgraph, CPU, m) {
  m.impl("optim_sgd_", &optim_sgd_);
  m.impl("optim_adam_", &optim_adam_);
}

}  // namespace dwgraph::ops
