// cudasim_options.h: run-time options of the CUDA simulator (host code and tests).
// Defaults come from the environment on first use: CUDASIM_ORDER (forward|reverse|random),
// CUDASIM_SEED (for random), CUDASIM_WORKERS (default: hardware threads). CUDASIM_STACK_KB sets
// the fiber stack size (default 128, 512 under ASan).
#pragma once

#include <cstdint>

namespace cudasim {

// Order in which a block's runnable fibers are resumed in each scheduling round.
enum class Order { Forward, Reverse, Random };

struct Options {
  Order order = Order::Forward;
  std::uint64_t seed = 0;
  int workers = 1;  // threads executing blocks, the launching thread included
};

Options options();
// Changes the options for later launches (not while a launch is in flight).
void set_options(const Options& o);
const char* order_name(Order o);

}  // namespace cudasim
