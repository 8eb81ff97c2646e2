// dynlib.cpp: dlopen/dlsym behind DynLib (see dynlib.h for why the vendor libraries load late).
#include "optimized/runtime/dynlib.h"

#include <dlfcn.h>

#include <utility>

namespace twin::rt {

std::vector<std::string> library_candidates(const std::string& soname, const std::string& fallback_dir) {
  std::vector<std::string> c{soname};
  if (!fallback_dir.empty()) c.push_back(fallback_dir + "/" + soname);
  return c;
}

DynLib::DynLib(std::string what, const std::vector<std::string>& candidates) : what_(std::move(what)) {
  std::string errors;
  for (const std::string& path : candidates) {
    // RTLD_NOW: a library whose own dependencies are missing fails here with dlerror's reason,
    // not later at the first call. RTLD_LOCAL: its symbols do not leak into later lookups.
    handle_ = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_) {
      path_ = path;
      return;
    }
    const char* e = dlerror();
    errors += (errors.empty() ? "" : "; ") + std::string(e ? e : path + ": unknown dlopen error");
  }
  error_ = what_ + ": cannot load the library (" + errors + ")";
}

void* DynLib::symbol(const char* name) {
  if (!handle_) return nullptr;
  dlerror();  // clear a stale error so the one after dlsym is this lookup's
  void* p = dlsym(handle_, name);
  if (!p && error_.empty()) error_ = what_ + ": " + path_ + " lacks the symbol " + name;
  return p;
}

}  // namespace twin::rt
