// Start-up time of the `twin` tool, as a user pays it: wall time from posix_spawn of the built
// binary to its exit, stdout/stderr to /dev/null, page cache warm (the first, cold start of a
// fresh machine is slower, and is not what a benchmark can repeat).
//   BM_TwinHelp                     `twin --help`: process start, static initialisers, CLI setup
//   BM_TwinFixture                  `twin fixture` on the smallest dense golden (reference twin)
//   BM_TwinHelpVendorLibsPreloaded  `twin --help` with libcublasLt and libnccl in LD_PRELOAD: what
//                                   every start cost while the runtime linked them (CUDA builds)
// cuBLASLt and NCCL are opened only at first use (optimized/runtime/dynlib.h), so the first two
// must not pay for them. The binary is the one this build made (TWIN_BENCH_EXE); the fixtures are
// found under TWIN_SOURCE_DIR when set, else the source tree this was built from.
#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace {

std::string source_dir() {
  const char* s = std::getenv("TWIN_SOURCE_DIR");
  return s && *s ? s : TWIN_BENCH_SOURCE_DIR;
}

// Runs argv with the current environment plus `extra_env` ("NAME=value", may be empty); returns
// the seconds from spawn to exit, or a negative value with *why set when it failed.
double spawn_and_wait(const std::vector<std::string>& argv, const std::string& extra_env, std::string* why) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> env;
  for (char** e = environ; *e; ++e) env.push_back(*e);
  if (!extra_env.empty()) env.push_back(const_cast<char*>(extra_env.c_str()));
  env.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  const auto t0 = std::chrono::steady_clock::now();
  pid_t pid = 0;
  const int err = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&fa);
  if (err != 0) {
    *why = "posix_spawn " + argv[0] + ": " + std::strerror(err);
    return -1.0;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      *why = std::string("waitpid: ") + std::strerror(errno);
      return -1.0;
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string cmd;
    for (const std::string& a : argv) cmd += (cmd.empty() ? "" : " ") + a;
    *why = cmd + (WIFEXITED(status) ? ": exit status " + std::to_string(WEXITSTATUS(status)) : ": killed by a signal");
    return -1.0;
  }
  return s;
}

void run_spawns(benchmark::State& state, const std::vector<std::string>& argv, const std::string& extra_env = "") {
  std::string why;
  for (auto _ : state) {
    const double s = spawn_and_wait(argv, extra_env, &why);
    if (s < 0) {
      state.SkipWithError(why.c_str());
      break;
    }
    state.SetIterationTime(s);
  }
}

void BM_TwinHelp(benchmark::State& state) { run_spawns(state, {TWIN_BENCH_EXE, "--help"}); }

void BM_TwinFixture(benchmark::State& state) {
  const std::string golden = source_dir() + "/fixtures/megatron-core/dense_ln_mha_gelu_nobias.safetensors";
  if (access(golden.c_str(), R_OK) != 0) {
    state.SkipWithError(("no golden fixture at " + golden + " (set TWIN_SOURCE_DIR)").c_str());
    for (auto _ : state) {
    }
    return;
  }
  run_spawns(state, {TWIN_BENCH_EXE, "fixture", golden});
}

BENCHMARK(BM_TwinHelp)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(30);
BENCHMARK(BM_TwinFixture)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(10);

#ifdef TWIN_BENCH_VENDOR_LIBS
void BM_TwinHelpVendorLibsPreloaded(benchmark::State& state) {
  run_spawns(state, {TWIN_BENCH_EXE, "--help"}, std::string("LD_PRELOAD=") + TWIN_BENCH_VENDOR_LIBS);
}
BENCHMARK(BM_TwinHelpVendorLibsPreloaded)->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(30);
#endif

}  // namespace

BENCHMARK_MAIN();
