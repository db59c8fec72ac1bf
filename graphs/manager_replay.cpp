// The replay half of the GraphManager: calls, the graphed backward node, backward_dw()
// and its hand-off (graphs/manager_impl.h, Note [Slot states]).
#include "graphs/manager_impl.h"

#include "common/autograd_node.h"
#include "common/check.h"
#include "common/log.h"
#include "graphs/state_epoch.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <limits>
#include <unordered_set>

namespace dwgraph::graphs {
namespace {

WatchedVersion watch(const at::Tensor& t, size_t index, const char* what = "input", bool hold = false) {
  const auto& counter = torch::autograd::impl::version_counter(t);
  return WatchedVersion{counter, counter.current_version(), index, what, hold ? t : at::Tensor()};
}

// Note [Parameter gradients through one node]: kept by its slot for the slot's life; its
// one input is the token a call's node sends it, its edges lead to the parameters.
//
// Note [Parameter hooks in autograd's order]: the engine runs the AccumulateGrad nodes one
// node makes ready in no fixed order (its ready queue is a heap and they share one
// priority), which only the parameters' tensor hooks can tell. While some parameter of the
// slot has one (looked at when a leaf's hooks change, tensor_hook_epoch), a call's node
// leads to a chain instead: its head hands the first parameter's gradient and passes the
// token to a relay, which hands the next, and so on, in the order the captured backward
// reached them (recorded at capture). Both have the priority just below AccumulateGrad's,
// so each parameter's AccumulateGrad and hooks run before the next relay, and the whole
// hand-off right after the callable's backward, before other nodes: where and in the order
// eager's backward runs them. A relay costs an engine node (a few microseconds here), hence
// only with hooks. Not seen, so in the engine's order: hooks first registered between a
// call's forward and its backward (the forward chose), hooks on the AccumulateGrad nodes
// themselves, hooks registered from C++ after the first call. The order among three or
// more parameters one node feeds is the capture's: eager's engine breaks that tie by what
// else its ready queue holds. Modules without deferral run their wgrad hooks in the same
// reach order (manager_capture.cpp).
constexpr uint64_t kRelayPriority = std::numeric_limits<uint64_t>::max() - 1;

// Note [Parameter gradients through one node]: up to this many parameter edges, and while
// no parameter of the slot has a tensor hook, a call's node has the edges to the
// parameters itself and returns their gradients: the engine runs one node fewer (a few
// microseconds a backward here, a tenth of a small layer's step), and the edges a call
// copies stay bounded (contract C10). Without hooks the order of the AccumulateGrad nodes
// is not seen; with hooks the chain decides it, as before.
constexpr size_t kDirectParamEdges = 16;

// The chain's relays each hand on one parameter's gradient of the set their token names
// (ParamGradStash::take_one): a backward of the same slot that runs between two relays (a
// parameter's hook starts one) has its own token and set (a review found a chain-wide
// pending list overwritten by the nested backward's).
class ParamGradRelay final : public torch::autograd::Node {
 public:
  ParamGradRelay(std::shared_ptr<ParamGradStash> stash, size_t index)
      : Node(kRelayPriority), stash_(std::move(stash)), index_(index) {}
  std::string name() const override { return "dwgraph::GraphedParameterGrads"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(num_outputs());
    if (grads.empty() || !grads[0].defined()) return out;
    out[0] = stash_->take_one(grads[0], index_);
    if (out.size() > 1) out[1] = std::move(grads[0]);  // the token, on to the next relay
    return out;
  }

 private:
  std::shared_ptr<ParamGradStash> stash_;
  size_t index_;
};

class ParamGradNode final : public torch::autograd::Node {
 public:
  // `chain`: false for the node with an edge per parameter, true for the chain's head.
  ParamGradNode(std::shared_ptr<ParamGradStash> stash, bool chain)
      : Node(kRelayPriority), stash_(std::move(stash)), chain_(chain) {}
  std::string name() const override { return "dwgraph::GraphedParameterGrads"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (grads.empty() || !grads[0].defined()) return torch::autograd::variable_list(num_outputs());
    if (!chain_) return stash_->take(grads[0]);
    torch::autograd::variable_list out(num_outputs());
    out[0] = stash_->take_one(grads[0], 0);
    if (out.size() > 1) out[1] = std::move(grads[0]);
    return out;
  }

 private:
  std::shared_ptr<ParamGradStash> stash_;
  bool chain_;
};

class GraphedBackward final : public torch::autograd::Node {
 public:
  GraphedBackward(std::shared_ptr<GraphManager> m, size_t slot, uint64_t generation)
      : manager_(std::move(m)), slot_(slot), generation_(generation) {}
  // An output the backward graph reads (saved for backward): changing it in place before
  // the backward is an error, as eager autograd's saved-tensor version check makes it.
  void watch_output(const at::Tensor& t, size_t index) { watched_outputs_.push_back(watch(t, index)); }
  // Likewise an input whose static copy it reads (the eager ops saved the input).
  void watch_input(const at::Tensor& t, size_t index) { watched_inputs_.push_back(watch(t, index)); }
  // Note [State saved for the backward]: their versions at this call.
  void watch_saved(std::shared_ptr<const SavedState> saved) {
    saved_versions_.clear();
    saved_versions_.reserve(saved->counters.size());
    for (const auto& c : saved->counters) saved_versions_.push_back(c.current_version());
    saved_ = std::move(saved);
  }
  // Which of the slot's modules without deferral had hooks at this call's forward
  // (Landing::hooked_now): theirs run after this backward, as eager's forward decides.
  void set_hooked_at_forward(std::vector<uint8_t> hooked) { hooked_at_forward_ = std::move(hooked); }
  // Its edges lead to the parameters themselves, not to the slot's parameter node.
  void set_direct_params(bool direct) { direct_params_ = direct; }
  ~GraphedBackward() override { manager_->node_released(slot_, generation_); }
  std::string name() const override { return "dwgraph::GraphedBackward"; }

