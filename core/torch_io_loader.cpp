// The LibTorch-free side of core/torch_io.h's writer: loads the plugin built from torch_io.cpp on
// the first write. (Reading is core/torch_io_read.cpp and needs no plugin.)
#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <mutex>

#include "core/torch_io.h"

namespace twin {
namespace {

using WriteFn = int (*)(const std::string*, const std::vector<std::pair<std::string, Tensor>>*, std::string*);

struct Plugin {
  WriteFn write = nullptr;
  std::string why_not;  // set when the plugin is unavailable
};

std::string exe_dir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string p(buf, static_cast<std::size_t>(n));
  return p.substr(0, p.find_last_of('/'));
}

// Beside the executable first (build/bin holds twin, the tests and the plugin), then where the
// build put it. Never unloaded: LibTorch does not support being unloaded.
const Plugin& plugin() {
  static const Plugin p = [] {
    Plugin r;
#ifdef TWIN_TORCHIO_PLUGIN
    std::string errors;
    for (const std::string& path : {exe_dir() + "/" + TWIN_TORCHIO_PLUGIN_NAME, std::string(TWIN_TORCHIO_PLUGIN)}) {
      void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        errors += std::string(errors.empty() ? "" : "; ") + dlerror();
        continue;
      }
      r.write = reinterpret_cast<WriteFn>(dlsym(h, "twin_torchio_write_v1"));
      if (r.write) return r;
      errors += "; " + path + " lacks the twin_torchio_write_v1 entry point";
    }
    r.write = nullptr;
    r.why_not = "writing .pt files is unsupported: cannot load the LibTorch plugin (" + errors + ")";
#else
    r.why_not =
        "writing .pt files is unsupported: this twin was built without LibTorch (install libtorch-dev and rebuild)";
#endif
    return r;
  }();
  return p;
}

}  // namespace

bool torch_write_available() { return plugin().write != nullptr; }
bool torch_io_available() { return torch_write_available(); }

void write_torch_file(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors) {
  const Plugin& p = plugin();
  if (!p.write) throw TorchFileError(path + ": " + p.why_not);
  std::string error;
  if (p.write(&path, &tensors, &error) != 0) throw TorchFileError(error);
}

}  // namespace twin
