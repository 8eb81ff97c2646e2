// gpu_fixture.h: a gtest fixture for tests that need a CUDA device; without one (or in a build
// without CUDA) every test reports SKIPPED with the reason.
#pragma once

#include "optimized/runtime/device.h"

#include <gtest/gtest.h>

#include <string>

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!twin::rt::available(twin::rt::Backend::Cuda, &why)) GTEST_SKIP() << "needs a CUDA device: " << why;
  }
  twin::rt::Device& dev() { return twin::rt::device(twin::rt::Backend::Cuda); }
};
