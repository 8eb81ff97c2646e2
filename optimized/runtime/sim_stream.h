// sim_stream.h: the simulator's stream object (internal to twin_cudasim).
//
// Design: simulated work is executed synchronously, in issue order, when it is enqueued, so every
// stream is trivially ordered and events complete at once. While a stream is being captured
// (Stream::begin_capture), work is not executed but appended to `recorded`; the resulting graph
// replays that list. A cudaStream_t in the simulator is a SimStream* (nullptr: the default
// stream, which cannot be captured).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

namespace cudasim::detail {

struct SimStream {
  bool capturing = false;
  std::vector<std::function<void()>> recorded;
};

inline SimStream* sim_stream(cudaStream_t s) { return reinterpret_cast<SimStream*>(s); }
inline cudaStream_t to_handle(SimStream* s) { return reinterpret_cast<cudaStream_t>(s); }

// Runs `work` now, or records it when `stream` is capturing. `what` names the operation.
void enqueue(cudaStream_t stream, std::function<void()> work);

}  // namespace cudasim::detail
