// Small helpers shared by the `twin` subcommands: file formats, number formatting, and the
// exceptions that mean bad input (exit 2).
#pragma once

#include <exception>
#include <string>

namespace twin::cli {

enum class Status { Pass, Fail, Unsupported, Error };
const char* status_name(Status s);  // "pass" | "fail" | "unsupported" | "error"

// Several results in one run: 2 if any error, else 1 if any failed, else 3 if any unsupported, else 0.
int exit_code(Status s);
int combine_exit_codes(int a, int b);

bool ends_with(const std::string& s, const std::string& suffix);
// One line: newlines folded, so a message never spans lines.
std::string one_line(std::string s);
// The message of a bad-input exception (FixtureError, ConfigError, ShapeError, SafetensorsError,
// TorchFileError); anything else is reported as an internal error, still on one line.
std::string describe_exception(const std::exception_ptr& e);
// Compact number for tables: 6 significant digits, "nan", "inf".
std::string num(double v);

}  // namespace twin::cli
