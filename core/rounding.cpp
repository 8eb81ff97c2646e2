#include "core/rounding.h"

#include <algorithm>
#include <vector>

namespace twin {

namespace {
struct Counter {
  int depth = 0;  // active CountRoundings scopes
  RoundingCount now;
};
thread_local Counter counter;
}  // namespace

void RoundingCount::store(DType dt, int n) {
  switch (dt) {
    case DType::BF16:
      bf16 += n;
      break;
    case DType::F16:
      fp16 += n;
      break;
    case DType::F32:
      fp32 += n;
      break;
    default:
      break;  // fp64 and integer stores lose nothing a bound needs to count
  }
}

void RoundingCount::join(const RoundingCount& o) {
  bf16 = std::max(bf16, o.bf16);
  fp16 = std::max(fp16, o.fp16);
  fp32 = std::max(fp32, o.fp32);
  reduction = std::max(reduction, o.reduction);
}

std::string RoundingCount::describe() const {
  if (none()) return "no rounding point";
  std::vector<std::string> parts;
  if (bf16) parts.push_back(std::to_string(bf16) + " bf16");
  if (fp16) parts.push_back(std::to_string(fp16) + " fp16");
  if (fp32) parts.push_back(std::to_string(fp32) + " fp32");
  std::string s;
  for (std::size_t i = 0; i < parts.size(); ++i) s += (i ? " + " : "") + parts[i];
  if (!s.empty()) s += " stores";
  if (reduction)
    s += (s.empty() ? "" : ", ") + std::string("fp32 reductions of total length ") + std::to_string(reduction);
  return s;
}

RoundingCount rounding_now() { return counter.depth ? counter.now : RoundingCount{}; }
void rounding_set(const RoundingCount& r) {
  if (counter.depth) counter.now = r;
}
void rounding_store(DType dt, int n) {
  if (counter.depth) counter.now.store(dt, n);
}
void rounding_reduce(std::int64_t k) {
  if (counter.depth) counter.now.reduction += k;
}
void rounding_join(const RoundingCount& branch) {
  if (counter.depth) counter.now.join(branch);
}

CountRoundings::CountRoundings() : outer_(counter.depth == 0) {
  if (outer_) counter.now = RoundingCount{};
  ++counter.depth;
}
CountRoundings::~CountRoundings() { --counter.depth; }

}  // namespace twin
