#include "parity/tap_diff.h"

#include <fmt/format.h>
#include <map>

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
  for (const auto& e : extra) out += fmt::format("{:<40} only in the actual run\n", e);
  return out;
}

TapDiff diff_taps(const TapList& actual, const TapList& expected,
                  const std::function<Tolerance(const std::string&, const Tensor&)>& tol_for) {
  TapDiff d;
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [n, t] : actual) by_name.emplace(n, &t);
  std::map<std::string, bool> seen;
  for (const auto& [name, e] : expected) {
    seen[name] = true;
    auto it = by_name.find(name);
    Comparison c;
    if (it == by_name.end()) {
      c.name = name;
      c.shape = e.shape();
      c.pass = false;
      c.message = "missing in actual";
    } else {
      c = compare(name, *it->second, e, tol_for(name, e));
    }
    if (!c.pass && d.first_divergence < 0) d.first_divergence = static_cast<int>(d.rows.size());
    d.rows.push_back(std::move(c));
  }
  for (const auto& [n, t] : actual)
    if (!seen.count(n)) d.extra.push_back(n);
  return d;
}

std::string first_divergence(const TapList& actual, const TapList& expected,
                             const std::function<Tolerance(const std::string&, const Tensor&)>& tol_for) {
  return diff_taps(actual, expected, tol_for).first_divergence_name();
}

}  // namespace twin::parity
