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

}  // namespace twin::reference
