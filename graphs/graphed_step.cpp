#include "graphs/graphed_step.h"

#include "common/check.h"
#include "common/log.h"
#include "graphs/caller_state.h"
#include "graphs/phase_timing.h"
#include "graphs/state_epoch.h"
#include "ops/autocast.h"
#include "ops/fp8.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace dwgraph::graphs {
namespace {

constexpr const char* kApi = "dwgraph.graphed_step";

// Whether a leaf has a .grad: TensorImpl's, without at::Tensor::grad()'s check for a
// non-leaf's .grad (an autograd call per tensor; the step's parameters and gradient-taking
// arguments are leaves).
bool has_grad(const at::Tensor& t) { return t.unsafeGetTensorImpl()->grad().defined(); }

void append_tensor_key(std::ostringstream& os, const at::Tensor& t) {
  if (!t.defined()) {
    os << "None;";
    return;
  }
  os << t.scalar_type() << t.sizes() << t.strides() << '@' << t.device() << (t.requires_grad() ? "g" : "") << ';';
}

// A graph cannot follow eager's FIFO across the step's boundary (contract C1): eagerly,
// the step's backward_dw() lands the oldest queued unit, a caller's one from before the
// call if there is one, while the graph always lands the unit its own backward queued.
// So no unit may be queued in the step's modules when it is captured or replayed.
void check_none_queued_before(const std::vector<ModuleSpec>& modules, const char* when) {
  for (const auto& m : modules) {
    if (!m.store) continue;
    const size_t n = m.store->num_units();  // work pending in other graphs is not the step's backward_dw()'s
    DWGRAPH_CHECK_STATE(n == 0, kApi, ": ", m.name, " has ", n, " deferred weight-gradient unit", n == 1 ? "" : "s",
                        " queued from before this call, ", when,
                        ". Eagerly, the step's backward_dw() would land the oldest of them; the graph lands "
                        "the step's own unit. Run their backward_dw() before calling the graphed step");
  }
}

// A field of a key or of a variant's state (describe_call()) by what it is, for the log.
std::string field_in_words(const std::string& name) {
  static const std::pair<const char*, const char*> kWords[] = {
      {"args", "positional arguments"},
      {"kwargs", "keyword arguments"},
      {"aliases", "which tensor arguments are the same tensor"},
      {"grad", "grad mode"},
      {"inference", "inference mode"},
      {"tensors", "tensor arguments"},
      {"training", "training flags"},
      {"grad_dtype", "parameters' grad_dtype"},
      {"hooks", "module hooks"},
      {"global", "global module hooks"},
      {"unwatched", "modules the step cannot watch"},
      {"gradients", "parameters' gradients"},
  };
  for (const auto& [key, words] : kWords) {
    if (name == key) return words;
  }
  return name;
}

// Tensor arguments as a reader names them: "float32[4, 8] on cpu, float32[4] on cpu
// requiring grad" (strides only when not contiguous).
std::string tensors_in_words(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return "none";
  std::ostringstream os;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (i > 0) os << ", ";
    if (!t.defined()) {
      os << "None";
      continue;
    }
    os << c10::getDtypeNames(t.scalar_type()).first << t.sizes();
    if (!t.is_contiguous()) os << " strides " << t.strides();
    os << " on " << t.device() << (t.requires_grad() ? " requiring grad" : "");
  }
  return os.str();
}

// The '|'-separated fields ("name rest") in which two descriptions differ, each with the
// part that differs, the field named in words (Note [A step that keeps capturing]):
// "hyperparameters(SGD#1): ...'lr', 0.1)... -> ...'lr', 0.09)...". At most three fields.
std::string what_changed(const std::string& before, const std::string& after) {
  auto split = [](const std::string& s) {
    std::vector<std::string> out;
    size_t start = 0;
    for (;;) {
      const size_t bar = s.find('|', start);
      out.push_back(s.substr(start, bar == std::string::npos ? std::string::npos : bar - start));
      if (bar == std::string::npos) break;
      start = bar + 1;
    }
    return out;
  };
  auto excerpt = [](const std::string& s, size_t from, size_t to) {
    constexpr size_t kContext = 24, kMost = 96;
    const size_t b = from > kContext ? from - kContext : 0;
    size_t e = std::min(s.size(), to + kContext);
    std::string out = (b > 0 ? "..." : "") + s.substr(b, std::min(e - b, kMost));
    if (e - b > kMost || e < s.size()) out += "...";
    return out;
  };
  const auto a = split(before), b = split(after);
  std::vector<std::string> parts;
  for (size_t i = 0; i < std::max(a.size(), b.size()) && parts.size() < 3; ++i) {
    if ((i < a.size() ? a[i] : "") == (i < b.size() ? b[i] : "")) continue;
    const std::string& named = i < b.size() && !b[i].empty() ? b[i] : a[i];
    const std::string name = named.substr(0, named.find(' '));
    // The values without the field's name, which field_in_words says.
    auto value = [&](const std::vector<std::string>& v) {
      if (i >= v.size()) return std::string();
      return v[i].compare(0, name.size() + 1, name + " ") == 0 ? v[i].substr(name.size() + 1) : v[i];
    };
    const std::string x = value(a), y = value(b);
    size_t p = 0;
    while (p < x.size() && p < y.size() && x[p] == y[p]) ++p;
    size_t q = 0;
    while (q < x.size() - p && q < y.size() - p && x[x.size() - 1 - q] == y[y.size() - 1 - q]) ++q;
    parts.push_back(c10::str(field_in_words(name), ": ", excerpt(x, p, x.size() - q), " -> ", excerpt(y, p, y.size() - q)));
  }
  if (parts.empty()) return "nothing it can name";
  std::string out;
  for (const auto& part : parts) out += (out.empty() ? "" : "; ") + part;
  return out;
}

}  // namespace

