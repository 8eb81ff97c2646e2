// The Retro decoder's kernel sequence compiled for the CUDA simulator (see retro_layer_impl.cuh).
#include "optimized/layer/backend_entries.h"
#include "optimized/retro/retro_layer_impl.cuh"
