# The optimized Retro decoder (retro_layer.h): the Retro kernels (retro_kernels.cuh) and the layer
# and block kernel sequence (retro_layer_impl.cuh), compiled for the simulator and, when nvcc
# exists, for the GPU, into twin_optimized.
target_sources(twin_optimized PRIVATE ${CMAKE_CURRENT_LIST_DIR}/retro_layer.cpp
                                      ${CMAKE_CURRENT_LIST_DIR}/retro_layer_sim.cpp)
if(TWIN_HAVE_CUDA)
  target_sources(twin_optimized PRIVATE ${CMAKE_CURRENT_LIST_DIR}/retro_layer_cuda.cu)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/retro_layer_cuda.cu PROPERTIES COMPILE_OPTIONS
    "$<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr;-Xcudafe=--diag_suppress=20012>")
endif()
