// RapidCheck generator of dense-layer cases (parity/dense_case.h), for the property tests only:
// the `twin` tool parses and prints cases without RapidCheck.
//
// Every field with samples in dense_case_fields() is drawn from them uniformly (the first sample is
// what a failing case shrinks toward); the sizes are derived from the parallel layout so that each drawn
// and each shrunk case is valid: groups and ffn are multiples of tp, heads a multiple of groups,
// s a multiple of tp with sequence parallelism.
#pragma once

#include <ostream>

#include <rapidcheck.h>

#include "parity/dense_case.h"

namespace twin::parity {

// Sizes the generator draws from; defaults are tiny so the simulator runs 100 cases quickly.
struct CaseLimits {
  int max_tp = 4;  // tp drawn from the table's samples {1, 2, 4} up to this
  int max_groups_per_rank = 2;
  int max_heads_per_group = 2;
  int max_s_per_rank = 4;
  int min_s = 1;  // s at least this (a few more drawn above it): past one 32-key attention tile
  int max_b = 2;
  bool allow_dropout = false;
  bool any_dtype = true;  // false: only `dtype`
  DType dtype = DType::F32;
  bool force_tp = false;  // true: tp = `tp` exactly
  int tp = 1;
};
rc::Gen<DenseCase> gen_dense_case(CaseLimits limits = {});

// RapidCheck prints a counterexample with this: the id, rerunnable with `twin case`.
inline void showValue(const DenseCase& c, std::ostream& os) { os << to_id(c); }

}  // namespace twin::parity

namespace rc {
template <>
struct Arbitrary<twin::parity::DenseCase> {
  static Gen<twin::parity::DenseCase> arbitrary() { return twin::parity::gen_dense_case(); }
};
}  // namespace rc