// What the caller gets back in .grad after a replay (Note [A step's gradients are graph state]).
enum class GradBack {
  kUntouched,  // the graph neither reads nor changes it
  kCopy,       // the step worked in place on the caller's gradient: copy the buffer into it
  kAssign,     // the step produced a new gradient tensor: the caller gets a clone
  kClear,      // the step set it to None
};

struct GradSlot {
  // The static buffer standing for the caller's .grad in the graph (when one existed at
  // the call), and whether the graph reads or writes it: then the caller's .grad is copied
  // in before every replay, whatever the step leaves in .grad afterwards.
  at::Tensor stand_in;
  bool copy_in = false;
  GradBack back = GradBack::kUntouched;
  at::Tensor out;  // kCopy: stand_in; kAssign: the tensor the step produced
  std::string name;
};

struct GraphedStep::Variant {
  std::string pattern;  // which gradients exist, which parameters require grad, where they live
  std::string id;       // short and unique for the step's lifetime (last_variant)
  std::string words;    // its tensor arguments in words (tensors_in_words), for the log
  std::unique_ptr<Graph> graph;
  StaticInputs inputs;
  std::vector<at::Tensor> static_outputs;
  std::vector<GradSlot> param_grads;
  std::vector<size_t> grad_inputs;  // indices of the inputs that require grad
  std::vector<GradSlot> input_grads;
  CapturedParameters params;
  CapturedMainGrads main_grads;
  Landing landing;  // flags and hooks (the gradients are handed back slot by slot)
  // The parameter slots the hand-off works on (copy_in, and back != kUntouched): a step
  // that leaves .grad as it found it (zero_grad(set_to_none=True) inside) costs nothing
  // per parameter there.
  std::vector<size_t> copied_in;
  std::vector<size_t> handed_back;
  // Note [A step's checks paid when state changes]: the state epoch at which `params` and
  // `main_grads` were last checked (a watched step checks them again only when it moved).
  uint64_t checked_epoch = ~uint64_t{0};
};

struct GraphedStep::Entry {
  std::list<std::string>::iterator lru_pos;  // in key_lru_
  int calls = 0;
  bool known = false;  // params and modules asked
  NamedTensors params;
  std::vector<at::Tensor> buffers;  // the modules' buffers, asked with params
  std::vector<ModuleSpec> modules;
  std::map<std::string, std::unique_ptr<Variant>> variants;
  // Note [A step's checks paid when state changes]: the variant the last full variant
  // check chose, and what it saw that no watch sees.
  struct Chosen {
    Variant* variant = nullptr;  // cleared when it is erased (erase_variant)
    uint64_t epoch = 0;
    uint64_t state_tensors_version = 0;
    std::string state;        // the front end's variant state
    std::vector<char> grads;  // .grad presence of params, then of the arguments requiring grad
  } chosen;
};

GraphedStep::GraphedStep(StepFn step, GraphedStepOptions options)
    : step_(std::move(step)), opts_(std::move(options)), pool_(opts_.pool) {
  DWGRAPH_CHECK_ARG(step_ != nullptr, kApi, ": argument 'fn' must be a callable step, got none");
  DWGRAPH_CHECK_ARG(opts_.warmup_iters >= 0, kApi, ": argument 'warmup_iters' must be >= 0, got ", opts_.warmup_iters);
  DWGRAPH_CHECK_ARG(opts_.max_graphs >= 1, kApi, ": argument 'max_graphs' must be >= 1, got ", opts_.max_graphs);
  DWGRAPH_CHECK_ARG(opts_.max_captures >= 0, kApi, ": argument 'max_captures' must be >= 0, got ", opts_.max_captures);
}

GraphedStep::~GraphedStep() { reset(); }

size_t GraphedStep::num_graphs() const { return lru_.size(); }

std::vector<std::string> GraphedStep::live_variants() const {
  std::vector<std::string> out;
  for (const auto& [key, e] : entries_) {
    for (const auto& [pattern, v] : e->variants) {
      if (v->graph) out.push_back(v->id);
    }
  }
  return out;
}

void GraphedStep::reset() {
  for (auto& [key, e] : entries_) {
    for (auto& [pattern, v] : e->variants) {
      if (v->graph) v->graph->reset();
    }
  }
  entries_.clear();
  lru_.clear();
  key_lru_.clear();
  captures_since_reset_ = 0;
  last_capture_.clear();
  last_key_.clear();
  plain_.reset();
  if (!opts_.pool) pool_.reset();
}

