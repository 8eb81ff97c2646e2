// The Retro decoder's kernel sequence compiled for the CUDA simulator (see retro_layer_impl.cuh).
#include "optimized/retro/retro_layer_impl.cuh"

namespace twin::opt::sim {
std::unique_ptr<retro::detail::Runner> make_retro_layer(const TransformerConfig& config,
                                                        const std::map<std::string, Tensor>& params,
                                                        retro::RetroLayerKind kind, int layer_number) {
  return retro_impl::make_layer_impl(config, params, kind, layer_number);
}
std::unique_ptr<retro::detail::Runner> make_retro_block(const TransformerConfig& config,
                                                        const std::map<std::string, Tensor>& params,
                                                        const std::vector<retro::RetroLayerKind>& layout) {
  return retro_impl::make_block_impl(config, params, layout);
}
std::vector<std::pair<std::string, Shape>> retro_param_shapes(const TransformerConfig& config,
                                                              retro::RetroLayerKind kind) {
  return retro_impl::param_shapes_of(config, kind);
}
std::string retro_unsupported(const TransformerConfig& config) { return retro_impl::unsupported_of(config); }
}  // namespace twin::opt::sim
