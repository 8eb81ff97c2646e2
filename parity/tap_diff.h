// Tap-by-tap diff of two runs of a layer (the optimized twin against the reference, say): the
// one comparison (parity/golden.h) with the expected run's record in the golden's place, so the
// rows follow the actual run's computation order and the first one out of tolerance names where
// the runs diverge; later taps only inherit it.
#pragma once

#include <string>
#include <vector>

#include "core/record.h"
#include "parity/golden.h"

namespace twin::parity {

struct TapDiff {
  std::vector<Comparison> rows;  // the actual run's order, then taps only the expected run has
  int first_divergence = -1;     // index into rows of the first failing row, -1 when all pass

  bool pass() const { return first_divergence < 0; }
  // "" when all pass, else the name of the first row out of tolerance.
  std::string first_divergence_name() const;
  // Table: one line per tap (name, max abs, max rel, share of bound, worst index), marking the
  // first divergence with "<-- first divergence".
  std::string format() const;
};

TapDiff diff_taps(const Record& actual, const Record& expected, const BoundFn& bound);

}  // namespace twin::parity
