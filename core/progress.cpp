#include "core/progress.h"

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace twin::progress {

namespace {

// The installed sink and its thread; `on` is the fast check every mark makes first.
std::atomic<bool> on{false};
std::mutex mu;
Sink sink_;
std::thread::id owner;
std::vector<std::string> steps;  // the owner's steps now running, outermost first
std::string running;             // now(): the module running within the innermost step
std::string last_done;           // done(): the module last finished within it

bool mine() { return on.load(std::memory_order_acquire) && std::this_thread::get_id() == owner; }

// A sink that throws (a closed terminal) must not end the run it watches.
void report() noexcept try {
  std::string path;
  for (const std::string& s : steps) path += (path.empty() ? "" : " > ") + s;
  if (!running.empty()) path += (path.empty() ? "" : " > ") + running;
  if (!last_done.empty()) path += (path.empty() ? "after " : ", after ") + last_done;
  sink_(path);
} catch (...) {
}

}  // namespace

Show::Show(Sink sink) {
  std::lock_guard<std::mutex> lock(mu);
  if (on.load()) throw std::logic_error("progress::Show: a sink is already installed");
  sink_ = std::move(sink);
  owner = std::this_thread::get_id();
  steps.clear();
  running.clear();
  last_done.clear();
  on.store(true, std::memory_order_release);
}

Show::~Show() {
  std::lock_guard<std::mutex> lock(mu);
  on.store(false, std::memory_order_release);
  sink_ = nullptr;
}

Step::Step(std::string name) {
  if (!mine()) return;
  std::lock_guard<std::mutex> lock(mu);
  steps.push_back(std::move(name));
  running.clear();
  last_done.clear();
  pushed_ = true;
  report();
}

Step::~Step() {
  if (!pushed_ || !mine()) return;
  std::lock_guard<std::mutex> lock(mu);
  if (!steps.empty()) steps.pop_back();
  running.clear();
  last_done.clear();
  report();
}

void now(const std::string& module) {
  if (!mine()) return;
  std::lock_guard<std::mutex> lock(mu);
  running = module;
  last_done.clear();
  report();
}

void done(const std::string& module) {
  if (!mine()) return;
  std::lock_guard<std::mutex> lock(mu);
  last_done = module;
  report();
}

}  // namespace twin::progress