  // Called by the engine after a backward without retain_graph, as for nodes that free
  // their saved tensors: a later backward through this node is refused, as eager's is.
  void release_variables() override {
    released_ = true;
    manager_->node_done(slot_, generation_);
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    DWGRAPH_CHECK_STATE(!released_, "dwgraph: backward through a graphed call a second time, but the first "
                        "backward did not keep the graph; specify retain_graph=True the first time (as eager "
                        "autograd requires)");
    DWGRAPH_CHECK_STATE(!at::GradMode::is_enabled(), "dwgraph: a backward with create_graph=True (a double "
                        "backward, a gradient penalty) through a graphed call: the backward graph computes "
                        "gradients without an autograd graph of its own. Run that part eagerly");
    for (const auto& w : watched_outputs_) {
      DWGRAPH_CHECK_STATE(w.counter.current_version() == w.version, "dwgraph: output ", w.index,
                          " of a graphed call was modified by an inplace operation after the call, but the "
                          "backward needs its value (as eager autograd, which refuses this too)");
    }
    for (const auto& w : watched_inputs_) {
      DWGRAPH_CHECK_STATE(w.counter.current_version() == w.version, "dwgraph: input ", w.index,
                          " of a graphed call was modified by an inplace operation after the call, but the "
                          "backward needs its value (as eager autograd, which refuses this too)");
    }
    for (size_t i = 0; saved_ && i < saved_versions_.size(); ++i) {
      const uint32_t now = saved_->counters[i].current_version();
      DWGRAPH_CHECK_STATE(now == saved_versions_[i], "dwgraph: ", manager_->where(slot_), ": '", saved_->names[i],
                          "', which the forward saved for the backward, was modified by an inplace operation after "
                          "the call (version ", saved_versions_[i], ", now ", now, "), but the backward needs the "
                          "value the call used (as eager autograd, which refuses this too). Change it after the "
                          "backward (an optimizer step after the last microbatch's backward)");
    }
    // Note [Autocast in the backward]: the engine runs this in the state backward() was called in.
    const ops::AutocastState now = ops::AutocastState::current();
    const ops::AutocastState& captured = manager_->backward_autocast();
    DWGRAPH_CHECK_STATE(now.same_where_on(captured), manager_->where(slot_), ": a backward with autocast ", now.describe(),
                        " through a graphed call whose backward graph was captured with autocast ",
                        captured.describe(), "; the autograd engine runs a backward in the autocast state it is "
                        "started in, and the graph replays its capture's. ",
                        captured.cpu || captured.cuda
                            ? "Call backward() inside the autocast region, as at capture, or capture without "
                              "backward_under_autocast=True"
                            : "Call backward() outside the autocast region (as torch recommends), or capture "
                              "with backward_under_autocast=True");
    // Note [What a backward asked for]: what the engine's graph task asks of each target.
    const size_t ni = manager_->num_grad_inputs(slot_);
    const auto& accumulators = manager_->accumulators(slot_);
    std::vector<uint8_t> asked;
    const auto* info = torch::autograd::get_current_graph_task_exec_info();
    if (info != nullptr && !info->empty()) {
      // A parameter is asked for when its AccumulateGrad is (an output of the graph task,
      // or on the way to one), whether or not an edge of ours leads there.
      asked.assign(ni + accumulators.size(), 0);
      for (size_t k = 0; k < ni; ++k) asked[k] = task_should_compute_output(k) ? 1 : 0;
      for (size_t j = 0; j < accumulators.size(); ++j) {
        auto it = accumulators[j] ? info->find(accumulators[j].get()) : info->end();
        asked[ni + j] = it != info->end() && it->second.should_execute() ? 1 : 0;
      }
    }
    BackwardResult result = manager_->backward(slot_, generation_, grads, asked, direct_params_);
    if (!manager_->after_backward(slot_).empty()) {
      // After autograd has accumulated what this node returns: at the end of the backward.
      torch::autograd::Engine::get_default_engine().queue_callback(
          [m = manager_, s = slot_, live = std::move(result.live), reached = std::move(result.reached),
           hooked = hooked_at_forward_] { m->after_backward(s).land(live, &hooked, &reached); });
    }
    return std::move(result.grads);
  }

