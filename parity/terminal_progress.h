// One status line on a terminal, redrawn in place while a twin runs: "<label> · <what runs> ·
// 12.3 s". What runs comes from the twins' progress marks (core/progress.h); the time counts from
// the start of the run and is redrawn every half second by a ticker thread, so a module that runs
// for minutes still shows the run alive. For people at a terminal only: the caller creates one
// when its stream is a terminal and its output is not --json (pipes and CTest see results alone).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>

#include "core/progress.h"

namespace twin::cli {

class TerminalProgress {
 public:
  // Shows `label` on `err` (a terminal of `columns` characters: a longer line is cut, never wrapped,
  // so the next redraw overwrites it) until destroyed; the line is cleared then.
  TerminalProgress(std::ostream& err, std::string label, int columns);
  ~TerminalProgress();
  TerminalProgress(const TerminalProgress&) = delete;
  TerminalProgress& operator=(const TerminalProgress&) = delete;

  // The line as it is drawn now (a test reads it).
  std::string line() const;

 private:
  void draw();  // holds mu_
  std::ostream& err_;
  const std::string label_;
  const int columns_;
  const std::chrono::steady_clock::time_point start_;
  mutable std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::string what_;
  progress::Show show_;  // before the ticker: a Show that throws leaves no thread running
  std::thread ticker_;
};

// The terminal width of `fd`, or 0 when it is not a terminal.
int terminal_columns(int fd);

}  // namespace twin::cli
