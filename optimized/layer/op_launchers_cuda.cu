// The single-op launchers compiled by nvcc for the GPU (see op_launchers.cuh).
#include "optimized/layer/op_launchers.cuh"
