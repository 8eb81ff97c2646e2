// Touches every bundled library once, so each is compiled against and linked from the bundle; the
// process must run (libbenchmark.so through the build tree's RPATH). Prints one line per library.
#include <CLI/CLI.hpp>
#include <Eigen/Dense>
#include <benchmark/benchmark.h>
#include <boost/context/detail/fcontext.hpp>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>
#include <zlib.h>

#include <algorithm>

#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>

namespace ctx = boost::context::detail;

namespace {
int fiber_ran = 0;
ctx::fcontext_t main_ctx;
void fiber(ctx::transfer_t t) {
  fiber_ran = 1;
  ctx::jump_fcontext(t.fctx, nullptr);
}
void BM_Nothing(benchmark::State& s) {
  for (auto _ : s) benchmark::DoNotOptimize(s.iterations());
}
BENCHMARK(BM_Nothing);

TEST(Probe, RapidCheckProperty) {
  EXPECT_TRUE(rc::check("reverse twice", [](const std::vector<int>& v) {
    auto r = v;
    std::reverse(r.begin(), r.end());
    std::reverse(r.begin(), r.end());
    RC_ASSERT(r == v);
  }));
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"probe"};
  CLI11_PARSE(app, 1, argv);
  Eigen::Matrix2d m;
  m << 1, 2, 3, 4;
  std::cout << "eigen det " << m.determinant() << "\n";
  std::cout << "json " << nlohmann::json{{"a", 1}}.dump() << "\n";
  std::cout << fmt::format("fmt {:.3f}", 3.14159) << "\n";
  const char* s = "123456789";
  std::cout << fmt::format("zlib crc32 {:08x}", crc32(0L, reinterpret_cast<const Bytef*>(s), std::strlen(s))) << "\n";
  static char stack[64 * 1024];
  ctx::fcontext_t f = ctx::make_fcontext(stack + sizeof(stack), sizeof(stack), fiber);
  ctx::jump_fcontext(f, nullptr);
  std::cout << "boost.context fiber ran " << fiber_ran << "\n";
  int bargc = 2;
  char filter[] = "--benchmark_filter=BM_Nothing", name[] = "probe";
  char* bargv[] = {name, filter, nullptr};
  benchmark::Initialize(&bargc, bargv);
  std::cout << std::flush;
  const std::size_t rows = benchmark::RunSpecifiedBenchmarks();
  std::cout << "benchmark rows " << rows << std::endl;
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS() || fiber_ran != 1 || m.determinant() != -2.0;
}
