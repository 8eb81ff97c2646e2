// sim_fixture.h: a gtest fixture for simulator tests: blocks run on 4 workers (so blocks really
// run in parallel), the resume order stays whatever CUDASIM_ORDER says, options are restored after.
// Also launch_error / EXPECT_HAS for the tests of the simulator's error reports.
#pragma once

#include "cuda_compat.h"  // cudasim::KernelError
#include "optimized/runtime/cudasim_options.h"
#include "optimized/runtime/device.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

class SimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = cudasim::options();
    cudasim::Options o = saved_;
    o.workers = 4;
    cudasim::set_options(o);
  }
  void TearDown() override { cudasim::set_options(saved_); }
  twin::rt::Device& dev() { return twin::rt::device(twin::rt::Backend::Sim); }
  void set_order(cudasim::Order order) {
    cudasim::Options o = cudasim::options();
    o.order = order;
    cudasim::set_options(o);
  }

 private:
  cudasim::Options saved_;
};

// Runs `launch`, expects a cudasim::KernelError, returns its message.
template <class F>
std::string launch_error(F launch) {
  try {
    launch();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(dynamic_cast<const cudasim::KernelError*>(&e), nullptr) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "the launch did not fail";
  return "";
}

#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (msg)