size_t GraphedStep::max_idle_keys() const {
  return static_cast<size_t>(std::max<int64_t>(64, 8 * opts_.max_graphs));
}

GraphedStepStats GraphedStep::stats() const {
  GraphedStepStats s;
  s.num_graphs = lru_.size();
  s.num_captures = captures_;
  s.captures_since_reset = captures_since_reset_;
  s.num_variants = variants_made_;
  s.num_keys = entries_.size();
  s.replays = replays_;
  s.eager_calls = eager_calls_;
  s.capture_limited_calls = limited_calls_;
  s.released = released_;
  s.dropped_keys = dropped_keys_;
  s.max_graphs = opts_.max_graphs;
  s.max_captures = opts_.max_captures;
  if (pool_) {
    const auto p = pool_->stats();
    s.pool_reserved_bytes = static_cast<int64_t>(p.reserved_bytes);
    s.pool_allocated_bytes = static_cast<int64_t>(p.allocated_bytes);
    s.pool_peak_allocated_bytes = static_cast<int64_t>(p.peak_allocated_bytes);
  }
  return s;
}

void GraphedStep::drop_idle_keys(const std::string& current) {
  // Note [A step that keeps capturing]: keys that hold no graph, least recently called
  // first. Keys with graphs are at most max_graphs, so the walk is short.
  while (entries_.size() > max_idle_keys()) {
    auto pos = key_lru_.end();
    bool dropped = false;
    while (pos != key_lru_.begin()) {
      --pos;
      if (*pos == current) continue;
      auto it = entries_.find(*pos);
      const bool holds = std::any_of(it->second->variants.begin(), it->second->variants.end(),
                                     [](const auto& kv) { return kv.second->graph != nullptr; });
      if (holds) continue;
      if (!warned_keys_) {
        warned_keys_ = true;
        log::warning("graphed_step ", name_, ": its key changed at every call (", entries_.size(),
                     " keys; what changed from the previous call: ", what_changed(last_key_, current),
                     "); a key is captured only after its first warmup_iters=", opts_.warmup_iters,
                     " calls, so these calls run eagerly. Pass values that change at every call as tensors "
                     "(a tensor argument's value is read by the graph), or keep them out of the step. Keys "
                     "without a graph beyond ", max_idle_keys(), " are forgotten, least recently used first");
      }
      entries_.erase(it);
      key_lru_.erase(pos);
      ++dropped_keys_;
      dropped = true;
      break;
    }
    if (!dropped) break;
  }
}

void GraphedStep::evict_until_room() {
  while (static_cast<int64_t>(lru_.size()) >= opts_.max_graphs) {
    const auto [key, pattern] = lru_.back();
    lru_.pop_back();
    auto& e = *entries_.at(key);
    auto it = e.variants.find(pattern);
    if (it == e.variants.end()) continue;
    log::info("graphed_step ", name_, ": released graph #", it->second->id, " (tensor arguments ", it->second->words,
              "), the least recently used: max_graphs=", opts_.max_graphs, " reached");
    if (it->second->graph) it->second->graph->reset();
    erase_variant(e, pattern);
    ++released_;
  }
}

std::vector<at::Tensor> GraphedStep::run_eagerly(const std::vector<at::Tensor>& tensors) {
  last_variant_.clear();
  ++eager_calls_;
  return step_(tensors);
}

std::string step_ambient(bool* autocast_on) {
  const auto autocast = ops::AutocastState::current();
  std::string text = at::GradMode::is_enabled() ? "grad 1|autocast " : "grad 0|autocast ";
  text += autocast.describe();
  text += "|fp8 ";
  text += ops::Fp8State::current().describe();
  // Grad mode reads 1 under inference_mode() with enable_grad() inside, where eager
  // autograd refuses what a graph of the same key would replay.
  if (c10::InferenceMode::is_enabled()) text += "|inference 1";
  if (autocast_on != nullptr) *autocast_on = autocast.cpu || autocast.cuda;
  return text;
}

void GraphedStep::check_arguments(const std::vector<at::Tensor>& tensors) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined()) continue;
    DWGRAPH_CHECK_ARG(!device_known_ || t.device() == device_, kApi, ": tensor argument ", i, " is on ", t.device(),
                      " but the step runs on ", device_, " (its parameters' device); move it there first");
    // A static input is a normal tensor: eager autograd cannot save an inference tensor for
    // backward, the graph's copy of it can.
    DWGRAPH_CHECK_ARG(!t.is_inference() || c10::InferenceMode::is_enabled() || !at::GradMode::is_enabled(), kApi,
                      ": tensor argument ", i,
                      " is an inference tensor (made under torch.inference_mode()) in a call with grad enabled "
                      "outside inference mode; the graph would copy it into a normal static input, which autograd "
                      "may save where eager autograd refuses to save the inference tensor. Pass a normal tensor "
                      "(clone it outside inference mode)");
    DWGRAPH_CHECK_ARG(!t.requires_grad() || t.is_leaf(), kApi, ": tensor argument ", i,
                      " requires grad and has autograd history (it is not a leaf); a graphed step cannot "
                      "backpropagate into the caller's graph. Detach it, or compute it inside the step");
  }
}

