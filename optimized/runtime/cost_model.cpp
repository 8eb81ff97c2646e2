#include "optimized/runtime/cost_model.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>

namespace twin::rt {

namespace {
thread_local CostScope* tl_scope = nullptr;

void appendf(std::string& out, const char* format, ...) {
  char buf[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buf, sizeof buf, format, args);
  va_end(args);
  out += buf;
}
}  // namespace

void declare_cost(const char* kernel, double bytes, double flops) {
  if (tl_scope) tl_scope->add(kernel, bytes, flops);
}

void note_kernel_launch(const std::string& kernel) {
  if (tl_scope) tl_scope->note_launch(kernel);
}

double Roofline::seconds(const KernelCost& k) const { return std::max(k.bytes / bytes_per_s, k.flops / flops_per_s); }

CostScope::CostScope() : outer_(tl_scope) { tl_scope = this; }
CostScope::~CostScope() { tl_scope = outer_; }

void CostScope::add(const char* kernel, double bytes, double flops) {
  auto it = std::find_if(kernels_.begin(), kernels_.end(), [&](const KernelCost& k) { return k.kernel == kernel; });
  if (it == kernels_.end()) it = kernels_.insert(kernels_.end(), KernelCost{kernel});
  it->bytes += bytes;
  it->flops += flops;
  ++it->launches;
}

void CostScope::note_launch(const std::string& kernel) {
  auto it = std::find_if(launched_.begin(), launched_.end(), [&](const auto& k) { return k.first == kernel; });
  if (it == launched_.end()) it = launched_.insert(launched_.end(), {kernel, 0});
  ++it->second;
}

KernelCost CostScope::total() const {
  KernelCost t{"total"};
  for (const auto& k : kernels_) {
    t.bytes += k.bytes;
    t.flops += k.flops;
    t.launches += k.launches;
  }
  return t;
}

std::string cost_table(const std::vector<KernelCost>& kernels, const Roofline& roof) {
  std::string out;
  appendf(out,
          "MODEL (not measured): minimal global-memory bytes and FLOPs per kernel; roofline on %s (%.1f TB/s, %.0f "
          "TFLOP/s)\n",
          roof.device, roof.bytes_per_s / 1e12, roof.flops_per_s / 1e12);
  appendf(out, "%-34s %8s %12s %12s %8s %12s %8s\n", "kernel", "launches", "bytes", "FLOPs", "FLOP/B", "roofline us",
          "bound");
  KernelCost total{"total"};
  double total_seconds = 0;
  auto row = [&](const KernelCost& k, double seconds) {
    appendf(out, "%-34s %8d %12.4g %12.4g %8.2f %12.3f %8s\n", k.kernel.c_str(), k.launches, k.bytes, k.flops,
            k.intensity(), seconds * 1e6, roof.memory_bound(k) ? "memory" : "compute");
  };
  for (const auto& k : kernels) {
    row(k, roof.seconds(k));
    total.bytes += k.bytes;
    total.flops += k.flops;
    total.launches += k.launches;
    total_seconds += roof.seconds(k);  // kernels run one after another: their times add
  }
  row(total, total_seconds);
  return out;
}

}  // namespace twin::rt
