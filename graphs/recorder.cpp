#include "graphs/recorder.h"

#include "graphs/capture_dispatch.h"
#include "common/check.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string_view>
#include <unordered_set>

namespace dwgraph::graphs::detail {
namespace {

thread_local uint64_t t_reseeds = 0;

bool is_write(const c10::Argument& a) {
  const auto* info = a.alias_info();
  if (info == nullptr) return false;
  if (info->isWrite()) return true;
  for (const auto& inner : info->containedTypes()) {
    if (inner.isWrite()) return true;
  }
  return false;
}

// Kernels that write an argument their schema does not mark as written: the running
// statistics of batch norm in training mode. Treated as written (snapshotted and restored
// after a host capture, followed by the pool's replay order) like declared writes.
bool writes_undeclared(const c10::FunctionSchema& schema, size_t arg, const torch::jit::Stack& stack, size_t base) {
  const auto& name = schema.operator_name().name;
  if (name != "aten::native_batch_norm" && name != "aten::batch_norm" && name != "aten::_batch_norm_impl_index") {
    return false;
  }
  if (arg != 3 && arg != 4) return false;  // running_mean, running_var
  const c10::IValue& training = stack[base + 5];
  return !training.isBool() || training.toBool();
}

// Calls that read a tensor's value on the host: a CUDA graph cannot capture them (the
// capture would have to synchronise), so the host graph refuses them too.
bool reads_value_on_host(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> kSync = {
      "aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero",
      "aten::allclose", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
      "aten::_unique2", "aten::_unique", "aten::unique_dim", "aten::unique_dim_consecutive",
      // Output sizes from the values (max + 1): CUDA's kernel reads the maximum with .item().
      "aten::bincount",
      // Packed sequences: the lengths and batch sizes are read through the data pointer (the
      // packing's output size too); the backward and the unpacking keep a capture's batch
      // sizes (a review found an input gradient 1.08 off).
      "aten::_pack_padded_sequence", "aten::_pack_padded_sequence_backward", "aten::_pad_packed_sequence",
      // A shape given as a tensor (torch.onnx's reshape_from_tensor_shape), read the same way.
      "aten::_reshape_from_tensor"};
  if (kSync.count(name.name) > 0) return true;
  // Overloads that take integers as a tensor and read them on the host through the data
  // pointer, not .item(): the capture would keep its call's integers (split points,
  // sequence lengths, a packed sequence's batch sizes) where eager reads the caller's (a
  // review found each silently wrong).
  static const std::unordered_set<std::string> kPackedData = {"aten::lstm", "aten::gru", "aten::rnn_tanh",
                                                              "aten::rnn_relu"};
  return (name.name == "aten::tensor_split" && name.overload_name == "tensor_indices_or_sections") ||
         (name.name == "aten::ctc_loss" && name.overload_name == "Tensor") ||
         (name.overload_name == "data" && kPackedData.count(name.name) > 0);
}

// F.one_hot with num_classes given reads the labels' range with .item() on the CPU only to
// refuse one out of range (its CUDA kernel reads nothing); the output's size is the given one,
// and the replayed scatter still refuses an index out of range.
bool validates_on_host(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t base) {
  if (schema.operator_name().name != "aten::one_hot") return false;
  const auto index = schema.argumentIndexWithName("num_classes");
  if (!index || base + *index >= stack.size()) return false;
  const c10::IValue& n = stack[base + *index];
  return n.isInt() && n.toInt() >= 0;
}

// A repeat_interleave with tensor repeats and no output_size sizes its output by the sum of
// the repeats, read on the host (CUDA's kernel with .item()).
bool sizes_output_from_values(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t base) {
  if (schema.operator_name().name != "aten::repeat_interleave") return false;
  const auto index = schema.argumentIndexWithName("output_size");
  const auto repeats = schema.argumentIndexWithName("repeats");
  if (!index || !repeats || base + *index >= stack.size() || base + *repeats >= stack.size()) return false;
  return stack[base + *repeats].isTensor() && stack[base + *index].isNone();
}

// Calls that launch no kernel: their outputs' contents are undefined until written.
bool is_allocation(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> kAlloc = {"aten::empty", "aten::empty_like",
                                                         "aten::empty_strided", "aten::new_empty",
                                                         "aten::new_empty_strided"};
  return kAlloc.count(name.name) > 0;
}

// Calls f(t, k) for each tensor of `v` (a tensor, or a list of tensors and Nones), k its
// position in the list (its ValueSlot's index).
template <typename F>
void for_each_slot_tensor(const c10::IValue& v, F f) {
  if (v.isTensor()) {
    f(v.toTensor(), 0);
    return;
  }
  size_t k = 0;
  for (const auto& e : v.toListRef()) {
    if (e.isTensor()) f(e.toTensor(), k);
    ++k;
  }
}

// Some tensor among stack[begin, end) (tensors and tensor lists) requires grad.
bool any_requires_grad(const torch::jit::Stack& stack, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad()) return true;
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        if (t.defined() && t.requires_grad()) return true;
      }
    }
  }
  return false;
}

uint64_t hash_bytes(const c10::Storage& st) {
  if (st.data() == nullptr) return 0;
  return std::hash<std::string_view>{}(std::string_view(static_cast<const char*>(st.data()), st.nbytes()));
}

}  // namespace

