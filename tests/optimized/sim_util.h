// Helpers of the optimized-twin tests: host tensors to and from the simulator's device memory,
// random tensors, and case-id filtering (TWIN_OP_CASE=<id> reruns one case, as ggml's
// test-backend-ops does with -o / -p).
#pragma once

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "optimized/runtime/device.h"

namespace twin::test {

inline rt::Device& sim() { return rt::device(rt::Backend::Sim); }

inline rt::DeviceBuffer to_device(const Tensor& t) {
  rt::DeviceBuffer b(sim(), std::max<std::size_t>(t.nbytes(), 1));
  if (t.nbytes()) b.upload(t.raw(), t.nbytes());
  return b;
}
inline Tensor from_device(const rt::DeviceBuffer& b, DType dt, Shape shape) {
  Tensor t = Tensor::empty(dt, std::move(shape));
  if (t.nbytes()) b.download(t.raw_mut(), t.nbytes());
  return t;
}
inline Tensor random_tensor(DType dt, Shape shape, double lo, double hi, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (auto& x : v) x = u(rng);
  return Tensor::from_doubles(dt, std::move(shape), v);
}
// True when the case should run: TWIN_OP_CASE unset or equal to `id`.
inline bool selected(const std::string& id) {
  const char* want = std::getenv("TWIN_OP_CASE");
  return !want || id == want;
}
inline const char* dt_name(DType dt) { return dt == DType::F32 ? "fp32" : dt == DType::BF16 ? "bf16" : "fp16"; }

}  // namespace twin::test
