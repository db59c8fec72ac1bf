#pragma once
// How gradients reach the caller after a replay (namespace dwgraph::graphs), SPEC C4. One
// sequence serves make_graphed_callables and graphed_step alike, in eager's order:
//  1. the hand-off: each contribution (a graph-pool buffer the replay wrote) goes to its
//     parameter's .grad, `.grad = buffer.clone()` when .grad is None, otherwise added
//     (or, for a step that saw the caller's .grad, copied: the graph already added);
//  2. grad_added_to_main_grad is set on every fused parameter the replay accumulated into
//     (eager sets it inside the GEMM, so hooks see it set);
//  3. the delayed hooks (register_wgrad_hook, distributed reduce hooks), once per module,
//     for the modules that have hooks.
// The caller therefore owns every .grad, and zero_grad(set_to_none=True) between replays
// is always safe. check() runs before the replay: nothing is written when it throws.
//
// A landing may cover only part of what its graph computed (Note [What a backward asked
// for] in graphs/manager_impl.h): `live`, indexed by the parameter index each piece
// names, says which parameters the backward gave a gradient; the others get nothing, as
// eager modules whose backward did not run for them queue nothing.

#include "ops/wgrad_store.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dwgraph::graphs {

// Which parameters (by index) a landing covers; an empty mask covers all of them.
using LiveMask = std::vector<uint8_t>;

struct Contribution {
  enum class Mode {
    kAccumulate,  // None: clone; else .grad += buffer
    kReplace,     // None: clone; else .grad.copy_(buffer) (the buffer already holds .grad + new)
  };
  at::Tensor param;
  at::Tensor buffer;  // the graph-pool buffer the captured kernels write
  std::string name;
  Mode mode = Mode::kAccumulate;
  size_t param_index = 0;  // what `live` masks are indexed by
};

struct FlagSetter {
  std::function<void()> set;
  size_t param_index = 0;
};

// One module's delayed hooks: run when any of its parameters is live and it has hooks.
struct ModuleHooks {
  std::function<void()> run;
  std::shared_ptr<ops::WgradStore> store;  // its num_hooks() says whether to call run (null: always)
  std::vector<size_t> param_indices;       // empty: live whenever the landing runs
};

struct Landing {
  std::vector<Contribution> contributions;
  std::vector<FlagSetter> flags;
  // Filled through add_hook(); shared so that land() holds them while they run (a hook may
  // reset() the graphs that own this landing).
  std::shared_ptr<std::vector<ModuleHooks>> hooks;
  size_t unconditional_hooks = 0;  // hooks without a store: they run whenever live
  // Backward-dw landings ask each module whether it has hooks at its turn, as eager's
  // backward_dw() of each module in turn would; others ask before any hook runs (an eager
  // module whose weight gradients land in the backward runs the hooks it had at its forward).
  bool hooks_asked_at_turn = false;

  void add_hook(ModuleHooks h) {
    if (!h.store) ++unconditional_hooks;
    if (!hooks) hooks = std::make_shared<std::vector<ModuleHooks>>();
    hooks->push_back(std::move(h));
  }

  // ArgumentError, before anything is written, when an existing .grad has another dtype,
  // shape or device than its contribution (never a silent cast). `where` prefixes messages.
  void check(const std::string& where, const LiveMask& live = {}) const;
  // Which modules have hooks now (a module without a store: always), in add_hook() order;
  // empty when none has. A graphed forward takes it for its backward's landing: an eager
  // module whose gradients land in the backward runs hooks only if it had some at its
  // forward (one registered between them waits for the next forward).
  std::vector<uint8_t> hooked_now() const;
  // Whether land() may run a hook now: with no hooked module in the process and no hook
  // outside a store there is nothing to scan, so a landing's cost does not grow with the
  // module tree (contract C10).
  bool may_run_hooks() const { return hooks && hooks_may_run(unconditional_hooks); }
  // The same rule for landings holding `unconditional` hooks without a store between them
  // (backward_dw() asks it once for all of its modules' landings).
  static bool hooks_may_run(size_t unconditional);
  // Hand-off, flags, hooks, for the live parameters. `hooked_at_forward`: hooked_now() as
  // the call's forward saw it (null: which modules have hooks is asked here). Untimed: the
  // caller times the hand-offs of all the parts it lands at once (graphs/phase_timing.h),
  // as a clock read per part would count as overhead.
  // `reached` (null: `live`): which parameters' layers the backward reached, for the hooks.
  void land(const LiveMask& live = {}, const std::vector<uint8_t>* hooked_at_forward = nullptr,
            const LiveMask* reached = nullptr) const;
  bool empty() const { return contributions.empty() && flags.empty() && (!hooks || hooks->empty()); }
};

// An index the mask does not cover (a parameter outside the callable's list) is live.
inline bool is_live(const LiveMask& live, size_t index) { return index >= live.size() || live[index] != 0; }

}  // namespace dwgraph::graphs