AutogradLayer Recorder::autograd_layer(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                       size_t base) const {
  // A kernel that torch's autograd fallback (or a fallthrough) runs with gradients to
  // compute: the fallback leaves autograd on inside it, and its inner calls' autograd is
  // its gradient (torch warns that it has no autograd kernel).
  auto differentiated = [&] { return c10::GradMode::is_enabled() && any_requires_grad(stack, base, stack.size()); };
  const bool cuda = device_type_ == c10::DeviceType::CUDA;
  const auto key = cuda ? c10::DispatchKey::AutogradCUDA : c10::DispatchKey::AutogradCPU;
  // A kernel for the backend (or CompositeExplicitAutograd, which serves every backend):
  // torch runs it, not a CompositeImplicitAutograd one registered beside it.
  const bool backend_kernel = op.hasKernelForDispatchKey(cuda ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU) ||
                              op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
                              op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
  if (!op.hasKernelForDispatchKey(c10::DispatchKey::Autograd) && !op.hasKernelForDispatchKey(key)) {
    if (!backend_kernel && op.hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) {
      return AutogradLayer::kComposite;
    }
    return differentiated() ? AutogradLayer::kNoneWithGrad : AutogradLayer::kNone;
  }
  const c10::KernelFunction& k = op.lookup(c10::DispatchKeySet(key));
  if (k.isFallthrough()) return differentiated() ? AutogradLayer::kNoneWithGrad : AutogradLayer::kFallthrough;
  // ATen's generated autograd kernels and C++ custom ones are unboxed (SymInt ones by their
  // SymInt signature). Boxed only: a Python kernel, or the one autograd kernel torch gives
  // ATen's non-differentiable operators (out= overloads, randperm), which runs their kernel
  // below autograd.
  if (k.isValidUnboxed() || k.isValidSymUnboxed()) return AutogradLayer::kKernel;
  if (k._equalsBoxedAndUnboxed(not_implemented_autograd_kernel())) return AutogradLayer::kKernel;
  // A Python autograd kernel over a kernel for the backend (torch.library.custom_op's,
  // which runs it below autograd): that kernel is the op's, and the op replays whole like
  // an ATen one. Without one, the Python kernel is all of the op's body.
  return backend_kernel ? AutogradLayer::kKernel : AutogradLayer::kPython;
}

const c10::KernelFunction& not_implemented_autograd_kernel() {
  // ATen's randperm is one of the operators torch gives that kernel (a test checks that
  // out= overloads share it).
  static const c10::KernelFunction kernel = [] {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::randperm", "");
    return op.lookup(c10::DispatchKeySet(c10::DispatchKey::AutogradCPU));
  }();
  return kernel;
}

Recorder::Recorder(allocator::Ledger& ledger, std::function<bool(const void*)> owned, bool execute,
                   std::function<int64_t(const void*)> serial, int64_t first_serial)
    : ledger_(ledger),
      owned_(std::move(owned)),
      execute_(execute),
      serial_(std::move(serial)),
      first_serial_(first_serial),
      reseed_epoch_(t_reseeds) {
  advance_generator_mark();
  if (execute_) generator_at_begin_ = at::Tensor(at::detail::getDefaultCPUGenerator().get_state());
}

bool GeneratorPosition::operator==(const GeneratorPosition& o) const {
  return engine.seed_ == o.engine.seed_ && engine.left_ == o.engine.left_ && engine.seeded_ == o.engine.seeded_ &&
         engine.next_ == o.engine.next_ && engine.state_ == o.engine.state_ && next_float == o.next_float &&
         next_double == o.next_double;
}

// Host: where the default CPU generator stands now (Note [The generator between kernels]).
// Read without copying a state tensor: every recorded call of a host capture reads it twice.
bool Recorder::advance_generator_mark() {
  if (!execute_) return false;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  // Not under the generator's mutex: a kernel holds it while it calls other operators
  // (randperm's CPU kernel resizes its output), which reach this read.
  GeneratorPosition now;
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
  now.engine = cpu->engine().data();
  now.next_float = cpu->next_float_normal_sample();
  now.next_double = cpu->next_double_normal_sample();
  const bool moved = !(now == generator_mark_);
  generator_mark_ = now;
  return moved;
}

void Recorder::check_generator(const char* where) {
  DWGRAPH_CHECK_STATE(!advance_generator_mark(), "dwgraph graph capture: the default random number generator changed ", where,
                      " outside the captured kernels (torch.manual_seed, torch.set_rng_state, torch.random.fork_rng "
                      "around random work, torch.utils.checkpoint recomputing dropout, or another thread drawing). "
                      "A replay runs no Python: its kernels draw on from wherever the generator stands, so its "
                      "random numbers would differ from eager. Seed and restore outside the captured region, or "
                      "checkpoint with preserve_rng_state=False (or without randomness in the checkpointed part)");
}

namespace {

// Before anything reads its storage (a sparse tensor has none: its access raised torch's
// untyped error, where a review expected this one).
void refuse_unstrided(const at::Tensor& t) {
  // A nested tensor (nn.TransformerEncoder's fast path over a padding mask) has no one
  // size and stride a replay could rebuild it by.
  DWGRAPH_CHECK_STATE(!t.is_nested(), "dwgraph graph capture: a nested tensor reaches a captured kernel; graphs "
                      "capture strided tensors of fixed shape only (for nn.TransformerEncoder, pass "
                      "enable_nested_tensor=False, or run it outside the captured region)");
  DWGRAPH_CHECK_STATE(t.layout() == at::kStrided, "dwgraph graph capture: a ", t.layout(), " ", t.scalar_type(),
                      " tensor of shape ", t.sizes(), " reaches a captured kernel; graphs capture strided tensors only "
                      "(for a sparse nn.Embedding, pass sparse=False or run it outside the captured region)");
}

}  // namespace

