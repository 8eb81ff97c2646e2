// The seam between the optimized Retro decoder's public classes (retro_layer.cpp) and its
// per-backend kernel sequences (retro_layer_impl.cuh, compiled for the simulator and by nvcc).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "optimized/retro/retro_layer.h"

namespace twin::opt::retro::detail {

// A built layer or block of one backend.
struct Runner {
  virtual ~Runner() = default;
  virtual RetroOutput forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                              const RetroForwardOptions& options) = 0;
};

}  // namespace twin::opt::retro::detail

// Each backend's builders (ConfigError / ShapeError before anything runs).
#define TWIN_RETRO_BACKEND_API(ns)                                                                           \
  namespace twin::opt::ns {                                                                                  \
  std::unique_ptr<retro::detail::Runner> make_retro_layer(const TransformerConfig& config,                   \
                                                          const std::map<std::string, Tensor>& params,       \
                                                          retro::RetroLayerKind kind, int layer_number);     \
  std::unique_ptr<retro::detail::Runner> make_retro_block(const TransformerConfig& config,                   \
                                                          const std::map<std::string, Tensor>& params,       \
                                                          const std::vector<retro::RetroLayerKind>& layout); \
  std::vector<std::pair<std::string, Shape>> retro_param_shapes(const TransformerConfig& config,             \
                                                                retro::RetroLayerKind kind);                 \
  std::string retro_unsupported(const TransformerConfig& config);                                            \
  }
TWIN_RETRO_BACKEND_API(sim)
#if TWIN_HAVE_CUDA
TWIN_RETRO_BACKEND_API(cuda)
#endif
#undef TWIN_RETRO_BACKEND_API
