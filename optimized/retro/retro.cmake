# The optimized Retro decoder (retro_layer.h): the Retro kernels (retro_kernels.cuh) and the layer
# and block host code, compiled for the simulator into twin_optimized.
target_sources(twin_optimized PRIVATE ${CMAKE_CURRENT_LIST_DIR}/retro_layer.cpp)
