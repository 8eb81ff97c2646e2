// TransformerBlock over a Retro decoder block spec: the context each layer returns is the next
// layer's context (the first Retro layer's encoder output reaches the later Retro layers), and
// the block equals its layers chained by hand.
#include <gtest/gtest.h>

#include "reference/retro/decoder_layer_spec.h"
#include "reference/transformer_block.h"
#include "tests/reference/retro/retro_test_util.h"

using namespace twin;
using namespace twin::reference;
using namespace twin::reference::retro;

namespace {

// A 9-layer block (Retro layers 6 with the encoder, and 9) with the weights of the 6-layer block
// fixture: layers 0-5 as in the file, 6-7 copies of its GPT layers 0-1, 8 its Retro layer 5
// without the encoder.
StateDict nine_layer_params(const Fixture& f) {
  StateDict sd;
  auto copy = [&](int from, int to, bool drop_encoder) {
    const std::string src = "param.layers." + std::to_string(from) + ".";
    for (const auto& name : f.names_with_prefix(src)) {
      const std::string rest = name.substr(src.size());
      if (drop_encoder && rest.rfind("cross_attention.encoder.", 0) == 0) continue;
      sd.set("layers." + std::to_string(to) + "." + rest, f.tensor(name));
    }
  };
  for (int i = 0; i < 6; ++i) copy(i, i, false);
  copy(0, 6, false);
  copy(1, 7, false);
  copy(5, 8, true);
  return sd;
}

}  // namespace

TEST(RetroBlock, ContextFlowsFromTheFirstRetroLayer) {
  const Fixture f = load_fixture(test::fixture_dir() + "retro_block_6layers_nondivisible.safetensors");
  TransformerConfig c = f.config;
  c.num_layers = 9;
  const StateDict sd = nine_layer_params(f);
  TransformerBlock block(c, get_retro_decoder_block_spec(c, false), Precision::from_config(c));
  block.load_state_dict(sd);
  sd.expect_all_used("nine-layer block");

  const Tensor& hidden = f.tensor("input.hidden_states");  // [10, 1, 32]
  const Tensor& neighbours = f.tensor("input.context");    // [8, 6, 32]
  LayerInputs in;
  in.context = &neighbours;
  TapRecord rec;
  std::optional<Tensor> last_context;
  const Tensor out = block.forward(hidden, in, false, DropoutRng{}, Taps(&rec), &last_context);

  // Layers 1-5 pass the neighbours through; layer 6 returns the encoder output [r*k, bs*l, d],
  // which layers 7-9 receive and return.
  for (int i = 0; i < 5; ++i) EXPECT_EQ(rec.find("layers." + std::to_string(i) + ".1")->to_f64(), neighbours.to_f64());
  const Tensor* encoder_output = rec.find("layers.5.1");
  ASSERT_NE(encoder_output, nullptr);
  EXPECT_EQ(encoder_output->shape(), (Shape{16, 3, 32}));
  for (int i = 6; i < 9; ++i)
    EXPECT_EQ(rec.find("layers." + std::to_string(i) + ".1")->to_f64(), encoder_output->to_f64()) << i;
  EXPECT_EQ(rec.find("layers.8.cross_attention.context")->to_f64(), encoder_output->to_f64());
  EXPECT_EQ(last_context->to_f64(), encoder_output->to_f64());

  // The same by hand: each layer's returned context is the next one's.
  Tensor h = hidden;
  std::optional<Tensor> ctx = neighbours;
  for (auto& layer : block.layers) {
    LayerInputs li;
    li.context = &*ctx;
    auto [nh, nc] = layer->forward(h, li);
    h = nh;
    ctx = nc;
  }
  EXPECT_EQ(out.to_f64(), h.to_f64());
}

TEST(RetroBlock, ForeignParameterIsRejected) {
  const Fixture f = load_fixture(test::fixture_dir() + "retro_block_6layers_nondivisible.safetensors");
  StateDict sd;
  for (const auto& name : f.names_with_prefix("param.")) sd.set(name.substr(6), f.tensor(name));
  sd.set("layers.0.cross_attention.attn.linear_q.weight", f.tensor("param.layers.0.self_attention.linear_proj.weight"));
  TransformerBlock block(f.config, get_retro_decoder_block_spec(f.config, false), Precision::from_config(f.config));
  EXPECT_THROW(block.load_state_dict(sd), ShapeError);
}
