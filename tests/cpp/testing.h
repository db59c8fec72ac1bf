#pragma once
// Shared helpers for dwgraph's Catch2 tests (namespace dwgraph::testing).
// ATen first: c10's logging defines a fatal CHECK macro; Catch's CHECK must win.
#include <ATen/ATen.h>
#undef CHECK
#include <catch2/catch.hpp>

#include <iostream>

namespace dwgraph::testing {

inline bool cuda_device_available() { return at::hasCUDA(); }

// Fresh standard-normal values (never zeros), made in FP32 on the CPU and converted, so a
// test's inputs do not depend on the device's generator.
inline at::Tensor randn(at::IntArrayRef shape, at::ScalarType dtype, c10::Device device) {
  return at::randn(shape, at::TensorOptions().dtype(at::kFloat)).to(device, dtype);
}

inline at::Tensor to_double(const at::Tensor& t) { return t.to(at::kCPU).to(at::kDouble); }

// ‖out − ref‖ / ‖ref‖ with ref in float64.
inline double rel_err(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor o = to_double(out);
  return (o - ref).norm().item<double>() / std::max(ref.norm().item<double>(), 1e-300);
}

// Bound on rel_err for an output of `dtype` accumulated in FP32: FP32 rounding of short
// sums, or one rounding to the 8 (BF16) / 11 (FP16) bit mantissa of the output.
inline double tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return 8e-3;
    case at::kHalf:
      return 2e-3;
    default:
      return 2e-6;
  }
}

inline const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

}  // namespace dwgraph::testing

#define DWGRAPH_CAT_(a, b) a##b
#define DWGRAPH_CAT(a, b) DWGRAPH_CAT_(a, b)

// DWGRAPH_DEVICE_TEST(name, tags) { body using `device` }
// Registers the body twice: "<name> (cpu)" and "<name> (cuda)"; the CUDA case reports
// DWGRAPH_SKIP (ctest marks it skipped) when no GPU is present.
#define DWGRAPH_DEVICE_TEST(name, tags) DWGRAPH_DEVICE_TEST_(DWGRAPH_CAT(dwgraph_body_, __LINE__), name, tags)
#define DWGRAPH_DEVICE_TEST_(body, name, tags)                                   \
  static void body(c10::Device device);                                          \
  TEST_CASE(name " (cpu)", tags "[cpu]") { body(c10::Device(c10::kCPU)); }       \
  TEST_CASE(name " (cuda)", tags "[cuda]") {                                     \
    if (!::dwgraph::testing::cuda_device_available()) {                          \
      std::cout << "DWGRAPH_SKIP: no CUDA device" << std::endl;                  \
      return;                                                                    \
    }                                                                            \
    body(c10::Device(c10::kCUDA, 0));                                            \
  }                                                                              \
  static void body(c10::Device device)