 private:
  std::shared_ptr<GraphManager> manager_;
  size_t slot_;
  uint64_t generation_;
  bool released_ = false;
  bool direct_params_ = false;
  std::vector<WatchedVersion> watched_outputs_, watched_inputs_;
  std::shared_ptr<const SavedState> saved_;
  std::vector<uint32_t> saved_versions_;
  std::vector<uint8_t> hooked_at_forward_;
};

// A plain alias of `t` (no autograd view tracking), so a node can own its history.
at::Tensor plain_alias(const at::Tensor& t) {
  const at::AutoDispatchBelowADInplaceOrView below;
  return t.view(t.sizes());
}

}  // namespace

at::Tensor ParamGradStash::put(std::vector<at::Tensor> grads) {
  const std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < sets_.size();) {
    if (sets_[i].token.use_count() == 1) {  // its backward ended without handing it all on
      release_locked(sets_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  at::Tensor token;
  if (free_tokens_.empty()) {
    token = at::zeros({}, token_options_);
  } else {
    token = std::move(free_tokens_.back());
    free_tokens_.pop_back();
  }
  sets_.push_back(Set{token, std::move(grads), 0});
  return token;
}

std::vector<ParamGradStash::Set>::iterator ParamGradStash::find_locked(const at::Tensor& token) {
  auto it = std::find_if(sets_.begin(), sets_.end(), [&](const Set& e) {
    return e.token.unsafeGetTensorImpl() == token.unsafeGetTensorImpl();
  });
  // Not found: another tensor reached the parameter node (a hook on it replaced the token):
  // the oldest set, as one set per backward lands in order.
  return it == sets_.end() ? sets_.begin() : it;
}

void ParamGradStash::release_locked(std::vector<Set>::iterator it) {
  free_tokens_.push_back(std::move(it->token));
  sets_.erase(it);
}

std::vector<at::Tensor> ParamGradStash::take(const at::Tensor& token) {
  const std::lock_guard<std::mutex> lock(mu_);
  std::vector<at::Tensor> out;
  const auto it = find_locked(token);
  if (it != sets_.end()) {
    out = std::move(it->grads);
    release_locked(it);
  }
  out.resize(n_);
  return out;
}

at::Tensor ParamGradStash::take_one(const at::Tensor& token, size_t index) {
  const std::lock_guard<std::mutex> lock(mu_);
  const auto it = find_locked(token);
  if (it == sets_.end()) return at::Tensor();
  at::Tensor out = index < it->grads.size() ? std::move(it->grads[index]) : at::Tensor();
  if (++it->taken >= n_) release_locked(it);
  return out;
}

void PooledWrite::add(const std::shared_ptr<GraphPool>& p, std::string name, const std::vector<at::Tensor>& buffers) {
  std::vector<MemoryAccess> writes;
  for (const auto& t : buffers) {
    if (!t.defined() || t.numel() == 0) continue;
    const auto [begin, end] = byte_span(t);  // a static input with gaps: the copy writes its whole reach
    writes.push_back(MemoryAccess{begin, end, MemoryAccess::Kind::kWrite});
  }
  remove();
  if (writes.empty()) return;
  pool = p;
  id = pool->order().add_graph(std::move(name), writes);
}

void PooledWrite::check() const {
  if (id) pool->order().check_replay(*id);
}

void PooledWrite::done() {
  if (id) pool->order().replayed(*id);
}

void PooledWrite::abandon_for(const Graph& reader) {
  if (id && reader.order_id()) pool->order().abandon(*id, *reader.order_id());
}

void PooledWrite::remove() noexcept {
  if (id && pool) pool->order().remove_graph(*id);
  id.reset();
  pool.reset();
}

void GraphManager::make_param_node(size_t s) {
  Slot& slot = slots_[s];
  const auto& c = callables_[slot.info.callable];
  slot.param_node = dwgraph::detail::NodePtr();
  slot.param_chain = dwgraph::detail::NodePtr();
  slot.param_relays.clear();
  slot.hooks_epoch = 0;
  slot.param_node_edges.clear();
  slot.param_edges_given.clear();
  slot.accumulators.clear();
  // Every parameter that requires grad, deferred-only ones too: a partial backward that
  // asks for a deferred weight alone (backward(inputs=[w])) must reach this slot's node,
  // as it reaches an eager deferred module's, whose unit it then queues.
  std::vector<torch::autograd::Edge> to_param;
  for (size_t j = 0; j < slot.grad_param_indices.size(); ++j) {
    to_param.push_back(torch::autograd::impl::gradient_edge(c.parameters[slot.grad_param_indices[j]]));
    slot.accumulators.push_back(to_param.back().function);
  }
  if (to_param.empty()) return;
  // Note [Parameter hooks in autograd's order]: edge e hands parameter param_order[e]. A
  // parameter no output reaches (a submodule the forward does not use) gets no edge, so its
  // AccumulateGrad and hooks do not run, as in eager (the engine would run them with None).
  std::vector<uint8_t> seen(to_param.size(), 0);
  const size_t ni = slot.grad_input_indices.size();
  for (size_t j = 0; j < seen.size(); ++j) {
    if (ni + j < slot.reached.size() && !slot.reached[ni + j]) seen[j] = 1;
  }
  for (size_t j : slot.param_order) {
    if (j < seen.size() && !seen[j]) slot.param_node_edges.push_back(j), seen[j] = 1;
  }
  for (size_t j = 0; j < seen.size(); ++j) {
    if (!seen[j]) slot.param_node_edges.push_back(j);
  }
  // The edges the backward graph gives a gradient (not a deferred weight's): the only ones a
  // backward visits (contract C10: a tree of deferred layers costs no visit per weight).
  for (size_t e = 0; e < slot.param_node_edges.size(); ++e) {
    const size_t k = ni + slot.param_node_edges[e];
    if (k < slot.static_grad_inputs.size() && slot.static_grad_inputs[k].defined()) slot.param_edges_given.push_back(e);
  }
  const size_t n = slot.param_node_edges.size();
  if (n == 0) return;
  slot.param_token = at::zeros({}, at::TensorOptions().device(device_));
  slot.param_grads = std::make_shared<ParamGradStash>(n, slot.param_token.options());
  {
    torch::autograd::edge_list edges;
    for (size_t j : slot.param_node_edges) edges.push_back(to_param[j]);
    auto node = dwgraph::detail::make_node<ParamGradNode>(slot.param_grads, false);
    node->set_next_edges(std::move(edges));
    node->add_input_metadata(slot.param_token);
    slot.param_node = node;
  }
  if (n < 2) return;
  // Note [Parameter hooks in autograd's order]: the chain, built from its end (a node's
  // edges are set before it has a parent).
  std::vector<dwgraph::detail::NodePtr> chain;
  chain.push_back(dwgraph::detail::make_node<ParamGradNode>(slot.param_grads, true));
  for (size_t e = 1; e < n; ++e) chain.push_back(dwgraph::detail::make_node<ParamGradRelay>(slot.param_grads, e));
  for (size_t e = n; e-- > 0;) {
    torch::autograd::edge_list edges{to_param[slot.param_node_edges[e]]};
    if (e + 1 < n) edges.emplace_back(chain[e + 1], 0);
    chain[e]->set_next_edges(std::move(edges));
    chain[e]->add_input_metadata(slot.param_token);
  }
  slot.param_chain = chain.front();
  slot.param_relays.assign(chain.begin() + 1, chain.end());
}

bool GraphManager::has_param_hooks(size_t s) {
  Slot& slot = slots_.at(s);
  const uint64_t epoch = tensor_hook_epoch();
  if (slot.hooks_epoch != epoch) {
    const auto& c = callables_[slot.info.callable];
    bool any = false;
    for (size_t j : slot.grad_param_indices) {
      const auto& p = c.parameters[j];
      if (torch::autograd::impl::get_autograd_meta(p) == nullptr) continue;
      any = any || !torch::autograd::impl::hooks(p).empty() || torch::autograd::impl::post_acc_grad_hooks(p) != nullptr;
    }
    slot.param_hooks = any;
    slot.hooks_epoch = epoch;
  }
  return slot.param_hooks;
}

void GraphManager::check_live(const char* what) const {
  DWGRAPH_CHECK_STATE(!reset_, "dwgraph: ", what, " after reset(): the graphs, their pool and contributions were "
                               "released; build new graphed callables with make_graphed_callables");
}

bool GraphManager::replays(size_t s) {
  const size_t ci = slots_.at(s).info.callable;
  const auto& c = callables_[ci];
  if (!c.training_mode) return true;
  auto& checks = *checks_[ci];
  const uint64_t epoch = state_epoch();  // read first: a change while reading is seen next time
  const uint64_t cached = checks.mode.load(std::memory_order_acquire);
  if (c.state_watched && (cached >> 1) == epoch) return (cached & 1) != 0;
  const bool captured = c.training_mode() == checks.captured_mode;
  checks.mode.store((epoch << 1) | (captured ? 1 : 0), std::memory_order_release);
  return captured;
}

void GraphManager::verify(size_t ci, const std::string& where, bool front_end) {
  const auto& c = callables_[ci];
  auto& checks = *checks_[ci];
  const uint64_t epoch = state_epoch();
  if (front_end && c.check_state && !(c.state_watched && checks.front_end.load(std::memory_order_acquire) == epoch)) {
    c.check_state(where);
    if (c.state_watched) checks.front_end.store(epoch, std::memory_order_release);
  }
  if (c.state_watched && checks.tensors.load(std::memory_order_acquire) == epoch) return;
  params_[ci].check(where);
  buffers_[ci].check(where);
  main_grads_[ci].check(where);
  if (c.state_watched) checks.tensors.store(epoch, std::memory_order_release);
}

bool GraphManager::runs_eagerly(size_t s, const std::vector<at::Tensor>& inputs) {
  const bool grad_now = at::GradMode::is_enabled();
  const Slot& slot = slots_.at(s);
  std::string why;
  if (inference_at_capture_ && !c10::InferenceMode::is_enabled()) {
    // Graphs captured under torch.inference_mode() hold inference tensors, which only an
    // inference-mode call may write (their static inputs). The other way replays: a call
    // in inference mode returns inference tensors, as eager's does.
    why = "it was captured under torch.inference_mode() and is called outside it";
  } else if (grad_now != grad_at_capture_) {
    // Kernels may branch on grad mode alone (oneDNN's RNN takes its training kernel
    // whenever it is on, trainable or not, and its last bits differ): the captured kernels
    // are not the ones eager runs in the other mode.
    why = grad_now ? "it was captured under torch.no_grad() and is called with grad enabled"
                   : "it was captured with grad enabled and is called under torch.no_grad()";
  } else if (grad_now) {
    const int64_t gaining = slot.buffers->inputs.first_gaining_grad(inputs);
    if (gaining >= 0) {
      why = c10::str("argument ", gaining, " requires grad but its sample did not, so the graphs hold no gradient for it");
    }
  }
  const char* advice = "Capture in the grad mode of the calls, with samples that require grad where their inputs do";
  bool identity = false;
  if (why.empty()) {
    // Note [One tensor in two argument positions] (graphs/replay_checks.cpp): eager's kernels
    // may take another path than the captured ones; a module that does not branch on it
    // loses nothing but the replay (a review found refusing such calls too strict). A call
    // that passes one tensor where the samples were two, to graphs that write an argument,
    // is refused (StaticInputs::check), as arguments sharing memory are.
    bool aliases = false;
    why = slot.buffers->inputs.identity_mismatch(inputs, &aliases);
    if (aliases && slot.buffers->inputs.writes_arguments()) return false;
    advice = "Give the samples as the calls give their tensors (one tensor where they pass one)";
    identity = true;
  }
  if (why.empty()) return false;
  // One warning per set and reason: an earlier grad-mode one does not hide this one.
  std::atomic<bool>& warned = identity ? warned_eager_identity_ : warned_eager_autograd_;
  if (!warned.exchange(true)) {
    log::warning(slot.where, ": ", why, "; such calls run eagerly (eager's results and gradients, nothing "
                 "replayed). ", advice, ", to replay them (docs/memory-contract.md)");
  }
  return true;
}

std::optional<std::vector<at::Tensor>> GraphManager::replay_or_nothing(size_t s, const std::vector<at::Tensor>& inputs) {
  // A mode the graphs were not captured in, or an autograd graph they did not capture: eager.
  if (!replays(s) || runs_eagerly(s, inputs)) return std::nullopt;
  return replay_call(s, inputs);
}

std::vector<at::Tensor> GraphManager::call(size_t s, const std::vector<at::Tensor>& inputs) {
  check_live("calling a graphed callable");
  auto outs = replay_or_nothing(s, inputs);
  return outs ? std::move(*outs) : callables_[slots_.at(s).info.callable].forward(inputs);
}

std::vector<at::Tensor> GraphManager::replay_call(size_t s, const std::vector<at::Tensor>& inputs) {
  check_live("calling a graphed callable");
  const std::shared_ptr<GraphPool> pool = pool_;  // held: a hook may reset() the graphs
  const PoolUse::Scope in_use(pool->use(), slots_.at(s).where);  // Note [One thread at a time on a pool]
  Slot& slot = slots_.at(s);
  const size_t ci = slot.info.callable;
  const std::string& w = slot.where;
  const ops::AutocastState now = ops::AutocastState::current();
  DWGRAPH_CHECK_ARG(now == forward_autocast_, w, ": called with autocast ", now.describe(), ", captured with ",
                    forward_autocast_.describe(), "; a graph replays the kernels of its capture. Call it under the "
                    "autocast state it was captured in (or capture it in this one)");
  verify(ci, w, /*front_end=*/true);
  slot.buffers->inputs.check(inputs, w);
  {
    const std::lock_guard<std::mutex> lock(mu_);
    for (size_t other : slot.buffers->slots) {
      DWGRAPH_CHECK_STATE(other == s || !busy(slots_[other]), w, ": its static input buffers are shared with ",
                          where(other), " (reuse_static_buffers), whose backward or backward_dw() is still "
                          "pending or whose graph is retained; finish that microbatch first, as in the capture order");
    }
    DWGRAPH_CHECK_STATE(slot.state != SlotState::kDwPending, w,
                        ": called again while the backward_dw() of its previous backward is pending; call "
                        "backward_dw() first");
    DWGRAPH_CHECK_STATE(slot.state != SlotState::kForward, w,
                        ": called again while the backward of its previous call is pending (its outputs are "
                        "still part of an autograd graph); the graphs keep one set of saved activations per "
                        "slot. Run that backward first (or drop its outputs), or give each microbatch its own "
                        "slot with a pipeline 'order'");
  }
  uint64_t replay_ns = 0, copy_ns = 0;
  slot.input_write.check();  // Note [Slots share the pool by liveness]
  {
    const ScopedNs t(&copy_ns);
    slot.buffers->inputs.copy_in(inputs);
  }
  slot.input_write.done();
  {
    const ScopedNs t(&replay_ns);
    slot.fwd->replay();
  }
  std::vector<at::Tensor> outs;
  {
    const ScopedNs t(&copy_ns);
    slot.buffers->inputs.copy_back(inputs);
    outs.reserve(slot.static_outputs.size());
    for (const auto& o : slot.static_outputs) outs.push_back(opts_.clone_outputs ? layout_copy(o) : plain_alias(o));
  }
  add_phase_time(TimedPhase::kCall, replay_ns, copy_ns, true);
  bool needs_node = false;
  for (bool r : slot.output_requires_grad) needs_node = needs_node || r;
  if (!(needs_node && at::GradMode::is_enabled() && slot.bwd)) {
    abandon_activations(slot);  // no backward will read what this forward saved
    return outs;
  }
  uint64_t generation;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    generation = ++slot.generation;
    set_state(slot, SlotState::kForward);
    slot.graph_retained = true;
  }
  // Autograd edges: inputs that require grad, then the slot's parameter node (Note
  // [Parameter gradients through one node]).
  auto node = dwgraph::detail::make_node<GraphedBackward>(shared_from_this(), s, generation);
  node->set_hooked_at_forward(slot.after_backward.hooked_now());
  const bool hooked = slot.param_node && has_param_hooks(s);
  const bool direct = slot.param_node && !hooked && slot.param_node_edges.size() <= kDirectParamEdges;
  torch::autograd::edge_list edges;
  edges.reserve(slot.grad_input_indices.size() + (direct ? slot.param_node_edges.size() : 1));
  for (size_t i : slot.grad_input_indices) {
    edges.push_back(inputs[i].requires_grad() ? torch::autograd::impl::gradient_edge(inputs[i]) : torch::autograd::Edge());
  }
  if (direct) {
    for (const auto& e : slot.param_node->next_edges()) edges.push_back(e);
  } else if (slot.param_node) {
    edges.emplace_back(slot.param_chain && hooked ? slot.param_chain : slot.param_node, 0);
  }
  node->set_direct_params(direct);
  node->set_next_edges(std::move(edges));
  dwgraph::detail::NodePtr base = node;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (slot.output_requires_grad[i]) torch::autograd::set_history(outs[i], base);
    if (i < slot.output_read_by_bwd.size() && slot.output_read_by_bwd[i]) node->watch_output(outs[i], i);
  }
  // Under saved-tensor hooks too, where eager autograd checks no version: a hook that packs
  // a copy (torch's save_on_cpu) gives eager's backward the old value, and the backward
  // graph reads the tensor itself (a review found the skip a silent difference).
  if (slot.saved_state) node->watch_saved(slot.saved_state);
  slot.dw_inputs.clear();
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    // The eager ops saved what either later graph reads: the backward checks both.
    const bool by_dw = i < slot.input_read_by_dw.size() && slot.input_read_by_dw[i];
    if (by_dw || (i < slot.input_read_by_bwd.size() && slot.input_read_by_bwd[i])) node->watch_input(inputs[i], i);
    if (by_dw) slot.dw_inputs.push_back(watch(inputs[i], i));
  }
  // An output a deferred GEMM reads (the eager module saved it): the caller changing it in
  // place before backward_dw() is refused, as the eager unit's stale check refuses it.
  for (size_t i = 0; i < outs.size(); ++i) {
    if (i < slot.output_read_by_dw.size() && slot.output_read_by_dw[i]) slot.dw_inputs.push_back(watch(outs[i], i, "output"));
  }
  return outs;
}

