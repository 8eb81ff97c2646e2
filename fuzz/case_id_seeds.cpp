// Writes seed ids for fuzz_case_id as the tools print them (to_id): the default case, and the
// default with one knob or a few knobs moved to each of its other values, so the fuzzer starts
// from every spelling of every key. Usage: case_id_seeds DIR
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "parity/dense_case.h"

int main(int argc, char** argv) {
  using twin::parity::DenseCase;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::vector<std::function<void(DenseCase&)>> edits = {
      [](DenseCase&) {},
      [](DenseCase& c) {
        c.hidden = 64;
        c.heads = 8;
        c.groups = 2;
        c.kv_channels = 16;
        c.ffn = 128;
      },
      [](DenseCase& c) {
        c.rms = true;
        c.act = "silu";
        c.glu = true;
      },
      [](DenseCase& c) {
        c.act = "relu";
        c.bias = false;
        c.qkv_bias = true;
      },
      [](DenseCase& c) {
        c.rope = twin::parity::RopeKind::Half;
        c.rotary_percent = 0.5;
      },
      [](DenseCase& c) {
        c.rope = twin::parity::RopeKind::Interleaved;
        c.qk_layernorm = true;
      },
      [](DenseCase& c) {
        c.mask = twin::parity::MaskKind::None;
        c.dtype = twin::DType::BF16;
      },
      [](DenseCase& c) {
        c.mask = twin::parity::MaskKind::Padding;
        c.dtype = twin::DType::F16;
      },
      [](DenseCase& c) {  // the optional keys present
        c.layer = 3;
        c.qk_layer_scaling = true;
      },
      [](DenseCase& c) {
        c.mask = twin::parity::MaskKind::Arbitrary;
        c.s = 8;
        c.b = 2;
      },
      [](DenseCase& c) {
        c.heads = 4;
        c.groups = 2;
        c.tp = 2;
        c.sp = true;
        c.s = 8;
      },
      [](DenseCase& c) {
        c.dropout = 0.1;
        c.seed = 18446744073709551615ull;
      },
      [](DenseCase& c) {
        c.dropout = 1e-05;
        c.rotary_percent = 0.25;
        c.kv_channels = 16;
        c.rope = twin::parity::RopeKind::Half;
      },
  };
  int i = 0;
  for (const auto& edit : edits) {
    DenseCase c;
    edit(c);
    std::ofstream(std::string(argv[1]) + "/seed-" + std::to_string(i++) + ".txt", std::ios::binary)
        << twin::parity::to_id(c);
  }
  return 0;
}
