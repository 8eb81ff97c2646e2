// optimized/layer/sharding.h: every rank's shard of every parameter a layer kind shards, put back
// together in rank order as Megatron's layout says (rows by query group, head or GLU half for the
// column-parallel linears, columns for the row-parallel weights, the rest whole on every rank),
// is the full parameter; and each shard has 1 / tp of it. Each value of a parameter is its own
// index, so a shard taken from the wrong rows, columns or half cannot reassemble.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "optimized/layer/sharding.h"
#include "optimized/transformer_layer_impl.h"  // gather_shards, ShardLayout

namespace twin::opt {
namespace {

Tensor indexed(Shape shape) {
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  std::iota(v.begin(), v.end(), 0.0);
  return Tensor::from_doubles(DType::F32, std::move(shape), v);
}

struct ShardedKey {
  std::string key;
  Shape shape;
  ShardLayout layout;  // how the ranks' shards make up the full tensor
};

struct Sizes {
  int h, np, ng, hn, ffn, tp;
  bool glu;
};

std::vector<ShardedKey> keys_of(const Sizes& z) {
  const std::int64_t qkv_rows = std::int64_t(z.np + 2 * z.ng) * z.hn, fc1_rows = (z.glu ? 2 : 1) * z.ffn;
  const ShardLayout rows{0, 1}, cols{1, 1}, whole{}, fc1{0, z.glu ? 2 : 1};
  return {{"input_layernorm.weight", {z.h}, whole},
          {"self_attention.linear_qkv.weight", {qkv_rows, z.h}, rows},
          {"self_attention.linear_qkv.bias", {qkv_rows}, rows},
          {"self_attention.linear_proj.weight", {z.h, std::int64_t(z.np) * z.hn}, cols},
          {"self_attention.linear_proj.bias", {z.h}, whole},
          {"cross_attention.attn.linear_q.weight", {std::int64_t(z.np) * z.hn, z.h}, rows},
          {"cross_attention.attn.linear_kv.weight", {2 * std::int64_t(z.np) * z.hn, z.h}, rows},
          {"cross_attention.attn.linear_proj.weight", {z.h, std::int64_t(z.np) * z.hn}, cols},
          {"mlp.linear_fc1.weight", {fc1_rows, z.h}, fc1},
          {"mlp.linear_fc1.bias", {fc1_rows}, fc1},
          {"mlp.linear_fc2.weight", {z.h, z.ffn}, cols},
          {"mlp.linear_fc2.bias", {z.h}, whole}};
}

TEST(TensorParallelShard, RanksShardsReassembleEveryParameterInMegatronsLayout) {
  for (const Sizes& z : {Sizes{8, 4, 2, 4, 12, 2, false}, Sizes{8, 4, 2, 4, 12, 2, true},
                         Sizes{16, 8, 4, 2, 8, 4, true}, Sizes{8, 4, 4, 2, 8, 4, false}}) {
    TransformerConfig c;
    c.hidden_size = z.h;
    c.num_attention_heads = z.np;
    c.num_query_groups = z.ng;
    c.kv_channels = z.hn;
    c.ffn_hidden_size = z.ffn;
    c.gated_linear_unit = z.glu;
    for (const ShardedKey& k : keys_of(z)) {
      SCOPED_TRACE(k.key + " tp " + std::to_string(z.tp) + (z.glu ? " glu" : ""));
      // The layout a backward gathers its gradients' shards by is the sharding rule's.
      const ShardLayout layout = tensor_parallel_layout(c, k.key);
      EXPECT_EQ(layout.dim, k.layout.dim);
      EXPECT_EQ(layout.blocks, k.layout.blocks);
      const Tensor full = indexed(k.shape);
      std::vector<Tensor> shards;
      for (int r = 0; r < z.tp; ++r) shards.push_back(tensor_parallel_shard(c, k.key, full, r, z.tp));
      for (const Tensor& s : shards) {
        Shape expect = k.shape;
        if (k.layout.dim >= 0) expect[std::size_t(k.layout.dim)] /= z.tp;
        EXPECT_EQ(s.shape(), expect);
      }
      if (k.layout.dim < 0) {
        for (const Tensor& s : shards) EXPECT_EQ(s.to_f64(), full.to_f64()) << "a replicated parameter differs";
        continue;
      }
      std::vector<const Tensor*> parts;
      for (const Tensor& s : shards) parts.push_back(&s);
      EXPECT_EQ(gather_shards(parts, k.layout).to_f64(), full.to_f64());
    }
  }
}

// The query-group rows of linear_qkv: rank r holds groups [r ng / tp, (r + 1) ng / tp), each
// group's hpg query heads, then its key, then its value, in the fused layout.
TEST(TensorParallelShard, LinearQkvRowsAreTheRanksQueryGroups) {
  TransformerConfig c;
  c.hidden_size = 4;
  c.num_attention_heads = 4;
  c.num_query_groups = 2;
  c.kv_channels = 1;
  const Tensor full = indexed({8, 1});  // groups of (2 + 2) rows: [q q k v][q q k v]
  EXPECT_EQ(tensor_parallel_shard(c, "self_attention.linear_qkv.weight", full, 1, 2).to_f64(),
            (std::vector<double>{4, 5, 6, 7}));
}

}  // namespace
}  // namespace twin::opt
