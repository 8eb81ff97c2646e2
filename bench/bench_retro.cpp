// The optimized Retro decoder on the simulator: the first Retro layer (with the retriever
// encoder) and a 6-layer decoder block (5 GPT layers, then the first Retro layer), forward, and
// forward with backward; no taps. Sizes are small (the simulator runs every device thread on the CPU); the numbers
// track the twin's host + kernel overheads between commits, not GPU speed.
#include <benchmark/benchmark.h>

#include <random>

#include "optimized/retro/retro_layer.h"

using namespace twin;
using opt::retro::RetroLayerKind;

namespace {

struct Setup {
  TransformerConfig config;
  std::map<std::string, Tensor> params;
  Tensor hidden_states, context;
};

Tensor random(Shape shape, std::mt19937_64& rng, double scale) {
  std::normal_distribution<double> n(0.0, scale);
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (auto& x : v) x = n(rng);
  return Tensor::from_doubles(DType::F32, std::move(shape), v);
}

// ns = 16 tokens, bs = 1, chunk length 4 (l = 4), 2 neighbours of 2 chunks, hidden 64, 4 heads.
Setup make(const std::vector<RetroLayerKind>& layout) {
  Setup s;
  TransformerConfig& c = s.config;
  c.num_layers = static_cast<int>(layout.size());
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 128;
  c.hidden_dropout = c.attention_dropout = 0.0;
  c.retro_chunk_length = 4;
  c.retro_num_neighbors = 2;
  c.retro_num_retrieved_chunks = 2;
  c.retro_encoder_num_layers = 2;
  c.retro_encoder_hidden_dropout = c.retro_encoder_attention_dropout = 0.0;
  std::mt19937_64 rng(1);
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const std::string prefix = layout.size() == 1 ? "" : "layers." + std::to_string(i) + ".";
    for (const auto& [key, shape] : opt::retro::retro_layer_param_shapes(c, layout[i]))
      s.params[prefix + key] = random(shape, rng, 0.1);
  }
  const std::int64_t ns = 16, bs = 1, l = 4, r = 8, k = 2, d = 64;
  s.hidden_states = random({ns, bs, d}, rng, 1.0);
  s.context = random({r, k * bs * l, d}, rng, 1.0);  // the neighbour embeddings
  return s;
}

void BM_RetroFirstLayer(benchmark::State& state) {
  const Setup s = make({RetroLayerKind::RetroWithEncoder});
  opt::retro::RetroDecoderLayer layer(s.config, s.params, RetroLayerKind::RetroWithEncoder, 6);
  for (auto _ : state) benchmark::DoNotOptimize(layer.forward(s.hidden_states, &s.context, nullptr));
}
BENCHMARK(BM_RetroFirstLayer)->Unit(benchmark::kMillisecond);

void BM_RetroBlock6(benchmark::State& state) {
  std::vector<RetroLayerKind> layout(5, RetroLayerKind::Gpt);
  layout.push_back(RetroLayerKind::RetroWithEncoder);
  const Setup s = make(layout);
  opt::retro::RetroDecoderBlock block(s.config, s.params, layout);
  for (auto _ : state) benchmark::DoNotOptimize(block.forward(s.hidden_states, &s.context, nullptr));
}
BENCHMARK(BM_RetroBlock6)->Unit(benchmark::kMillisecond);

// The backward of the same layer and block (each iteration a forward that keeps its activations,
// then the backward: the forward rows above are the forward's share).
void BM_RetroFirstLayerForwardBackward(benchmark::State& state) {
  const Setup s = make({RetroLayerKind::RetroWithEncoder});
  opt::retro::RetroDecoderLayer layer(s.config, s.params, RetroLayerKind::RetroWithEncoder, 6);
  opt::retro::RetroForwardOptions o;
  o.keep_for_backward = true;
  for (auto _ : state) {
    const opt::retro::RetroOutput out = layer.forward(s.hidden_states, &s.context, nullptr, o);
    benchmark::DoNotOptimize(layer.backward(out.hidden_states));
  }
}
BENCHMARK(BM_RetroFirstLayerForwardBackward)->Unit(benchmark::kMillisecond);

void BM_RetroBlock6ForwardBackward(benchmark::State& state) {
  std::vector<RetroLayerKind> layout(5, RetroLayerKind::Gpt);
  layout.push_back(RetroLayerKind::RetroWithEncoder);
  const Setup s = make(layout);
  opt::retro::RetroDecoderBlock block(s.config, s.params, layout);
  opt::retro::RetroForwardOptions o;
  o.keep_for_backward = true;
  for (auto _ : state) {
    const opt::retro::RetroOutput out = block.forward(s.hidden_states, &s.context, nullptr, o);
    benchmark::DoNotOptimize(block.backward(out.hidden_states));
  }
}
BENCHMARK(BM_RetroBlock6ForwardBackward)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
