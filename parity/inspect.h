// `twin inspect FILE...`: metadata, the parsed config, and a table of tensors (name, dtype,
// shape, min/max/mean) of .safetensors, .pt (through LibTorch) and fixture .json files.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace twin::cli {

struct InspectOptions {
  std::vector<std::string> files;
  bool json = false;  // one JSON object per file per line
};

// Exit 0, or 2 when any file is unreadable, corrupt or has a bad config.
int run_inspect(const InspectOptions& opt, std::ostream& out, std::ostream& err);

}  // namespace twin::cli
