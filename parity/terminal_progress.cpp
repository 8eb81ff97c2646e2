#include "parity/terminal_progress.h"

#include <fmt/format.h>
#include <sys/ioctl.h>
#include <unistd.h>

namespace twin::cli {

TerminalProgress::TerminalProgress(std::ostream& err, std::string label, int columns)
    : err_(err),
      label_(std::move(label)),
      columns_(columns),
      start_(std::chrono::steady_clock::now()),
      show_([this](const std::string& what) {
        std::lock_guard<std::mutex> lock(mu_);
        what_ = what;
        draw();
      }),
      ticker_([this] {
        std::unique_lock<std::mutex> lock(mu_);
        while (!stop_cv_.wait_for(lock, std::chrono::milliseconds(500), [this] { return stop_; })) draw();
      }) {
  std::lock_guard<std::mutex> lock(mu_);
  draw();
}

TerminalProgress::~TerminalProgress() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  ticker_.join();
  err_ << "\r\033[K" << std::flush;
}

namespace {

// Characters, not bytes: the separators are two UTF-8 bytes each.
std::size_t chars(const std::string& s) {
  std::size_t n = 0;
  for (const char c : s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

// The last `n` characters of an ASCII-or-UTF-8 string.
std::string last_chars(const std::string& s, std::size_t n) {
  std::size_t i = s.size();
  for (std::size_t kept = 0; i > 0 && kept < n;) kept += (static_cast<unsigned char>(s[--i]) & 0xC0) != 0x80;
  return s.substr(i);
}

}  // namespace

std::string TerminalProgress::line() const {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const std::string tail = (what_.empty() ? "" : " · " + what_) + fmt::format(" · {:.1f} s", seconds);
  // What runs and the time are what the line is for: a long label gives way first, from its left
  // (a fixture's path keeps its file name), then the module path from its left.
  if (columns_ <= 1) return label_ + tail;
  const std::size_t width = std::size_t(columns_ - 1);
  if (chars(label_) + chars(tail) <= width) return label_ + tail;
  if (chars(tail) + 8 <= width) return "…" + last_chars(label_, width - chars(tail) - 1) + tail;
  return "…" + last_chars(tail, width - 1);
}

void TerminalProgress::draw() { err_ << "\r\033[K" << line() << std::flush; }

int terminal_columns(int fd) {
  if (!isatty(fd)) return 0;
  winsize w{};
  return ioctl(fd, TIOCGWINSZ, &w) == 0 && w.ws_col > 0 ? int(w.ws_col) : 80;
}

}  // namespace twin::cli
