#include "parity/report.h"

#include <fmt/format.h>

#include <algorithm>

#include "parity/cli_common.h"

namespace twin::cli {

nlohmann::json rows_json(const std::vector<Comparison>& rows) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& c : rows)
    tensors.push_back({{"name", c.name},
                       {"shape", c.shape},
                       {"max_abs", c.max_abs},
                       {"max_rel", c.max_rel},
                       {"tol_abs", c.tol.atol},
                       {"tol_rel", c.tol.rtol},
                       {"pass", c.pass}});
  return tensors;
}

void print_rows(std::ostream& out, const std::vector<Comparison>& rows, int first, const RowWords& words) {
  std::size_t nw = 6, sw = 5;
  for (const auto& c : rows) {
    nw = std::max(nw, c.name.size());
    sw = std::max(sw, shape_str(c.shape).size());
  }
  out << fmt::format("    {:<{}}  {:<{}}  {:>11}  {:>11}  {:>24}  {:>8}\n", "tensor", nw, "shape", sw, "max abs err",
                     "max rel err", "tolerance (abs + rel|e|)", "used");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Comparison& c = rows[i];
    const bool is_first = static_cast<int>(i) == first;
    const std::string mark = is_first ? ">>" : (c.pass ? "  " : " x");
    const std::string used = c.message.empty() ? num(100.0 * c.share_used) + "%" : "-";
    out << fmt::format("  {}{:<{}}  {:<{}}  {:>11}  {:>11}  {:>24}  {:>8}{}\n", mark, c.name, nw, shape_str(c.shape),
                       sw, num(c.max_abs), num(c.max_rel), num(c.tol.atol) + " + " + num(c.tol.rtol), used,
                       is_first ? "  <- " + words.first : "");
  }
  if (first < 0) return;
  const Comparison& c = rows[static_cast<std::size_t>(first)];
  if (!c.message.empty())
    out << fmt::format("  {}: {}: {}\n", words.first, c.name, c.message);
  else
    out << fmt::format("  {}: {} at {}: {} {}, {} {}; {} of {} elements out; tolerance: {}\n", words.first, c.name,
                       c.worst_index_str(), words.actual, num(c.worst_actual), words.expected, num(c.worst_expected),
                       c.mismatches, shape_numel(c.shape), c.tol.reason);
}

}  // namespace twin::cli
