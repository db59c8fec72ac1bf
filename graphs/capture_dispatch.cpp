#include "graphs/capture_dispatch.h"

#include "graphs/recorder.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <thread>
#include <vector>

namespace dwgraph::graphs::detail {
namespace {

struct Registration {
  Recorder* rec;
  std::function<bool()> claims;
};

std::mutex g_mu;
std::vector<Registration>& registrations() {
  static auto* r = new std::vector<Registration>();  // never destroyed: used by static teardown
  return *r;
}

// Nesting of recorded calls on this thread (a per-thread fact, not routing).
thread_local int tls_depth = 0;

void pass_through(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::impl::ExcludeDispatchKeyGuard guard(kCaptureModeKey);
  op.redispatchBoxed(ks.remove(kCaptureModeKey), stack);
}

void capture_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // Inside a kernel, below autograd: part of the call being recorded, not a call of its
  // own, unless that call is a body of calls (Note [Calls in a kernel's body]).
  const bool in_kernel = tls_depth > 0 && c10::impl::tls_is_dispatch_keyset_excluded(c10::autograd_dispatch_keyset);
  Recorder* rec = claiming_recorder();
  if (rec == nullptr || (in_kernel && !rec->records_calls_below_autograd())) {
    pass_through(op, ks, stack);  // part of a kernel, or inherited the key and belongs to no capture
    return;
  }
  rec->on_call(op, stack, [&] { op.redispatchBoxed(ks.remove(kCaptureModeKey), stack); });
}

}  // namespace

Recorder* claiming_recorder() {
  const std::lock_guard<std::mutex> lock(g_mu);
  for (const auto& r : registrations()) {
    if (r.claims()) return r.rec;
  }
  return nullptr;
}

void note_refused_here(const std::string& what) {
  if (Recorder* rec = claiming_recorder()) rec->note_refused(what);
}

TORCH_LIBRARY_IMPL(_, TESTING_ONLY_GenericMode, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&capture_fallback>());
}

void run_recorded_call(const std::function<void()>& call) {
  ++tls_depth;
  try {
    call();
  } catch (...) {
    --tls_depth;
    throw;
  }
  --tls_depth;
}

ActiveRecording::ActiveRecording(Recorder* rec, std::function<bool()> claims)
    : rec_(rec), previously_included_(c10::impl::tls_is_dispatch_key_included(kCaptureModeKey)) {
  {
    const std::lock_guard<std::mutex> lock(g_mu);
    registrations().push_back(Registration{rec, std::move(claims)});
  }
  c10::impl::tls_set_dispatch_key_included(kCaptureModeKey, true);
}

ActiveRecording::~ActiveRecording() {
  c10::impl::tls_set_dispatch_key_included(kCaptureModeKey, previously_included_);
  const std::lock_guard<std::mutex> lock(g_mu);
  auto& regs = registrations();
  regs.erase(std::remove_if(regs.begin(), regs.end(), [&](const Registration& r) { return r.rec == rec_; }),
             regs.end());
}

std::function<bool()> claim_this_thread() {
  return [id = std::this_thread::get_id()] { return std::this_thread::get_id() == id; };
}

bool this_thread_records() { return claiming_recorder() != nullptr; }

}  // namespace dwgraph::graphs::detail
