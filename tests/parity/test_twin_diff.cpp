// `twin diff A B`: two captures of one layer compared tensor by tensor in computation order. The
// second capture is made the way a second implementation makes one: the reference twin runs on a
// copy of the golden (perturbed or not) and its record is written as a capture.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "parity/fixture_kinds.h"
#include "tests/parity/twin_cli_util.h"

using namespace twin;
using twin::testing::quote;
using twin::testing::run_twin;
using twin::testing::TempDir;
using json = nlohmann::json;
using CliRun = twin::testing::TwinRun;

namespace {

const std::string kDense = "dense_ln_mha_gelu_bias.safetensors";

std::string golden(const std::string& name) { return twin::golden_dir() + "/" + name; }

using Tensors = std::vector<std::pair<std::string, Tensor>>;

Tensors tensors_of(const SafetensorsFile& f) {
  Tensors t;
  for (const auto& n : f.names()) t.emplace_back(n, f.at(n));
  return t;
}

Tensor scaled(const Tensor& t, double factor) {
  std::vector<double> v = t.to_f64();
  for (double& x : v) x *= factor;
  return Tensor::from_doubles(t.dtype(), t.shape(), v);
}

// A capture of the golden's layer made by the reference twin: the golden with `param` scaled by
// `factor` (1: unchanged), and every tensor the twin computes replaced by the twin's value.
std::string twin_capture(const TempDir& dir, const std::string& name, const std::string& param, double factor) {
  const SafetensorsFile src = read_safetensors(golden(name));
  Tensors tensors = tensors_of(src);
  for (auto& [n, t] : tensors)
    if (n == param) t = scaled(t, factor);
  std::string flat = name;  // "random/moe_p000.safetensors": one file name in dir
  std::replace(flat.begin(), flat.end(), '/', '_');
  const std::string inputs = dir.file("inputs_" + flat);
  write_safetensors(inputs, tensors, src.metadata());
  const Fixture f = load_fixture(inputs);
  const TwinRun run = find_fixture_handler(f.kind, TwinKind::Reference)(f, RunMode{});
  int replaced = 0;
  for (auto& [n, t] : tensors)
    for (const RecordEntry& e : run.record.entries)
      if (e.key() == n) {
        t = e.value.to(t.dtype());
        ++replaced;
        break;
      }
  EXPECT_GT(replaced, 10) << "the twin computed few of the golden's tensors";
  const std::string path = dir.file("twin_" + flat);
  write_safetensors(path, tensors, src.metadata());
  return path;
}

// The capture at `source` with its metadata changed (or added) and tensors edited by `edit`.
template <typename Edit>
std::string edited_file(const TempDir& dir, const std::string& source, const std::string& out,
                        const std::map<std::string, std::string>& meta, Edit edit) {
  const SafetensorsFile src = read_safetensors(source);
  Tensors tensors = tensors_of(src);
  edit(tensors);
  std::map<std::string, std::string> metadata = src.metadata();
  for (const auto& [k, v] : meta) metadata[k] = v;
  const std::string path = dir.file(out);
  write_safetensors(path, tensors, metadata);
  return path;
}

// The golden `name`, edited so.
template <typename Edit>
std::string edited_copy(const TempDir& dir, const std::string& name, const std::string& out,
                        const std::map<std::string, std::string>& meta, Edit edit) {
  return edited_file(dir, golden(name), out, meta, edit);
}

std::vector<std::string> row_names(const json& v) {
  std::vector<std::string> r;
  for (const auto& t : v["tensors"]) r.push_back(t["name"]);
  return r;
}

}  // namespace

