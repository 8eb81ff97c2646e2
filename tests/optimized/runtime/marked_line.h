// marked_line.h: the line of a test kernel file that ends with `// @marker`, for tests that expect
// a report to name that file:line. The file is the kernel header's __FILE__, which a compiler cache
// that rewrites paths relative to the build directory (ccache's base_dir) makes relative; such a
// path is also tried under $TWIN_SOURCE_DIR (set by CTest) with its leading "../" removed.
#pragma once

#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

namespace twin::testing {

inline std::ifstream open_source_file(const std::string& file) {
  std::ifstream f(file);
  if (f || file.empty() || file[0] == '/') return f;
  std::string rest = file;
  for (;;) {
    if (rest.rfind("../", 0) == 0)
      rest.erase(0, 3);
    else if (rest.rfind("./", 0) == 0)
      rest.erase(0, 2);
    else
      break;
  }
  if (const char* src = std::getenv("TWIN_SOURCE_DIR")) return std::ifstream(std::string(src) + "/" + rest);
  return f;
}

// 1-based line number of the line ending in "// @marker"; throws when the file or marker is missing.
inline int marked_line(const std::string& file, const std::string& marker) {
  std::ifstream f = open_source_file(file);
  if (!f) throw std::runtime_error("cannot open " + file + " (set TWIN_SOURCE_DIR to the source tree)");
  std::string line;
  for (int n = 1; std::getline(f, line); ++n)
    if (line.size() >= marker.size() + 4 &&
        line.compare(line.size() - marker.size() - 4, std::string::npos, "// @" + marker) == 0)
      return n;
  throw std::runtime_error("marker @" + marker + " not found in " + file);
}

}  // namespace twin::testing
