#include "parity/capture_diff.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "parity/bounds.h"
#include "parity/fixture_kinds.h"
#include "parity/golden.h"
#include "parity/routing_ties.h"

namespace twin::parity {

namespace {

[[noreturn]] void bad(const std::string& message) { throw FixtureError("twin diff: " + message); }

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// The role of a compared tensor name, or false for names of no known prefix. The given tensors
// (inputs, parameters, the upstream gradient) are Role::Input / Role::Param; grad_in.* is an input.
bool role_of(const std::string& name, Role& role) {
  static const std::pair<const char*, Role> roles[] = {
      {"input.", Role::Input},   {"param.", Role::Param},  {"grad_in.", Role::Input},
      {"output.", Role::Output}, {"tap_in.", Role::TapIn}, {"tap.", Role::Tap},
      {"aux.", Role::Aux},       {"state.", Role::State},  {"grad.", Role::Grad},
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

// The compared names of a capture in file order.
std::vector<std::string> compared_names(const Fixture& f) {
  std::vector<std::string> names;
  for (const auto& n : f.file->names()) {
    Role r;
    if (role_of(n, r)) names.push_back(n);
  }
  return names;
}

Role role_of(const std::string& name) {
  Role r = Role::Input;
  role_of(name, r);
  return r;
}

// Bit for bit: every element's bytes. The first differing element is the row's worst, with both
// bit patterns in its reason.
Comparison bitwise(const std::string& name, const Tensor& a, const Tensor& b) {
  Comparison c;
  c.name = name;
  c.shape = a.shape();
  const std::size_t size = dtype_size(a.dtype());
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const std::byte *x = a.raw() + i * size, *y = b.raw() + i * size;
    if (std::memcmp(x, y, size) == 0) continue;
    c.max_abs = std::max(c.max_abs, std::fabs(a.at_f64(i) - b.at_f64(i)));
    if (c.mismatches++ == 0) {
      c.worst_index = i;
      c.worst_actual = a.at_f64(i);
      c.worst_expected = b.at_f64(i);
      std::uint64_t bx = 0, by = 0;
      std::memcpy(&bx, x, size);
      std::memcpy(&by, y, size);
      c.tol.reason = fmt::format("bit for bit: the first differing element is 0x{:0{}x} in A, 0x{:0{}x} in B", bx,
                                 2 * size, by, 2 * size);
    }
  }
  c.pass = c.mismatches == 0;
  if (c.pass) c.tol.reason = "bit for bit";
  return c;
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

namespace {

// The same tensors on both sides, each of one dtype and shape; returns A's compared names.
std::vector<std::string> check_same_tensors(const Fixture& a, const Fixture& b) {
  for (const Fixture* f : {&a, &b})
    if (!f->file) bad(f->path + " is a JSON table; twin diff compares layer captures (.safetensors)");
  if (a.kind != b.kind)
    bad(fmt::format("{} is kind '{}' but {} is kind '{}': not captures of the same layer", a.path, a.kind, b.path,
                    b.kind));
  const std::vector<std::string> names = compared_names(a);
  const std::set<std::string> in_a(names.begin(), names.end());
  std::vector<std::string> only_a, only_b;
  for (const auto& n : compared_names(b))
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
  return names;
}

// The rows' order (see the header): the given tensors, then `listed` (A's or B's tap_order, else
// `forward`), the other forward tensors, then `backward`, then the other gradients; file order
// where no order is given; only names in `names`.
std::vector<std::string> row_order(const Fixture& a, const Fixture& b, const std::vector<std::string>& names,
                                   const std::vector<std::string>& forward, const std::vector<std::string>& backward) {
  const std::set<std::string> in_a(names.begin(), names.end());
  std::vector<std::string> order;
  std::set<std::string> placed;
  auto place = [&](const std::string& n) {
    if (in_a.count(n) && placed.insert(n).second) order.push_back(n);
  };
  for (const auto& n : names)
    if (given(role_of(n))) place(n);
  std::vector<std::string> listed = tap_order(a, in_a);
  if (listed.empty()) listed = tap_order(b, in_a);
  for (const auto& n : listed.empty() ? forward : listed) place(n);
  for (const auto& n : names)
    if (role_of(n) != Role::Grad) place(n);
  for (const auto& n : backward) place(n);
  for (const auto& n : names) place(n);
  return order;
}

void mark_divergence(CaptureDiff& d, bool given_diverges) {
  for (std::size_t i = 0; i < d.rows.size(); ++i) {
    if (d.rows[i].pass) continue;
    const bool is_given = static_cast<int>(i) < d.given;
    if (is_given) d.differing_given.push_back(d.rows[i].name);
    if (d.first_divergence < 0 && (!is_given || given_diverges)) d.first_divergence = static_cast<int>(i);
  }
}

CaptureDiff diff_exact(const Fixture& a, const Fixture& b, const std::vector<std::string>& names) {
  CaptureDiff d;
  for (const auto& n : row_order(a, b, names, {}, {})) {
    d.given += given(role_of(n));
    d.rows.push_back(bitwise(n, a.tensor(n), b.tensor(n)));
  }
  const bool any_grad =
      std::any_of(names.begin(), names.end(), [](const std::string& n) { return role_of(n) == Role::Grad; });
  d.grads = any_grad ? "compared" : "none in the captures";
  mark_divergence(d, true);
  return d;
}

}  // namespace

CaptureDiff diff_captures(const Fixture& a, const Fixture& b, const DiffMode& mode) {
  std::vector<std::string> names = check_same_tensors(a, b);
  if (mode.exact) return diff_exact(a, b, names);

  // The computation order and the rounding counts: the reference twin on A, forward and backward.
  const FixtureHandler handler = find_fixture_handler(a.kind, TwinKind::Reference);
  if (!handler)
    bad("the reference twin does not know kind '" + a.kind +
        "': the comparison needs its computation order and rounding counts");
  const TwinRun run = handler(a, RunMode{});
  CaptureDiff d;
  const auto grad_end = std::remove_if(names.begin(), names.end(),
                                       [&](const std::string& n) { return !run.backward && role_of(n) == Role::Grad; });
  d.not_compared = static_cast<int>(names.end() - grad_end);
  names.erase(grad_end, names.end());
  d.grads = d.not_compared ? "not compared: " + (run.no_backward_reason.empty()
                                                     ? "the reference twin has no backward for kind " + a.kind
                                                     : run.no_backward_reason)
            : run.backward ? "compared"
                           : "none in the captures";

  std::map<std::string, const RecordEntry*> twin_entry;
  std::vector<std::string> forward, backward;
  RoundingCount layer;  // every count the twin recorded, joined: the whole layer
  for (const RecordEntry& e : run.record.entries) {
    twin_entry.emplace(e.key(), &e);
    (e.role == Role::Grad ? backward : forward).push_back(e.key());
    layer.join(e.rounding);
  }

  // The given tensors exactly; A's computed tensors as the record compared, with the twin's counts.
  Record record;
  Expected expected;
  std::set<std::string> unknown;
  for (const auto& n : row_order(a, b, names, forward, backward)) {
    RecordEntry e;
    e.role = role_of(n);
    if (given(e.role)) {
      d.rows.push_back(compare_exact(n, a.tensor(n), b.tensor(n)));
      continue;
    }
    e.name = n.substr(std::string(role_prefix(e.role)).size());
    e.value = a.tensor(n);
    auto it = twin_entry.find(n);
    if (it != twin_entry.end()) {
      e.rounding = it->second->rounding;
      e.magnitude = it->second->magnitude;
      e.block_magnitude = it->second->block_magnitude;
    } else {
      e.rounding = layer;
      unknown.insert(n);
    }
    record.entries.push_back(std::move(e));
    expected.emplace_back(n, b.tensor(n));
  }
  d.given = static_cast<int>(d.rows.size());
  const std::vector<Comparison> computed =
      compare_record(record, expected, "capture A", [&](const RecordEntry& e, const Tensor& x) {
        Tolerance t = golden_bound(e, x);
        if (unknown.count(e.key())) t.reason += " (the reference twin does not compute it: the whole layer's count)";
        return t;
      });
  d.rows.insert(d.rows.end(), computed.begin(), computed.end());
  mark_divergence(d, false);
  if (const auto flips = routing_flips(b, record)) d.routing = flips->describe();
  return d;
}

}  // namespace twin::parity