BackwardResult GraphManager::backward(size_t s, uint64_t generation, const std::vector<at::Tensor>& grads,
                                      const std::vector<uint8_t>& asked, bool direct) {
  check_live("backward through a graphed callable");
  const std::shared_ptr<GraphPool> pool = pool_;  // held: a hook may reset() the graphs
  const PoolUse::Scope in_use(pool->use(), slots_.at(s).where);  // Note [One thread at a time on a pool]
  Slot& slot = slots_.at(s);
  const size_t ci = slot.info.callable;
  const std::string& w = slot.where;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    DWGRAPH_CHECK_STATE(generation == slot.generation, w, ": backward of an earlier call, whose saved activations "
                        "a later call of the same slot has overwritten (the first backward kept the graph with "
                        "retain_graph=True); run each call's backwards before calling it again");
    DWGRAPH_CHECK_STATE(slot.state != SlotState::kDwPending, w, ": a second backward (retain_graph=True) while the "
                        "backward_dw() of the first is pending; the graphs hold one unit of weight-gradient work "
                        "per slot: call backward_dw() between the backwards");
  }
  const size_t ni = slot.grad_input_indices.size();
  const size_t np = slot.grad_param_indices.size();
  // Note [What a backward asked for]: the targets this backward gives a gradient.
  std::vector<uint8_t> defined;
  bool all_defined = true;
  for (size_t i = 0, k = 0; i < slot.static_outputs.size(); ++i) {
    if (!slot.output_requires_grad[i]) continue;
    defined.push_back(k < grads.size() && grads[k].defined() ? 1 : 0);
    all_defined = all_defined && defined.back();
    ++k;
  }
  std::vector<uint8_t> live;  // per target; empty: all
  std::vector<uint8_t> unasked;  // reached by a used output but not asked for (with `live`)
  if (!all_defined || !asked.empty()) {
    live.assign(ni + np, 1);
    unasked.assign(ni + np, 0);
    bool deferred_live = false;
    for (size_t j = 0; j < ni + np; ++j) {
      bool reached = j >= slot.reached.size() || !slot.reached[j];  // unknown reach: never masked
      for (size_t i = 0; i < defined.size() && !reached; ++i) reached = defined[i] && slot.reaches[i][j];
      const bool wanted = asked.empty() || asked[j];
      live[j] = reached && wanted ? 1 : 0;
      unasked[j] = reached && !wanted ? 1 : 0;
      deferred_live = deferred_live || (j >= ni && slot.param_deferred[j - ni] && live[j]);
    }
    // main_grad is accumulated in a graph whatever is asked (zeros for an unused output):
    // by the backward graph when undeferred, by the backward-dw graph when deferred (which
    // replays when any deferred parameter gets a gradient).
    for (size_t j = ni; j < ni + np; ++j) {
      const size_t k = j - ni;
      const bool accumulates = slot.param_fused[k] && (!slot.param_deferred[k] || deferred_live);
      DWGRAPH_CHECK_STATE(!(accumulates && unasked[j]), w, ": a backward that asks for only some gradients "
                          "(backward(inputs=...), torch.autograd.grad) and not for parameter '",
                          callables_[ci].parameter_names[slot.grad_param_indices[k]],
                          "', whose weight gradient the graphs accumulate into main_grad "
                          "(fuse_wgrad_accumulation); eager would skip that accumulation. Ask for it too (backward() "
                          "without inputs=), or make that pass outside the graphed callable");
    }
  }
  verify(ci, w, /*front_end=*/false);
  slot.grad_write.check();  // Note [Slots share the pool by liveness]
  uint64_t replay_ns = 0, copy_ns = 0;
  {
    const ScopedNs t(&copy_ns);
    const at::NoGradGuard no_grad;
    size_t k = 0;
    for (size_t i = 0; i < slot.static_outputs.size(); ++i) {
      if (!slot.output_requires_grad[i]) continue;
      const at::Tensor& g = k < grads.size() ? grads[k] : at::Tensor();
      ++k;
      at::Tensor& dst = slot.static_grad_outputs[i];
      if (!g.defined()) {
        dst.zero_();
      } else if (g.data_ptr() != dst.data_ptr()) {
        // A dense gradient in another layout (a channels_last output's loss against a
        // contiguous target, a loss over y.t()): the backward runs the kernels captured for
        // the capture's layout, where eager runs them on this one, which can round
        // differently (a review found 1.5e-8 that grew with the steps); an expanded one
        // (y.sum()) is the documented common case and says nothing.
        // Dimensions of size 1 have no layout of their own; an expanded gradient (a zero
        // stride) is the documented common case.
        bool expanded = false, other = false;
        for (int64_t d = 0; d < g.dim(); ++d) {
          if (g.size(d) < 2) continue;
          expanded = expanded || g.stride(d) == 0;
          other = other || g.stride(d) != dst.stride(d);
        }
        if (other && !expanded && !warned_grad_layout_.exchange(true)) {
          log::warning(w, ": the gradient of output ", i, " has strides ", g.strides(), " where the graphs' buffer "
                       "for it, the layout the backward was captured for, has ", dst.strides(), "; the graphs copy "
                       "it into that layout and run the backward captured for it, where eager code runs it on this "
                       "one: results can differ in the last bits (docs/memory-contract.md, row 15). A loss whose "
                       "gradient has the output's layout (e.g. a target in the output's memory format) is exact");
        }
        dst.copy_(g);
      }
    }
  }
  slot.grad_write.done();
  // An output gradient the backward-dw graph reads (the eager modules save dy for it): held
  // as they hold it (so autograd cannot accumulate into it in place) and checked then.
  slot.dw_grads.clear();
  for (size_t i = 0, k = 0; i < slot.static_outputs.size(); ++i) {
    if (!slot.output_requires_grad[i]) continue;
    const at::Tensor& g = k < grads.size() ? grads[k] : at::Tensor();
    ++k;
    const bool read = i < slot.grad_output_read_by_dw.size() && slot.grad_output_read_by_dw[i];
    // A non-contiguous one the eager GEMM would have copied (dy.contiguous()): not saved.
    if (read && g.defined() && g.is_contiguous()) slot.dw_grads.push_back(watch(g, i, "output gradient", /*hold=*/true));
  }
  {
    const ScopedNs t(&replay_ns);
    try {
      slot.bwd->replay();
    } catch (...) {
      // Refused (the pool's replay order, a released borrowed storage) after the grad
      // outputs were copied in: that copy's data will not be read, so it holds back no
      // other graph's writes (a review found every later replay of the set refused).
      slot.grad_write.abandon_for(*slot.bwd);
      throw;
    }
  }
  // The caller owns what autograd receives: never the buffers the next replay rewrites.
  auto is = [&](size_t j) { return live.empty() || live[j]; };
  BackwardResult result;
  std::vector<at::Tensor> param_grads;  // per parameter edge; sized only when one is given a gradient
  bool any_param = false;
  bool dw_pending = false;
  {
    const ScopedNs t(&copy_ns);
    result.grads.reserve(ni + 1);
    for (size_t j = 0; j < ni; ++j) {
      const at::Tensor& g = slot.static_grad_inputs[j];
      result.grads.push_back(g.defined() && is(j) ? g.clone() : at::Tensor());
    }
    for (size_t e : slot.param_edges_given) {
      const size_t j = slot.param_node_edges[e];
      if (!is(ni + j)) continue;
      if (param_grads.empty()) param_grads.resize(slot.param_node_edges.size());
      param_grads[e] = slot.static_grad_inputs[ni + j].clone();
      any_param = true;
    }
  }
  if (live.empty()) {
    dw_pending = slot.any_param_deferred;  // contract C10: not a visit per parameter
  } else {
    for (size_t j = 0; j < np; ++j) dw_pending = dw_pending || (slot.param_deferred[j] && is(ni + j));
  }
  add_phase_time(TimedPhase::kBackward, replay_ns, copy_ns, true);
  if (direct) {
    if (param_grads.empty()) {
      result.grads.resize(ni + slot.param_node_edges.size());
    } else {
      for (auto& g : param_grads) result.grads.push_back(std::move(g));
    }
  } else {
    at::Tensor token;  // what this backward's node sends the parameter node: finds its gradients there
    if (any_param && slot.param_grads) token = slot.param_grads->put(std::move(param_grads));
    if (slot.param_node) result.grads.push_back(token);
  }
  if (!live.empty()) {
    result.live.assign(callables_[ci].parameters.size(), 0);
    result.reached.assign(callables_[ci].parameters.size(), 0);
    for (size_t j = 0; j < np; ++j) {
      result.live[slot.grad_param_indices[j]] = live[ni + j];
      result.reached[slot.grad_param_indices[j]] = live[ni + j] || unasked[ni + j] ? 1 : 0;
    }
  }
  const std::lock_guard<std::mutex> lock(mu_);
  slot.dw_live = result.live;
  if (all_defined) {
    slot.dw_defined.clear();
  } else {
    slot.dw_defined = defined;
  }
  set_state(slot, defers_[ci] && dw_pending ? SlotState::kDwPending : SlotState::kIdle);
  if (slot.armed_parts == slot.dw_parts.size()) return result;  // every part will be read
  for (const auto& part : slot.dw_parts) {
    if (part.state->pending() || !part.graph) continue;
    // No backward_dw() will replay this part (a backward that asked for none of its
    // module's weights): what the forward and this backward wrote for it is not read.
    abandon_reads(slot, *part.graph);
  }
  return result;
}

