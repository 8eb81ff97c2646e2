// Runs the built `twin` executable (its path comes from the TWIN_EXE compile definition) and
// captures exit code, stdout and stderr separately.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "tests/core/corrupt_safetensors.h"

namespace twin::testing {

struct TwinRun {
  int code = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// `args` is passed to the shell as is: quote paths with quote().
inline TwinRun run_twin(const std::string& args) {
  TempDir dir;
  const std::string cmd =
      std::string("'") + TWIN_EXE + "' " + args + " >'" + dir.file("out") + "' 2>'" + dir.file("err") + "'";
  const int status = std::system(cmd.c_str());
  TwinRun r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(dir.file("out"));
  r.err = slurp(dir.file("err"));
  return r;
}

inline std::string quote(const std::string& s) { return "'" + s + "'"; }

inline std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> r;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) r.push_back(l);
  return r;
}

}  // namespace twin::testing
