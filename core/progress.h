// Progress of a long run, for a person watching a terminal: which module a twin is running, in
// Megatron's module names, as it runs. A real-size layer takes minutes in either twin; without
// this a tool prints nothing for all of them.
//
// The twins mark what they run: a Step for a module or phase, from construction to destruction,
// nested as the modules are ("backward > mlp"); now() for the module running within it until the
// next mark ("backward > mlp > linear_fc1"); done() for a module that just finished, as a tap is
// recorded ("forward, after self_attention.linear_qkv"). A tool that shows progress installs a sink (Show) for the time
// it runs a twin; without one a mark costs an atomic load. Only the thread that installed the sink
// reports (a twin's rank threads run the same modules as rank 0 at once; their marks would only
// interleave), and the sink is called with that thread's current path.
#pragma once

#include <functional>
#include <string>

namespace twin::progress {

// Called with what runs: the steps, " > "-joined, the module now() named within the innermost,
// and ", after " the module done() named, if any.
using Sink = std::function<void(const std::string& path)>;

// Installs `sink` for the calling thread's marks for its lifetime; one at a time (a second Show
// while one is installed throws std::logic_error).
class Show {
 public:
  explicit Show(Sink sink);
  ~Show();
  Show(const Show&) = delete;
  Show& operator=(const Show&) = delete;
};

// A module or phase running, from construction to destruction.
class Step {
 public:
  explicit Step(std::string name);
  ~Step();
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;

 private:
  bool pushed_ = false;
};

// The module running within the current step, until the next mark.
void now(const std::string& module);
// A module finished within the current step (a tap recorded): shown until the next mark.
void done(const std::string& module);

}  // namespace twin::progress
