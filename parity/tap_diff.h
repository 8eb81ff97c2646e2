// Tap-by-tap diff of two runs of a layer: every tap the expected run recorded is compared (in
// the order the layer computed it) with the actual run's tap of the same name, and the first one
// out of tolerance is named: that is where the two runs diverge; later taps only inherit it.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "parity/compare.h"

namespace twin::parity {

using TapList = std::vector<std::pair<std::string, Tensor>>;  // (module path, tensor) in order

struct TapDiff {
  std::vector<Comparison> rows;  // one per expected tap, in the expected run's order
  std::vector<std::string> extra;  // taps only the actual run recorded
  int first_divergence = -1;       // index into rows of the first failing tap, -1 when all pass

  bool pass() const { return first_divergence < 0 && extra.empty(); }
  // "" when all pass, else the name of the first tap out of tolerance.
  std::string first_divergence_name() const;
  // Table: one line per tap (name, max abs, max rel, share of bound, worst index), marking the
  // first divergence with "<-- first divergence".
  std::string format() const;
};

// `tol_for(name, expected)` gives each tap its bound (and the reason printed with it). A tap the
// actual run lacks is a failing row ("missing in actual").
TapDiff diff_taps(const TapList& actual, const TapList& expected,
                  const std::function<Tolerance(const std::string&, const Tensor&)>& tol_for);

// The first tap out of tolerance, or "" when none is.
std::string first_divergence(const TapList& actual, const TapList& expected,
                             const std::function<Tolerance(const std::string&, const Tensor&)>& tol_for);

}  // namespace twin::parity
