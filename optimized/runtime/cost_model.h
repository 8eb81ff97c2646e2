// Cost model of the optimized kernels without a GPU: every kernel launcher declares the minimal
// global-memory bytes and the FLOPs of its launch, and a CostScope on the calling thread sums them
// by kernel, so a table per layer (bytes, FLOPs, arithmetic intensity, roofline time) shows a
// kernel that moves more than it must before any GPU runs it. A MODEL, not a measurement.
//
// API (one call per launcher, beside its rounding_* counts):
//   rt::declare_cost("kernel_name", bytes, flops);
// bytes: what the launch must read and write in global memory at least (every input, weight and
// output once, in its storage dtype; what a fused kernel keeps on chip is not counted). flops: the
// arithmetic the math needs (2 per multiply-add; elementwise ops at a few per element, the launcher
// says which). A no-op unless a CostScope is alive on this thread, so launches outside one cost
// nothing. GEMMs declare through declare_gemm_cost (runtime/gemm.cpp) from both backends.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace twin::rt {

void declare_cost(const char* kernel, double bytes, double flops);

// Called by the simulator for every kernel launch (not GEMMs, copies or collectives): the scope
// counts them by kernel name, so a test can tell a launcher that declares nothing.
void note_kernel_launch(const std::string& kernel);

struct KernelCost {
  std::string kernel;
  double bytes = 0, flops = 0;
  int launches = 0;
  double intensity() const { return bytes > 0 ? flops / bytes : 0.0; }  // FLOP per byte
};

// The device a roofline time is modelled on: H200 SXM by default (4.8 TB/s HBM3e, 989 TFLOP/s
// dense bf16 tensor cores).
struct Roofline {
  const char* device = "H200";
  double bytes_per_s = 4.8e12;
  double flops_per_s = 989e12;
  // max(bytes / bandwidth, flops / peak): the time no kernel can beat on that device.
  double seconds(const KernelCost& k) const;
  bool memory_bound(const KernelCost& k) const { return k.bytes / bytes_per_s >= k.flops / flops_per_s; }
};

// Collects the declarations of this thread while alive (scopes nest: the innermost collects).
class CostScope {
 public:
  CostScope();
  ~CostScope();
  CostScope(const CostScope&) = delete;
  CostScope& operator=(const CostScope&) = delete;

  // One row per kernel name, in first-launch order, launches of the same name summed.
  const std::vector<KernelCost>& kernels() const { return kernels_; }
  KernelCost total() const;  // kernel "total"
  void add(const char* kernel, double bytes, double flops);
  // Simulated kernel launches seen by this scope, by kernel name ("router_topk_kernel<R>"), in
  // first-launch order. Each should be matched by one declaration of its launcher.
  const std::vector<std::pair<std::string, int>>& kernel_launches() const { return launched_; }
  void note_launch(const std::string& kernel);

 private:
  std::vector<KernelCost> kernels_;
  std::vector<std::pair<std::string, int>> launched_;
  CostScope* outer_;
};

// The table: kernel, launches, bytes, FLOPs, FLOP/B, roofline us, bound (memory | compute), a
// total row, and a header line saying it is a model and of which device.
std::string cost_table(const std::vector<KernelCost>& kernels, const Roofline& roof = {});

}  // namespace twin::rt