void GraphManager::node_released(size_t s, uint64_t generation) noexcept {
  const std::lock_guard<std::mutex> lock(mu_);
  if (s >= slots_.size()) return;
  Slot& slot = slots_[s];
  if (slot.generation != generation) return;
  // The forward's outputs were dropped without a backward: nothing is pending any more.
  if (slot.state == SlotState::kForward) {
    set_state(slot, SlotState::kIdle);
    try {
      abandon_activations(slot);
    } catch (...) {  // a failed bookkeeping step only keeps the order checks stricter
    }
  }
  slot.graph_retained = false;
}

void GraphManager::node_done(size_t s, uint64_t generation) noexcept {
  const std::lock_guard<std::mutex> lock(mu_);
  if (s < slots_.size() && slots_[s].generation == generation) slots_[s].graph_retained = false;
}

bool GraphManager::busy(const Slot& slot) const {
  return slot.state != SlotState::kIdle || slot.graph_retained;
}

std::vector<std::shared_ptr<ops::WgradStore>> GraphManager::deferring_stores(size_t ci) const {
  std::vector<std::shared_ptr<ops::WgradStore>> out;
  for (const auto& m : callables_[ci].modules) {
    if (!module_defers(m)) continue;
    if (m.store) out.push_back(m.store);
    for (const auto& inner : m.inner) {
      if (inner.store && inner.defers) out.push_back(inner.store);
    }
  }
  return out;
}

