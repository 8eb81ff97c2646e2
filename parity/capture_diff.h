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
//   - Order: the given tensors first (input.*, param.* and the upstream gradient grad_in.*, file
//     order), compared exactly: a capture's given tensors should be the same; they are reported
//     but never "the first divergence". Then the computed forward tensors (output.*, tap.*,
//     tap_in.*, aux.*, state.*) in the order of A's metadata `tap_order` (a JSON list of tensor
//     names) when it has one (else B's), else in the twin's order, then the other forward tensors
//     in A's file order; then the gradients (grad.input.*, grad.param.*) in the order the twin's
//     backward produced them, then the other gradients in A's file order.
//   - Gradients are bounded by the counts of the reference twin's backward on A (the count of
//     every rounding point of the forward and the backward before each gradient). Where that twin
//     runs no backward on A (a golden its kink rule leaves out), they are not compared and
//     `grads` says why.
//   - A computed tensor the twin does not produce gets the whole layer's count (the join of every
//     count the twin recorded, backward included): it lies somewhere inside the layer.
//   - Routing: where the router's maps differ, `routing` says whether each differing token is a
//     near tie in B's logits (the captures are data: nothing reruns on either's routing).
//   - Exact (`--exact`, for determinism: two runs of one job, one commit, one machine): every
//     tensor bit for bit, in the same order, with no twin run; the first differing tensor, given or
//     computed, is the divergence, named with its first differing element and both bit patterns.
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
  int not_compared = 0;                      // gradients left out (see grads)
  // What happened to the gradients: "compared", "none in the captures", or "not compared: <why>".
  std::string grads;
  // Where the MoE router's maps differ ("" when they do not), each token judged against B's logits
  // within their counted bound (parity/routing_ties.h): near ties tell that the two captures
  // chose differently where rounding decides, and the tensors downstream differ for those tokens.
  std::string routing;

  bool diverges() const { return first_divergence >= 0; }
  std::string first_divergence_name() const;  // "" when none
};

struct DiffMode {
  bool exact = false;  // bit for bit, no bounds (above)
};

CaptureDiff diff_captures(const Fixture& a, const Fixture& b, const DiffMode& mode = {});

}  // namespace twin::parity