TensorSlot Recorder::tensor_slot(const at::Tensor& t) {
  TensorSlot s;
  if (!t.defined()) return s;
  refuse_unstrided(t);
  s.defined = true;
  s.sizes = t.sizes().vec();
  s.strides = t.strides().vec();
  s.storage_offset = t.storage_offset();
  s.dtype = t.scalar_type();
  s.device = t.device();
  s.wrapped_number = t.unsafeGetTensorImpl()->is_wrapped_number();
  const c10::Storage& st = t.storage();
  s.no_memory = st.nbytes() == 0 || st.data() == nullptr || (device_type_ && t.device().type() != *device_type_);
  if (!s.no_memory) s.entry = ledger_.record(st, owned_(st.data()));
  return s;
}

ValueSlot Recorder::slot_for(const c10::IValue& v) {
  ValueSlot s;
  if (v.isTensor()) {
    s.kind = ValueSlot::Kind::kTensor;
    s.tensors.push_back(tensor_slot(v.toTensor()));
  } else if (v.isTensorList()) {
    s.kind = ValueSlot::Kind::kTensorList;
    for (const at::Tensor& t : v.toTensorList()) s.tensors.push_back(tensor_slot(t));
  } else if (v.isList() && v.toListRef().size() > 0 &&
             std::any_of(v.toListRef().begin(), v.toListRef().end(),
                         [](const c10::IValue& e) { return e.isTensor(); })) {
    s.kind = ValueSlot::Kind::kOptionalTensorList;  // Tensor?[] (e.g. index)
    for (const auto& e : v.toListRef()) {
      s.tensors.push_back(e.isTensor() ? tensor_slot(e.toTensor()) : TensorSlot{});
    }
  } else {
    if (v.isGenerator()) {
      // A replay draws from the generator object of the capture, whose state no Python
      // resets (a generator made and seeded inside the step) or that the capture advanced
      // (CUDA graphs need register_generator_state for it). The default generators are
      // graph state dwgraph keeps (saved and restored around captures, as eager draws).
      const at::Generator& g = v.toGenerator();
      DWGRAPH_CHECK_STATE(g == at::globalContext().defaultGenerator(g.device()),
                          "dwgraph graph capture: a kernel draws from a torch.Generator other than the default one "
                          "of ", g.device(), "; a replay would draw from the capture's generator, whose state no "
                          "Python resets or restores. Draw from the default generator (torch.manual_seed) inside "
                          "the captured region, or make the random tensor outside it and pass it in");
    }
    s.kind = ValueSlot::Kind::kOther;
    s.other = v;
  }
  return s;
}

void note_reseed() { ++t_reseeds; }

void Recorder::refuse_draw_after_reseed(const c10::FunctionSchema& schema) const {
  // The host capture follows the generator itself (check_generator); this watch of
  // Python's reseeding functions covers the CUDA capture, whose generator is graph-safe.
  if (execute_ || t_reseeds == reseed_epoch_) return;
  for (const auto& a : schema.arguments()) {
    const auto& type = a.type();
    const auto inner = type->kind() == c10::TypeKind::OptionalType ? type->expectRef<c10::OptionalType>().getElementType()
                                                                    : type;
    DWGRAPH_CHECK_STATE(inner->kind() != c10::TypeKind::GeneratorType, "dwgraph graph capture: ",
                        schema.operator_name().name,
                        " draws random numbers after the random number generator was reseeded or restored inside "
                        "the captured region (torch.manual_seed, torch.set_rng_state; torch.utils.checkpoint does "
                        "this to recompute dropout). A replay runs no Python and draws on from the generator's "
                        "state, so its numbers would differ from eager. Seed outside the captured region, or "
                        "checkpoint with preserve_rng_state=False (or without randomness in the checkpointed part)");
  }
}

void Recorder::note_raised(const std::string& op_name, const char* what, bool refused) {
  // Note [A call that raised]: the host graph records a call when it returns. One that
  // raised may have run kernels first (torch.utils.checkpoint's early stop raises from the
  // pack hook of the last saving call, after its kernel wrote the output the backward then
  // reads); a replay would skip them. That only matters if the region goes on, as the
  // capture is abandoned otherwise. Likewise a call the capture refused before it ran (a
  // host read), should the region's code catch that: eager runs the call, so the region
  // went on along a path eager code does not take. A call that raised matters where the
  // capture runs kernels (the host graph); a refusal, on every backend (CUDA would not see
  // it: the host read it would have invalidated the capture with never ran).
  if ((!execute_ && !refused) || !raised_op_.empty()) return;
  raised_refused_ = refused;
  raised_op_ = op_name;
  raised_what_ = what;
  raised_what_ = raised_what_.substr(0, std::min(raised_what_.find('\n'), size_t{200}));
}

