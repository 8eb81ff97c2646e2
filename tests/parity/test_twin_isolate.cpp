// `twin fixture --isolate`: each module runs on the golden's own recorded input to it, so a row
// shows the error that module introduces. On the goldens it passes wherever end to end passes; on
// a copy of a golden with one module's parameter perturbed, only that module's output fails in
// isolation, while end to end everything downstream of it fails too.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "parity/fixture_kinds.h"
#include "tests/parity/twin_cli_util.h"

using namespace twin;
using twin::testing::TempDir;
using json = nlohmann::json;

namespace {

const RunMode kEndToEnd{false}, kIsolated{true};

std::vector<Comparison> rows_of(const std::string& path, const RunMode& mode) {
  return compare_fixture(load_fixture(path), TwinKind::Reference, mode);
}

std::set<std::string> failing(const std::vector<Comparison>& rows) {
  std::set<std::string> r;
  for (const auto& c : rows)
    if (!c.pass) r.insert(c.name);
  return r;
}

// A copy of a golden whose tensor `name` is multiplied by `factor` (metadata and order kept).
std::string perturbed_copy(const TempDir& dir, const std::string& golden, const std::string& name, double factor) {
  const SafetensorsFile src = read_safetensors(twin::golden_dir() + "/" + golden);
  std::vector<std::pair<std::string, Tensor>> tensors;
  bool found = false;
  for (const auto& n : src.names()) {
    const Tensor& t = src.at(n);
    if (n != name) {
      tensors.emplace_back(n, t);
      continue;
    }
    std::vector<double> v = t.to_f64();
    for (double& x : v) x *= factor;
    tensors.emplace_back(n, Tensor::from_doubles(t.dtype(), t.shape(), v));
    found = true;
  }
  EXPECT_TRUE(found) << golden << " has no tensor " << name;
  const std::string path = dir.file("perturbed_" + golden);
  write_safetensors(path, tensors, src.metadata());
  return path;
}

}  // namespace

TEST(TwinIsolate, PassesWhereverEndToEndPasses) {
  int passing = 0;
  for (const std::string& path : golden_files()) {
    SCOPED_TRACE(path);
    auto end_to_end = rows_of(path, kEndToEnd);
    if (!failing(end_to_end).empty()) continue;
    ++passing;
    const auto isolated = rows_of(path, kIsolated);
    EXPECT_EQ(failing(isolated), std::set<std::string>{});
    // The same forward tensors, in the same order: isolation changes inputs, not what is compared.
    // Gradients are compared end to end only (the golden has no intermediate gradients to restart
    // a module's backward from): an isolated run has none of the grad.* rows.
    for (const auto& c : isolated) EXPECT_NE(c.name.rfind("grad.", 0), 0u) << c.name;
    end_to_end.erase(std::remove_if(end_to_end.begin(), end_to_end.end(),
                                    [](const twin::Comparison& c) { return c.name.rfind("grad.", 0) == 0; }),
                     end_to_end.end());
    ASSERT_EQ(isolated.size(), end_to_end.size());
    for (std::size_t i = 0; i < isolated.size(); ++i) {
      EXPECT_EQ(isolated[i].name, end_to_end[i].name);
      // The output's bound counts only the last module's rounding points and the store its
      // given input carries, never more than the whole layer's.
      if (isolated[i].name == "output.hidden_states") {
        EXPECT_LT(isolated[i].tol.rtol, end_to_end[i].tol.rtol);
      }
    }
  }
  EXPECT_GE(passing, 1) << "no golden passes end to end: nothing was checked";
}

