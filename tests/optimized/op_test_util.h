// What the per-op tests of the optimized kernels (test_ops.cpp forwards, test_ops_backward.cpp
// backwards) share beyond sim_util.h: the dtypes every op runs in, the reference's precision for
// a dtype, and one failure message naming the case id, the worst element and the bound's reason.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "parity/compare.h"
#include "reference/precision.h"
#include "tests/optimized/sim_util.h"

namespace twin::test {

inline constexpr DType kDtypes[] = {DType::F32, DType::BF16, DType::F16};

// The reference in the dtype's Megatron rounding (fp32 arithmetic between the rounding points).
inline reference::Precision prec(DType dt) { return reference::Precision{reference::ComputeMode::FP32, dt}; }

inline void expect_pass(const Comparison& c, const std::string& id) {
  EXPECT_TRUE(c.pass) << id << ": " << c.name << " max abs " << c.max_abs << " at " << c.worst_index_str() << " actual "
                      << c.worst_actual << " expected " << c.worst_expected << " share " << c.share_used << " ("
                      << c.tol.reason << ")" << c.message;
}

}  // namespace twin::test
