// The table of compared tensors that `twin fixture` and `twin diff` print, and its JSON rows: one
// layout for every report of Comparison rows.
#pragma once

#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <vector>

#include "parity/compare.h"

namespace twin::cli {

// One object per row: name, shape, max_abs, max_rel, tol_abs, tol_rel, pass.
nlohmann::json rows_json(const std::vector<Comparison>& rows);

// How the table names its first marked row and the two sides of a comparison.
struct RowWords {
  std::string first = "first out of tolerance";
  std::string actual = "actual", expected = "expected";
};

// The header line and one line per row; rows[first] (when first >= 0) is marked ">>" and
// "<- <first>", other failing rows " x"; then a line spelling out rows[first]: its worst element
// on both sides, how many elements are out, and the reason of its tolerance.
void print_rows(std::ostream& out, const std::vector<Comparison>& rows, int first, const RowWords& words = {});

}  // namespace twin::cli
