// The caller-state guard of warmup and capture (graphs/caller_state.h): everything is put
// back on every exit path, queued wgrad units are stashed and restored, hooks suppressed.
#include "testing.h"

#include "graphs/caller_state.h"
#include "ops/wgrad_store.h"

#include <ATen/core/grad_mode.h>

#include <stdexcept>

using dwgraph::graphs::CallerState;
using dwgraph::graphs::CallerStateGuard;
using dwgraph::graphs::FusedParameter;

TEST_CASE("CallerStateGuard puts everything back, also when the region throws", "[caller_state][cpu]") {
  const bool throws = GENERATE(false, true);
  CAPTURE(throws);
  auto p = at::randn({4}).requires_grad_();
  const auto caller_grad = at::randn({4});
  p.mutable_grad() = caller_grad;
  const auto p_values = p.detach().clone();
  auto buffer = at::randn({3});
  const auto buffer_values = buffer.clone();
  auto main_grad = at::zeros({4});
  std::optional<bool> flag;
  FusedParameter f;
  f.name = "p";
  f.param = p;
  f.main_grad = [&] { return main_grad; };
  f.get_flag = [&] { return flag; };
  f.set_flag = [&](std::optional<bool> v) { flag = v; };
  auto store = std::make_shared<dwgraph::ops::WgradStore>();
  int ran = 0;
  store->push(store->new_unit_id(), &ran, [&] { ++ran; });  // the caller's own queued unit
  at::manual_seed(5);
  const auto expected_draw = at::randn({2});
  at::manual_seed(5);

  CallerState state;
  state.parameters = {p};
  state.parameter_contents = true;
  state.buffers = {buffer};
  state.fused = {f};
  state.stores = {store};
  try {
    const CallerStateGuard guard(state);
    CHECK(store->empty());  // stashed: the region can neither run nor lose it
    CHECK(store->hooks_suppressed());
    const at::NoGradGuard no_grad;
    p.add_(1.0);                  // an undeclared write to a parameter
    buffer.fill_(7.0);            // BatchNorm-like statistics
    main_grad.add_(2.0);
    flag = true;
    p.mutable_grad() = at::Tensor();
    (void)at::randn({5});         // draws from the generator
    store->push(store->new_unit_id(), &ran, [&] { ran += 100; });  // the region's own unit
    if (throws) throw std::runtime_error("region failed");
  } catch (const std::runtime_error&) {
    CHECK(throws);
  }
  CHECK(p.grad().unsafeGetTensorImpl() == caller_grad.unsafeGetTensorImpl());
  CHECK(at::equal(p.detach(), p_values));
  CHECK(at::equal(buffer, buffer_values));
  CHECK(at::equal(main_grad, at::zeros({4})));
  CHECK_FALSE(flag.has_value());
  CHECK_FALSE(store->hooks_suppressed());
  CHECK(at::equal(at::randn({2}), expected_draw));
  REQUIRE(store->num_units() == 1);  // the caller's unit is back, the region's is dropped
  store->run_oldest("test");
  CHECK(ran == 1);
}
