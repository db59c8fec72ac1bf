#pragma once
// The state epoch (namespace dwgraph::graphs): one process-wide counter that a front end
// moves whenever anything a graph's replay checks read may have changed.
//
// Note [Checks paid when state changes] (contract C10): a replay must refuse a parameter
// replaced, reallocated or frozen since capture, a submodule or hook added, a module
// switched to eval, a main_grad swapped (C7, C8). Walking the module tree and calling back
// into the front end for that at every call costs more than the graph saves. So the front
// end that can see every such change (Python: dwgraph._watch, through torch's
// registration hooks, watched module dicts and the setters of parameters and modules)
// moves this epoch when one happens, and a graphed callable runs its full checks only
// when the epoch moved since they last passed. A front end that cannot see changes (the
// C++ API: torch::nn has no registration hooks) leaves its callables unwatched, and they
// check at every call.

#include <cstdint>

namespace dwgraph::graphs {

uint64_t state_epoch();
void bump_state_epoch();

// Moved (with the state epoch) when a parameter, buffer or submodule is registered: what
// replaced a parameter then was a registration, not a write into a module's dict behind
// its back (the messages differ: only the second is what FSDP2 does between unshards).
uint64_t registration_epoch();
void bump_registration_epoch();

// Moved (alone: no check reads it) when a tensor hook is registered on a leaf, so a graphed
// call looks at its parameters' hooks only then (Note [Parameter hooks in autograd's order]).
uint64_t tensor_hook_epoch();
void bump_tensor_hook_epoch();

}  // namespace dwgraph::graphs
