// Two captures of one layer (golden files of one kind: two runs, two TP sizes, two commits, GPU
// and CPU) compared tensor by tensor in computation order, naming the first tensor that diverges.
//
// The comparison is the one of every golden (parity/golden.h compare_record, bounds from
// golden_bound): capture A takes the place of a twin's record and B the place of the golden. The
// reference twin runs on A (end to end) only to learn the computation order and the rounding
// points before each tensor; the record compared holds A's tensors with those counts. Two
// implementations of Megatron's math that store at the same points may land one rounding apart at
// each store, which is exactly what a count bounds, so two captures of one layer must agree
// within the bound `twin fixture` holds a twin to.
//
//   - Order: input.* and param.* first (file order), compared exactly: a capture's given tensors
//     should be the same; they are reported but never "the first divergence". Then the computed
//     tensors (output.*, tap.*, tap_in.*, aux.*, state.*) in the order of A's metadata `tap_order`
//     (a JSON list of tensor names) when it has one (else B's), else in the twin's order; then
//     those neither names, in A's file order.
//   - A computed tensor the twin does not produce gets the whole layer's count (the join of every
//     count the twin recorded): it lies somewhere inside the layer.
//   - grad.* and grad_in.* are not compared: the twins run forward only, so no count bounds them.
//   - Bad input (FixtureError, one line): a JSON table, different kinds, a tensor only one capture
//     has, a tensor whose dtype or shape differs, a bad `tap_order`, a kind the reference twin does
//     not know (no order and no counts).
#pragma once

#include <string>
#include <vector>

#include "fixtures/fixture.h"
#include "parity/compare.h"

namespace twin::parity {

struct CaptureDiff {
  std::vector<Comparison> rows;              // inputs and parameters, then the computed tensors in order
  int given = 0;                             // how many leading rows are input.* / param.* tensors
  int first_divergence = -1;                 // index into rows of the first computed row out of bound, -1: none
  std::vector<std::string> differing_given;  // input.* / param.* names whose values differ
  int not_compared = 0;                      // grad.* / grad_in.* tensors left out

  bool diverges() const { return first_divergence >= 0; }
  std::string first_divergence_name() const;  // "" when none
};

CaptureDiff diff_captures(const Fixture& a, const Fixture& b);

}  // namespace twin::parity