std::string GraphedStep::full_key(const std::string& key, const std::vector<at::Tensor>& tensors) {
  std::string full = key + "|tensors ";
  if (!tensors.empty()) {  // (a stream costs more than the rest of the key)
    std::ostringstream os;
    for (const auto& t : tensors) append_tensor_key(os, t);
    full += os.str();
  }
  return full;
}

void GraphedStep::called(Entry& e, const std::string& full) {
  if (e.lru_pos != key_lru_.begin()) key_lru_.splice(key_lru_.begin(), key_lru_, e.lru_pos);
  if (last_key_ != full) last_key_ = full;
  ++e.calls;
}

std::vector<at::Tensor> GraphedStep::replay_chosen(Entry& e, Variant& v, const std::string& full,
                                                   const std::vector<at::Tensor>& tensors) {
  last_variant_ = v.id;
  if (lru_.empty() || lru_.front().first != full || lru_.front().second != v.pattern) {
    // Moved to the front only when another graph ran last: the pattern holds a few bytes
    // per parameter, and copying it per call is O(parameters).
    auto id = std::make_pair(full, v.pattern);
    lru_.remove(id);
    lru_.push_front(std::move(id));
  }
  return replay(e, v, tensors);
}

std::vector<at::Tensor> GraphedStep::operator()(const std::vector<at::Tensor>& tensors, const std::string& key) {
  check_arguments(tensors);
  const std::string full = full_key(key, tensors);
  auto it = entries_.find(full);
  if (it == entries_.end()) {
    it = entries_.emplace(full, std::make_unique<Entry>()).first;
    key_lru_.push_front(full);
    it->second->lru_pos = key_lru_.begin();
    drop_idle_keys(full);
  }
  Entry& e = *it->second;
  called(e, full);
  if (e.calls <= opts_.warmup_iters) return run_eagerly(tensors);  // warmup: the real step, eagerly
  Variant& v = *variant_for(e, tensors, /*captured_only=*/false);
  last_variant_ = v.id;
  if (!v.graph) {
    if (opts_.max_captures >= 0 && captures_since_reset_ >= static_cast<size_t>(opts_.max_captures)) {
      // Note [A step that keeps capturing]: past the limit, what would be captured runs
      // eagerly (the graphs held still replay).
      if (!warned_limit_) {
        warned_limit_ = true;
        log::warning("graphed_step ", name_, ": captured ", captures_since_reset_,
                     " graphs since its last reset() (max_captures=", opts_.max_captures,
                     "); from now on a call that would capture runs eagerly (what changed from the last capture: ",
                     what_changed(last_capture_, describe_call(full, e, tensors)),
                     "). See docs/graphed-step.md, \"A step that keeps capturing\"; reset() starts counting again");
      }
      const std::string pattern = v.pattern;  // v is destroyed by the erase
      erase_variant(e, pattern);
      ++limited_calls_;
      return run_eagerly(tensors);
    }
    try {
      return capture(e, v, full, tensors);
    } catch (...) {
      const auto pattern = v.pattern;
      if (v.graph) lru_.remove(std::make_pair(full, pattern));
      erase_variant(e, pattern);  // a failed capture leaves nothing behind; the next call retries
      throw;
    }
  }
  return replay_chosen(e, v, full, tensors);
}

// Note [A step's plain call]: everything operator() does for a call that replays, and
// nothing for one that would not (no key made, no call counted, no front-end function
// asked what the step trains; the variant state may have been asked, and is asked again
// by operator(), which then decides that call as for any other). `state`: the variant
// state as the front end knows it without being asked (its binding's probe: nothing it
// reads moved since its last answer), used in place of options' variant_state.
std::optional<std::vector<at::Tensor>> GraphedStep::replay_if_captured(const std::vector<at::Tensor>& tensors,
                                                                       const std::string& key,
                                                                       const std::string* state) {
  check_arguments(tensors);
  const std::string full = full_key(key, tensors);
  auto it = entries_.find(full);
  if (it == entries_.end()) return std::nullopt;
  Entry& e = *it->second;
  if (e.calls < opts_.warmup_iters || !e.known) return std::nullopt;  // this call would be a warmup call
  Variant* v = variant_for(e, tensors, /*captured_only=*/true, state);
  if (v == nullptr) return std::nullopt;
  called(e, full);
  return replay_chosen(e, *v, full, tensors);
}

void GraphedStep::set_plain_call(std::optional<PlainCall> call) { plain_ = std::move(call); }

