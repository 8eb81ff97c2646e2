// The Retro decoder's kernel sequence compiled by nvcc for the GPU (see retro_layer_impl.cuh).
#include "optimized/layer/backend_entries.h"
#include "optimized/retro/retro_layer_impl.cuh"
