// The reference twin's fixture handlers, one per fixture kind, registered in
// parity/fixture_kinds.cpp. Each runs a loaded fixture through the reference and returns one
// Comparison per output / tap / table column; bad input throws FixtureError or ConfigError.
#pragma once

#include <vector>

#include "fixtures/fixture.h"
#include "parity/compare.h"

namespace twin::reference {

// layer_offset_table: TransformerConfig validation, get_transformer_layer_offset and
// get_num_layers_to_build over every entry (reference/table_fixtures.cpp).
std::vector<Comparison> run_layer_offset_table_fixture(const Fixture& fixture);
// retro_layout_table: get_retro_decoder_block_spec's layout for every num_layers.
std::vector<Comparison> run_retro_layout_table_fixture(const Fixture& fixture);
// retro_decoder_layer_first / retro_decoder_layer / retro_block: a Retro decoder layer (owning the
// encoder, or not) and a whole Retro decoder block (reference/retro/retro_fixtures.cpp).
std::vector<Comparison> run_retro_decoder_layer_first_fixture(const Fixture& fixture);
std::vector<Comparison> run_retro_decoder_layer_fixture(const Fixture& fixture);
std::vector<Comparison> run_retro_block_fixture(const Fixture& fixture);
// dense_layer: TransformerLayer from get_gpt_layer_local_spec; output and every tap compared
// (reference/dense_layer_fixture.cpp).
std::vector<Comparison> run_dense_layer_fixture(const Fixture& fixture);
// moe_layer: MoETransformerLayer (dense layer + MoELayer); output, every tap, tap_in, aux loss and
// the expert-bias counter compared (reference/moe/moe_fixture.cpp).
std::vector<Comparison> run_moe_layer_fixture(const Fixture& fixture);

}  // namespace twin::reference