void Recorder::check_none_raised(const char* where, bool refusals) const {
  if (raised_refused_ && !refusals) return;
  DWGRAPH_CHECK_STATE(raised_op_.empty() || !raised_refused_, "dwgraph graph capture: ", raised_op_,
                      " was refused inside the captured region and the region went on (", where, "): the refusal "
                      "was caught inside it (a try/except around a host read, or a library that swallows errors, as "
                      "logging does while formatting a tensor), so the capture holds a path that eager code, where "
                      "the call runs, does not take. Move the call out of the captured region, or catch exceptions "
                      "outside it");
  DWGRAPH_CHECK_STATE(raised_op_.empty(), "dwgraph host graph capture: ", raised_op_, " raised inside the captured "
                      "region (", raised_what_.empty() ? std::string("no message") : raised_what_, ") and the region "
                      "went on (", where, "): the exception was caught inside it. The host graph records a call when "
                      "it returns, so kernels the raising call ran before it raised would not be replayed and a replay "
                      "would read the capture's values there. torch.utils.checkpoint(use_reentrant=False) ends its "
                      "recomputation this way under early stop: checkpoints made inside a dwgraph capture recompute "
                      "whole; one made outside the captured region, or under set_checkpoint_early_stop(True) inside "
                      "it, is refused. Catch exceptions outside the captured region");
}

void Recorder::snapshot_if_caller(const TensorSlot& s, const at::Tensor& t) {
  if (!execute_ || !s.defined || s.no_memory) return;
  if (ledger_.entry(s.entry).ownership == allocator::Ownership::kGraph) return;
  if (snapshots_.count(s.entry) > 0) return;
  const c10::Storage& st = t.storage();
  std::vector<uint8_t> bytes(st.nbytes());
  std::memcpy(bytes.data(), st.data(), st.nbytes());
  snapshots_.emplace(s.entry, std::make_pair(st, std::move(bytes)));
}

// The calls a capture refuses before they run: host reads, collectives, data-dependent
// shapes, draws after a reseed.
void Recorder::refuse_uncapturable(const c10::FunctionSchema& schema, const torch::jit::Stack& stack, size_t base) const {
  const std::string& op_name = schema.operator_name().name;
  const bool refused = reads_value_on_host(schema.operator_name()) &&
                       std::none_of(frames_.begin(), frames_.end(), [](const Frame& f) { return f.validates_on_host; });
  DWGRAPH_CHECK_STATE(!refused, "dwgraph graph capture: ", op_name,
                      schema.overload_name().empty() ? std::string() : "." + schema.overload_name(),
                      " reads a tensor's value on the host (e.g. .item(), torch.equal, nonzero, tensor split points "
                      "or lengths), which a CUDA graph cannot capture and a replay would not read again; move it out "
                      "of the captured region (or pass such integers as Python ints, which the capture bakes in)");
  DWGRAPH_CHECK_STATE(!sizes_output_from_values(schema, stack, base), "dwgraph graph capture: ", op_name,
                      " with tensor repeats and no output_size sizes its output by the repeats' sum, read on the "
                      "host, which a CUDA graph cannot capture and a replay would not read again; pass output_size "
                      "(a graph replays one output size), or move it out of the captured region");
  // Collectives (c10d::allreduce_, the functional collectives, torch DDP's reducer, which
  // calls them from its autograd hooks) talk to other processes: their effect is not a
  // kernel a graph can replay (the host graph would skip or repeat it alone, on one rank).
  DWGRAPH_CHECK_STATE(op_name.rfind("c10d::", 0) != 0 && op_name.rfind("_c10d_functional::", 0) != 0 &&
                          op_name.rfind("c10d_functional::", 0) != 0,
                      "dwgraph graph capture: the collective ", op_name,
                      " runs inside the captured region; a graph replays kernels, not communication with other "
                      "ranks. Run collectives outside the graphs: call a DistributedDataParallel model outside "
                      "@graphed_step (graph its inner modules with make_graphed_callables, or use "
                      "dwgraph.distributed, whose reduction runs after each replay's hand-off)");
  refuse_data_dependent(schema, stack, base);
  refuse_draw_after_reseed(schema);
}