void GraphManager::check_saved_versions(Slot& slot, const std::vector<size_t>& parts, const std::vector<size_t>& drop,
                                        const std::string& who) {
  auto read_by = [&](const WatchedVersion& v) {
    for (size_t p : parts) {
      const DwPart& part = slot.dw_parts[p];
      const std::string what = v.what;
      const auto& reads = what == "input" ? part.reads_input : what == "output" ? part.reads_output : part.reads_grad_output;
      if (v.index < reads.size() && reads[v.index]) return true;
    }
    return false;
  };
  std::vector<const WatchedVersion*> watched;
  for (const auto& v : slot.dw_inputs) watched.push_back(&v);
  for (const auto& v : slot.dw_grads) watched.push_back(&v);
  for (const WatchedVersion* p : watched) {
    const WatchedVersion& v = *p;
    if (v.counter.current_version() == v.version || !read_by(v)) continue;
    const std::string what = v.what;
    const size_t index = v.index;
    {
      // As an eager dwgraph module drops the unit whose inputs changed: it can never land
      // eager's gradient.
      const std::lock_guard<std::mutex> lock(mu_);
      for (size_t d : drop) drop_part(slot, d);
    }
    DWGRAPH_CHECK_STATE(false, who, ": ", what, " ", index, " of its ",
                        what == "output gradient" ? "backward" : "call",
                        " was modified by an inplace operation since, but its weight gradients need the value "
                        "the graphs saw (as the eager modules, which refuse this too); that backward's weight "
                        "gradients are dropped", drop.size() < parts.size() ? " (this module's unit)" : "");
  }
}

void GraphManager::backward_dw(size_t s) {
  check_live("backward_dw()");
  const std::shared_ptr<GraphPool> pool = pool_;  // held: a hook may reset() the graphs
  // Note [One thread at a time on a pool]: held while the graphs' memory is read and written,
  // not while the modules' hooks run (on CUDA a backward a hook starts runs on autograd's
  // device thread, which would find the pool in use).
  std::optional<PoolUse::Scope> in_use;
  in_use.emplace(pool->use(), slots_.at(s).where);
  Slot& slot = slots_.at(s);
  const size_t ci = slot.info.callable;
  const std::string& w = slot.where;
  DWGRAPH_CHECK_STATE(defers_[ci], w, ".backward_dw(): it has no module with deferred weight gradients");
  SlotState state;
  uint64_t sequence;
  std::vector<size_t> parts;  // Note [A backward-dw graph per unit]: the ones still pending
  std::vector<const Graph*> run;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    state = slot.state;
    sequence = slot.dw_sequence;
    parts.swap(slot.dw_scratch_parts);
    run.swap(slot.dw_scratch_run);
    parts.clear();
    run.clear();
    if (slot.armed_parts == slot.dw_parts.size()) {
      parts = slot.dw_all_parts;  // Note [Units armed together]: no visit per part
    } else if (slot.armed_parts > 0) {
      for (size_t p = 0; p < slot.dw_parts.size(); ++p) {
        if (slot.dw_parts[p].state->pending()) parts.push_back(p);
      }
    }
  }
  // FIFO (contract C1): eager units its modules queued before the graphed backward (calls
  // in a mode the graphs were not captured in) land first, as their backward_dw() would.
  // Not in the pipeline schedule: there each microbatch has its own slot and its
  // backward_dw() lands that microbatch's work (Note [Deferred work of a pipeline slot]).
  bool older_eager = false;
  if (state == SlotState::kDwPending && !schedule_.pipelined() && ops::num_queued_units_anywhere() > 0) {
    for (const auto& store : deferring_stores(ci)) {
      const auto oldest = store->oldest_sequence();
      older_eager = older_eager || (oldest && *oldest < sequence);
    }
  }
  if (state != SlotState::kDwPending || parts.empty() || older_eager) {
    {
      const std::lock_guard<std::mutex> lock(mu_);
      slot.dw_scratch_parts.swap(parts);
      slot.dw_scratch_run.swap(run);
    }
    in_use.reset();  // eager units land on the modules' own .grad, with their hooks
    run_eager_backward_dw(s);
    return;
  }
  verify(ci, w, /*front_end=*/false);
  const LiveMask live = slot.dw_live;
  const std::string who = w + ".backward_dw()";
  {
    // The hand-off's own checks (before anything is written): timed with the hand-off.
    uint64_t check_ns = 0;
    {
      const ScopedNs t(&check_ns);
      for (size_t p : parts) slot.dw_parts[p].landing.check(who, live);
    }
    add_phase_time(TimedPhase::kBackwardDw, 0, check_ns, false);
  }
  // A changed saved tensor drops every pending part: that backward's weight gradients.
  check_saved_versions(slot, parts, parts, who);
  uint64_t replay_ns = 0;
  {
    // Every part's graph is checked before any replays, so that one refusal writes nothing:
    // the checks each replay() would make, made together, and timed with the replays.
    const ScopedNs t(&replay_ns);
    for (size_t p : parts) run.push_back(slot.dw_parts[p].graph.get());
    Graph::check_run(run);
    for (size_t p : parts) slot.dw_parts[p].graph->replay();
  }
  {
    const std::lock_guard<std::mutex> lock(mu_);
    set_state(slot, SlotState::kIdle);
  }
  add_phase_time(TimedPhase::kBackwardDw, replay_ns, 0, true);
  {
    uint64_t copy_ns = 0;  // the parts' hand-offs (they hold no hooks: dw_hooks below), timed together
    {
      const ScopedNs t(&copy_ns);
      for (size_t p : parts) slot.dw_parts[p].landing.land(live);
    }
    add_phase_time(TimedPhase::kBackwardDw, 0, copy_ns, false);
  }
  std::vector<std::shared_ptr<const Landing>> hooks;  // held: a hook may reset() the graphs that own them
  {
    // Before the hooks, which may reset() the graphs and with them the slot.
    const std::lock_guard<std::mutex> lock(mu_);
    // Once per module with a part landing now (a module used twice runs its hooks once per
    // backward_dw(), as eager), after every part's hand-off. Whether a module's hook runs is
    // asked at its turn (land()): an earlier hook may register one. Asked after the
    // hand-offs, whose Python (a flag setter) may register the first hook of the process;
    // with none anywhere and none without a store, no hook can run: no visit per part
    // (contract C10).
    if (slot.any_dw_hooks && Landing::hooks_may_run(slot.dw_unconditional_hooks)) {
      size_t last = slot.dw_hooks.size();
      for (size_t p : parts) {
        const size_t k = slot.dw_parts[p].module;
        if (k < slot.dw_hooks.size() && k != last && slot.dw_hooks[k]) hooks.push_back(slot.dw_hooks[k]);
        last = k;
      }
    }
    slot.dw_scratch_parts.swap(parts);
    slot.dw_scratch_run.swap(run);
  }
  in_use.reset();
  for (const auto& h : hooks) h->land(live);
}

