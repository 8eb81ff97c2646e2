// Fuzzes the case-id parser: ids are typed by users (`twin case '<id>'`) and printed by RapidCheck
// as counterexamples to rerun, so the parser must reject bad text with a CaseIdError and the
// printed form must be canonical (parity/dense_case.h): for any id that parses to c,
// parse_case_id(to_id(c)) == c and to_id of that is to_id(c) again.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_common.h"
#include "parity/dense_case.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string id(reinterpret_cast<const char*>(data), size);
  twin::parity::DenseCase c;
  try {
    c = twin::parity::parse_case_id(id);
  } catch (const twin::parity::CaseIdError&) {
    return 0;  // the documented answer to a bad id
  } catch (const std::exception& e) {
    twin::fuzz::unexpected_exception(e);
  }
  try {
    const std::string canonical = twin::parity::to_id(c);
    const twin::parity::DenseCase again = twin::parity::parse_case_id(canonical);
    if (!(again == c)) twin::fuzz::finding("parse_case_id(to_id(c)) != c");
    if (twin::parity::to_id(again) != canonical) twin::fuzz::finding("to_id is not idempotent through parse_case_id");
  } catch (const std::exception& e) {
    // The canonical id of a case that parsed must parse: any exception is a finding.
    twin::fuzz::unexpected_exception(e);
  }
  return 0;
}