void Recorder::on_call(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                       const std::function<void()>& redispatch) {
  const auto& schema = op.schema();
  const std::string& op_name = schema.operator_name().name;
  const size_t nargs = schema.arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= nargs);
  const size_t base = stack->size() - nargs;
  // Our own bookkeeping below must not be recorded.
  std::optional<c10::impl::ExcludeDispatchKeyGuard> exclude;
  OpRecord rec{op, {}, {}, false, {}};
  std::unordered_set<const void*> input_data;
  // Host: the storages this call writes (written arguments, fresh returns), by ledger entry.
  std::vector<std::pair<size_t, c10::Storage>> wrote;
  try {
    refuse_uncapturable(schema, *stack, base);
    if (depth_ == 0) {
      const std::string where = c10::str("before ", op_name);
      // Not a refusal yet: this call may be cleanup while the refusal propagates out of the
      // region (record_function's exit inside Optimizer.step); only a region that ends
      // normally has caught it.
      check_none_raised(where.c_str(), /*refusals=*/false);
      check_generator(where.c_str());
    }
    exclude.emplace(kCaptureModeKey);
    rec.grad_enabled = c10::GradMode::is_enabled();
    rec.args.reserve(nargs);
    for (size_t i = 0; i < nargs; ++i) {
      const c10::IValue& v = (*stack)[base + i];
      ValueSlot s = slot_for(v);  // refuses what a graph cannot hold (another generator, sparse, nested)
      s.written = is_write(schema.arguments()[i]) || writes_undeclared(schema, i, *stack, base);
      if (s.kind != ValueSlot::Kind::kOther) {
        for_each_slot_tensor(v, [&](const at::Tensor& t, size_t k) {
          const TensorSlot& ts = s.tensors[k];
          if (!ts.defined) return;
          if (!ts.no_memory) {
            input_data.insert(t.storage().data());
            note_version(t, ts.entry);
          }
          if (s.written) snapshot_if_caller(ts, t);
          if (s.written && !ts.no_memory && execute_) wrote.emplace_back(ts.entry, t.storage());
        });
      }
      // Note [The same tensor twice in a call]: kernels branch on argument identity
      // (native multi-head attention takes its self-attention path when query, key and
      // value are one tensor): the replay passes one tensor again where the call did.
      if (v.isTensor() && v.toTensor().defined()) {
        for (size_t j = 0; j < i; ++j) {
          const c10::IValue& w = (*stack)[base + j];
          if (w.isTensor() && w.toTensor().unsafeGetTensorImpl() == v.toTensor().unsafeGetTensorImpl()) {
            s.same_as = static_cast<int64_t>(j);
            break;
          }
        }
      }
      rec.args.push_back(std::move(s));
    }
    snapshot_constants(rec, *stack, base);
  } catch (const c10::Error& e) {
    // Note [A call that raised]: a refusal that the region's code catches and goes past is a
    // path eager code does not take (eager runs the call): refused at the end of the region
    // (a later call may be cleanup while it propagates). (With the Python extension it is a Python error.)
    note_raised(op_name, e.what_without_backtrace(), /*refused=*/true);
    throw;
  } catch (const std::exception& e) {
    note_raised(op_name, e.what(), /*refused=*/true);
    throw;
  }
  // The call itself: its autograd layer's own calls (a clone of self saved for backward,
  // the pieces of a CompositeImplicitAutograd operator) are recorded as its children;
  // calls inside its kernels are not (see capture_fallback). The kernel's allocations
  // follow the capture's routing (the pool on the host graph).
  const size_t first_child = records_.size();
  // Note [Calls in a kernel's body]: a call whose autograd-level code is a body of calls (a
  // custom kernel run by torch's autograd fallback, a CompositeImplicitAutograd one, a
  // Python kernel registered for Autograd) is described by the calls that body makes, and
  // those include calls made below autograd (torch's factory functions, torch.rand_like
  // among them, run their ATen call so): they are recorded as its children too, where
  // they would otherwise pass as part of a kernel and their output replay as a constant.
  // A call with an ATen or C++ autograd kernel whose kernel draws below autograd and that
  // its children replay is refused below.
  const AutogradLayer layer = autograd_layer(op, *stack, base);
  // This call ran inside its parent's kernel, below the parent's autograd layer: a parent
  // that replays whole runs it again (Note [A kernel's own writes]).
  rec.first_child = first_child;
  rec.below_autograd = c10::impl::tls_is_dispatch_keyset_excluded(c10::autograd_dispatch_keyset);
  rec.in_parent_kernel = !frames_.empty() && frames_.back().layer != AutogradLayer::kKernel;
  // Note [The generator between kernels], inside a call: the generator moved since the
  // last recorded call began or ended, so the call being recorded drew in its own kernel.
  if (advance_generator_mark() && !frames_.empty()) frames_.back().drew = true;
  exclude.reset();
  ++depth_;
  frames_.push_back(Frame{layer, false, validates_on_host(schema, *stack, base)});
  bool drew = false;
  auto leave = [&] {
    --depth_;
    drew = frames_.back().drew;
    frames_.pop_back();
  };
  try {
    const uint64_t reseeds = t_reseeds;
    if (allocations_) rec.allocations_before = allocations_();
    run_recorded_call(redispatch);
    if (allocations_) rec.allocations_after = allocations_();
    // A reseed or restore inside it (torch.random.fork_rng around a draw leaves the
    // generator where it was) counts as a draw: a replay must run it again.
    if (advance_generator_mark() || t_reseeds != reseeds) frames_.back().drew = true;
  } catch (const c10::Error& e) {
    leave();
    note_raised(op_name, e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    leave();
    note_raised(op_name, e.what());
    throw;
  } catch (...) {
    leave();
    note_raised(op_name, "");
    throw;
  }
  leave();
  exclude.emplace(kCaptureModeKey);

  bool any_fresh = false;
  bool any_write = std::any_of(rec.args.begin(), rec.args.end(), [](const ValueSlot& s) { return s.written; });
  const size_t nret = schema.returns().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= base + nret);
  for (size_t i = 0; i < nret; ++i) {
    const c10::IValue& v = (*stack)[base + i];
    // A fresh output lives in memory the capture allocated: the graph's pool.
    auto mark_owned = [&](const at::Tensor& t) {
      if (t.defined()) refuse_unstrided(t);
      if (t.defined() && t.storage().nbytes() > 0 && input_data.count(t.storage().data()) == 0 &&
          (!device_type_ || t.device().type() == *device_type_)) {
        ledger_.record(t.storage(), /*owned=*/true, /*fresh_output=*/true);
      }
    };
    if (v.isTensor()) {
      mark_owned(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) mark_owned(t);
    }
    ValueSlot s = slot_for(v);
    auto fresh_of = [&](const at::Tensor& t) {
      return t.defined() && t.storage().nbytes() > 0 && input_data.count(t.storage().data()) == 0;
    };
    if (v.isTensor()) {
      s.fresh.push_back(fresh_of(v.toTensor()));
    } else if (s.kind != ValueSlot::Kind::kOther) {
      for (const auto& e : v.toListRef()) s.fresh.push_back(e.isTensor() && fresh_of(e.toTensor()));
    }
    if (execute_ && s.kind != ValueSlot::Kind::kOther) {
      for_each_slot_tensor(v, [&](const at::Tensor& t, size_t k) {
        const TensorSlot& ts = s.tensors[k];
        if (k < s.fresh.size() && s.fresh[k] && ts.defined && !ts.no_memory) wrote.emplace_back(ts.entry, t.storage());
      });
    }
    for (bool f : s.fresh) any_fresh = any_fresh || f;
    rec.returns.push_back(std::move(s));
  }
  rec.skip_at_replay = (!any_write && !any_fresh) || is_allocation(schema.operator_name());
  // Note [A kernel's own writes]: a custom kernel that torch's autograd fallback runs
  // (kNone; a fallthrough alike) runs without leaving autograd, so the calls it makes
  // through the dispatcher reach the capture as its children, but not what it does
  // besides them. Where they do not write all it wrote (it filled its output through the
  // data pointer), or the generator moved outside them (it drew through torch's factory
  // functions, which call ATen below autograd, or reseeded), it replays whole, below
  // autograd: its kernel runs again, and its children, which ran inside it, do not replay
  // on their own (an in-place count inside it moved by two a replay). Taken for a
  // composite of its children, it replayed stale values, or the capture's random numbers.
  // One the fallback ran with gradients to compute (kNoneWithGrad) whose outputs do not
  // require grad was not differentiated through its inner calls after all (dwgraph's GEMMs
  // under their modules' autograd nodes): the same.
  const bool kernel = layer == AutogradLayer::kNone || layer == AutogradLayer::kFallthrough ||
                      (layer == AutogradLayer::kNoneWithGrad && !any_requires_grad(*stack, base, base + nret));
  if (!rec.skip_at_replay && records_.size() > first_child) {
    // Everything this call wrote was written by its children (a composite such as
    // layer_norm): replaying them is replaying it. An allocation writes nothing. A child's
    // write counts where it wrote the memory this call's tensor holds, not an earlier
    // tensor freed from the same block (a temporary torch.ones(...) whose block the
    // kernel's output then took).
    // A kernel's own calls below autograd are its own work (recorded only where the
    // fallback ran it with gradients to compute), not its children's.
    const auto mine = written_entries(rec);
    // And the kernel did not change it after that child returned (a clone it then rewrote
    // through the data pointer, as C++ extensions do): its bytes are as that child left them.
    rec.skip_at_replay = !mine.empty() && std::all_of(mine.begin(), mine.end(), [&](size_t e) {
      const int64_t w = last_writer(e);
      if (w < static_cast<int64_t>(first_child) || (kernel && records_[w].below_autograd)) return false;
      if (!execute_) return true;
      const auto left = child_bytes_.find(e);
      const auto now = std::find_if(wrote.begin(), wrote.end(), [&](const auto& x) { return x.first == e; });
      return left != child_bytes_.end() && now != wrote.end() && left->second == hash_bytes(now->second);
    });
  }
  // Its inner calls read memory it filled itself, outside them (an intermediate it wrote
  // through the data pointer: read as a constant, allocated while it ran).
  auto reads_its_own_fill = [&] {
    for (size_t r = first_child; r < records_.size(); ++r) {
      for (int64_t s : records_[r].constant_serials) {
        if (s > rec.allocations_before && s <= rec.allocations_after) return true;
      }
    }
    return false;
  };
  if (kernel && rec.skip_at_replay && (any_write || any_fresh) && (drew || reads_its_own_fill())) {
    rec.skip_at_replay = false;
  }
  // Below autograd, a replay has no kernel to run such a call by (it would run another).
  DWGRAPH_CHECK_STATE(rec.skip_at_replay || layer != AutogradLayer::kPython, "dwgraph host graph capture: ", op_name,
                      " has a Python autograd kernel and no kernel for the backend, and writes memory its inner calls "
                      "do not (through the data pointer): a replay runs kernels below autograd and has none to run it "
                      "by. Register its computation for the backend (torch.library.custom_op, or Library.impl with "
                      "\"CPU\"), or write its results through dispatched calls");
  // A call that replays (whole, or a body whose children did not write all it wrote: it
  // filled its output through the data pointer) runs its kernel again, below autograd: the
  // calls that kernel made, recorded as its children (those of a kernel torch's autograd
  // fallback runs; those below a Python autograd kernel, Note [Calls in a kernel's body]),
  // do not replay again. Calls its autograd layer made itself replay as before.
  if (!rec.skip_at_replay) {
    const auto mine = written_entries(rec);
    const std::unordered_set<size_t> own(mine.begin(), mine.end());
    for (size_t end = records_.size(); end > first_child;) {
      const OpRecord& child = records_[end - 1];
      const size_t begin = child.first_child;  // the child and the calls it made
      if (child.in_parent_kernel) {
        for (size_t r = begin; r < end; ++r) {
          records_[r].skip_at_replay = true;
          // What it wrote besides this call's own results is no replayed call's write
          // (Note [A kernel's tensors outlive it]).
          for (size_t e : written_entries(records_[r])) {
            if (own.count(e) == 0 && e < defined_.size()) defined_[e] = -1;
          }
        }
      }
      end = begin;
    }
  }
  // A call that drew random numbers in its own kernel and is not replayed (its children,
  // which do not draw them, stand for it) would hand the capture's numbers to every replay.
  DWGRAPH_CHECK_STATE(!drew || !rec.skip_at_replay, "dwgraph host graph capture: the default random number generator "
                      "moved inside ", op_name, " outside the calls the host graph replays for it: its kernel drew "
                      "through calls it makes below autograd (as torch::rand_like and torch's other factory functions "
                      "do from C++), or reseeded or restored the generator (torch.manual_seed, set_rng_state). Every "
                      "replay would repeat the capture's numbers. Draw through dispatched calls in a kernel registered "
                      "for the backend (torch.library.custom_op, or Library.impl with \"CPU\") or as "
                      "CompositeImplicitAutograd, seed outside the captured region, or make the random tensor outside "
                      "the op and pass it in");
  if (!is_allocation(schema.operator_name())) {
    for (size_t e : written_entries(rec)) mark_defined(e, static_cast<int64_t>(records_.size()));
    // A call inside another: what its writes left, for the enclosing call's coverage.
    if (!frames_.empty()) {
      for (const auto& [e, st] : wrote) child_bytes_[e] = hash_bytes(st);
    }
  }
  records_.push_back(std::move(rec));
}

