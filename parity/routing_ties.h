// Routing decided on a near tie is a finding, not a failure. A router's top-k choice is discrete:
// where two experts' scores lie within rounding of each other, two correct implementations may
// choose differently, and no bound on the routing map can say which is right. So where a twin's
// routing map differs from the golden's, each differing token is checked against the golden's own
// logits, each within the bound the twin's count gives the logits (parity/bounds.h golden_bound):
//
//   - the selection space is what the top-k compares: the logits for softmax (before or after the
//     top-k; softmax keeps their order), sigmoid(logits) + expert bias for sigmoid scoring;
//   - each score may be off by its logit's bound (x 1/4, sigmoid's largest slope, for sigmoid), plus
//     one rounding u of the router dtype where the scores are stored in it before the top-k compares
//     them (pre-softmax and sigmoid scores): storing may make two close scores exactly equal;
//   - group-limited routing: a flip between experts of two groups is also near when the two
//     groups' scores (the sum of each one's top topk / group_topk) lie within their members' bounds;
//   - training-mode sinkhorn: each side's choice the top-k of the sinkhorn of its own logits (every
//     token's logits scale every column, so no per-token bound exists; routing_ties.cpp says why);
//   - a token is a near tie when every expert the golden chose and the twin did not (displaced)
//     scores at most the two bounds above every expert the twin chose and the golden did not.
//
// When every differing token is a near tie, the engine runs the twin again on the golden's routing
// (the handler's RunMode::golden_routing) so the experts, the combine and the gradients are still
// compared, and says so; otherwise the comparison fails at the routing map as before, naming the
// first token far from a tie.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/record.h"
#include "fixtures/fixture.h"

namespace twin::parity {

struct RoutingFlips {
  std::int64_t tokens = 0;           // tokens whose chosen experts differ
  std::vector<std::int64_t> near;    // those within the scores' bound (above), in token order
  std::string far;                   // the first token beyond it, described ("" when none)
  bool takes_golden_routing = true;  // the twins can run on the golden's map (false: why in `why_not`)
  std::string why_not;

  bool all_near() const { return far.empty() && static_cast<std::int64_t>(near.size()) == tokens; }
  // "differs on 2 near-tie tokens (5, 17)", or the first far token.
  std::string describe() const;
};

// std::nullopt when the golden holds no router map and logits (tap.<router>.1, .logits) or the
// twin's map equals the golden's. FixtureError for maps of different shapes.
std::optional<RoutingFlips> routing_flips(const Fixture& f, const Record& twin);

}  // namespace twin::parity
