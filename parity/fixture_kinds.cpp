#include "parity/fixture_kinds.h"

#include <map>
#include <utility>

namespace twin {

const char* twin_kind_name(TwinKind t) { return t == TwinKind::Reference ? "reference" : "optimized"; }

FixtureHandler find_fixture_handler(const std::string& kind, TwinKind twin) {
  // One line per supported (kind, twin); the twins add theirs as they learn a kind.
  static const std::map<std::pair<std::string, TwinKind>, FixtureHandler> handlers = {
  };
  auto it = handlers.find({kind, twin});
  return it == handlers.end() ? nullptr : it->second;
}

}  // namespace twin