namespace {

// The variant of a call: the front end's variant state, then per parameter whether its
// .grad exists, whether it requires grad and where its memory is, the same of the module
// buffers (moved by `.data = ...` or set_(), which no watch sees), the memory of the state
// tensors (the optimizers'), and which tensor arguments that require grad have a .grad.
// Binary (a few bytes per parameter, no formatting): it is built at every call.
std::string pattern_of(const NamedTensors& params, const std::vector<at::Tensor>& buffers,
                       const std::vector<at::Tensor>& tensors, const std::string& state,
                       const std::vector<at::Tensor>& state_tensors) {
  std::string s = state;
  s.reserve(s.size() + 3 + (params.size() + buffers.size()) * (1 + sizeof(void*)) +
            state_tensors.size() * sizeof(void*) + tensors.size());
  s.push_back('\0');
  auto append = [&s](const void* ptr) { s.append(reinterpret_cast<const char*>(&ptr), sizeof(ptr)); };
  for (const auto& [name, p] : params) {
    s.push_back(static_cast<char>((has_grad(p) ? 1 : 0) | (p.requires_grad() ? 2 : 0)));
    append(p.data_ptr());
  }
  s.push_back('\0');
  for (const auto& b : buffers) {
    s.push_back(b.defined() && b.requires_grad() ? 'R' : '-');
    append(b.defined() && b.has_storage() ? b.data_ptr() : nullptr);
  }
  s.push_back('\0');
  for (const auto& t : state_tensors) append(t.defined() && t.has_storage() ? t.data_ptr() : nullptr);
  for (const auto& t : tensors) {
    if (t.defined() && t.requires_grad()) s.push_back(has_grad(t) ? 'G' : '-');
  }
  return s;
}

// What the fast variant check compares (Note [A step's checks paid when state changes]):
// which of the parameters and of the arguments requiring grad have a .grad, the parts of
// pattern_of() that no watch sees (zero_grad, an eager backward outside the step).
void gradients_present(const NamedTensors& params, const std::vector<at::Tensor>& tensors, std::vector<char>& out) {
  out.clear();
  out.reserve(params.size() + tensors.size());
  // After a large replay the parameters' TensorImpls and autograd metadata are out of the
  // caches, and one read after another pays each miss in turn: fetched ahead in two passes,
  // the misses overlap.
  for (const auto& [name, p] : params) __builtin_prefetch(p.unsafeGetTensorImpl());
  for (const auto& [name, p] : params) __builtin_prefetch(p.unsafeGetTensorImpl()->autograd_meta());
  for (const auto& [name, p] : params) out.push_back(has_grad(p) ? 1 : 0);
  for (const auto& t : tensors) {
    if (t.defined() && t.requires_grad()) out.push_back(has_grad(t) ? 1 : 0);
  }
}

// The same in words, for the log: "gradients 0.weight (.grad set, trainable, at 0x...); ...".
std::string gradients_in_words(const NamedTensors& params, const std::vector<at::Tensor>& tensors) {
  std::ostringstream os;
  os << "gradients ";
  for (const auto& [name, p] : params) {
    os << name << " (.grad " << (p.grad().defined() ? "set" : "None") << ", " << (p.requires_grad() ? "trainable" : "frozen")
       << ", at " << p.data_ptr() << "); ";
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.defined() && t.requires_grad()) os << "tensor argument " << i << " (.grad " << (t.grad().defined() ? "set" : "None") << "); ";
  }
  return os.str();
}

}  // namespace

void GraphedStep::erase_variant(Entry& e, const std::string& pattern) {
  auto it = e.variants.find(pattern);
  if (it == e.variants.end()) return;
  if (e.chosen.variant == it->second.get()) e.chosen = Entry::Chosen{};
  e.variants.erase(it);
}

// Note [A step's checks paid when state changes] (contract C10): the full variant of a call
// (pattern_of) reads every parameter's and buffer's requires_grad and memory and every state
// tensor's memory. When the front end watches all of those (set_watched), they change only
// with the state epoch: a call whose epoch, state tensors and variant state are those of
// the last full check, and whose gradients exist where they did, selects the same variant
// without reading the rest. Any difference takes the full check, which decides as before.
GraphedStep::Variant* GraphedStep::variant_for(Entry& e, const std::vector<at::Tensor>& tensors, bool captured_only,
                                               const std::string* known_state) {
  const uint64_t epoch = state_epoch();  // read first: a change while reading is seen next time
  std::string asked;  // the front end's answer, where it is asked
  if (known_state == nullptr && opts_.variant_state) asked = opts_.variant_state();
  const std::string& state = known_state != nullptr ? *known_state : asked;
  Entry::Chosen& c = e.chosen;
  if (watched_ && c.variant && c.variant->graph && c.epoch == epoch &&
      c.state_tensors_version == state_tensors_version_ && c.state == state) {
    gradients_present(e.params, tensors, grads_now_);
    if (grads_now_ == c.grads) return c.variant;
  }
  if (!e.known) {
    if (captured_only) return nullptr;
    e.params = opts_.params ? opts_.params() : NamedTensors{};
    e.buffers = opts_.buffers ? opts_.buffers() : std::vector<at::Tensor>{};
    e.modules = opts_.modules ? opts_.modules() : std::vector<ModuleSpec>{};
    e.known = true;
  }
  std::string pattern = pattern_of(e.params, e.buffers, tensors, state, state_tensors_);
  auto it = e.variants.find(pattern);
  if (it == e.variants.end() || !it->second->graph) {
    if (captured_only) return nullptr;  // operator() asks again, as for any call that captures
    // About to capture: what the step trains may have grown since (a parameter unfrozen).
    e.params = opts_.params ? opts_.params() : NamedTensors{};
    e.buffers = opts_.buffers ? opts_.buffers() : std::vector<at::Tensor>{};
    e.modules = opts_.modules ? opts_.modules() : std::vector<ModuleSpec>{};
    pattern = pattern_of(e.params, e.buffers, tensors, state, state_tensors_);
    it = e.variants.find(pattern);
  }
  if (it == e.variants.end()) {
    it = e.variants.emplace(pattern, std::make_unique<Variant>()).first;
    it->second->pattern = pattern;
    it->second->id = std::to_string(++variants_made_);
  }
  c.variant = it->second.get();
  c.epoch = epoch;
  c.state_tensors_version = state_tensors_version_;
  c.state = state;
  gradients_present(e.params, tensors, c.grads);
  return it->second.get();
}

