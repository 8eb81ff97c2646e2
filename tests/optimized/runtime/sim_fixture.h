// sim_fixture.h: a gtest fixture for simulator tests: blocks run on 4 workers (so blocks really
// run in parallel), the resume order stays whatever CUDASIM_ORDER says, options are restored after.
#pragma once

#include "optimized/runtime/cudasim_options.h"
#include "optimized/runtime/device.h"

#include <gtest/gtest.h>

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
