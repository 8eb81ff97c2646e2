// dynlib.h: opens a vendor shared library (cuBLASLt, cuBLAS, NCCL) on first use instead of at startup.
//
// Why: linking libcublasLt (~500 MB) and libnccl makes every process that links the runtime map
// them before main, also `twin --help` and the tests on machines without a GPU. The CUDA backends
// instead keep a table of function pointers per library (typed with the library's own header
// through decltype, so the header still provides the types and nothing links the library) and
// fill it once with std::call_once the first time a GEMM or a communicator needs it.
//
// Rules: a library that cannot be opened, or lacks an entry point, is never a crash: the loader
// records one line naming the library, the file and the missing symbol, and every use throws
// CudaError with that line. Handles are never closed (the process may hold objects made by them).
#pragma once

#include "optimized/runtime/device.h"  // CudaError

#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace twin::rt {

class DynLib {
 public:
  // Opens the first of `candidates` (sonames searched the dynamic loader's way, or paths) that
  // dlopen accepts. `what` names the library in messages ("cuBLASLt").
  DynLib(std::string what, const std::vector<std::string>& candidates);

  bool ok() const { return handle_ != nullptr; }
  // The one-line reason the library or one of its symbols is unavailable ("" while none is).
  const std::string& error() const { return error_; }

  // The address of `symbol`, or nullptr with error() naming the library, its file and the symbol.
  void* symbol(const char* symbol);

  // Stores the address of `symbol` in `fn` (a function pointer of the header's type); false when
  // absent (error() says which).
  template <class Fn>
  bool resolve(Fn& fn, const char* name) {
    fn = reinterpret_cast<Fn>(symbol(name));
    return fn != nullptr;
  }

 private:
  std::string what_;
  std::string path_;  // the candidate that opened
  void* handle_ = nullptr;
  std::string error_;
};

// Where to look for a library: its soname first (LD_LIBRARY_PATH, the executable's runpath,
// ld.so.cache), then the same file in `fallback_dir` (the directory the build found it in) when
// not empty.
std::vector<std::string> library_candidates(const std::string& soname, const std::string& fallback_dir);

// A library's table of entry points, loaded by the first call of any member (std::call_once, so
// concurrent first calls load it once). Api is a struct of function pointers declared with
// TWIN_DYNLIB_DECLARE_FN; `fill` opens nothing itself, it resolves every member from the DynLib
// (with TWIN_DYNLIB_RESOLVE_FN) and says whether all resolved.
template <class Api>
class LazyLibrary {
 public:
  using Fill = bool (*)(DynLib& lib, Api& api);
  LazyLibrary(std::string what, std::vector<std::string> candidates, Fill fill)
      : what_(std::move(what)), candidates_(std::move(candidates)), fill_(fill) {}

  // "" once every entry point resolved, else the one-line reason. Never throws.
  const std::string& error() {
    load();
    return error_;
  }
  // The table; throws CudaError with error() when the library or an entry point is missing.
  const Api& api() {
    load();
    if (!error_.empty()) throw CudaError(error_);
    return api_;
  }
  // The table unchecked, for destructors: they run only after a create call succeeded (so the
  // table is complete), and must not throw.
  const Api& loaded_api() {
    load();
    return api_;
  }

 private:
  void load() {
    std::call_once(once_, [this] {
      DynLib lib(what_, candidates_);
      if (!(lib.ok() && fill_(lib, api_))) error_ = lib.error();
    });
  }

  std::string what_;
  std::vector<std::string> candidates_;
  Fill fill_;
  std::once_flag once_;
  Api api_;
  std::string error_;
};

}  // namespace twin::rt

// One member of an Api table: a pointer typed by the library's header (decltype does not
// reference the function, so nothing links the library).
#define TWIN_DYNLIB_DECLARE_FN(name) decltype(&::name) name = nullptr;
// Resolves one member inside a Fill function whose parameters are named `lib` and `api`; chained
// with &&, so the first missing symbol is the one reported.
#define TWIN_DYNLIB_RESOLVE_FN(name) &&lib.resolve(api.name, #name)

namespace twin::rt {

// Loads (once) the table of a CUDA backend's library and says "" when every entry point resolved,
// else the one-line reason. Defined with the backends: gemm_cublaslt.cpp (builds with
// TWIN_HAVE_CUDA) and collectives_nccl.cpp (TWIN_HAVE_NCCL). Needs the library, not a GPU.
std::string load_cublaslt();
std::string load_cublas();  // libcublas: the grouped GEMM's one call (gemm_cublaslt.cpp)
std::string load_nccl();

}  // namespace twin::rt