std::string GraphedStep::describe_call(const std::string& key, const Entry& e, const std::vector<at::Tensor>& tensors) const {
  std::string state = opts_.describe_state ? opts_.describe_state() : (opts_.variant_state ? opts_.variant_state() : "");
  // The key's own tensor field (append_tensor_key's compact text) in words.
  const size_t at = key.rfind("|tensors ");
  const std::string front = at == std::string::npos ? key : key.substr(0, at);
  return c10::str(front, "|tensors ", tensors_in_words(tensors), '|', state, '|', gradients_in_words(e.params, tensors));
}

std::vector<at::Tensor> GraphedStep::capture(Entry& e, Variant& v, const std::string& key,
                                             const std::vector<at::Tensor>& tensors) {
  const auto start = std::chrono::steady_clock::now();
  if (!e.params.empty()) {
    device_ = e.params[0].second.device();
  } else {
    for (const auto& t : tensors) {
      if (t.defined()) {
        device_ = t.device();
        break;
      }
    }
  }
  device_known_ = true;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : e.params) {
    DWGRAPH_CHECK_ARG(p.device() == device_, kApi, ": parameter '", name, "' is on ", p.device(),
                      " but the step's other parameters are on ", device_);
    DWGRAPH_CHECK_STATE(p.layout() == at::kStrided && (!p.grad().defined() || p.grad().layout() == at::kStrided),
                        kApi, ": parameter '", name, "' or its .grad is ",
                        p.layout() == at::kStrided ? p.grad().layout() : p.layout(),
                        "; graphs capture strided tensors only (for a sparse nn.Embedding, pass sparse=False or "
                        "run it outside the step)");
    names.push_back(name);
    params.push_back(p);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    DWGRAPH_CHECK_ARG(!tensors[i].defined() || tensors[i].device() == device_, kApi, ": tensor argument ", i, " is on ",
                      tensors[i].device(), " but the step runs on ", device_,
                      " (its parameters' device); move it there first");
  }
  evict_until_room();
  if (!pool_) pool_ = make_pool(device_);
  v.inputs = StaticInputs(tensors);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined() && tensors[i].requires_grad()) v.grad_inputs.push_back(i);
  }
  std::vector<FusedParameter> fused;
  CallerState state;
  state.device = device_;
  state.parameter_contents = device_.is_cpu();  // the host backend runs the captured kernels
  state.parameters = params;
  if (opts_.buffers) state.buffers = opts_.buffers();
  for (const auto& m : e.modules) {
    fused.insert(fused.end(), m.fused.begin(), m.fused.end());
    if (m.store) state.stores.push_back(m.store);
  }
  state.fused = fused;
  check_none_queued_before(e.modules, "which it would capture");
  std::vector<at::Tensor> outs;
  auto graph = make_graph(device_);
  std::vector<const ops::WgradStore*> step_stores;
  for (const auto& m : e.modules) {
    if (m.store) step_stores.push_back(m.store.get());
  }
  ops::HookRunRecording hook_runs(std::move(step_stores));  // Note [Hook runs a capture saw]
  {
    const CallerStateGuard guard(std::move(state));
    // The gradients as this call sees them (Note [A step's gradients are graph state]).
    auto stand_in = [](const at::Tensor& leaf, bool exists, const at::Tensor& caller_grad, GradSlot& slot) {
      at::Tensor s;
      if (exists) {
        const at::NoGradGuard no_grad;
        s = at::empty_like(caller_grad);
        s.copy_(caller_grad);
      }
      leaf.mutable_grad() = s;
      slot.stand_in = s;
    };
    v.param_grads.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      v.param_grads[i].name = c10::str("parameter '", names[i], "'");
      stand_in(params[i], params[i].grad().defined(), params[i].grad(), v.param_grads[i]);
    }
    v.input_grads.resize(v.grad_inputs.size());
    for (size_t k = 0; k < v.grad_inputs.size(); ++k) {
      const size_t i = v.grad_inputs[k];
      v.input_grads[k].name = c10::str("tensor argument ", i);
      stand_in(v.inputs.tensors()[i], tensors[i].grad().defined(), tensors[i].grad(), v.input_grads[k]);
    }
    graph->set_name(c10::str("graph of the step for key '", key, "'"));
    for (size_t i = 0; i < v.inputs.tensors().size(); ++i) {
      if (v.inputs.tensors()[i].defined()) graph->set_role(v.inputs.tensors()[i].storage(), c10::str("static input ", i), true);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      graph->set_role(params[i].storage(), c10::str("parameter '", names[i], "'"), true);
      if (v.param_grads[i].stand_in.defined()) {
        graph->set_role(v.param_grads[i].stand_in.storage(), c10::str(".grad of parameter '", names[i], "'"), true);
      }
    }
    for (const auto& f : fused) graph->set_role(f.main_grad().storage(), c10::str("main_grad of parameter '", f.name, "'"), true);
    // Note [Host work around a replay]: the step's own kernels (its optimizer step) read
    // the gradients a collective hoisted after the replay would write.
    graph->refuse_after_calls(c10::str(
        kApi, ": the step hands work to the host after its replay (the reduce-scatter of a sharded weight's "
        "gradient, dwgraph.distributed.ShardedWeight); inside one graph of the whole step, the optimizer would read "
        "that gradient before it arrives. Graph the model with dwgraph.make_graphed_callables (its backward_dw() "
        "reduces after each replay) and keep the optimizer step outside the graph"));
    graph->capture_begin(pool_);
    try {
      outs = step_(v.inputs.tensors());
    } catch (...) {
      graph->capture_abort();
      for (size_t k = 0; k < v.grad_inputs.size(); ++k) v.inputs.tensors()[v.grad_inputs[k]].mutable_grad() = at::Tensor();
      throw;
    }
    graph->capture_end();
    // Work the step queues and leaves to the caller would be queued once, at capture:
    // replays cannot hand a unit to code outside the graph.
    for (const auto& m : e.modules) {
      if (!m.store) continue;
      const size_t n = m.store->num_units();
      DWGRAPH_CHECK_STATE(n == 0, kApi, ": the step leaves ", n, " deferred weight-gradient unit", n == 1 ? "" : "s",
                          " queued in ", m.name,
                          " (its backward runs inside the step, its backward_dw() does not); a graph cannot hand "
                          "queued work to code outside it. Call backward_dw() inside the step, or leave "
                          "loss.backward() outside it too");
    }
    // What the step left in each .grad decides what the caller gets back.
    auto settle = [&](const at::Tensor& leaf, GradSlot& slot) {
      const at::Tensor f = leaf.grad();
      const at::Tensor& s = slot.stand_in;
      slot.copy_in = s.defined() && graph->touches(s.storage());
      if (s.defined() && f.defined() && f.unsafeGetTensorImpl() == s.unsafeGetTensorImpl()) {
        slot.back = slot.copy_in ? GradBack::kCopy : GradBack::kUntouched;
        slot.out = s;
      } else if (!f.defined()) {
        slot.back = s.defined() ? GradBack::kClear : GradBack::kUntouched;
      } else {
        DWGRAPH_CHECK_STATE(graph->writes(f.storage()), kApi, ": the step sets the .grad of ", slot.name,
                            " to a tensor the captured kernels do not produce; assign gradients computed inside "
                            "the step");
        slot.back = GradBack::kAssign;
        slot.out = f;
      }
      if (!slot.copy_in) slot.stand_in = at::Tensor();  // nothing reads it: no need to keep it
      leaf.mutable_grad() = at::Tensor();
    };
    for (size_t i = 0; i < params.size(); ++i) {
      settle(params[i], v.param_grads[i]);
      if (v.param_grads[i].copy_in) v.copied_in.push_back(i);
      if (v.param_grads[i].back != GradBack::kUntouched) v.handed_back.push_back(i);
    }
    for (size_t k = 0; k < v.grad_inputs.size(); ++k) settle(v.inputs.tensors()[v.grad_inputs[k]], v.input_grads[k]);
  }
  for (const auto& o : outs) v.static_outputs.push_back(o.defined() ? o.detach() : at::Tensor());
  v.inputs.note_writes(*graph);
  v.params = CapturedParameters(names, params);
  std::vector<FusedParameter> written;
  for (const auto& f : fused) {
    if (graph->writes(f.main_grad().storage())) written.push_back(f);
  }
  v.main_grads = CapturedMainGrads(written);
  for (const auto& f : written) {
    if (f.set_flag) v.landing.flags.push_back(FlagSetter{[f] { f.set_flag(true); }});
  }
  // Note [Hook runs a capture saw]: the modules' hooks as often and in the order the capture
  // met their runs; modules without a store once per call, after those.
  const auto runs = hook_runs.take();
  DWGRAPH_CHECK_STATE(runs.has_value(), kApi, ": another graphed step that shares a module with this one captured "
                      "on another thread at the same time, so which wgrad-hook runs were whose cannot be told; "
                      "capture them one at a time (call each once on one thread first). Nothing was kept of this "
                      "capture.");
  for (const ops::WgradStore* store : *runs) {
    for (const auto& m : e.modules) {
      if (m.run_hooks && m.store.get() == store) {
        v.landing.add_hook(ModuleHooks{m.run_hooks, m.store, {}});
        break;
      }
    }
  }
  for (const auto& m : e.modules) {
    if (m.run_hooks && !m.store) v.landing.add_hook(ModuleHooks{m.run_hooks, m.store, {}});
  }
  v.graph = std::move(graph);
  ++captures_;
  ++captures_since_reset_;
  lru_.emplace_front(key, v.pattern);
  v.words = tensors_in_words(tensors);
  std::string change;  // for the INFO line: which graph this is, in words
  {
    // Note [A step that keeps capturing].
    std::string words = describe_call(key, e, tensors);
    change = last_capture_.empty()
                 ? c10::str(captures_ == 1 ? "its first" : "its first since reset()", "; tensor arguments ", v.words)
                 : c10::str("what changed from the previous capture: ", what_changed(last_capture_, words));
    if (!warned_storm_ && static_cast<int64_t>(captures_since_reset_) > opts_.max_graphs) {
      warned_storm_ = true;
      log::warning("graphed_step ", name_, ": captured ", captures_since_reset_, " graphs, more than it holds (max_graphs=",
                   opts_.max_graphs, "), so it keeps capturing instead of replaying (what changed from the previous "
                   "capture: ", what_changed(last_capture_, words), "). A value the graph bakes in changes between "
                   "calls: see docs/graphed-step.md, \"A step that keeps capturing\". After max_captures=",
                   opts_.max_captures, " captures it runs such calls eagerly");
    }
    last_capture_ = std::move(words);
  }
  if (log::enabled(log::Level::kInfo)) {
    const auto pool_stats = pool_->stats();
    char time[32];
    std::snprintf(time, sizeof(time), "%.3f s",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    log::info("graphed_step ", name_, ": captured graph #", v.id, " (", change, ") in ", time, ": ",
              v.graph->num_kernels(), " kernels; pool ", log::format_bytes(pool_stats.reserved_bytes), " reserved, ",
              log::format_bytes(pool_stats.allocated_bytes), " live");
  }
  // The capture changed nothing the caller sees; this call's step happens by replaying.
  return replay(e, v, tensors);
}

