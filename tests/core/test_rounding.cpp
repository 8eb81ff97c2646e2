// Rounding counts: what a twin's precision policy adds at each rounding point, and the record
// that carries the count before each tensor.
#include <gtest/gtest.h>

#include "core/record.h"
#include "core/rounding.h"

using namespace twin;

TEST(RoundingCount, CountsOnlyInsideACountingScope) {
  rounding_store(DType::BF16);
  EXPECT_TRUE(rounding_now().none());
  {
    CountRoundings counting;
    rounding_store(DType::BF16, 2);
    rounding_store(DType::F32);
    rounding_reduce(64);
    rounding_store(DType::I64);  // integer stores lose nothing
    const RoundingCount r = rounding_now();
    EXPECT_EQ(r.bf16, 2);
    EXPECT_EQ(r.fp32, 1);
    EXPECT_EQ(r.fp16, 0);
    EXPECT_EQ(r.reduction, 64);
    EXPECT_EQ(r.describe(), "2 bf16 + 1 fp32 stores, fp32 reductions of total length 64");
    {
      CountRoundings nested;  // keeps the outer count
      EXPECT_EQ(rounding_now(), r);
    }
  }
  EXPECT_TRUE(rounding_now().none());
  CountRoundings again;  // a new scope starts from zero
  EXPECT_TRUE(rounding_now().none());
}

// Parallel branches: a value where they meet carries the larger count of each kind, not the sum.
TEST(RoundingCount, BranchesJoinByMaximum) {
  CountRoundings counting;
  rounding_store(DType::BF16);
  const RoundingCount fork = rounding_now();
  rounding_store(DType::BF16, 3);
  const RoundingCount left = rounding_now();
  rounding_set(fork);
  rounding_store(DType::F32, 2);
  rounding_reduce(10);
  rounding_join(left);
  const RoundingCount r = rounding_now();
  EXPECT_EQ(r.bf16, 4);
  EXPECT_EQ(r.fp32, 2);
  EXPECT_EQ(r.reduction, 10);
}

TEST(Record, EntriesCarryTheCountAtTheirRecordingAndParametersNone) {
  CountRoundings counting;
  Record rec;
  rounding_store(DType::F32);
  rec.add(Role::Tap, "input_layernorm", Tensor::zeros(DType::F32, {2}));
  rounding_store(DType::F32, 2);
  rec.add_exact(Role::Tap, "linear_proj.1", Tensor::zeros(DType::F32, {2}));
  rec.add(Role::Output, "hidden_states", Tensor::zeros(DType::F32, {2}));
  ASSERT_EQ(rec.entries.size(), 3u);
  EXPECT_EQ(rec.entries[0].rounding.fp32, 1);
  EXPECT_TRUE(rec.entries[1].rounding.none());
  EXPECT_EQ(rec.entries[2].rounding.fp32, 3);
  EXPECT_EQ(rec.entries[2].key(), "output.hidden_states");
  EXPECT_EQ(rec.entries[0].key(), "tap.input_layernorm");
  EXPECT_NE(rec.find("hidden_states", Role::Output), nullptr);
  EXPECT_EQ(rec.find("hidden_states"), nullptr);  // the default role is Tap
}
