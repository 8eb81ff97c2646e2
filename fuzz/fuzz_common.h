// Shared by the fuzz targets: an exception a parser documents is the expected answer to bad
// bytes; any other exception escaping a parser is a finding, reported here and turned into an
// abort so that libFuzzer saves the input as a crash.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <typeinfo>

namespace twin::fuzz {

[[noreturn]] inline void finding(const char* what) {
  std::fprintf(stderr, "FUZZ FINDING: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

[[noreturn]] inline void unexpected_exception(const std::exception& e) {
  std::fprintf(stderr, "FUZZ FINDING: undocumented exception %s: %s\n", typeid(e).name(), e.what());
  std::fflush(stderr);
  std::abort();
}

}  // namespace twin::fuzz
