// The one comparison of a twin's run against a golden: every (kind, twin) goes through
// compare_record, so order, missing and extra tensors, the first divergence and the bounds follow
// the same rules everywhere.
//
//   - Rows come in the order the twin computed them (the Record's order), then the expected
//     tensors the twin did not produce, each a failing row.
//   - A tap the twin computed that the golden lacks is not compared (the golden's hooks capture a
//     subset of the modules); an output, aux value, state or table column the golden lacks is a
//     failing row: the twin claims something the golden cannot confirm.
//   - Integer and bool tensors (routing maps, token counts, table cells) are compared exactly;
//     floating tensors within golden_bound (parity/bounds.h), from the entry's rounding count.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/record.h"
#include "fixtures/fixture.h"
#include "parity/compare.h"

namespace twin::parity {

// Expected tensors by key ("tap.mlp.router.1", "output.hidden_states", "offset"), in the
// golden's order.
using Expected = std::vector<std::pair<std::string, Tensor>>;

// Every forward tensor of a layer golden: output.*, tap.*, tap_in.*, aux.*, state.*. input.*,
// param.* and grad_in.* are inputs.
Expected expected_of(const Fixture& f);
// The golden's gradients, grad.input.* and grad.param.*, compared after the forward tensors when
// the twin ran a backward (TwinRun::backward).
Expected grads_of(const Fixture& f);

// The bound of one entry against its expected tensor.
using BoundFn = std::function<Tolerance(const RecordEntry& actual, const Tensor& expected)>;

// `twin` names the twin in messages ("reference", "optimized"). `bound`: golden_bound
// (parity/bounds.h) for goldens; a twin-against-twin diff passes its own.
std::vector<Comparison> compare_record(const Record& actual, const Expected& expected, const std::string& twin,
                                       const BoundFn& bound = nullptr);

// A record's entries as the expected side of a comparison (a second run of a layer).
Expected expected_of(const Record& r);

}  // namespace twin::parity
