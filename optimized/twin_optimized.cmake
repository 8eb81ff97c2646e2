# twin_optimized: the optimized layers. layer/ is the host code every kind shares (compiled once,
# backend-neutral; layer/kernels.cpp the backend boundary); each kind's files keep its parameter
# keys, plan binding and phases; the kernel sequences and single-op launchers (*.cuh) are compiled
# for the simulator (*_sim.cpp) and, when nvcc exists, for the GPU (*_cuda.cu).
add_library(twin_optimized STATIC
  ${CMAKE_CURRENT_LIST_DIR}/layer/attention_half.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/buffer_arena.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/features.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/grad_magnitudes.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/graph_cache.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/kernels.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/op_launchers_sim.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/rank_context.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/rank_runner.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/rank_exchange.cpp
  ${CMAKE_CURRENT_LIST_DIR}/layer/sharding.cpp
  ${CMAKE_CURRENT_LIST_DIR}/transformer_layer.cpp
  ${CMAKE_CURRENT_LIST_DIR}/transformer_layer_backward.cpp
  ${CMAKE_CURRENT_LIST_DIR}/transformer_layer_sim.cpp
  ${CMAKE_CURRENT_LIST_DIR}/moe/moe_layer.cpp
  ${CMAKE_CURRENT_LIST_DIR}/moe/moe_transformer_layer.cpp
  ${CMAKE_CURRENT_LIST_DIR}/moe/moe_transformer_layer_backward.cpp
  ${CMAKE_CURRENT_LIST_DIR}/moe/moe_transformer_layer_sim.cpp)
target_link_libraries(twin_optimized PUBLIC twin_runtime twin_core)
if(TWIN_HAVE_CUDA)
  target_sources(twin_optimized PRIVATE ${CMAKE_CURRENT_LIST_DIR}/transformer_layer_cuda.cu
                                        ${CMAKE_CURRENT_LIST_DIR}/moe/moe_transformer_layer_cuda.cu
                                        ${CMAKE_CURRENT_LIST_DIR}/layer/op_launchers_cuda.cu)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/transformer_layer_cuda.cu
                              ${CMAKE_CURRENT_LIST_DIR}/moe/moe_transformer_layer_cuda.cu
                              ${CMAKE_CURRENT_LIST_DIR}/layer/op_launchers_cuda.cu PROPERTIES COMPILE_OPTIONS
    "$<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr;-Xcudafe=--diag_suppress=20012>")
endif()
