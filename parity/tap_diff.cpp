#include "parity/tap_diff.h"

#include <fmt/format.h>

namespace twin::parity {

std::string TapDiff::first_divergence_name() const {
  return first_divergence < 0 ? std::string() : rows[static_cast<std::size_t>(first_divergence)].name;
}

std::string TapDiff::format() const {
  std::string out = fmt::format("{:<40} {:>11} {:>11} {:>9}  {}\n", "tap", "max abs", "max rel", "share", "worst");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Comparison& c = rows[i];
    if (!c.message.empty()) {
      out += fmt::format("{:<40} FAIL: {}", c.name, c.message);
    } else {
      out += fmt::format("{:<40} {:>11.3e} {:>11.3e} {:>9.3f}  {} a={:.7g} e={:.7g}", c.name, c.max_abs, c.max_rel,
                         c.share_used, c.worst_index_str(), c.worst_actual, c.worst_expected);
    }
    if (static_cast<int>(i) == first_divergence) out += "   <-- first divergence (" + c.tol.reason + ")";
    out += "\n";
  }
  return out;
}

TapDiff diff_taps(const Record& actual, const Record& expected, const BoundFn& bound) {
  TapDiff d;
  d.rows = compare_record(actual, expected_of(expected), "actual", bound);
  for (std::size_t i = 0; i < d.rows.size() && d.first_divergence < 0; ++i)
    if (!d.rows[i].pass) d.first_divergence = static_cast<int>(i);
  return d;
}

}  // namespace twin::parity