// Note [Version counters at a replay]: eager code bumps the version counter of every
// tensor an in-place call changes, and version checks made outside the graphs rely on it
// (autograd's saved tensors of an eager forward whose backward runs after a replayed
// optimizer step; the FP8 weight cache's stale check after a step that moves the weights by
// hand). A replay runs kernels below autograd, which bump nothing: so each replay bumps
// the counters of the caller's tensors by what the captured region bumped them, read at
// its end against their versions when a recorded call first saw them (the bump of an
// in-place call comes after the call returns, so the first sight is before the region's
// first change). The graph's own memory is left alone: nothing outside sees it.
void Recorder::note_version(const at::Tensor& t, size_t entry) {
  const at::TensorBase& root = t.is_view() ? t._base() : t;
  const c10::TensorImpl* key = root.unsafeGetTensorImpl();
  if (seen_versions_.count(key) > 0) return;
  const c10::VariableVersion& counter = root.unsafeGetTensorImpl()->version_counter();
  if (!counter.enabled()) return;  // an inference tensor: no version
  seen_versions_.emplace(key, SeenVersion{counter, counter.current_version(), entry});
}

std::vector<std::pair<c10::VariableVersion, uint32_t>> Recorder::version_changes() const {
  std::vector<std::pair<c10::VariableVersion, uint32_t>> out;
  for (const auto& [key, seen] : seen_versions_) {
    if (seen.entry >= ledger_.size() || ledger_.entry(seen.entry).ownership == allocator::Ownership::kGraph) continue;
    const uint32_t now = seen.counter.current_version();
    if (now != seen.version) out.emplace_back(seen.counter, now - seen.version);
  }
  return out;
}

