// Case ids as field tables: a case kind (dense, later moe and retro) is a struct of knobs and one
// table of CaseField<Case>, one row per knob. The table is the only place a field is spelled: it
// prints the id (`kind(key=value,...)`, keys in table order), parses it (every key once, in any
// order), checks each value against the field's domain with a message that names the key, the bad
// value and what is allowed, and gives the property-test generators (tests/parity/*_gen) the
// domains and the sample values they draw.
//
// Values are written as to_id prints them: integers in decimal, reals as the shortest text that
// reads back to the same double, finite domains by their spelling. So parse(to_id(c)) == c, and
// to_id(parse(id)) == id for an id written in table order.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/dtype.h"

namespace twin::parity {

struct CaseIdError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A numeric interval, for the generators to clip their draws to and for messages. Integer fields
// hold their exact bounds in the typed check; these doubles are exact up to 2^53, beyond which no
// generator draws.
struct FieldRange {
  double lo = 0, hi = 0;
  bool lo_open = false, hi_open = false;
  bool contains(double x) const { return (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi); }
};

template <class Case>
struct CaseField {
  std::string key;       // the id's key
  std::string megatron;  // what the field is in Megatron's words (a TransformerConfig name, or a forward argument)
  std::string allowed;   // the domain in words: "an integer in [1, 4096]", "one of ln, rms"
  // The domain as data: the spellings of a finite domain (empty otherwise), or the numeric range
  // (int and real fields only).
  std::vector<std::string> choices;
  FieldRange range;
  // The values a generator draws, simplest first (RapidCheck shrinks toward the first); empty when
  // generators derive the field from others (sizes that must divide by tp, the seed).
  std::vector<std::string> samples;
  // A knob added after ids were written down: an id may leave it out (the Case's default holds),
  // and to_id prints it only when it differs from the default, so every older id still parses
  // and prints as it was written.
  bool optional = false;

  std::function<std::string(const Case&)> print;
  // Reads the text into the case; throws CaseIdError (field_error) when it is not in the domain.
  std::function<void(Case&, const std::string&)> parse;
  // Whether the case's value lies in the domain (a case built in code, not parsed).
  std::function<bool(const Case&)> in_domain;

  // "key=text: key (megatron) must be <allowed>"
  std::string field_error(const std::string& text) const {
    return fmt::format("{}={}: {} ({}) must be {}", key, text, key, megatron, allowed);
  }
};

// The CaseIdError a field's parser throws for `text` (the field's words captured by value: the
// parser lives inside the row it reports on).
template <class Case>
std::function<CaseIdError(const std::string&)> parse_error(const CaseField<Case>& f) {
  CaseField<Case> words;
  words.key = f.key;
  words.megatron = f.megatron;
  words.allowed = f.allowed;
  return [words](const std::string& text) { return CaseIdError("case id: " + words.field_error(text)); };
}

namespace case_field_detail {

inline std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}
inline std::string one_of(const std::vector<std::string>& v) { return "one of " + join(v, ", "); }
inline std::string interval(const FieldRange& r) {
  return fmt::format("{}{}, {}{}", r.lo_open ? "(" : "[", r.lo, r.hi, r.hi_open ? ")" : "]");
}

// The text of a value that no spelling names (a case built in code): the value itself for strings,
// the dtype's name, the enumerator's number otherwise.
inline std::string unnamed(const std::string& s) { return s; }
inline std::string unnamed(DType d) { return dtype_name(d); }
inline std::string unnamed(bool b) { return b ? "1" : "0"; }
template <class T>
std::string unnamed(const T& v) {
  return std::to_string(static_cast<long long>(v));
}

// Strict decimal integer: digits with an optional '-' (signed types), nothing else, no overflow.
template <class T>
bool read_int(const std::string& text, T& out) {
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, out);
  return ec == std::errc() && p == end && !text.empty();
}
// A finite real: what strtod reads, starting at the first character (no blanks) and to the end.
inline bool read_real(const std::string& text, double& out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  char* end = nullptr;
  out = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && std::isfinite(out);
}

}  // namespace case_field_detail

// An integer knob in [lo, hi]. samples: what generators draw (empty: they derive it).
template <class Case, class T>
CaseField<Case> int_field(std::string key, std::string megatron, T Case::*member, T lo, T hi,
                          std::vector<T> samples = {}) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>, "int_field: integer members");
  CaseField<Case> f;
  f.key = std::move(key);
  f.megatron = std::move(megatron);
  f.range = {static_cast<double>(lo), static_cast<double>(hi), false, false};
  f.allowed = fmt::format("an integer in [{}, {}]", lo, hi);
  for (T v : samples) f.samples.push_back(fmt::format("{}", v));
  f.print = [member](const Case& c) { return fmt::format("{}", c.*member); };
  f.in_domain = [member, lo, hi](const Case& c) { return c.*member >= lo && c.*member <= hi; };
  f.parse = [member, lo, hi, error = parse_error(f)](Case& c, const std::string& text) {
    T v{};
    if (!case_field_detail::read_int(text, v) || v < lo || v > hi) throw error(text);
    c.*member = v;
  };
  return f;
}

