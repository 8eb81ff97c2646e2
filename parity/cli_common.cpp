#include "parity/cli_common.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/config.h"
#include "core/safetensors.h"
#include "core/torch_io.h"
#include "fixtures/fixture.h"

namespace twin::cli {

const char* status_name(Status s) {
  switch (s) {
    case Status::Pass:
      return "pass";
    case Status::Fail:
      return "fail";
    case Status::Unsupported:
      return "unsupported";
    case Status::Error:
      return "error";
  }
  return "?";
}

int exit_code(Status s) {
  switch (s) {
    case Status::Pass:
      return 0;
    case Status::Fail:
      return 1;
    case Status::Error:
      return 2;
    case Status::Unsupported:
      return 3;
  }
  return 2;
}

int combine_exit_codes(int a, int b) {
  // Precedence: error (2) > fail (1) > unsupported (3) > pass (0).
  const auto rank = [](int c) { return c == 2 ? 3 : c == 1 ? 2 : c == 3 ? 1 : 0; };
  return rank(a) >= rank(b) ? a : b;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  return s;
}

std::string describe_exception(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const FixtureError& x) {
    return one_line(x.what());
  } catch (const ConfigError& x) {
    return one_line(x.what());
  } catch (const ShapeError& x) {
    return one_line(x.what());
  } catch (const SafetensorsError& x) {
    return one_line(x.what());
  } catch (const TorchFileError& x) {
    return one_line(x.what());
  } catch (const std::exception& x) {
    return one_line(std::string("internal error: ") + x.what());
  } catch (...) {
    return "internal error: unknown exception";
  }
}

std::string num(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{:.6g}", v);
}

}  // namespace twin::cli
