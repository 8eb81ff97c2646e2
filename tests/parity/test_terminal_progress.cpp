// parity/terminal_progress.h and `twin fixture` on a terminal: each module as a twin runs it on
// stderr, the results on stdout as they are without a terminal; nothing of it with --json.
#include "parity/terminal_progress.h"

#include <gtest/gtest.h>
#include <pty.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <sstream>
#include <string>

#include "fixtures/fixture.h"
#include "tests/parity/twin_cli_util.h"

namespace twin::cli {
namespace {

using twin::testing::quote;
using twin::testing::TwinRun;

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(TerminalProgress, ALongLabelGivesWayFromItsLeftThenTheModulePath) {
  {
    std::ostringstream err;
    const TerminalProgress shown(err, "fixtures/megatron-core/dense_rms_gqa_swiglu_rope.safetensors · reference", 60);
    const std::string line = shown.line();  // "…<end of the label> · 0.0 s", 59 characters
    EXPECT_TRUE(has(line, "rope.safetensors · reference · 0.")) << line;
    EXPECT_EQ(line.rfind("…", 0), 0u) << line;
    EXPECT_TRUE(has(err.str(), "\r\033[K")) << "drawn in place";
  }
  std::ostringstream narrow;
  const TerminalProgress tiny(narrow, "label", 12);
  EXPECT_EQ(tiny.line().rfind("…", 0), 0u);
  EXPECT_TRUE(has(tiny.line(), " s")) << tiny.line();
}

// `twin fixture ARGS` with stderr (and stdin) a terminal of 200 columns and stdout a file.
TwinRun run_on_terminal(const std::string& args) {
  twin::testing::TempDir dir;
  const std::string out = dir.file("out");
  winsize size{};
  size.ws_row = 50;
  size.ws_col = 200;
  int master = -1;
  const pid_t pid = forkpty(&master, nullptr, nullptr, &size);
  if (pid == 0) {
    const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDOUT_FILENO);
    execl("/bin/sh", "sh", "-c", (std::string("'") + TWIN_EXE + "' fixture " + args).c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  TwinRun r;
  char buf[4096];
  for (ssize_t n; (n = read(master, buf, sizeof buf)) > 0;) r.err.append(buf, std::size_t(n));  // EIO at the end
  int status = 0;
  waitpid(pid, &status, 0);
  close(master);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = twin::testing::slurp(out);
  return r;
}

TEST(TerminalProgress, TwinFixtureShowsEachModuleOnATerminalAndLeavesTheResultsAsTheyAre) {
  const std::string golden = quote(twin::golden_dir() + "/moe_top2_shared_expert_swiglu.safetensors");
  const TwinRun plain = twin::testing::run_twin("fixture --twin both " + golden);
  const TwinRun shown = run_on_terminal("--twin both " + golden);
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_EQ(shown.code, 0);
  EXPECT_TRUE(plain.err.empty()) << "no progress without a terminal: " << plain.err;
  // The results on stdout as without a terminal (the text report has no timings).
  EXPECT_EQ(shown.out, plain.out);
  for (const char* module :
       {"reference · forward, after input_layernorm", "reference · forward, after mlp.router.0",
        "reference · backward > mlp > experts > local_experts.1 > linear_fc1", "reference · backward > mlp > router",
        "reference · backward > self_attention > linear_qkv",
        "optimized · forward > _forward_mlp_router, after self_attention.linear_qkv.0",
        "optimized · backward > _backward_mlp_expert_compute"})
    EXPECT_TRUE(has(shown.err, module)) << module << " not in:\n" << shown.err;
  EXPECT_TRUE(has(shown.err, " s\r\033[K")) << "each line with its time, redrawn in place";

  // --json: the same objects, and nothing on the terminal.
  const TwinRun json_plain = twin::testing::run_twin("fixture --json --twin reference " + golden);
  const TwinRun json_shown = run_on_terminal("--json --twin reference " + golden);
  EXPECT_EQ(json_shown.code, json_plain.code);
  EXPECT_EQ(json_shown.out, json_plain.out);
  EXPECT_EQ(json_shown.err, "") << json_shown.err;
}

}  // namespace
}  // namespace twin::cli
