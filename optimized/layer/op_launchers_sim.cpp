// The single-op launchers compiled for the CUDA simulator (see op_launchers.cuh).
#include "optimized/layer/op_launchers.cuh"