std::vector<size_t> Recorder::written_entries(const OpRecord& rec) const {
  std::vector<size_t> out;
  for (const auto& a : rec.args) {
    if (!a.written) continue;
    for (const auto& t : a.tensors) {
      if (t.defined && !t.no_memory) out.push_back(t.entry);
    }
  }
  for (const auto& r : rec.returns) {
    for (size_t k = 0; k < r.tensors.size(); ++k) {
      if (k < r.fresh.size() && r.fresh[k] && r.tensors[k].defined && !r.tensors[k].no_memory) {
        out.push_back(r.tensors[k].entry);
      }
    }
  }
  return out;
}

// Note [A kernel's tensors outlive it]: a call that replays runs its kernel again, below
// autograd, and the tensors that kernel makes besides its outputs are made anew, wherever
// the allocator puts them then. A tensor the capture saw it make inside the pool and that
// outlives the call (saved for the backward by a torch.library.custom_op's setup_context,
// which runs below autograd unrecorded; kept by the kernel elsewhere) holds the capture's
// values at every replay: refused when a later replayed call reads it, or when it is still
// alive at the end of the region (eager code may read it after a replay).
void Recorder::check_kernel_internals() const {
  if (!execute_ || !allocations_ || !serial_) return;
  // The replayed call whose kernel allocated block `serial`, innermost first, other than
  // the call `reader` and the calls it is inside of; -1: none.
  auto maker = [&](int64_t serial, int64_t reader) -> int64_t {
    int64_t best = -1;
    for (size_t r = 0; r < records_.size(); ++r) {
      const OpRecord& rec = records_[r];
      if (rec.skip_at_replay || serial <= rec.allocations_before || serial > rec.allocations_after) continue;
      if (reader >= 0 && (static_cast<int64_t>(r) == reader ||
                          (static_cast<int64_t>(rec.first_child) <= reader && reader < static_cast<int64_t>(r)))) {
        continue;
      }
      if (best < 0 || rec.allocations_before >= records_[best].allocations_before) best = static_cast<int64_t>(r);
    }
    return best;
  };
  auto refuse = [&](int64_t m, const std::string& by) {
    DWGRAPH_CHECK_STATE(false, "dwgraph host graph capture: ", records_[m].op.schema().operator_name().name,
                        " made a tensor inside its kernel that is not one of its outputs and that ", by,
                        " (a tensor a torch.library.custom_op's setup_context computes and saves for the backward, or "
                        "one the kernel keeps elsewhere). A replay runs the call's kernel again, which makes that "
                        "tensor anew elsewhere: the captured one would keep the capture's values. Save only the op's "
                        "inputs and outputs for the backward (return what else it needs as an output), or compute it "
                        "in the backward. A table the kernel builds once and keeps (a cache) is made before the "
                        "captured region by a first call outside it");
  };
  // Every record's constants, skipped ones too: a replay restores them all, and the calls
  // replaying in a skipped one's place (saved.float(): aten::to's _to_copy) read them.
  for (size_t r = 0; r < records_.size(); ++r) {
    for (int64_t s : records_[r].constant_serials) {
      const int64_t m = maker(s, static_cast<int64_t>(r));
      if (m >= 0) refuse(m, c10::str(records_[r].op.schema().operator_name().name, " reads later"));
    }
  }
  std::unordered_set<int64_t> written;
  for (int64_t s : defined_) {
    if (s > 0) written.insert(s);
  }
  for (int64_t s : live_since_(first_serial_)) {
    if (written.count(s) > 0) continue;
    const int64_t m = maker(s, -1);
    if (m >= 0) refuse(m, "is still alive at the end of the captured region");
  }
}