std::vector<at::Tensor> GraphedStep::replay(Entry& e, Variant& v, const std::vector<at::Tensor>& tensors) {
  // Note [A step's checks paid when state changes]: what these read moves the epoch when
  // the step is watched.
  const uint64_t epoch = state_epoch();
  if (!watched_ || v.checked_epoch != epoch) {
    v.params.check(kApi);
    v.main_grads.check(kApi);
    v.checked_epoch = watched_ ? epoch : ~uint64_t{0};
  }
  check_none_queued_before(e.modules, "which it would replay");
  v.inputs.check(tensors, kApi);
  // Every gradient the graph reads must fit its buffer, checked before anything is written.
  auto check_grad = [](const at::Tensor& caller, const GradSlot& slot) {
    if (!slot.copy_in) return;
    DWGRAPH_CHECK_ARG(caller.defined() && caller.scalar_type() == slot.stand_in.scalar_type() &&
                          caller.sizes() == slot.stand_in.sizes() && caller.device() == slot.stand_in.device(),
                      kApi, ": .grad of ", slot.name, " is ", describe(caller), " but the graph was captured with ",
                      describe(slot.stand_in), " (no silent cast); reset() the step after changing gradient dtypes");
  };
  const auto& params = v.params.tensors();
  for (const size_t i : v.copied_in) check_grad(params[i].grad(), v.param_grads[i]);
  for (size_t k = 0; k < v.grad_inputs.size(); ++k) check_grad(tensors[v.grad_inputs[k]].grad(), v.input_grads[k]);
  ++replays_;
  uint64_t replay_ns = 0, copy_ns = 0;  // phase_timing.h: the overhead benchmark subtracts them
  {
    const ScopedNs t(&copy_ns);
    v.inputs.copy_in(tensors);
    const at::NoGradGuard no_grad;
    for (const size_t i : v.copied_in) v.param_grads[i].stand_in.copy_(params[i].grad());
    for (size_t k = 0; k < v.grad_inputs.size(); ++k) {
      if (v.input_grads[k].copy_in) v.input_grads[k].stand_in.copy_(tensors[v.grad_inputs[k]].grad());
    }
  }
  {
    const ScopedNs t(&replay_ns);
    v.graph->replay();
  }
  {
    const ScopedNs t(&copy_ns);
    v.inputs.copy_back(tensors);
    const at::NoGradGuard no_grad;
    auto give_back = [](const at::Tensor& leaf, const GradSlot& slot) {
      switch (slot.back) {
        case GradBack::kUntouched:
          break;
        case GradBack::kCopy:
          leaf.grad().copy_(slot.out);
          break;
        case GradBack::kAssign:
          leaf.mutable_grad() = slot.out.clone();
          break;
        case GradBack::kClear:
          leaf.mutable_grad() = at::Tensor();
          break;
      }
    };
    for (const size_t i : v.handed_back) give_back(params[i], v.param_grads[i]);
    for (size_t k = 0; k < v.grad_inputs.size(); ++k) give_back(tensors[v.grad_inputs[k]], v.input_grads[k]);
  }
  v.landing.land();
  // Fresh tensors the caller owns, as an eager step returns.
  std::vector<at::Tensor> out;
  {
    const ScopedNs t(&copy_ns);
    out.reserve(v.static_outputs.size());
    for (const auto& o : v.static_outputs) out.push_back(o.defined() ? layout_copy(o) : at::Tensor());
  }
  add_phase_time(TimedPhase::kStep, replay_ns, copy_ns, true);
  return out;
}

}  // namespace dwgraph::graphs
