// What each optimized layer kind implements, decided before anything runs (ggml's supports_op: one
// place, asked first). A row is one feature Megatron-Core runs: when a config asks for it, which
// kinds implement it, and the reason the others refuse it. The dense and MoE constructors, the
// Retro runner and the golden handlers all report layer_unsupported()'s message, so a refusal
// reads the same wherever it comes from, and a feature one kind forgets cannot be computed as if
// it were off.
//
// Bad input (sizes that do not divide, a missing parameter) is not here: that is a ConfigError or
// ShapeError of the layer. Limits of the kernels are rows (kv_channels past the attention kernel's
// head dim, experts past the router kernel's), their values shared with the kernels below.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/config.h"
#include "optimized/layer/kernel_types.h"  // the kernels' limits
#include "optimized/layer/options.h"

namespace twin::opt {

enum class LayerKind { Dense, MoE, Retro };
const char* layer_kind_name(LayerKind k);  // dense | moe | retro
const std::vector<LayerKind>& all_layer_kinds();

struct LayerFeature {
  std::string name;  // the config field (or forward option) in Megatron's words
  // Whether the config asks for the feature.
  std::function<bool(const TransformerConfig&, const LayerOptions&)> requested;
  std::vector<LayerKind> supported_by;  // the kinds that implement it
  std::string reason;                   // why the other kinds refuse it
  // An edit of a config (of a kind the feature applies to) that asks for it and nothing else new:
  // what the tests apply to a supported config to see each kind's answer.
  std::function<void(TransformerConfig&, LayerOptions&)> example;

  bool supported(LayerKind k) const;
  std::string refusal() const { return name + ": " + reason; }
};

// Every row, in the order they are asked.
const std::vector<LayerFeature>& layer_features();

// The refusal of the first feature the config asks for that `kind` does not implement ("<name>:
// <reason>"), or "" when the kind implements everything asked.
std::string layer_unsupported(LayerKind kind, const TransformerConfig& c, const LayerOptions& o = {});

}  // namespace twin::opt
