// Where each twin plugs in its support for a fixture kind. `twin fixture` loads a file, finds the
// handler for (kind, twin) and reports the comparisons the handler returns, in the order the layer
// computes them.
#pragma once

#include <string>
#include <vector>

#include "fixtures/fixture.h"
#include "parity/compare.h"

namespace twin {

enum class TwinKind { Reference, Optimized };
const char* twin_kind_name(TwinKind t);  // "reference" | "optimized"

// A handler runs the fixture through its twin and compares every output, tap and aux value the
// file holds. It throws FixtureError / ConfigError / ShapeError for bad input.
using FixtureHandler = std::vector<Comparison> (*)(const Fixture&);

// nullptr when that twin does not support the kind (yet).
FixtureHandler find_fixture_handler(const std::string& kind, TwinKind twin);

}  // namespace twin
