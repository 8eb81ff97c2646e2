# The optimized Retro decoder (retro_layer.h): its host side compiled once (retro_layer_impl.h
# names the files, one per Megatron module), its kernels (retro_kernels.cuh) launched through
# the backend's launchers (layer/op_launchers.cuh), into twin_optimized.
target_sources(twin_optimized PRIVATE ${CMAKE_CURRENT_LIST_DIR}/retro_layer.cpp
                                      ${CMAKE_CURRENT_LIST_DIR}/retro_layer_backward.cpp
                                      ${CMAKE_CURRENT_LIST_DIR}/decoder_attention.cpp
                                      ${CMAKE_CURRENT_LIST_DIR}/encoder_attention.cpp
                                      ${CMAKE_CURRENT_LIST_DIR}/decoder_spec.cpp)
