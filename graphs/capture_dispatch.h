#pragma once
// How a capture sees the dispatcher calls of its region (dwgraph::graphs::detail).
//
// Note [How the host graph sees kernels]: a boxed fallback is registered for the mode
// dispatch key TESTING_ONLY_GenericMode, which sits above autograd, the Python key and
// every backend key. While a capture is active the capturing thread includes that key in
// its dispatch set, and every thread that inherits the thread's state does too (the
// autograd engine's worker threads copy it into each backward task). So every top-level
// dispatcher call of the region, from C++ or Python, forward or backward, ATen or
// torch.ops.dwgraph, reaches the fallback first, which hands it to the capture's Recorder.
//
// Note [Captures are found by stream, not by thread]: autograd runs CUDA backward kernels
// on its per-device worker thread, not on the thread that began the capture. The
// fallback therefore never asks "which capture did this thread start"; it asks every
// active capture whether the call belongs to it: a CUDA capture claims calls made while
// its capture stream is current (on any thread, as PyTorch's allocator routes a capture's
// allocations by stream), a host capture the calls of its capturing thread (the engine
// runs CPU backward work on the thread that called backward). A thread that inherited the
// key but belongs to no capture just runs the call.

#include <c10/core/DispatchKey.h>

#include <functional>
#include <string>

namespace dwgraph::graphs::detail {

class Recorder;

constexpr auto kCaptureModeKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

// While alive, dispatcher calls for which `claims()` is true are recorded by `rec`, and
// the constructing thread includes the mode key. `claims` is asked on whichever thread
// makes the call.
class ActiveRecording {
 public:
  ActiveRecording(Recorder* rec, std::function<bool()> claims);
  ~ActiveRecording();
  ActiveRecording(const ActiveRecording&) = delete;
  ActiveRecording& operator=(const ActiveRecording&) = delete;

 private:
  Recorder* rec_;
  bool previously_included_;
};

// A claim for the calling thread (host captures).
std::function<bool()> claim_this_thread();

// True while any capture records on the calling thread (host captures: one per thread).
bool this_thread_records();

// The recorder of the capture that claims the calling context's work (null: none).
Recorder* claiming_recorder();
// Notes a refusal made outside the dispatcher on the capture that claims this thread's
// calls, if any (Recorder::note_refused).
void note_refused_here(const std::string& what);

// Runs `call` as a recorded call's own dispatch: calls it makes through its autograd layer
// are recorded as its children, calls below autograd (inside its kernels) are not, unless
// the call has no autograd kernel (Note [Calls in a kernel's body], recorder.cpp).
void run_recorded_call(const std::function<void()>& call);

}  // namespace dwgraph::graphs::detail
