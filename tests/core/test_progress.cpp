// core/progress.h: what a sink is told, in what order; marks from other threads and without a
// sink are dropped; a throwing sink does not end the run.
#include "core/progress.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace twin::progress {
namespace {

TEST(Progress, StepsNestNowAndDoneNameTheModuleWithinTheInnermost) {
  std::vector<std::string> seen;
  {
    const Show show([&](const std::string& path) { seen.push_back(path); });
    const Step outer("backward");
    {
      const Step inner("mlp");
      now("linear_fc2");
      now("linear_fc1");
    }
    done("self_attention.linear_qkv.0");
  }
  const std::vector<std::string> want = {"backward",
                                         "backward > mlp",
                                         "backward > mlp > linear_fc2",
                                         "backward > mlp > linear_fc1",
                                         "backward",
                                         "backward, after self_attention.linear_qkv.0",
                                         ""};
  EXPECT_EQ(seen, want);
}

TEST(Progress, WithoutASinkAndFromOtherThreadsNothingIsReported) {
  done("before any sink");  // no sink: nothing to call, no crash
  const Step early("unseen");
  std::vector<std::string> seen;
  {
    const Show show([&](const std::string& path) { seen.push_back(path); });
    std::thread rank1([] {
      const Step step("rank 1");
      now("linear_qkv");
      done("input_layernorm");
    });
    rank1.join();
    now("rank 0");
  }
  done("after the sink");
  EXPECT_EQ(seen, std::vector<std::string>{"rank 0"});
}

TEST(Progress, OneSinkAtATimeAndAThrowingSinkIsIgnored) {
  int calls = 0;
  const Show show([&](const std::string&) {
    ++calls;
    throw std::runtime_error("terminal closed");
  });
  EXPECT_THROW(Show([](const std::string&) {}), std::logic_error);
  EXPECT_NO_THROW({
    const Step step("forward");
    done("input_layernorm");
  });
  EXPECT_EQ(calls, 3);  // the step, done, the step's end
}

}  // namespace
}  // namespace twin::progress