void Recorder::mark_defined(size_t entry, int64_t writer) {
  if (writer_.size() <= entry) writer_.resize(entry + 1, -1);
  writer_[entry] = writer;
  if (!serial_) return;
  if (defined_.size() <= entry) defined_.resize(entry + 1, -1);
  defined_[entry] = serial_(ledger_.entry(entry).data);
}

int64_t Recorder::last_writer(size_t entry) const {
  if (writer_.size() <= entry) return -1;
  // On the host, only a write into this very allocation (a reused block is new memory).
  if (serial_ && !is_defined(entry)) return -1;
  return writer_[entry];
}

bool Recorder::is_defined(size_t entry) const {
  // Written by a recorded kernel into this very allocation (a reused block is new memory).
  return defined_.size() > entry && defined_[entry] == serial_(ledger_.entry(entry).data);
}

void Recorder::snapshot_constants(OpRecord& rec, const torch::jit::Stack& stack, size_t base) {
  // Note [Constants in the pool]: a graph-pool tensor a recorded call reads before any
  // recorded kernel wrote it was filled outside the dispatcher (a Python number turned
  // into a 0-dim tensor for x * 2, torch.tensor([...]) data). Its block may be freed and
  // reused later in the capture, so replay restores its bytes just before this call, as
  // CUDA bakes such values into the captured kernel. Arguments the call writes are
  // outputs (out=, in-place), not constants.
  static const bool off = std::getenv("DWGRAPH_HOST_GRAPH_NO_CONSTANTS") != nullptr;
  if (!execute_ || !serial_ || off) return;
  for (size_t i = 0; i < rec.args.size(); ++i) {
    const auto& a = rec.args[i];
    if (a.written || a.kind != ValueSlot::Kind::kTensor) continue;
    const auto& t = a.tensors[0];
    if (!t.defined || t.no_memory) continue;
    const auto& e = ledger_.entry(t.entry);
    if (e.ownership != allocator::Ownership::kGraph) continue;
    if (is_defined(t.entry)) continue;
    if (serial_(e.data) <= first_serial_) continue;  // an earlier graph's block on this pool
    // The storage as it is now (the entry may span a larger earlier use of the address).
    const c10::Storage& st = stack[base + i].toTensor().storage();
    const auto* begin = static_cast<const uint8_t*>(st.data());
    rec.constants.emplace_back(t.entry, std::vector<uint8_t>(begin, begin + st.nbytes()));
    rec.constant_serials.push_back(serial_(e.data));
    mark_defined(t.entry, /*writer=*/-1);  // restored before the call: no record wrote it
  }
}

void Recorder::refuse_data_dependent(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                                     size_t base) {
  // Boolean-mask indexing runs nonzero inside its kernel: a host sync with a data-dependent
  // shape, which a CUDA graph cannot capture.
  const auto& name = schema.operator_name().name;
  if (name != "aten::index" && name != "aten::index_put_" && name != "aten::index_put" &&
      name != "aten::_index_put_impl_") {
    return;
  }
  for (size_t i = base; i < stack.size(); ++i) {
    const auto& v = stack[i];
    if (!v.isList()) continue;
    for (const auto& e : v.toListRef()) {
      if (!e.isTensor()) continue;
      const auto dtype = e.toTensor().scalar_type();
      DWGRAPH_CHECK_STATE(dtype != at::kBool && dtype != at::kByte, "dwgraph graph capture: ", name,
                          " with a boolean mask reads a tensor's value on the host (its kernel runs "
                          "nonzero, with a data-dependent shape), which a CUDA graph cannot capture; use "
                          "torch.where or masked_fill, or move it out of the captured region");
    }
  }
}

void Recorder::restore_caller_writes() {
  for (auto& [entry, snap] : snapshots_) {
    c10::Storage& st = snap.first;
    std::memcpy(st.mutable_data(), snap.second.data(), snap.second.size());
  }
  snapshots_.clear();
}

void Recorder::restore_generator() {
  // The capture's draws are the caller's no more than its writes (helper-47: a replay right
  // after a raw capture drew the numbers of eager's next step).
  if (generator_at_begin_.defined()) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    const std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(generator_at_begin_);
    generator_at_begin_ = at::Tensor();
  }
}

}  // namespace dwgraph::graphs::detail
