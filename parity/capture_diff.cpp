#include "parity/capture_diff.h"

#include <fmt/format.h>

#include <map>
#include <set>
#include <utility>

#include "parity/bounds.h"
#include "parity/fixture_kinds.h"
#include "parity/golden.h"

namespace twin::parity {

namespace {

[[noreturn]] void bad(const std::string& message) { throw FixtureError("twin diff: " + message); }

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// The role of a compared tensor name, or false for one that is not compared (grad.*, grad_in.*,
// names of no known prefix).
bool role_of(const std::string& name, Role& role) {
  static const std::pair<const char*, Role> roles[] = {
      {"input.", Role::Input}, {"param.", Role::Param}, {"output.", Role::Output}, {"tap_in.", Role::TapIn},
      {"tap.", Role::Tap},     {"aux.", Role::Aux},     {"state.", Role::State},
  };
  for (const auto& [prefix, r] : roles)
    if (starts_with(name, prefix)) {
      role = r;
      return true;
    }
  return false;
}

bool given(Role r) { return r == Role::Input || r == Role::Param; }

std::string some(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < 3; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 3) s += fmt::format(" and {} more", names.size() - 3);
  return s;
}

// The compared names of a capture in file order; counts the ones left out.
std::vector<std::string> compared_names(const Fixture& f, int* left_out) {
  std::vector<std::string> names;
  for (const auto& n : f.file->names()) {
    Role r;
    if (role_of(n, r))
      names.push_back(n);
    else if (left_out)
      ++*left_out;
  }
  return names;
}

// A capture's `tap_order` metadata: a JSON list of names it has. Empty when absent.
std::vector<std::string> tap_order(const Fixture& f, const std::set<std::string>& names) {
  const std::string text = f.meta("tap_order");
  if (text.empty()) return {};
  nlohmann::json order;
  try {
    order = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    bad(f.path + ": __metadata__.tap_order is not JSON");
  }
  if (!order.is_array()) bad(f.path + ": __metadata__.tap_order must be a JSON list of tensor names");
  std::vector<std::string> r;
  for (const auto& n : order) {
    if (!n.is_string()) bad(f.path + ": __metadata__.tap_order must be a JSON list of tensor names");
    if (!names.count(n.get<std::string>()))
      bad(f.path + ": __metadata__.tap_order names " + n.get<std::string>() + ", which is not a compared tensor of it");
    r.push_back(n.get<std::string>());
  }
  return r;
}

}  // namespace

std::string CaptureDiff::first_divergence_name() const {
  return first_divergence < 0 ? std::string() : rows[static_cast<std::size_t>(first_divergence)].name;
}

CaptureDiff diff_captures(const Fixture& a, const Fixture& b) {
  for (const Fixture* f : {&a, &b})
    if (!f->file) bad(f->path + " is a JSON table; twin diff compares layer captures (.safetensors)");
  if (a.kind != b.kind)
    bad(fmt::format("{} is kind '{}' but {} is kind '{}': not captures of the same layer", a.path, a.kind, b.path,
                    b.kind));

  // The same tensors on both sides, each of one dtype and shape.
  CaptureDiff d;
  const std::vector<std::string> names = compared_names(a, &d.not_compared);
  const std::set<std::string> in_a(names.begin(), names.end());
  std::vector<std::string> only_a, only_b;
  for (const auto& n : compared_names(b, nullptr))
    if (!in_a.count(n)) only_b.push_back(n);
  for (const auto& n : names)
    if (!b.has(n)) only_a.push_back(n);
  if (!only_a.empty() || !only_b.empty())
    bad(fmt::format("the captures hold different tensors (only in {}: {}; only in {}: {})", a.path,
                    only_a.empty() ? "none" : some(only_a), b.path, only_b.empty() ? "none" : some(only_b)));
  for (const auto& n : names) {
    const Tensor &x = a.tensor(n), &y = b.tensor(n);
    if (x.dtype() != y.dtype() || x.shape() != y.shape())
      bad(fmt::format("{}: {} in {} but {} in {}", n, x.describe(), a.path, y.describe(), b.path));
  }

  // The computation order and the rounding counts: the reference twin on A.
  const FixtureHandler handler = find_fixture_handler(a.kind, TwinKind::Reference);
  if (!handler)
    bad("the reference twin does not know kind '" + a.kind +
        "': the comparison needs its computation order and rounding counts");
  const TwinRun run = handler(a, RunMode{});
  std::map<std::string, const RecordEntry*> twin_entry;
  RoundingCount layer;  // every count the twin recorded, joined: the whole layer
  for (const RecordEntry& e : run.record.entries) {
    twin_entry.emplace(e.key(), &e);
    layer.join(e.rounding);
  }

  std::vector<std::string> order;
  std::set<std::string> placed;
  auto place = [&](const std::string& n) {
    if (placed.insert(n).second) order.push_back(n);
  };
  for (const auto& n : names) {
    Role r;
    role_of(n, r);
    if (given(r)) place(n);
  }
  d.given = static_cast<int>(order.size());
  std::vector<std::string> listed = tap_order(a, in_a);
  if (listed.empty()) listed = tap_order(b, in_a);
  if (listed.empty())
    for (const RecordEntry& e : run.record.entries) listed.push_back(e.key());
  for (const auto& n : listed)
    if (in_a.count(n)) place(n);
  for (const auto& n : names) place(n);

  // A's tensors as the record compared, with the twin's counts.
  Record record;
  std::set<std::string> unknown;
  for (const auto& n : order) {
    RecordEntry e;
    role_of(n, e.role);
    e.name = n.substr(std::string(role_prefix(e.role)).size());
    e.value = a.tensor(n);
    if (!given(e.role)) {
      auto it = twin_entry.find(n);
      if (it != twin_entry.end()) {
        e.rounding = it->second->rounding;
        e.magnitude = it->second->magnitude;
      } else {
        e.rounding = layer;
        unknown.insert(n);
      }
    }
    record.entries.push_back(std::move(e));
  }
  Expected expected;
  for (const auto& n : names) expected.emplace_back(n, b.tensor(n));
  d.rows = compare_record(record, expected, "capture A", [&](const RecordEntry& e, const Tensor& x) {
    Tolerance t = golden_bound(e, x);
    if (unknown.count(e.key())) t.reason += " (the reference twin does not compute it: the whole layer's count)";
    return t;
  });
  for (std::size_t i = 0; i < d.rows.size(); ++i) {
    if (d.rows[i].pass) continue;
    if (static_cast<int>(i) < d.given)
      d.differing_given.push_back(d.rows[i].name);
    else if (d.first_divergence < 0)
      d.first_divergence = static_cast<int>(i);
  }
  return d;
}

}  // namespace twin::parity
