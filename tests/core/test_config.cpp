// Strict TransformerConfig parsing: unknown fields and wrong types are errors naming the field.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/config.h"

using namespace twin;
using json = nlohmann::json;

namespace {

std::string config_error(const std::string& text) {
  try {
    parse_transformer_config(text);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError for " << text;
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST(Config, ParsesFieldsAndAppliesMegatronDefaults) {
  const TransformerConfig c = parse_transformer_config(std::string(
      R"({"hidden_size": 64, "num_attention_heads": 4, "num_query_groups": null, "layernorm_epsilon": 1e-6,
          "normalization": "RMSNorm", "bf16": true, "window_size": [8, 0], "num_moe_experts": 4,
          "moe_router_topk_scaling_factor": 2, "retro_verify_neighbor_count": true})"));
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.query_groups(), 4);  // None -> num_attention_heads
  EXPECT_EQ(c.head_dim(), 16);     // hidden / heads
  EXPECT_EQ(c.ffn(), 256);         // 4 * hidden
  EXPECT_DOUBLE_EQ(c.layernorm_epsilon, 1e-6);
  EXPECT_EQ(c.normalization, "RMSNorm");
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.window_size, (std::vector<int>{8, 0}));
  EXPECT_EQ(c.num_moe_experts, 4);
  EXPECT_EQ(c.moe_router_topk_scaling_factor, 2.0);  // an integer is a valid float
  EXPECT_EQ(c.retro_verify_neighbor_count, true);
}

TEST(Config, UnknownFieldIsNamed) {
  const std::string m = config_error(R"({"hidden_size": 64, "hiden_size": 64})");
  EXPECT_TRUE(has(m, "'hiden_size'") && has(m, "unknown")) << m;
}

TEST(Config, WrongTypesAreNamedWithTheValue) {
  struct Case {
    const char* text;
    const char* field;
    const char* want;
  };
  for (const Case& c :
       {Case{R"({"hidden_size": "64"})", "'hidden_size'", "integer"},
        Case{R"({"hidden_size": 64.5})", "'hidden_size'", "integer"}, Case{R"({"bf16": 1})", "'bf16'", "true or false"},
        Case{R"({"layernorm_epsilon": "1e-5"})", "'layernorm_epsilon'", "number"},
        Case{R"({"normalization": null})", "'normalization'", "string"},
        Case{R"({"window_size": [8, "x"]})", "'window_size'", "list of integers"},
        Case{R"({"num_query_groups": true})", "'num_query_groups'", "integer"},
        Case{R"({"moe_router_dtype": 32})", "'moe_router_dtype'", "string"}}) {
    const std::string m = config_error(c.text);
    EXPECT_TRUE(has(m, c.field) && has(m, c.want)) << c.text << " -> " << m;
  }
}

TEST(Config, NotJsonOrNotAnObject) {
  EXPECT_TRUE(has(config_error("{hidden_size: 64}"), "not valid JSON"));
  EXPECT_TRUE(has(config_error("[1, 2]"), "JSON object"));
}

// Found by fuzz/fuzz_config.cpp: a number beyond double's range made nlohmann throw
// out_of_range, which escaped as a non-ConfigError.
TEST(Config, NumberBeyondDoubleRangeIsAConfigError) {
  EXPECT_TRUE(has(config_error(R"({"hidden_dropout": 1e400})"), "not valid JSON"));
  EXPECT_TRUE(has(config_error(R"({"hidden_dropout": -1e3333333333333})"), "not valid JSON"));
}

// Found by fuzz/fuzz_config.cpp: integers beyond int were narrowed (4294967312 read as 16).
TEST(Config, IntegerBeyondIntRangeIsRefusedNotWrapped) {
  for (const char* text : {R"({"hidden_size": 4294967312})", R"({"hidden_size": 2147483648})",
                           R"({"num_layers": -2147483649})", R"({"hidden_size": 18446744073709551615})",
                           R"({"num_query_groups": 4294967298})", R"({"window_size": [8, 4294967296]})"}) {
    const std::string m = config_error(text);
    EXPECT_TRUE(has(m, "integer")) << text << " -> " << m;
  }
  EXPECT_EQ(parse_transformer_config(std::string(R"({"hidden_size": 2147483647})")).hidden_size, 2147483647);
  EXPECT_EQ(parse_transformer_config(std::string(R"({"num_layers": -2147483648})")).num_layers, -2147483648);
}

TEST(Config, ToJsonRoundTripsEveryField) {
  TransformerConfig c;
  c.hidden_size = 96;
  c.num_query_groups = 2;
  c.moe_router_dtype = "fp64";
  c.window_size = std::vector<int>{4, 4};
  const json j = to_json(c);
  EXPECT_EQ(j.size(), transformer_config_fields().size());
  for (const auto& f : transformer_config_fields()) EXPECT_TRUE(j.contains(f)) << f;
  const TransformerConfig back = parse_transformer_config(j);
  EXPECT_EQ(to_json(back), j);
}