void GraphManager::land_part(size_t s, size_t p) {
  check_live("backward_dw()");
  const std::shared_ptr<GraphPool> pool = pool_;  // held: a hook may reset() the graphs
  const PoolUse::Scope in_use(pool->use(), slots_.at(s).where);  // Note [One thread at a time on a pool]
  Slot& slot = slots_.at(s);
  DwPart& part = slot.dw_parts.at(p);
  const size_t ci = slot.info.callable;
  const auto& m = callables_[ci].modules.at(part.module);
  const std::string who = c10::str(slot.where, ": module '", m.name.empty() ? std::string("(root)") : m.name,
                                   "'.backward_dw()");
  {
    const std::lock_guard<std::mutex> lock(mu_);
    DWGRAPH_CHECK_STATE(slot.state == SlotState::kDwPending && part.state->pending(),
                        who, ": expected its unit pending in the graphs, got none (another thread landed it)");
  }
  verify(ci, slot.where, /*front_end=*/false);
  const LiveMask live = slot.dw_live;
  {
    uint64_t check_ns = 0;
    {
      const ScopedNs t(&check_ns);
      part.landing.check(who, live);
    }
    add_phase_time(TimedPhase::kBackwardDw, 0, check_ns, false);
  }
  // As an eager module: a changed saved tensor drops this module's unit only.
  check_saved_versions(slot, {p}, {p}, who);
  uint64_t replay_ns = 0;
  {
    const ScopedNs t(&replay_ns);
    part.graph->replay();
  }
  {
    const std::lock_guard<std::mutex> lock(mu_);
    disarm_part(slot, p);
  }
  add_phase_time(TimedPhase::kBackwardDw, replay_ns, 0, true);
  uint64_t copy_ns = 0;  // the hand-off (a part holds no hooks: the module's backward_dw() runs them)
  {
    const ScopedNs t(&copy_ns);
    part.landing.land(live);
  }
  add_phase_time(TimedPhase::kBackwardDw, 0, copy_ns, false);
}

void GraphManager::discard_part(size_t s, size_t p) {
  const std::lock_guard<std::mutex> lock(mu_);
  if (reset_ || s >= slots_.size() || p >= slots_[s].dw_parts.size()) return;
  drop_part(slots_[s], p);
}

void GraphManager::drop_part(Slot& slot, size_t p) {
  const DwPart& part = slot.dw_parts.at(p);
  if (!part.state->pending()) return;
  disarm_part(slot, p);
  if (part.graph) abandon_reads(slot, *part.graph);
}

void GraphManager::abandon_reads(Slot& slot, const Graph& reader) {
  slot.fwd->abandon_for(reader);
  slot.bwd->abandon_for(reader);
  slot.input_write.abandon_for(reader);
  slot.grad_write.abandon_for(reader);
}

void GraphManager::disarm_part(Slot& slot, size_t p) {
  ops::GraphedUnit& unit = *slot.dw_parts.at(p).state;
  if (unit.pending()) {
    unit.set_own(false, 0);
    if (slot.armed_parts > 0) --slot.armed_parts;
  }
  if (slot.armed_parts == 0 && slot.state == SlotState::kDwPending) set_state(slot, SlotState::kIdle);
}

void GraphManager::run_eager_backward_dw(size_t s) {
  // Units the modules queued themselves: calls that ran eagerly (a training mode the
  // graphs were not captured in). Run them as the modules' own backward_dw() would: one
  // backward's worth (as many units per module as a backward of the callable queues).
  const Slot& slot = slots_.at(s);
  // Copies: a module's hook may reset() the graphs, which releases the callables.
  const std::vector<ModuleSpec> modules = callables_[slot.info.callable].modules;
  const std::vector<size_t> runs = slot.units_per_backward;
  // A module that did not defer at capture and does now (delay_wgrad_compute set since: its
  // calls run eagerly and queue units) lands here too, as its own backward_dw() would: every
  // unit it has queued, as the capture cannot tell how many one backward queues for it (a
  // module used twice queues two; before, its units stayed queued and its .grad None, and
  // then one of two did: reviews found both).
  auto lands = [&](const ModuleSpec& m) {
    return m.store && !m.store->empty() && (module_defers(m) || (!m.defers && m.backward_dw != nullptr));
  };
  bool any = false;
  for (const auto& m : modules) any = any || lands(m);
  SlotState state;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    state = slot.state;
  }
  DWGRAPH_CHECK_STATE(any, slot.where, ".backward_dw(): ",
                      state == SlotState::kForward ? "its backward has not run yet"
                                                   : "no backward is pending (called before any backward, or twice)");
  for (size_t k = 0; k < modules.size(); ++k) {
    const auto& m = modules[k];
    if (!lands(m)) continue;
    const size_t n = !module_defers(m) ? m.store->num_units() : k < runs.size() ? std::max<size_t>(runs[k], 1) : 1;
    for (size_t r = 0; r < n && !m.store->empty(); ++r) m.backward_dw();
    if (m.run_hooks && m.store->num_hooks() > 0) m.run_hooks();
  }
}

void GraphManager::abandon_activations(Slot& slot) {
  if (!slot.fwd) return;
  std::vector<const Graph*> readers = {slot.bwd.get()};
  for (const auto& part : slot.dw_parts) readers.push_back(part.graph.get());
  for (const auto* reader : readers) {
    if (reader == nullptr) continue;
    slot.fwd->abandon_for(*reader);
    slot.input_write.abandon_for(*reader);
  }
}

void GraphManager::set_state(Slot& slot, SlotState next) {
  const bool is = next == SlotState::kDwPending;
  slot.state = next;
  if (is) slot.dw_sequence = ops::next_wgrad_sequence();
  if (!is) slot.dw_grads.clear();  // nothing of that backward will be read
  if (!is && slot.armed_parts == 0) return;  // no part to disarm (contract C10: not a visit per part)
  if (!slot.dw_arm) return;  // no parts captured
  // Note [A backward-dw graph per unit]: a part is pending when the backward gave its
  // module's deferred (or fused) parameters a gradient; in capture order, which is its
  // module's FIFO order. Note [Units armed together]: all at once in the common case.
  if (is && slot.dw_live.empty() && slot.dw_parts_all_have_params) {
    slot.dw_arm->arm_all(ops::next_wgrad_sequences(slot.dw_parts.size()));
    slot.armed_parts = slot.dw_parts.size();
    return;
  }
  slot.dw_arm->disarm_all();
  slot.armed_parts = 0;
  if (!is) return;
  for (auto& part : slot.dw_parts) {
    bool armed = false;
    for (size_t i : part.param_indices) armed = armed || is_live(slot.dw_live, i);
    if (armed && !part.reached_from.empty() && !slot.dw_defined.empty()) {
      // Note [Parts armed per use]: a use no output with a gradient reaches queued nothing
      // in eager (its node did not run), though another use of its module did.
      bool reached = false;
      for (size_t i = 0; i < part.reached_from.size() && i < slot.dw_defined.size(); ++i) {
        reached = reached || (part.reached_from[i] && slot.dw_defined[i]);
      }
      armed = reached;
    }
    if (!armed) continue;
    part.state->set_own(true, ops::next_wgrad_sequence());
    ++slot.armed_parts;
  }
  // A deferred weight got a gradient through no use of its module (a tie: x @ lin.weight.t()
  // beside lin(x), the loss only of the first): nothing of that backward to land, as eager
  // queues nothing; the slot is idle (a review found it left pending, refusing every call).
  if (slot.armed_parts == 0) set_state(slot, SlotState::kIdle);
}