// linear_fc1's weight x 1.01: a 1% error, far outside an fp32 golden's bound (a few 2^-24 per
// rounding point). In isolation linear_fc2 starts from the golden's fc1 output and passes.
TEST(TwinIsolate, ADenseModuleFailsAloneInIsolation) {
  TempDir dir;
  const std::string path =
      perturbed_copy(dir, "dense_ln_mha_gelu_bias.safetensors", "param.mlp.linear_fc1.weight", 1.01);
  EXPECT_EQ(failing(rows_of(path, kIsolated)), std::set<std::string>{"tap.mlp.linear_fc1.0"});
  // End to end everything computed from it fails (its bias taps are parameters: exact, and pass),
  // and every gradient but fc2's bias gradient (the column sums of grad_output, which reads nothing
  // the weight touched): the others read fc1's output or flow back through fc1's weight.
  std::set<std::string> end_to_end = {"tap.mlp.linear_fc1.0", "tap.mlp.linear_fc2.0", "tap.mlp.0",
                                      "output.hidden_states"};
  for (const auto& n : twin::load_fixture(path).names_with_prefix("grad."))
    if (n != "grad.param.mlp.linear_fc2.bias") end_to_end.insert(n);
  EXPECT_EQ(failing(rows_of(path, kEndToEnd)), end_to_end);
}

// The router's weight x 1.01: its logits fail; in isolation the probabilities, the routing map,
// the aux loss and every expert start from the golden's logits and pass.
TEST(TwinIsolate, TheMoERouterFailsAloneInIsolation) {
  TempDir dir;
  const std::string path = perturbed_copy(dir, "moe_top2_aux_allgather.safetensors", "param.mlp.router.weight", 1.01);
  EXPECT_EQ(failing(rows_of(path, kIsolated)), std::set<std::string>{"tap.mlp.router.logits"});
  const std::set<std::string> end_to_end = failing(rows_of(path, kEndToEnd));
  for (const char* downstream :
       {"tap.mlp.router.logits", "tap.mlp.router.0", "tap.mlp.experts.0", "tap.mlp.0", "output.hidden_states"})
    EXPECT_TRUE(end_to_end.count(downstream)) << downstream;
}

// A block: layer 2's MLP perturbed. In isolation layer 3 starts from the golden's layer-2 output.
TEST(TwinIsolate, OneLayerOfABlockFailsAloneInIsolation) {
  TempDir dir;
  const std::string path =
      perturbed_copy(dir, "retro_block_6layers_nondivisible.safetensors", "param.layers.2.mlp.linear_fc1.weight", 1.01);
  EXPECT_EQ(failing(rows_of(path, kIsolated)), std::set<std::string>{"tap.layers.2.0"});
  const std::set<std::string> end_to_end = failing(rows_of(path, kEndToEnd));
  for (const char* downstream :
       {"tap.layers.2.0", "tap.layers.3.0", "tap.layers.4.0", "tap.layers.5.0", "output.hidden_states"})
    EXPECT_TRUE(end_to_end.count(downstream)) << downstream;
  EXPECT_FALSE(end_to_end.count("tap.layers.1.0"));  // upstream of the perturbation
}

TEST(TwinIsolate, TheReportSaysIsolated) {
  using twin::testing::quote;
  using twin::testing::run_twin;
  const std::string golden = quote(twin::golden_dir() + "/dense_ln_mha_gelu_bias.safetensors");
  const twin::testing::TwinRun text = run_twin("fixture --isolate " + golden);
  EXPECT_EQ(text.code, 0) << text.out << text.err;
  EXPECT_NE(text.out.find("[kind dense_layer, reference twin, isolated, Megatron-Core 93ddc247 (January 2026)]"),
            std::string::npos)
      << text.out;
  const twin::testing::TwinRun j = run_twin("fixture --isolate --json " + golden);
  EXPECT_EQ(j.code, 0);
  EXPECT_EQ(json::parse(j.out)["isolated"], true);
  EXPECT_EQ(json::parse(run_twin("fixture --json " + golden).out)["isolated"], false);
  // The optimized twin does not continue from substitutes: unsupported (3), not a false pass.
  const twin::testing::TwinRun opt = run_twin("fixture --isolate --twin optimized --json " + golden);
  EXPECT_EQ(opt.code, 3);
  EXPECT_EQ(json::parse(opt.out)["status"], "unsupported");
  EXPECT_NE(json::parse(opt.out)["message"].get<std::string>().find("isolated"), std::string::npos) << opt.out;
}
