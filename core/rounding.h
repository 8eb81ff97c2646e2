// RoundingCount points a twin executed on the way to a value, counted as the twin runs.
//
// A golden comparison needs a bound per tensor that any correct implementation of Megatron's
// math meets. Two implementations that store at the same points may land one rounding apart at
// each store (one unit roundoff u of that dtype, relative), and two fp32-accumulated reductions
// of length K in different orders may differ by 2 gamma_K(u_fp32). So a twin's precision policy
// counts, at each rounding point it executes, the store (by dtype) and the reduction length, and
// the record carries the count seen before each tensor; parity/ turns it into the bound.
//
// Counting is per thread and off unless a CountRoundings scope is active (a forward run for a
// comparison). Values computed on parallel branches (q and k heads, experts) do not inherit each
// other's roundings: a module forks at the branch and joins (elementwise max) where they meet.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace twin {

struct RoundingCount {
  int bf16 = 0, fp16 = 0, fp32 = 0;  // stores to each dtype
  std::int64_t reduction = 0;        // total length of the fp32-accumulated reductions

  bool none() const { return bf16 == 0 && fp16 == 0 && fp32 == 0 && reduction == 0; }
  void store(DType dt, int n = 1);
  // A value computed from two paths carries the larger count of each.
  void join(const RoundingCount& o);
  // "3 bf16 + 2 fp32 stores, fp32 reductions of total length 320"
  std::string describe() const;
  bool operator==(const RoundingCount& o) const {
    return bf16 == o.bf16 && fp16 == o.fp16 && fp32 == o.fp32 && reduction == o.reduction;
  }
};

// The running count of this thread's forward: zero when no CountRoundings scope is active.
RoundingCount rounding_now();
// Sets the running count (a module forking into parallel branches restarts each from the fork).
void rounding_set(const RoundingCount& r);
// At a rounding point: `n` stores to dtype dt / a reduction of length k accumulated in fp32.
void rounding_store(DType dt, int n = 1);
void rounding_reduce(std::int64_t k);
// Where parallel branches meet: the running count becomes the larger of it and `branch`.
void rounding_join(const RoundingCount& branch);

// Turns counting on for this thread while it lives (nested scopes keep the outer count).
class CountRoundings {
 public:
  CountRoundings();
  ~CountRoundings();
  CountRoundings(const CountRoundings&) = delete;
  CountRoundings& operator=(const CountRoundings&) = delete;

 private:
  bool outer_;
};

// The rounding counts of a backward's parameter grads. Each grad is a leaf: it branches off the
// data path, which goes on from the branch point; every gradient is compared with the count at
// the end, so that count joins each leaf's.
class GradLeaves {
 public:
  explicit GradLeaves(const RoundingCount& start) : joined_(start) {}
  // A leaf ends here: keep its count, and go back to where the data path branched off.
  void done(const RoundingCount& branch_point) {
    joined_.join(rounding_now());
    rounding_set(branch_point);
  }
  // At the end of the backward: the running count covers every leaf.
  void join_all() const { rounding_join(joined_); }

 private:
  RoundingCount joined_;
};

}  // namespace twin
