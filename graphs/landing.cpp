#include "graphs/landing.h"

#include "common/check.h"
#include "ops/grad_accumulation.h"

#include <ATen/core/grad_mode.h>

namespace dwgraph::graphs {

void Landing::check(const std::string& where, const LiveMask& live) const {
  for (const auto& c : contributions) {
    if (is_live(live, c.param_index)) ops::check_accumulable(c.param, c.buffer, where, &c.name);
  }
}

bool Landing::hooks_may_run(size_t unconditional) { return unconditional > 0 || ops::num_stores_with_hooks() > 0; }

std::vector<uint8_t> Landing::hooked_now() const {
  std::vector<uint8_t> hooked;
  if (!may_run_hooks()) return hooked;
  hooked.reserve(hooks->size());
  for (const auto& h : *hooks) hooked.push_back(!h.store || h.store->num_hooks() > 0 ? 1 : 0);
  return hooked;
}

void Landing::land(const LiveMask& live, const std::vector<uint8_t>* hooked_at_forward, const LiveMask* reached) const {
  {
    const at::NoGradGuard no_grad;
    for (const auto& c : contributions) {
      if (!is_live(live, c.param_index)) continue;
      at::Tensor& grad = c.param.mutable_grad();
      if (c.mode == Contribution::Mode::kAccumulate || !grad.defined()) {
        ops::accumulate_grad(c.param, c.buffer, ops::Take::kClone, c.name);  // checked already: no throw
      } else if (grad.data_ptr() != c.buffer.data_ptr()) {
        grad.copy_(c.buffer);
      }
    }
  }
  for (const auto& f : flags) {
    if (is_live(live, f.param_index)) f.set();
  }
  if (!may_run_hooks()) return;
  // A hook may reset() the graphs that own this landing, destroying it (and `live`): the
  // hooks are held here and which modules are live is read before any runs.
  const std::shared_ptr<const std::vector<ModuleHooks>> held = hooks;
  const LiveMask& by = reached != nullptr ? *reached : live;
  std::vector<uint8_t> live_module(held->size(), 0);
  for (size_t k = 0; k < held->size(); ++k) {
    const auto& h = (*held)[k];
    bool any = h.param_indices.empty();
    for (size_t i : h.param_indices) any = any || is_live(by, i);
    const bool hooked = hooked_at_forward != nullptr
                            ? k < hooked_at_forward->size() && (*hooked_at_forward)[k] != 0
                            : hooks_asked_at_turn || !h.store || h.store->num_hooks() > 0;
    live_module[k] = any && hooked ? 1 : 0;
  }
  // hooks_asked_at_turn: a hook an earlier module's hook registers on a later module runs
  // in this landing, as that module's own backward_dw() after the earlier one's would run it.
  const bool ask = hooks_asked_at_turn;
  for (size_t k = 0; k < held->size(); ++k) {
    const auto& h = (*held)[k];
    if (live_module[k] && (!ask || !h.store || h.store->num_hooks() > 0)) h.run();
  }
}

}  // namespace dwgraph::graphs
