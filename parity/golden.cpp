#include "parity/golden.h"

#include <fmt/format.h>

#include <map>
#include <set>

#include "parity/bounds.h"

namespace twin::parity {

namespace {

Comparison failing(const std::string& name, const Shape& shape, std::string why) {
  Comparison c;
  c.name = name;
  c.shape = shape;
  c.pass = false;
  c.message = std::move(why);
  return c;
}

bool exact_dtype(DType dt) { return dt == DType::BOOL || dt == DType::I64 || dt == DType::I32; }

std::string show(const RecordEntry& e, double v) { return e.show ? e.show(v) : fmt::format("{:.9g}", v); }

// A table column's failure names its first mismatching row with both values.
void describe_rows(Comparison& c, const RecordEntry& e, const Tensor& expected) {
  if (c.pass || e.row_labels.empty() || !c.message.empty()) return;
  for (std::int64_t i = 0; i < expected.numel() && i < static_cast<std::int64_t>(e.row_labels.size()); ++i) {
    const double a = e.value.at_f64(i), x = expected.at_f64(i);
    if (a == x) continue;
    c.message = fmt::format("{} of {} rows differ; first: row {} {}: twin {}, Megatron {}", c.mismatches,
                            expected.numel(), i, e.row_labels[static_cast<std::size_t>(i)], show(e, a), show(e, x));
    return;
  }
}

}  // namespace

Expected expected_of(const Fixture& f) {
  Expected out;
  for (const char* prefix : {"output.", "tap.", "tap_in.", "aux.", "state."})
    for (const auto& name : f.names_with_prefix(prefix)) out.emplace_back(name, f.tensor(name));
  return out;
}

Expected grads_of(const Fixture& f) {
  Expected out;
  for (const auto& name : f.names_with_prefix("grad.")) out.emplace_back(name, f.tensor(name));
  return out;
}

Expected expected_of(const Record& r) {
  Expected out;
  for (const auto& e : r.entries) out.emplace_back(e.key(), e.value);
  return out;
}

std::vector<Comparison> compare_record(const Record& actual, const Expected& expected, const std::string& twin,
                                       const BoundFn& bound) {
  std::map<std::string, const Tensor*> want;
  for (const auto& [k, t] : expected) want.emplace(k, &t);
  std::vector<Comparison> rows;
  std::set<std::string> done;
  for (const RecordEntry& e : actual.entries) {
    const std::string key = e.key();
    auto it = want.find(key);
    if (it == want.end()) {
      if (e.role != Role::Tap && e.role != Role::TapIn)
        rows.push_back(
            failing(key, e.value.shape(), fmt::format("the {} twin produced this but the golden has none", twin)));
      continue;
    }
    if (!done.insert(key).second) {
      rows.push_back(failing(key, e.value.shape(), fmt::format("the {} twin produced this name twice", twin)));
      continue;
    }
    const Tensor& x = *it->second;
    Comparison c = exact_dtype(x.dtype()) || exact_dtype(e.value.dtype())
                       ? compare_exact(key, e.value, x)
                       : compare(key, e.value, x, bound ? bound(e, x) : golden_bound(e, x));
    describe_rows(c, e, x);
    rows.push_back(std::move(c));
  }
  for (const auto& [key, t] : expected)
    if (!done.count(key))
      rows.push_back(failing(key, t.shape(), fmt::format("the {} twin produces no tensor for this name", twin)));
  return rows;
}

}  // namespace twin::parity
