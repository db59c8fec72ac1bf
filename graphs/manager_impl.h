#pragma once
// The GraphManager behind make_graphed_callables (dwgraph::graphs, internal): its capture
// half is manager_capture.cpp, its replay half manager_replay.cpp.
//
// Note [Backward-dw graphs are captured last]: in the sequential schedule the manager
// captures all forwards, all backwards in reverse, and only then the backward-dw graphs,
// with every wgrad unit the backward captures queued (the dy and x each deferred GEMM
// reads) kept allocated until the last backward-dw graph is captured. No backward graph
// and no other backward-dw graph can then be placed in the memory a backward-dw graph
// reads, so the natural use (loss.backward(), then each module's backward_dw(), in any
// order) replays safely. TransformerEngine captures each backward-dw right after its
// backward, which lets the next backward's capture reuse the queued inputs; replaying
// the backward-dw graphs after all backwards would then read overwritten memory.
//
// Note [Contributions are shared across microbatches]: each deferred parameter's
// gradient lands, during capture, in a fresh graph-pool buffer (its contribution), which
// every replay of that backward-dw graph hands off to .grad right after the replay. The
// backward-dw graphs of one callable's microbatches (pipeline schedule) write the same
// buffer: the first capture allocates it, later ones zero it in the graph and land into
// it. A contribution is handed off before any other backward-dw replay can write it, so
// one buffer serves every microbatch, and contribution memory does not grow with the
// number of microbatches. A parameter tied between two modules of one callable gets one
// buffer per module, so the hand-off adds a, then b, exactly as eager modules land them.
//
// Note [Static buffers reused across microbatches]: with reuse_static_buffers
// (TransformerEngine's _reuse_graph_input_output_buffers) the slots of one callable whose
// lifetimes in the pipeline order do not overlap (a slot lives from its forward to its
// backward-dw, or its backward when it defers nothing) share one set of static inputs
// and static grad outputs. TransformerEngine frees a slot's buffers after its backward;
// dwgraph keeps them until the backward-dw, because a deferred GEMM reads its input (often
// the static input itself) and its output gradient (often the static grad output) in the
// backward-dw graph. At replay a call whose buffers another slot still needs (its
// backward or backward-dw pending, or its graph retained for a second backward) is
// refused, so a replay order that differs from the capture cannot make one microbatch
// read another's inputs.
//
// Note [Slot states]: each slot follows its calls: idle -> forward replayed (its backward
// pending while the autograd node lives) -> backward replayed (backward-dw pending when
// it has deferred weights and the backward asked for them) -> idle. A second call while
// a backward or backward-dw of the slot is pending is refused: the graphs have one set of
// saved activations per slot, and the schedule gives a callable one slot per microbatch.
// The pool's replay order (graphs/pool_order.h) guards what the slots share.

