// DynLib (optimized/runtime/dynlib.h), which opens cuBLASLt, cuBLAS and NCCL at first use: a missing file
// or symbol is one line naming the library, the file and the symbol, never a crash; and in CUDA
// builds neither vendor library is mapped until asked for (no GPU needed: only the files).
#include "optimized/runtime/dynlib.h"

#include <gtest/gtest.h>
#include <link.h>

#include <cmath>
#include <string>

namespace {

using twin::rt::DynLib;
using twin::rt::library_candidates;

// Whether a loaded object's path contains `name`.
bool mapped(const char* name) {
  struct Query {
    const char* name;
    bool found;
  } q{name, false};
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        auto* q = static_cast<Query*>(data);
        if (info->dlpi_name && std::string(info->dlpi_name).find(q->name) != std::string::npos) q->found = true;
        return 0;
      },
      &q);
  return q.found;
}

// Taken before main, so that the order the tests run in does not matter.
const bool g_cublaslt_at_start = mapped("libcublasLt");
const bool g_cublas_at_start = mapped("libcublas.so");
const bool g_nccl_at_start = mapped("libnccl");

TEST(DynLib, MissingLibraryIsOneLineNamingItAndTheFile) {
  DynLib lib("libtwin-missing", library_candidates("libtwin_no_such_library.so.1", "/nonexistent/dir"));
  EXPECT_FALSE(lib.ok());
  EXPECT_NE(lib.error().find("libtwin-missing: cannot load the library"), std::string::npos) << lib.error();
  EXPECT_NE(lib.error().find("libtwin_no_such_library.so.1"), std::string::npos) << lib.error();
  EXPECT_NE(lib.error().find("/nonexistent/dir/libtwin_no_such_library.so.1"), std::string::npos) << lib.error();
  EXPECT_EQ(lib.error().find('\n'), std::string::npos) << lib.error();
  double (*fn)(double) = nullptr;
  EXPECT_FALSE(lib.resolve(fn, "cos"));
  EXPECT_EQ(fn, nullptr);
}

TEST(DynLib, MissingSymbolIsOneLineNamingIt) {
  DynLib lib("libm", {"/nonexistent/libm.so.6", "libm.so.6"});  // the second candidate opens
  ASSERT_TRUE(lib.ok()) << lib.error();
  EXPECT_EQ(lib.error(), "");
  double (*cos_fn)(double) = nullptr;
  ASSERT_TRUE(lib.resolve(cos_fn, "cos"));
  EXPECT_EQ(cos_fn(0.0), 1.0);
  void (*none)() = nullptr;
  EXPECT_FALSE(lib.resolve(none, "twin_no_such_symbol"));
  EXPECT_EQ(lib.error(), "libm: libm.so.6 lacks the symbol twin_no_such_symbol");
  // The first missing symbol stays the one reported.
  EXPECT_EQ(lib.symbol("twin_other_missing_symbol"), nullptr);
  EXPECT_EQ(lib.error(), "libm: libm.so.6 lacks the symbol twin_no_such_symbol");
}

#if TWIN_HAVE_CUDA
TEST(DynLib, CublasLtLoadsOnFirstUseOnly) {
  EXPECT_FALSE(g_cublaslt_at_start) << "libcublasLt is mapped before main: something links it";
  EXPECT_EQ(twin::rt::load_cublaslt(), "");  // every entry point gemm_cublaslt.cpp calls resolves
  EXPECT_TRUE(mapped("libcublasLt"));
  EXPECT_EQ(twin::rt::load_cublaslt(), "");  // once: the second call finds the table
}

TEST(DynLib, CublasLoadsOnFirstUseOnly) {
  EXPECT_FALSE(g_cublas_at_start) << "libcublas is mapped before main: something links it";
  EXPECT_EQ(twin::rt::load_cublas(), "");  // cublasGemmGroupedBatchedEx and the handle calls resolve
  EXPECT_TRUE(mapped("libcublas.so"));
}
#endif

#if TWIN_HAVE_NCCL
TEST(DynLib, NcclLoadsOnFirstUseOnly) {
  EXPECT_FALSE(g_nccl_at_start) << "libnccl is mapped before main: something links it";
  EXPECT_EQ(twin::rt::load_nccl(), "");  // every entry point collectives_nccl.cpp calls resolves
  EXPECT_TRUE(mapped("libnccl"));
}
#endif

}  // namespace
