// Printable, rerunnable property cases: the one convention of every RapidCheck generator here.
//
// A generator draws ONE case struct that names everything the property computes from (sizes,
// options, dtype and the seed its data comes from), and the struct has a canonical id written as
// the dense ids of parity/dense_case.h are:
//   norm(norm=rms,h=7,rows=3,scale=2.5,shift=0,dtype=bf16,seed=41)
// RapidCheck prints a counterexample through showValue, so a failure prints the id (never <???>).
// To rerun exactly that case:
//   TWIN_CASE='<id>' RC_PARAMS=max_success=1 build/bin/<test binary> --gtest_filter='<Suite>.<Property>'
// (the generator, wrapped by `rerunnable`, then yields only that case). A `dense(...)` id also runs
// under `twin case '<id>'`, which compares the twins on it tap by tap.
//
// A case struct C derives from PropertyCase, names its kind (static constexpr const char* kKind)
// and lists its fields once, in id order, for printing and parsing alike:
//   template <class V> void fields(V& v) { v("h", h); v("dtype", dtype); v("seed", seed); }
// Field types: int, std::int64_t, std::uint64_t, bool (0|1), double (shortest round trip),
// std::string (no ',', '(', ')', '='), DType (fp32 | bf16 | fp16).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <rapidcheck.h>

#include "core/dtype.h"

namespace twin::proptest {

// Base of every case struct: ADL finds showValue below for anything derived from it.
struct PropertyCase {};

// A case id that does not parse as the kind asked for: the message names the key and the value.
struct CaseIdParseError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// fp32 | bf16 | fp16, the spelling of dense ids.
const char* case_dtype_name(DType dt);
DType case_dtype_from_name(const std::string& s);  // CaseIdParseError for any other name

std::string format_case_value(int v);
std::string format_case_value(std::int64_t v);
std::string format_case_value(std::uint64_t v);
std::string format_case_value(bool v);
std::string format_case_value(double v);
std::string format_case_value(const std::string& v);
std::string format_case_value(DType v);
void parse_case_value(const std::string& key, const std::string& s, int& v);
void parse_case_value(const std::string& key, const std::string& s, std::int64_t& v);
void parse_case_value(const std::string& key, const std::string& s, std::uint64_t& v);
void parse_case_value(const std::string& key, const std::string& s, bool& v);
void parse_case_value(const std::string& key, const std::string& s, double& v);
void parse_case_value(const std::string& key, const std::string& s, std::string& v);
void parse_case_value(const std::string& key, const std::string& s, DType& v);

// `kind(k=v,...)` split into its kind and its fields, in order; CaseIdParseError when malformed.
struct SplitId {
  std::string kind;
  std::vector<std::pair<std::string, std::string>> fields;
};
SplitId split_case_id(const std::string& id);

template <class C>
std::string case_id(const C& c) {
  std::string out = std::string(C::kKind) + "(";
  bool first = true;
  auto put = [&](const char* key, const auto& value) {
    out += (first ? "" : ",") + std::string(key) + "=" + format_case_value(value);
    first = false;
  };
  const_cast<C&>(c).fields(put);  // fields() only reads through `put`
  return out + ")";
}

// Strict: the kind of C, every field once in id order, nothing else.
template <class C>
C parse_case(const std::string& id) {
  const SplitId split = split_case_id(id);
  if (split.kind != C::kKind)
    throw CaseIdParseError("case id '" + id + "': kind '" + split.kind + "', expected '" + C::kKind + "'");
  C c;
  std::size_t i = 0;
  auto get = [&](const char* key, auto& value) {
    if (i >= split.fields.size() || split.fields[i].first != key)
      throw CaseIdParseError("case id '" + id + "': expected key '" + key + "' at position " + std::to_string(i));
    parse_case_value(key, split.fields[i].second, value);
    ++i;
  };
  c.fields(get);
  if (i != split.fields.size())
    throw CaseIdParseError("case id '" + id + "': unknown key '" + split.fields[i].first + "'");
  return c;
}

template <class C, class = std::enable_if_t<std::is_base_of_v<PropertyCase, C>>>
void showValue(const C& c, std::ostream& os) {
  os << case_id(c);
}

// The case named by TWIN_CASE when it is of kind `kind`, else nullptr.
const char* rerun_request(const char* kind);

// The generator of property cases of kind C: `g`, unless TWIN_CASE names a case of this kind, which
// it then yields alone. Each drawn case must survive its id's round trip (a field the id forgets
// would make the printed id rerun another case), else the property fails naming both ids.
template <class C>
rc::Gen<C> rerunnable(rc::Gen<C> g) {
  if (const char* id = rerun_request(C::kKind)) return rc::gen::just(parse_case<C>(id));
  return rc::gen::map(std::move(g), [](C c) {
    const std::string id = case_id(c), again = case_id(parse_case<C>(id));
    if (again != id) throw std::logic_error("case id does not round-trip: '" + id + "' reparses as '" + again + "'");
    return c;
  });
}

// An index in [0, n) drawn uniformly whatever the case size, shrinking toward 0: for choices
// (dtype, tp, ep, layer number) that every run must reach in its default case count.
rc::Gen<int> gen_uniform_index(int n);
// One of `choices`, uniformly, shrinking toward the first.
template <class T>
rc::Gen<T> gen_uniform_element(std::vector<T> choices) {
  const int n = static_cast<int>(choices.size());
  return rc::gen::map(gen_uniform_index(n),
                      [choices = std::move(choices)](int i) { return choices[static_cast<std::size_t>(i)]; });
}

// The dtypes a module generator draws, fp32 first (what a failing case shrinks toward), uniformly.
rc::Gen<DType> gen_case_dtype();

// The RapidCheck seed of this process: the one RC_PARAMS names, or the project's fixed default
// that tests/rc_params.cpp adds to RC_PARAMS when it names none.
std::uint64_t rc_seed();
constexpr std::uint64_t kDefaultRcSeed = 20261202;

}  // namespace twin::proptest