// Note [What a backward asked for]: eager modules give gradients only to what a backward
// reaches and asks for. An output the loss does not use gets no gradient (autograd passes
// the node an undefined one), so parameters reached only from it keep .grad = None and
// their deferred modules queue nothing; `loss.backward(inputs=[...])` and
// `torch.autograd.grad(loss, [...])` ask for some leaves only. A graph computes
// everything it captured, so the manager masks what it hands over: at capture it records
// which backward targets each output reaches in the captured autograd graph; at each
// backward it takes the outputs whose gradient is defined and what the engine's graph task
// asks for (its exec_info), and only those parameters get a gradient from the backward,
// a contribution, a grad_added_to_main_grad flag and their modules' hooks at backward_dw().
// What the graph accumulates into main_grad cannot be masked: a backward that asks for
// some gradients only but reaches a fused parameter it does not ask for is refused. A
// fused parameter reached only from unused outputs is accumulated with a zero gradient,
// which leaves main_grad's value as it was (up to the sign of a zero).
//
// Note [Parameter gradients through one node]: a graphed call's autograd node has an edge
// per input that requires grad and one edge to a node the slot keeps for its whole life,
// whose edges lead to the parameters. Building an edge per parameter at every call would
// make the call cost grow with the module tree; the persistent node's edges are built once
// at capture. The backward stashes the parameters' gradients for it, and it hands them to
// the parameters' AccumulateGrad nodes (which also run the parameters' tensor hooks). A
// slot with few parameter edges and no parameter hooks skips it: the call's node has those
// edges itself (kDirectParamEdges, manager_replay.cpp).
//
// Note [Parameter tensor hooks at replay]: so a hook registered on a parameter
// (param.register_hook, register_post_accumulate_grad_hook), before capture or after it,
// runs at each graphed backward exactly as at an eager one: AccumulateGrad runs it on the
// gradient the backward hands over, a fresh tensor the caller owns (a hook may change it in
// place or return another, as in eager). A deferred parameter's AccumulateGrad gets no
// gradient from the backward, in eager dwgraph as in the graphs, so its hooks see None
// there, and backward_dw() lands the weight gradient in .grad without running them
// (register_wgrad_hook is the hook for that landing). Warmup and capture run none of them:
// the CallerStateGuard takes them off the parameters while it lives, or the captured
// backward would apply the hook once more than eager inside every replay, and a Python
// hook's side effects would happen at capture only.
//
// Note [Calls eager autograd would differentiate further]: a graph replays the forward
// and backward autograd saw at capture. A call with an input that requires grad where its
// sample did not (PyTorch's parameterless no-grad module test: an input captured without
// grad, later the output of a layer that requires it), or with grad enabled when the
// capture ran under torch.no_grad() (with something trainable), would make eager autograd
// build a graph the capture did not: an output the captured forward left without
// autograd history would require grad, and the backward would owe a gradient the backward
// graph does not compute (and eager kernels may even choose other paths for inputs that
// require grad: matmul's folding). Such a call runs eagerly, as the call in a training
// mode the graphs were not captured in does: its result, its backward and (deferred
// modules) its backward_dw() are eager's exactly. A warning says so once per set, since
// the graphs save nothing there; capturing with samples that require grad replays them.
// The same holds for any call in the other grad mode than the capture, trainable or not,
// either way: some kernels branch on grad mode alone (oneDNN's RNN runs its training
// kernel whenever grad is on), so the captured kernels are not the ones eager would run.
//
// Note [Deferred work of a pipeline slot]: with a pipeline order each microbatch has its
// own slot, and a slot's backward_dw() lands that microbatch's work: its graphed backward's
// when one is pending, else the oldest units its modules queued eagerly (a call that ran
// eagerly: a mode not captured, Note [Calls eager autograd would differentiate further]).
// A pending graphed backward never yields to an older eager unit there, as it does in the
// sequential schedule (whose one slot per callable makes eager units and replays one FIFO):
// that unit is another microbatch's, whose slot lands it at its own W step. Yielding made
// W steps in another order than the backwards land the wrong microbatch first and then
// refuse the other one ('no backward is pending') with a graphed backward still pending.
//
// Note [Autocast in the backward]: the autograd engine runs a backward in the autocast
// state of the thread that started it, so an op that the forward ran in FP32 (an
// autocast(enabled=False) region, an FP32 input) has its backward run in BF16 when
// loss.backward() is called inside the autocast region and in FP32 when called outside.
// A graph bakes in one of the two: the backward graph is captured (and warmed up) with
// autocast off, as the natural loop runs it, or in the forward's state with
// backward_under_autocast; a backward started in the other state is refused.

// Note [Slots share the pool by liveness]: a capture keeps nothing alive that eager code
// would have freed. The static inputs and grad outputs are blocks of the graphs' pool;
// during the captures, a slot's buffers, outputs, saved activations and (pipeline schedule)
// queued weight-gradient inputs live exactly as long as the schedule's eager run keeps
// them (the autograd graph and the units hold what later captures read), and then return
// to the pool, where later captures reuse them. The slot keeps only views that do not
// own that memory. At replay the pool's replay order (graphs/pool_order.h) already keeps
// graphs that share bytes apart; the host's own writes into the shared buffers (a call's
// copy into its static inputs, a backward's into its grad outputs) take their place in
// that order too (PooledWrite), so a replay order that would let one slot's copy clobber
// what another slot's graph still has to read is refused like any other. So a schedule's
// pool holds about what its eager run holds at its peak, whatever the microbatch count.
// This is the pipeline schedule's, on a pool of its own: its slots follow an explicit
// order. The sequential schedule's callables may be called again whenever they are idle
// (a second forward without grad), and graph sets on a caller's shared pool replay in
// orders no capture saw, so they keep their buffers to themselves. On the set's own pool
// reuse_static_buffers (TransformerEngine's explicit sharing) is subsumed by this; on a
// caller's pool it shares one callable's static inputs explicitly.

