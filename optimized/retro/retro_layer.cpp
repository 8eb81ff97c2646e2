// The optimized Retro decoder's public classes (retro_layer.h): each holds the runner of its
// backend (retro_layer_impl.cuh, built for the simulator and, with nvcc, for the GPU), made
// through the backend boundary (layer/kernels.h).
#include "optimized/retro/retro_layer.h"

#include "optimized/layer/kernels.h"
#include "optimized/retro/retro_runner.h"

namespace twin::opt::retro {

std::vector<std::pair<std::string, Shape>> retro_layer_param_shapes(const TransformerConfig& c, RetroLayerKind kind) {
  return layer_kernels(rt::Backend::Sim).retro_param_shapes(c, kind);  // the same for every backend
}

std::string retro_decoder_unsupported(const TransformerConfig& c) {
  return layer_kernels(rt::Backend::Sim).retro_unsupported(c);  // the same on every backend
}

std::vector<std::string> retro_layer_param_keys(const TransformerConfig& c, RetroLayerKind kind) {
  std::vector<std::string> keys;
  for (const auto& [key, shape] : retro_layer_param_shapes(c, kind)) keys.push_back(key);
  return keys;
}

struct RetroDecoderLayer::Impl {
  std::unique_ptr<detail::Runner> runner;
};

RetroDecoderLayer::RetroDecoderLayer(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                     RetroLayerKind kind, int layer_number, rt::Backend backend)
    : impl_(std::make_unique<Impl>()) {
  impl_->runner = layer_kernels(backend).make_retro_layer(c, params, kind, layer_number);
}
RetroDecoderLayer::~RetroDecoderLayer() = default;

RetroOutput RetroDecoderLayer::forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                                       const RetroForwardOptions& o) {
  return impl_->runner->forward(hidden_states, context, context_mask, o);
}

struct RetroDecoderBlock::Impl {
  std::unique_ptr<detail::Runner> runner;
};

RetroDecoderBlock::RetroDecoderBlock(const TransformerConfig& c, const std::map<std::string, Tensor>& params,
                                     const std::vector<RetroLayerKind>& layout, rt::Backend backend)
    : impl_(std::make_unique<Impl>()) {
  impl_->runner = layer_kernels(backend).make_retro_block(c, params, layout);
}
RetroDecoderBlock::~RetroDecoderBlock() = default;

RetroOutput RetroDecoderBlock::forward(const Tensor& hidden_states, const Tensor* context, const Tensor* context_mask,
                                       const RetroForwardOptions& o) {
  return impl_->runner->forward(hidden_states, context, context_mask, o);
}

}  // namespace twin::opt::retro