void GraphManager::release_pending() {
  // Modules outlive their graphs: a backward_dw() pending in a released graph never lands,
  // and the modules keep counting it (an optimizer step over it is refused).
  const std::lock_guard<std::mutex> lock(mu_);
  for (auto& slot : slots_) {
    if (slot.state != SlotState::kDwPending) continue;
    const auto& c = callables_[slot.info.callable];
    for (const auto& part : slot.dw_parts) {
      if (!part.state->pending()) continue;
      const auto& m = c.modules.at(part.module);
      if (m.store) m.store->add_graph_lost(1);
      for (const auto& inner : m.inner) {
        if (inner.store && inner.defers) inner.store->add_graph_lost(1);
      }
    }
    set_state(slot, SlotState::kIdle);
  }
}

GraphManager::~GraphManager() { release_pending(); }

void GraphManager::reset() {
  // Not inside a call, backward or backward_dw() of these graphs (Python they run, or another
  // thread): it frees the slots and parts they are using (Note [One thread at a time on a pool]).
  const std::shared_ptr<GraphPool> pool = pool_;
  static const std::string who = "dwgraph: reset() of graphed callables";
  std::optional<PoolUse::Scope> alone;
  if (pool) alone.emplace(pool->use(), who, /*alone=*/true);
  release_pending();
  for (auto& slot : slots_) {
    for (auto* g : {&slot.fwd, &slot.bwd}) {
      if (*g) (*g)->reset();
      g->reset();
    }
    for (auto& part : slot.dw_parts) {
      if (part.graph) part.graph->reset();
      part.state->land = nullptr;
    }
    slot.dw_parts.clear();
    slot.armed_parts = 0;
    slot.dw_all_parts.clear();
    slot.dw_hooks.clear();
    slot.any_dw_hooks = false;
    slot.dw_unconditional_hooks = 0;
    slot.input_write.remove();
    slot.grad_write.remove();
    slot.after_backward = Landing();
    slot.dw_inputs.clear();
    slot.dw_grads.clear();
    slot.dw_live.clear();
    slot.param_grads.reset();  // the parameter node keeps a backward's gradients it has not handed on
    slot.param_node = dwgraph::detail::NodePtr();
    slot.param_chain = dwgraph::detail::NodePtr();
    slot.param_relays.clear();
    slot.param_edges_given.clear();
    slot.hooks_epoch = 0;
    slot.param_token = at::Tensor();
    slot.buffers = std::make_shared<StaticBuffers>();
    slot.static_outputs.clear();
    slot.captured_outputs.clear();
    slot.static_grad_outputs.clear();
    slot.static_grad_inputs.clear();
  }
  shared_contributions_.clear();
  pool_.reset();
  // The callables' functions hold the caller's modules (Python objects whose references
  // through C++ the garbage collector cannot see): released too, so a reset module can be
  // freed. Every call after this is refused by check_live(); names stay for messages.
  for (auto& c : callables_) {
    GraphableCallable named;
    named.name = c.name;
    c = std::move(named);
  }
  for (auto& p : params_) p = CapturedParameters();
  for (auto& b : buffers_) b = CapturedParameters();
  for (auto& m : main_grads_) m = CapturedMainGrads();
  reset_ = true;
}

int64_t GraphManager::contribution_bytes(size_t s) const {
  int64_t n = 0;
  for (const auto& part : slots_.at(s).dw_parts) {
    for (const auto& c : part.landing.contributions) n += static_cast<int64_t>(c.buffer.nbytes());
  }
  return n;
}

GraphedStats GraphManager::stats() const {
  GraphedStats st;
  if (pool_) st.pool = pool_->stats();
  auto bytes = [](const std::vector<at::Tensor>& v) {
    int64_t n = 0;
    for (const auto& t : v) n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
    return n;
  };
  std::unordered_set<const void*> seen, seen_static;
  auto distinct = [&](const std::vector<at::Tensor>& v) {
    int64_t n = 0;
    for (const auto& t : v) {
      if (t.defined() && t.numel() > 0 && seen_static.insert(t.storage().data()).second) {
        const auto [begin, end] = byte_span(t);  // a static input with gaps holds its whole reach
        n += static_cast<int64_t>(end - begin);
      }
    }
    return n;
  };
  for (const auto& slot : slots_) {
    for (const auto& part : slot.dw_parts) {
      for (const auto& c : part.landing.contributions) {
        if (seen.insert(c.buffer.storage().data()).second) st.contribution_bytes += static_cast<int64_t>(c.buffer.nbytes());
      }
    }
    // Shared buffers (reuse_static_buffers) count once.
    st.static_bytes += distinct(slot.buffers->inputs.tensors()) + bytes(slot.static_outputs) +
                       distinct(slot.static_grad_outputs) + bytes(slot.static_grad_inputs);
    std::vector<std::pair<Phase, const Graph*>> kinds = {{Phase::kForward, slot.fwd.get()},
                                                         {Phase::kBackward, slot.bwd.get()}};
    for (const auto& part : slot.dw_parts) kinds.emplace_back(Phase::kBackwardDw, part.graph.get());
    for (const auto& [phase, g] : kinds) {
      if (g == nullptr) continue;
      st.graphs.push_back(GraphInfo{slot.where, to_string(phase), g->num_kernels()});
      st.num_kernels += g->num_kernels();
    }
  }
  st.num_graphs = st.graphs.size();
  if (const int64_t e = eager_peak_bytes_.load(); e > 0) st.eager_peak_bytes = e;
  return st;
}

void GraphManager::record_eager_peak(int64_t nbytes) {
  DWGRAPH_CHECK_ARG(nbytes > 0, "dwgraph GraphedCallable.record_eager_peak: argument 'nbytes' must be the positive peak live bytes "
                    "of the eager schedule, got ", nbytes);
  eager_peak_bytes_.store(nbytes);
}

// ---- GraphedCallable ------------------------------------------------------------------

std::vector<at::Tensor> GraphedCallable::operator()(const std::vector<at::Tensor>& inputs) {
  return manager_->call(index_, inputs);
}
std::optional<std::vector<at::Tensor>> GraphedCallable::replay_or_nothing(const std::vector<at::Tensor>& inputs) {
  return manager_->replay_or_nothing(index_, inputs);
}
bool GraphedCallable::replays() const { return manager_->replays(index_); }
void GraphedCallable::backward_dw() { manager_->backward_dw(index_); }
bool GraphedCallable::need_backward_dw() const { return manager_->need_backward_dw(index_); }
void GraphedCallable::reset() { manager_->reset(); }
int64_t GraphedCallable::contribution_bytes() const { return manager_->contribution_bytes(index_); }
size_t GraphedCallable::callable_index() const { return manager_->callable_index(index_); }
const std::string& GraphedCallable::name() const { return manager_->name(index_); }
GraphedStats GraphedCallable::stats() const { return manager_->stats(); }
void GraphedCallable::record_eager_peak(int64_t nbytes) { manager_->record_eager_peak(nbytes); }
c10::Device GraphedCallable::device() const { return manager_->device(); }
std::shared_ptr<GraphPool> GraphedCallable::pool() const { return manager_->pool(); }

}  // namespace dwgraph::graphs