#include "common/autograd_node.h"
#include "graphs/caller_state.h"
#include "graphs/landing.h"
#include "graphs/manager.h"
#include "graphs/phase_timing.h"
#include "ops/autocast.h"

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace dwgraph::graphs {

enum class SlotState { kIdle, kForward, kDwPending };

// Static inputs a slot's graphs read, shared by the slots of one callable whose lifetimes
// do not overlap when reuse_static_buffers is on (Note [Static buffers reused across
// microbatches]).
struct StaticBuffers {
  StaticInputs inputs;
  std::vector<size_t> slots;  // the slots that share them
};

// A tensor's version when a graphed call read it, so a later phase that needs its value
// refuses an in-place change as eager autograd's saved-tensor check does.
struct WatchedVersion {
  c10::VariableVersion counter;
  uint32_t version;
  size_t index;                // which input or output
  const char* what = "input";  // "input", "output", "output gradient"
  at::Tensor held;             // kept alive as the eager node would keep it (output gradients)
};

// Note [State saved for the backward]: eager autograd saves some parameters and buffers
// for the backward (a torch Linear saves its weight) and refuses a backward after one of
// them changed in place (an optimizer step or an EMA update between a microbatch's
// forward and its backward), where the graphed backward would read the new values with
// activations of the old ones. The front end lists them at capture (the forward's saved
// tensors that are the callable's parameters or buffers, or views of them); each call's
// node records their versions and its backward refuses a change as eager's does. A module
// that reads a weight live in its backward (dwgraph's own Linear) saves nothing, and eager
// and the graphs both use the new value.
struct SavedState {
  std::vector<c10::VariableVersion> counters;
  std::vector<std::string> names;
};

// Host code writing pool memory that graphs share (Note [Slots share the pool by
// liveness]): a place in the pool's replay order, as a graph with one write per buffer.
struct PooledWrite {
  std::shared_ptr<GraphPool> pool;
  std::optional<PoolOrder::GraphId> id;
  void add(const std::shared_ptr<GraphPool>& p, std::string name, const std::vector<at::Tensor>& buffers);
  void check() const;      // GraphStateError when the write would destroy what a graph still needs
  void done();             // the write happened
  void abandon_for(const Graph& reader);
  void remove() noexcept;
};

// Note [A backward-dw graph per unit]: a slot's backward-dw work is captured as one graph
// per unit that one backward of the callable queues (per deferring module, and per use of
// a module used twice in the forward), each with its own contributions. A module's
// backward_dw() on the graphed callable lands its oldest pending part through its store
// (Note [Graphed units] in ops/wgrad_store.h), as eager lands its oldest unit; the
// callable's backward_dw() lands every part of the slot still pending, in capture order:
// it checks every pending part (hand-off, saved tensors, the pool's replay order) before it
// replays any, so one failed check writes nothing. A part whose module the backward did
// not reach (an output the loss does not use) is not pending, as an eager module whose
// backward did not run queues nothing: it is not replayed (no zero accumulation into
// main_grad, no flag, no hooks) and that module's backward_dw() is refused as eager's is.
// On CUDA each part is one graph launch: the callable's backward_dw() costs one launch per
// deferring module (per use), where one graph would cost one.
//
// Note [Parts armed per use]: which parts a backward arms is decided per use of a module,
// not per module: a module used twice where one use feeds only an output the loss does not
// use queues one unit in eager (the other use's node never runs), so only that use's part
// is armed (a review found both armed: the module counted a unit more, refusing an
// optimizer step eager allows). The backward capture records, per output, the autograd
// nodes its graph reaches, and per unit the nodes that queued it (WgradStore::unit_sources);
// a part is armed when its module's parameters get a gradient and an output with a
// gradient reaches its use. A unit of unknown origin (another library's module) is armed
// by its module's parameters alone.
struct DwPart {
  size_t module = 0;  // index into the callable's modules
  size_t unit = 0;    // which of that module's units of one backward
  std::unique_ptr<Graph> graph;
  Landing landing;  // contributions and grad_added_to_main_grad flags (hooks: Slot::dw_hooks)
  std::vector<size_t> param_indices;  // the module's deferred and fused parameters (callable indices)
  // What its graph reads of the slot's static inputs, outputs and grad outputs.
  std::vector<bool> reads_input, reads_output, reads_grad_output;
  // Note [Parts armed per use]: per output requiring grad, whether the captured backward
  // from it reaches the use that queued this part's unit (empty: not known; the module's
  // parameters decide alone).
  std::vector<uint8_t> reached_from;
  // Pending flag and sequence, counted by the module's store (and inner stores); armed
  // with the slot's other parts through Slot::dw_arm (Note [Units armed together]).
  std::shared_ptr<ops::GraphedUnit> state;
};

// The gradients a graphed backward made for its slot's parameters (caller-owned copies, per
// param_node edge), until the slot's parameter node hands them on to the parameters'
// AccumulateGrad. Held by that node as well as by the slot: a reset() in between (a hook on
// the call's input runs between the two nodes) releases the slot, not the gradients eager
// would land; before, the parameter node found nothing and every .grad of that backward was
// silently lost. Each backward's set is found by the token tensor its node sends the
// parameter node (the node is the slot's, shared by its backwards): a backward of the same
// slot that runs in between (started by that hook, or on another thread) lands its own set,
// not the earlier one's (a review found the earlier set overwritten). A set whose token only
// the stash still holds belongs to a backward that ended without handing it on (an error
// in between): dropped at the next put.
class ParamGradStash {
 public:
  ParamGradStash(size_t edges, at::TensorOptions token_options) : n_(edges), token_options_(token_options) {}
  // Holds `grads` and returns the token the backward's node sends the parameter node.
  at::Tensor put(std::vector<at::Tensor> grads);
  // The set `token` was returned for, one entry per edge (undefined where none).
  std::vector<at::Tensor> take(const at::Tensor& token);
  // Its entry `index` alone (the chain of relays, Note [Parameter hooks in autograd's
  // order]); the set is released once every entry was taken.
  at::Tensor take_one(const at::Tensor& token, size_t index);

 private:
  struct Set {
    at::Tensor token;
    std::vector<at::Tensor> grads;
    size_t taken = 0;
  };
  std::vector<Set>::iterator find_locked(const at::Tensor& token);
  void release_locked(std::vector<Set>::iterator it);
  std::mutex mu_;
  std::vector<Set> sets_;  // oldest first
  std::vector<at::Tensor> free_tokens_;
  const size_t n_;
  const at::TensorOptions token_options_;
};

struct Slot {
  SlotInfo info;
  std::string where;  // "graphed callable 0 ('Linear')", for messages
  std::shared_ptr<StaticBuffers> buffers;
  PooledWrite input_write, grad_write;  // when the buffers are pool blocks
  std::vector<at::Tensor> captured_outputs;  // with the capture's autograd graph, until bwd capture
  std::vector<at::Tensor> static_outputs;
  std::vector<bool> output_requires_grad;
  std::vector<bool> output_read_by_bwd;  // the backward graph reads the static output (saved for backward)
  std::vector<bool> output_read_by_dw;   // the backward-dw graph reads it (a deferred GEMM's input)
  // The backward (backward-dw) graph reads the static input: the eager ops saved the input.
  std::vector<bool> input_read_by_bwd, input_read_by_dw;
  std::vector<WatchedVersion> dw_inputs;  // of the call whose backward-dw is pending (inputs, outputs)
  std::shared_ptr<const SavedState> saved_state;  // Note [State saved for the backward]; null: none
  std::vector<bool> grad_output_read_by_dw;  // per output: the backward-dw graph reads its static grad output
  std::vector<WatchedVersion> dw_grads;  // of the backward whose backward-dw is pending
  std::vector<at::Tensor> static_grad_outputs;
  // Gradient targets of the backward graph: inputs that require grad, then parameters
  // that require grad; the graph's results land in static_grad_inputs.
  std::vector<size_t> grad_input_indices;
  std::vector<size_t> grad_param_indices;
  std::vector<bool> param_deferred;  // per grad_param_indices: lands in backward_dw() (or main_grad)
  std::vector<bool> param_fused;     // per grad_param_indices: accumulates into main_grad in a graph
  bool any_param_deferred = false;  // some entry of param_deferred is set
  // Note [What a backward asked for]: per output requiring grad, per target (inputs, then
  // parameters, as static_grad_inputs), whether the captured autograd graph reaches it;
  // `reached` is their union (a target no output reaches is never masked out).
  std::vector<std::vector<uint8_t>> reaches;
  std::vector<uint8_t> reached;
  // Note [Parts armed per use]: between the backward capture and capture_dw(), per output
  // requiring grad, the autograd nodes its captured graph reaches, and per module the
  // nodes that queued each of its units in that backward (with its own store).
  std::vector<std::unordered_set<const void*>> reach_nodes;
  std::vector<std::vector<std::vector<const void*>>> unit_sources;
  std::vector<at::Tensor> static_grad_inputs;
  std::unique_ptr<Graph> fwd, bwd;
  std::vector<DwPart> dw_parts;  // Note [A backward-dw graph per unit]
  // How many of dw_parts are pending (their state's flag set; both written under mu_ only,
  // by set_state and disarm_part), so a call need not visit every part to find none is,
  // or that all are.
  size_t armed_parts = 0;
  // Note [Units armed together]: shared by the parts' states; a new one per capture.
  std::shared_ptr<ops::GraphedArm> dw_arm;
  // Every part has a parameter (so a backward that gives every parameter a gradient arms
  // them all at once), and 0..n-1, what backward_dw() lands when every part is pending.
  bool dw_parts_all_have_params = false;
  std::vector<size_t> dw_all_parts;
  bool any_dw_hooks = false;            // some entry of dw_hooks is set
  size_t dw_unconditional_hooks = 0;    // their hooks without a store (Landing::hooks_may_run)
  // backward_dw()'s lists of the parts it lands and their graphs, kept between calls
  // (contract C10: a call of many parts allocates nothing; a large allocation after the
  // replays' frees made glibc consolidate them inside the call). Taken out while in use,
  // so a call that a hook makes meanwhile gets empty ones of its own.
  std::vector<size_t> dw_scratch_parts;
  std::vector<const Graph*> dw_scratch_run;
  // Per module of the callable: its delayed hooks after a landing of its parts (empty for
  // modules without deferral; null for a module without hooks). Shared: a backward_dw()
  // holds the ones it will run while a hook may reset() the graphs.
  std::vector<std::shared_ptr<const Landing>> dw_hooks;
  // Note [Parameter gradients through one node]: built once at capture, with an edge per
  // parameter that requires grad (param_node_edges, indices into grad_param_indices).
  dwgraph::detail::NodePtr param_node;
  // Note [Parameter hooks in autograd's order]: the chain's head and relays (null with one
  // parameter), used by calls while a parameter has tensor hooks (as of hooks_epoch). Each
  // node's edge already owns the next; the relays are held here as well so that a long
  // chain is released one node at a time, not by a destructor recursion per parameter.
  dwgraph::detail::NodePtr param_chain;
  std::vector<dwgraph::detail::NodePtr> param_relays;
  uint64_t hooks_epoch = 0;
  bool param_hooks = false;
  std::vector<size_t> param_order;  // grad_param_indices positions, in the order the captured backward reached them
  std::vector<size_t> param_node_edges;
  std::vector<size_t> param_edges_given;  // positions in param_node_edges the backward graph gives a gradient
  std::vector<dwgraph::detail::NodePtr> accumulators;  // per grad_param_indices: its AccumulateGrad
  at::Tensor param_token;  // what the call's node sends param_node
  std::shared_ptr<ParamGradStash> param_grads;  // the backward's, for param_node
  Landing after_backward;  // flags and hooks of modules without deferral
  LiveMask dw_live;        // of the backward whose backward-dw is pending (empty: all)
  // Of that backward, per output requiring grad: whether it got a gradient (empty: all).
  std::vector<uint8_t> dw_defined;
  // Per module of the callable: how many units one backward queues (a module used twice
  // in the forward queues two), so the backward-dw graph runs them all.
  std::vector<size_t> units_per_backward;
  // Replay state (Note [Slot states]), guarded by GraphManager::mu_.
  SlotState state = SlotState::kIdle;
  // kDwPending: where its backward stands among the deferred work of the process
  // (ops::next_wgrad_sequence()), so backward_dw() lands older eager units first.
  uint64_t dw_sequence = 0;
  uint64_t generation = 0;  // of the latest forward that created an autograd node
  bool graph_retained = false;  // that node can still run a backward (retain_graph=True)
};

// Note [Checks paid when state changes]: the state epoch at which each of a callable's
// checks last passed (0: never).
struct CallableChecks {
  std::atomic<uint64_t> tensors{0};    // parameters, buffers, main_grad
  std::atomic<uint64_t> front_end{0};  // GraphableCallable::check_state
  std::atomic<uint64_t> mode{0};       // (epoch << 1) | (the mode read then was the captured one)
  std::string captured_mode;           // training_mode at the callable's first capture
};

// What a backward of a graphed call hands back: the inputs' gradients, then the token for
// param_node (Note [Parameter gradients through one node]), and which parameters it gave a
// gradient (Note [What a backward asked for]; empty: all).
struct BackwardResult {
  std::vector<at::Tensor> grads;
  LiveMask live;
  // Per callable parameter: whether a defined output gradient reaches it, asked for or not
  // (empty: all). Whose layers' wgrad hooks run after the backward, as eager runs a layer's
  // when the backward reaches its output.
  LiveMask reached;
};

class GraphManager : public std::enable_shared_from_this<GraphManager> {
 public:
  GraphManager(std::vector<GraphableCallable> callables, GraphedCallableOptions opts);
  ~GraphManager();

  void build(const std::vector<std::vector<at::Tensor>>& sample_args);
  // Note [A second capture on a planned pool]: after build(), a plan for the allocations
  // its captures made that spans materially less than the pool holds; null otherwise.
  std::shared_ptr<const allocator::PlacementPlan> better_placement() const;

  // Replay half.
  std::vector<at::Tensor> call(size_t s, const std::vector<at::Tensor>& inputs);
  // The one replay-or-eager decision: the outputs of a replay, or nothing when this call
  // must run the callable eagerly (a mode or an autograd graph the graphs did not capture).
  std::optional<std::vector<at::Tensor>> replay_or_nothing(size_t s, const std::vector<at::Tensor>& inputs);
  // The replay half, once the decision is made.
  std::vector<at::Tensor> replay_call(size_t s, const std::vector<at::Tensor>& inputs);
  // The backward of slot s's call `generation`, with the gradients of the outputs that
  // require grad (undefined: unused), `asked` per target (inputs, then parameters) from the
  // engine; returns the input gradients and stashes the parameters' for param_node, or
  // (`direct`: the call's node has the parameter edges itself) returns them too.
  BackwardResult backward(size_t s, uint64_t generation, const std::vector<at::Tensor>& grads,
                          const std::vector<uint8_t>& asked, bool direct);
  void node_released(size_t s, uint64_t generation) noexcept;
  void node_done(size_t s, uint64_t generation) noexcept;  // its backward freed the graph
  void backward_dw(size_t s);
  bool need_backward_dw(size_t s) const { return defers_[slots_.at(s).info.callable]; }
  bool replays(size_t s);
  // Note [Calls eager autograd would differentiate further]: true when this call must run
  // eagerly (said once per set in a warning).
  bool runs_eagerly(size_t s, const std::vector<at::Tensor>& inputs);
  void reset();
  int64_t contribution_bytes(size_t s) const;
  GraphedStats stats() const;
  void record_eager_peak(int64_t nbytes);
  c10::Device device() const { return device_; }
  std::shared_ptr<GraphPool> pool() const { return pool_; }
  const std::string& name(size_t s) const { return callables_.at(slots_.at(s).info.callable).name; }
  const std::string& where(size_t s) const { return slots_.at(s).where; }
  size_t callable_index(size_t s) const { return slots_.at(s).info.callable; }
  size_t num_slots() const { return slots_.size(); }
  const Landing& after_backward(size_t s) const { return slots_.at(s).after_backward; }
  const ops::AutocastState& backward_autocast() const { return backward_autocast_; }
  const torch::autograd::Node* param_node(size_t s) const { return slots_.at(s).param_node.get(); }
  const std::vector<dwgraph::detail::NodePtr>& accumulators(size_t s) const { return slots_.at(s).accumulators; }
  size_t num_grad_inputs(size_t s) const { return slots_.at(s).grad_input_indices.size(); }

 private:
  // Capture half.
  std::string describe_slot(size_t s) const;
  CallerState caller_state() const;
  void name_storages(Graph& g, size_t s) const;
  template <class Body>
  void capture(std::unique_ptr<Graph>& g, Phase phase, size_t s, Body&& body, const std::string& part = "");
  void warmup();
  void capture_fwd(size_t s);
  void capture_bwd(size_t s);
  void capture_dw(size_t s);
  void record_reach(size_t s, const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& targets);
  void make_param_node(size_t s);
  // Whether a parameter of slot s has tensor hooks, looked at when tensor_hook_epoch moved.
  bool has_param_hooks(size_t s);
  std::vector<at::Tensor> backward_targets(size_t s, bool for_capture);
  bool module_defers(const ModuleSpec& m) const;
  void check_live(const char* what) const;
  // Note [Checks paid when state changes]: every replay check of callable c, unless the
  // state epoch has not moved since they last passed.
  // `front_end`: also GraphableCallable::check_state (at calls; a backward does not ask).
  void verify(size_t c, const std::string& where, bool front_end);
  void refuse_deferring_modules_shared_across_callables() const;
  void run_eager_backward_dw(size_t s);
  void share_static_buffers();
  bool busy(const Slot& slot) const;  // with mu_ held
  // Moves a slot to `next` (with mu_ held), keeping its parts' pending flags in step:
  // kDwPending arms the parts whose module slot.dw_live reaches; kIdle disarms all.
  void set_state(Slot& slot, SlotState next);
  // Disarms part p (landed or dropped), the slot going idle when none is left (mu_ held).
  // discard_wgrad_units() on a module with a unit pending in these graphs: drops it (the
  // part's graph will not replay, so what the forward and backward wrote for it is free).
  void discard_part(size_t s, size_t p);
  // Under mu_: part p of `slot` dropped unlanded, and the reads of its graph abandoned.
  void drop_part(Slot& slot, size_t p);
  // Under mu_: what the slot's forward, backward and buffers wrote for `reader` is not read.
  static void abandon_reads(Slot& slot, const Graph& reader);
  void disarm_part(Slot& slot, size_t p);
  // A module's backward_dw() on the graphed callable: lands part p of slot s (its store
  // chose it, Note [Graphed units]) without the module's hooks.
  void land_part(size_t s, size_t p);
  // Refuses (dropping `drop`, and the slot's dw state when none is left armed) when a tensor
  // some part in `parts` reads was changed in place since the graphs saw it.
  void check_saved_versions(Slot& slot, const std::vector<size_t>& parts, const std::vector<size_t>& drop,
                            const std::string& who);
  // Marks every pending backward-dw as lost in the modules' stores (graphs released).
  void release_pending();
  // The slot's backward and backward-dw will not read what its last forward saved.
  void abandon_activations(Slot& slot);
  // The stores of callable c's deferring modules (their own and inner ones).
  std::vector<std::shared_ptr<ops::WgradStore>> deferring_stores(size_t c) const;

  std::vector<GraphableCallable> callables_;
  GraphedCallableOptions opts_;
  Schedule schedule_ = Schedule::sequential(1);
  std::vector<bool> defers_;  // per callable: some module defers trainable weights
  std::vector<Slot> slots_;
  std::shared_ptr<GraphPool> pool_;
  c10::Device device_ = c10::Device(c10::kCPU);
  ops::AutocastState forward_autocast_;   // the capture's, what every call must match
  ops::AutocastState backward_autocast_;  // Note [Autocast in the backward]
  // The guard of build() while it warms up and captures: each backward there takes the
  // parameters' tensor hooks registered since off them first (CallerStateGuard::take_tensor_hooks).
  CallerStateGuard* capture_guard_ = nullptr;
  bool grad_at_capture_ = true;  // grad mode at capture (Note [Calls eager autograd would differentiate further])
  bool inference_at_capture_ = false;  // inference mode at capture: its static tensors are inference tensors
  std::atomic<bool> warned_eager_autograd_{false};
  std::atomic<bool> warned_eager_identity_{false};  // calls passing arguments otherwise than the samples
  std::atomic<bool> warned_grad_layout_{false};  // once per set: a gradient in another dense layout
  std::vector<CapturedParameters> params_;    // per callable
  std::vector<CapturedMainGrads> main_grads_;  // per callable
  std::vector<CapturedParameters> buffers_;    // per callable
  std::vector<std::unique_ptr<CallableChecks>> checks_;  // per callable
  bool pooled_buffers_ = false;  // Note [Slots share the pool by liveness]
  bool recorded_placement_ = false;  // Note [A second capture on a planned pool]
  std::atomic<int64_t> eager_peak_bytes_{0};  // 0: none recorded
  // Note [Contributions are shared across microbatches]: (callable, module, unit of one
  // backward) -> parameter -> buffer.
  std::map<std::tuple<size_t, size_t, size_t>, std::map<const void*, at::Tensor>> shared_contributions_;
  mutable std::mutex mu_;  // slot states; never held while calling out
  bool reset_ = false;
};

}  // namespace dwgraph::graphs