// A real knob in `range`, printed as the shortest text that reads back to the same double.
template <class Case>
CaseField<Case> real_field(std::string key, std::string megatron, double Case::*member, FieldRange range,
                           std::vector<double> samples = {}) {
  CaseField<Case> f;
  f.key = std::move(key);
  f.megatron = std::move(megatron);
  f.range = range;
  f.allowed = "a number in " + case_field_detail::interval(range);
  for (double v : samples) f.samples.push_back(fmt::format("{}", v));
  f.print = [member](const Case& c) { return fmt::format("{}", c.*member); };
  f.in_domain = [member, range](const Case& c) { return std::isfinite(c.*member) && range.contains(c.*member); };
  f.parse = [member, range, error = parse_error(f)](Case& c, const std::string& text) {
    double v = 0;
    if (!case_field_detail::read_real(text, v) || !range.contains(v)) throw error(text);
    c.*member = v;
  };
  return f;
}

// A knob with a finite domain: each value and its spelling. samples: spellings in the order
// generators draw them (empty: every spelling, in the listed order).
template <class Case, class T>
CaseField<Case> choice_field(std::string key, std::string megatron, T Case::*member,
                             std::vector<std::pair<T, std::string>> spellings, std::vector<std::string> samples = {}) {
  CaseField<Case> f;
  f.key = std::move(key);
  f.megatron = std::move(megatron);
  for (const auto& [v, s] : spellings) f.choices.push_back(s);
  f.allowed = case_field_detail::one_of(f.choices);
  f.samples = samples.empty() ? f.choices : std::move(samples);
  f.print = [member, spellings](const Case& c) {
    for (const auto& [v, s] : spellings)
      if (c.*member == v) return s;
    return case_field_detail::unnamed(c.*member);
  };
  f.in_domain = [member, spellings](const Case& c) {
    for (const auto& [v, s] : spellings)
      if (c.*member == v) return true;
    return false;
  };
  f.parse = [member, spellings, error = parse_error(f)](Case& c, const std::string& text) {
    for (const auto& [v, s] : spellings)
      if (text == s) {
        c.*member = v;
        return;
      }
    throw error(text);
  };
  return f;
}

// A 0/1 switch. `first`: the value generators draw first (and shrink toward).
template <class Case>
CaseField<Case> bool_field(std::string key, std::string megatron, bool Case::*member, bool first = false) {
  return choice_field<Case, bool>(std::move(key), std::move(megatron), member, {{false, "0"}, {true, "1"}},
                                  first ? std::vector<std::string>{"1", "0"} : std::vector<std::string>{"0", "1"});
}

// The row of `key`; std::out_of_range when the table has none (a programming error).
template <class Case>
const CaseField<Case>& find_field(const std::vector<CaseField<Case>>& fields, const std::string& key) {
  for (const auto& f : fields)
    if (f.key == key) return f;
  throw std::out_of_range("no case field '" + key + "'");
}

// An optional row: the same field, which an id may omit while it holds the Case's default.
template <class Case>
CaseField<Case> optional_field(CaseField<Case> f) {
  f.optional = true;
  return f;
}

// `kind(key=value,...)`, every field in table order (an optional one only when not at its default).
template <class Case>
std::string format_case_id(const std::string& kind, const Case& c, const std::vector<CaseField<Case>>& fields) {
  std::string id = kind + "(";
  bool first = true;
  for (const auto& f : fields) {
    const std::string text = f.print(c);
    if (f.optional && text == f.print(Case{})) continue;
    id += (first ? "" : ",") + f.key + "=" + text;
    first = false;
  }
  return id + ")";
}

// The fields of a `kind(key=value,...)` id into a default Case: every key exactly once (an optional
// one at most once), in any order; unknown, missing or repeated keys and values outside a field's
// domain throw CaseIdError.
// Combinations of fields are the caller's to check.
template <class Case>
Case parse_case_fields(const std::string& kind, const std::string& id, const std::vector<CaseField<Case>>& fields) {
  const std::string head = kind + "(";
  if (id.rfind(head, 0) != 0 || id.size() < head.size() + 1 || id.back() != ')')
    throw CaseIdError("case id must look like " + kind + "(key=value,...), got '" + id + "'");
  const std::string body = id.substr(head.size(), id.size() - head.size() - 1);
  Case c{};
  std::set<std::string> seen;
  std::size_t start = 0;
  while (start <= body.size()) {
    const std::size_t comma = std::min(body.find(',', start), body.size());
    const std::string item = body.substr(start, comma - start);
    start = comma + 1;
    const auto eq = item.find('=');
    if (eq == std::string::npos) throw CaseIdError("case id: item '" + item + "' has no '='");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    const CaseField<Case>* f = nullptr;
    for (const auto& row : fields)
      if (row.key == k) f = &row;
    if (!f)
      throw CaseIdError("case id: unknown key '" + k + "' (keys: " + kind + "(" + [&] {
        std::vector<std::string> keys;
        for (const auto& row : fields) keys.push_back(row.key);
        return case_field_detail::join(keys, ",");
      }() + "))");
    if (!seen.insert(k).second) throw CaseIdError("case id: key '" + k + "' given twice");
    f->parse(c, v);
  }
  for (const auto& f : fields)
    if (!f.optional && !seen.count(f.key)) throw CaseIdError("case id: missing key '" + f.key + "'");
  return c;
}

// The first field of c outside its domain, as field_error's message; empty when all are inside.
template <class Case>
std::string first_field_error(const Case& c, const std::vector<CaseField<Case>>& fields) {
  for (const auto& f : fields)
    if (!f.in_domain(c)) return f.field_error(f.print(c));
  return "";
}

}  // namespace twin::parity