TEST(TwinDiff, ACaptureAgainstItselfIsTheSame) {
  const CliRun text = run_twin("diff " + quote(golden(kDense)) + " " + quote(golden(kDense)));
  EXPECT_EQ(text.code, 0) << text.out << text.err;
  EXPECT_NE(text.out.find("SAME: 28 computed tensors within bound"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("inputs and parameters: all 14 equal"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("gradients: compared"), std::string::npos) << text.out;
  const CliRun j = run_twin("diff --json " + quote(golden(kDense)) + " " + quote(golden(kDense)));
  EXPECT_EQ(j.code, 0);
  const json v = json::parse(j.out);
  EXPECT_EQ(v["status"], "pass");
  EXPECT_EQ(v["kind"], "dense_layer");
  EXPECT_TRUE(v["first_divergence"].is_null());
  EXPECT_EQ(v["grads"], "compared");
  // 13 inputs and parameters and the upstream gradient; 15 forward tensors and 13 gradients.
  EXPECT_EQ(v["tensors"].size(), 42u);
}

// Megatron's capture against the reference twin's of the same layer: two implementations, each
// rounding at Megatron's points, agree within the counted bounds.
TEST(TwinDiff, TwoImplementationsOfOneLayerAgree) {
  TempDir dir;
  const std::string b = twin_capture(dir, kDense, "", 1.0);
  const CliRun r = run_twin("diff --json " + quote(golden(kDense)) + " " + quote(b));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(json::parse(r.out)["message"], "28 computed tensors within bound");
}

// The acceptance case: B's linear_fc1 weight x 1.01 and everything after it recomputed. The
// parameter is reported, not the divergence; the first computed tensor out of bound is fc1's output.
TEST(TwinDiff, NamesTheFirstComputedTensorThatDiverges) {
  TempDir dir;
  const std::string b = twin_capture(dir, kDense, "param.mlp.linear_fc1.weight", 1.01);
  for (const auto& [x, y] : {std::pair{golden(kDense), b}, std::pair{b, golden(kDense)}}) {
    const CliRun j = run_twin("diff --json " + quote(x) + " " + quote(y));
    EXPECT_EQ(j.code, 1) << j.out << j.err;
    const json v = json::parse(j.out);
    EXPECT_EQ(v["status"], "fail");
    EXPECT_EQ(v["first_divergence"], "tap.mlp.linear_fc1.0");
    EXPECT_EQ(v["differing_given"], json::array({"param.mlp.linear_fc1.weight"}));
    // Every computed tensor before it is within bound.
    bool before = false;
    for (const auto& t : v["tensors"]) {
      const std::string n = t["name"];
      if (n == "tap.input_layernorm") before = true;
      if (n == "tap.mlp.linear_fc1.0") break;
      if (before) {
        EXPECT_TRUE(t["pass"].get<bool>()) << n;
      }
    }
    EXPECT_TRUE(before);
  }
  const CliRun text = run_twin("diff " + quote(golden(kDense)) + " " + quote(b));
  EXPECT_EQ(text.code, 1);
  EXPECT_EQ(twin::testing::lines(text.out).size(), 42u + 1 + 1 + 4) << text.out;  // title, header, rows, 4 notes
  EXPECT_NE(text.out.find(">>tap.mlp.linear_fc1.0"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("first divergence: tap.mlp.linear_fc1.0 at ["), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("inputs and parameters that differ: param.mlp.linear_fc1.weight"), std::string::npos);
  // fc1's output and the 3 forward tensors after it, and 12 of the 13 gradients: linear_fc2's bias
  // gradient is the upstream gradient summed over tokens, which fc1 does not touch.
  EXPECT_NE(text.out.find("DIVERGE: 16 of 28 computed tensors out of bound"), std::string::npos) << text.out;
}

// Gradients are rows of their own, after the forward, each within the bound of the rounding points
// of the forward and the backward before it: one gradient changed alone is the first divergence,
// and every forward row still passes.
TEST(TwinDiff, GradientsAreComparedWithTheBackwardsCountedBounds) {
  TempDir dir;
  const std::string b = twin_capture(dir, kDense, "", 1.0);
  const std::string grad = "grad.param.mlp.linear_fc2.weight";
  const std::string changed = edited_file(dir, b, "changed.safetensors", {}, [&](Tensors& t) {
    for (auto& [n, x] : t)
      if (n == grad) x = scaled(x, 1.01);
  });
  const CliRun r = run_twin("diff --json " + quote(golden(kDense)) + " " + quote(changed));
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  const json v = json::parse(r.out);
  EXPECT_EQ(v["first_divergence"], grad);
  EXPECT_EQ(v["grads"], "compared");
  for (const auto& t : v["tensors"]) {
    const std::string n = t["name"];
    if (n.rfind("grad.", 0) != 0) {
      EXPECT_TRUE(t["pass"].get<bool>()) << n;
    }
  }
  // A different upstream gradient is a given tensor that differs: reported, never the divergence.
  const std::string upstream = edited_file(dir, b, "upstream.safetensors", {}, [&](Tensors& t) {
    for (auto& [n, x] : t)
      if (n == "grad_in.output") x = scaled(x, 2.0);
  });
  const CliRun u = run_twin("diff --json " + quote(golden(kDense)) + " " + quote(upstream));
  EXPECT_EQ(json::parse(u.out)["differing_given"], json::array({"grad_in.output"})) << u.out;
}

namespace {

// The capture at `source` with the last element of `name` moved one ulp up (its bit pattern + 1).
std::string one_ulp_off(const TempDir& dir, const std::string& source, const std::string& name) {
  return edited_file(dir, source, "ulp.safetensors", {}, [&](Tensors& t) {
    for (auto& [n, x] : t) {
      if (n != name) continue;
      Tensor y = x.to(x.dtype());
      std::byte* last = y.raw_mut() + (y.numel() - 1) * static_cast<std::int64_t>(dtype_size(y.dtype()));
      if (dtype_size(y.dtype()) == 4) {
        std::uint32_t bits;
        std::memcpy(&bits, last, 4);
        ++bits;
        std::memcpy(last, &bits, 4);
      } else {
        std::uint16_t bits;
        std::memcpy(&bits, last, 2);
        ++bits;
        std::memcpy(last, &bits, 2);
      }
      x = y;
    }
  });
}

std::string last_index(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i] - 1);
  return s + "]";
}

}  // namespace

// `--exact`: two runs that should be deterministic. Every tensor bit for bit; one ulp anywhere,
// given or computed, is a difference named with its tensor and element; the bounded diff lets the
// same ulp pass.
TEST(TwinDiff, ExactComparesEveryTensorBitForBit) {
  TempDir dir;
  const std::string a = golden(kDense);
  const CliRun same = run_twin("diff --exact --json " + quote(a) + " " + quote(a));
  EXPECT_EQ(same.code, 0) << same.out << same.err;
  EXPECT_EQ(json::parse(same.out)["message"], "42 tensors equal bit for bit");
  // Two runs of one implementation on one machine: the reference twin twice.
  const std::string run1 = twin_capture(dir, kDense, "", 1.0);
  const std::string run2 =
      edited_file(dir, twin_capture(dir, kDense, "", 1.0), "run2.safetensors", {}, [](Tensors&) {});
  EXPECT_EQ(run_twin("diff --exact " + quote(run1) + " " + quote(run2)).code, 0);

  const Shape fc1_shape = read_safetensors(a).at("tap.mlp.linear_fc1.0").shape();
  for (const std::string name :
       {"tap.mlp.linear_fc1.0", "grad.param.self_attention.linear_qkv.weight", "param.pre_mlp_layernorm.weight"}) {
    SCOPED_TRACE(name);
    const std::string off = one_ulp_off(dir, a, name);
    const CliRun j = run_twin("diff --exact --json " + quote(a) + " " + quote(off));
    EXPECT_EQ(j.code, 1) << j.out << j.err;
    const json v = json::parse(j.out);
    EXPECT_EQ(v["first_divergence"], name);
    EXPECT_NE(v["message"].get<std::string>().find("1 of 42 tensors differ; first difference: " + name + " at ["),
              std::string::npos)
        << v["message"];
  }
  const std::string off = one_ulp_off(dir, a, "tap.mlp.linear_fc1.0");
  const CliRun text = run_twin("diff --exact " + quote(a) + " " + quote(off));
  EXPECT_NE(text.out.find("first difference: tap.mlp.linear_fc1.0 at " + last_index(fc1_shape)), std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("bit for bit: the first differing element is 0x"), std::string::npos) << text.out;
  EXPECT_EQ(run_twin("diff " + quote(a) + " " + quote(off)).code, 0) << "one ulp is within the counted bound";
}

TEST(TwinDiff, TapOrderMetadataOrdersTheRowsAndUnknownTensorsComeLast) {
  TempDir dir;
  const std::string order = R"(["output.hidden_states", "tap.mlp.linear_fc1.0"])";
  const Tensor extra = Tensor::from_vector<float>({2}, {1.0f, 2.0f});
  const std::string a = edited_copy(dir, kDense, "a.safetensors", {{"tap_order", order}},
                                    [&](Tensors& t) { t.emplace_back("tap.not_a_module_of_the_twin", extra); });
  const CliRun r = run_twin("diff --json " + quote(a) + " " + quote(a));
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  const std::vector<std::string> names = row_names(json::parse(r.out));
  ASSERT_EQ(names.size(), 43u);
  EXPECT_EQ(names[0], "grad_in.output");         // the given tensors in file order
  EXPECT_EQ(names[14], "output.hidden_states");  // after the 14 given tensors, tap_order's
  EXPECT_EQ(names[15], "tap.mlp.linear_fc1.0");
  EXPECT_EQ(names[16], "tap.input_layernorm");  // then the other forward tensors in file order
  const auto unknown = std::find(names.begin(), names.end(), "tap.not_a_module_of_the_twin");
  EXPECT_LT(unknown - names.begin(), 30);
  for (std::size_t i = 30; i < names.size(); ++i)  // then the 13 gradients
    EXPECT_EQ(names[i].rfind("grad.", 0), 0u) << names[i];

  // A tensor the twin does not compute is bounded by the whole layer's count: an error of 1e-3
  // relative is far outside an fp32 layer's (a few hundred 2^-24).
  const std::string b = edited_copy(dir, kDense, "b.safetensors", {}, [&](Tensors& t) {
    t.emplace_back("tap.not_a_module_of_the_twin", scaled(extra, 1.001));
  });
  const CliRun off = run_twin("diff --json " + quote(a) + " " + quote(b));
  EXPECT_EQ(off.code, 1) << off.out << off.err;
  EXPECT_EQ(json::parse(off.out)["first_divergence"], "tap.not_a_module_of_the_twin");
}

TEST(TwinDiff, BadInputExits2WithAClearMessage) {
  TempDir dir;
  const std::string dense = quote(golden(kDense));
  auto expect_bad = [&](const std::string& a, const std::string& b, const std::string& says) {
    const CliRun r = run_twin("diff " + a + " " + b);
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_EQ(twin::testing::lines(r.err).size(), 1u) << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    const CliRun j = run_twin("diff --json " + a + " " + b);
    EXPECT_EQ(j.code, 2);
    EXPECT_EQ(json::parse(j.out)["status"], "error");
  };
  expect_bad(dense, quote(golden("moe_top2_aux_allgather.safetensors")), "not captures of the same layer");
  expect_bad(dense, quote(golden("layer_offset_table.json")), "JSON table");
  expect_bad(dense, quote(dir.file("missing.safetensors")), "missing.safetensors");
  const std::string fewer = edited_copy(dir, kDense, "fewer.safetensors", {}, [](Tensors& t) {
    t.erase(std::remove_if(t.begin(), t.end(), [](const auto& p) { return p.first == "tap.mlp.0"; }), t.end());
  });
  expect_bad(dense, quote(fewer), "only in " + golden(kDense) + ": tap.mlp.0");
  const std::string bf16 = edited_copy(dir, kDense, "bf16.safetensors", {}, [](Tensors& t) {
    for (auto& [n, x] : t)
      if (n == "tap.mlp.0") x = x.to(DType::BF16);
  });
  expect_bad(dense, quote(bf16), "tap.mlp.0:");
  const std::string reshaped = edited_copy(dir, kDense, "reshaped.safetensors", {}, [](Tensors& t) {
    for (auto& [n, x] : t)
      if (n == "tap.mlp.0") x = x.reshape({x.numel()});
  });
  expect_bad(dense, quote(reshaped), "tap.mlp.0:");
  const std::string bad_order =
      edited_copy(dir, kDense, "bad_order.safetensors", {{"tap_order", R"(["tap.no_such_tensor"])"}}, [](Tensors&) {});
  expect_bad(quote(bad_order), dense, "tap_order names tap.no_such_tensor");
  const std::string not_list =
      edited_copy(dir, kDense, "not_list.safetensors", {{"tap_order", R"({"a": 1})"}}, [](Tensors&) {});
  expect_bad(quote(not_list), dense, "tap_order must be a JSON list");
}

// MoE and Retro captures: every kind of computed row is diffed (aux losses, the router's state, the
// integer token counts, the bool routing map, Retro's context output), and a change to any one of
// them alone is named as the first divergence.
TEST(TwinDiff, MoEAndRetroCapturesDiffAuxStateIntegerAndBoolRows) {
  TempDir dir;
  // golden -> the rows it must show, each then changed alone in B (x 1.01, + 1, or a flipped bool).
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"moe_top2_aux_allgather.safetensors",
       {"aux.load_balancing_loss", "tap_in.mlp.experts.tokens_per_expert", "tap.mlp.router.1"}},
      {"random/moe_p000.safetensors", {"state.mlp.router.local_tokens_per_expert_after"}},
      {"retro_later_layer_divisible.safetensors", {"output.context"}},
  };
  for (const auto& [name, rows] : cases) {
    SCOPED_TRACE(name);
    const std::string b = twin_capture(dir, name, "", 1.0);
    const CliRun same = run_twin("diff --json " + quote(golden(name)) + " " + quote(b));
    ASSERT_EQ(same.code, 0) << same.out << same.err;
    const std::vector<std::string> names = row_names(json::parse(same.out));
    for (const std::string& row : rows) {
      SCOPED_TRACE(row);
      EXPECT_EQ(std::count(names.begin(), names.end(), row), 1) << "no row " << row;
      const std::string changed = edited_file(dir, b, "changed.safetensors", {}, [&](Tensors& t) {
        for (auto& [n, x] : t) {
          if (n != row) continue;
          std::vector<double> v = x.to_f64();
          v[0] = x.dtype() == DType::BOOL ? 1.0 - v[0] : x.dtype() == DType::I64 ? v[0] + 1.0 : v[0] * 1.01 + 1e-3;
          x = Tensor::from_doubles(x.dtype(), x.shape(), v);
        }
      });
      const CliRun r = run_twin("diff --json " + quote(golden(name)) + " " + quote(changed));
      EXPECT_EQ(r.code, 1) << r.out << r.err;
      EXPECT_EQ(json::parse(r.out)["first_divergence"], row) << r.err;
    }
  }
}

// Two captures of one MoE layer that chose differently on a near tie (Megatron's golden and the
// reference twin's own run of it): the diff names the routing difference as near ties, and the
// routing map is where the captures part.
TEST(TwinDiff, RoutingThatDiffersOnANearTieIsNamedSo) {
  TempDir dir;
  const std::string name = "moe_bf16_top3_near_tie_flip.safetensors";
  const std::string b = twin_capture(dir, name, "", 1.0);
  const CliRun r = run_twin("diff --json " + quote(golden(name)) + " " + quote(b));
  const json v = json::parse(r.out);
  EXPECT_EQ(v["routing"], "differs on 1 near-tie token (12)") << r.out;
  EXPECT_EQ(v["first_divergence"].get<std::string>().rfind("tap.mlp.router.", 0), 0u) << r.out;
  const CliRun same = run_twin("diff --json " + quote(b) + " " + quote(b));
  EXPECT_TRUE(json::parse(same.out)["routing"].is_null());
  const CliRun text = run_twin("diff " + quote(golden(name)) + " " + quote(b));
  EXPECT_NE(text.out.find("  routing: differs on 1 near-tie token (12)\n"), std::string::npos) << text.out;
}
