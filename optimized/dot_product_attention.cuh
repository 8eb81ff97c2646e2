/* Core attention (reference/dot_product_attention.h; Megatron's DotProductAttention, unfused path
 * with FusedScaleMaskSoftmax.forward_torch_softmax):
 *   scores = alpha * q k^T (stored in T), [* coeff in fp32], masked_fill(mask, -10000.0),
 *   probs = softmax(scores) in fp32 stored in T, dropout(probs), context = probs v (stored in T).
 * One file per technique, sharing the per-pair helpers (dot_product_attention_common.cuh):
 *   dot_product_attention_simt.cuh      the forward on CUDA cores (every dtype);
 *   dot_product_attention_wmma.cuh      the forward on tensor cores (bf16 / fp16);
 *   dot_product_attention_backward.cuh  the backward (dq; dk and dv), on CUDA cores, its launcher;
 *   dot_product_attention_backward_wmma.cuh  the backward's dq on tensor cores (bf16 / fp16).
 * Here: the forward's launcher (which kernel, its cost, its counted rounding points).
 */
#pragma once

#include "optimized/dot_product_attention_backward.cuh"
#include "optimized/dot_product_attention_common.cuh"
#include "optimized/dot_product_attention_simt.cuh"
#include "optimized/dot_product_attention_wmma.cuh"

namespace twin::opt::TWIN_BACKEND {

// q, k, v as laid out by `ops`, context: [sq, b, np_local * hn].
inline void dot_product_attention_forward(DType dt, const AttnOperands& ops, void* context, const AttnParams& p,
                                          cudaStream_t stream) {
  const std::string op = "dot_product_attention_forward";
  require(ops.q && ops.k && ops.v && context, op + ": null q / k / v / context");
  // counts: q k^T (stored in T), * coeff in fp32, the softmax's sum and its output (fp32, then T
  // when the softmax runs in fp32 for a 16-bit T), the dropout product, probs @ v (stored in T).
  rounding_reduce(p.hn);
  rounding_store(dt);
  if (p.coeff != 0.0f) rounding_store(DType::F32);
  rounding_reduce(p.sk);
  if (p.softmax_fp32 && dt != DType::F32) rounding_store(DType::F32);
  rounding_store(dt);
  if (p.drop.active) rounding_store(dt);
  rounding_reduce(p.sk);
  rounding_store(dt);
  attention_check_shapes(op, ops, p);
  const bool tensor_cores = attention_wmma_supports(dt, p.hn);
  {
    // cost: attention_forward_cost of the kernel chosen (its query tile height).
    const AttnCost c = attention_forward_cost(dt, p, tensor_cores ? kTcBQ : kAttnBQ);
    rt::declare_cost("dot_product_attention_forward", c.bytes, c.flops);
  }
  if (tensor_cores) {
    const dim3 grid(ceil_div(p.sq, kTcBQ), static_cast<unsigned>(p.np_local), static_cast<unsigned>(p.b));
    dispatch_wmma(dt, p.hn, [&](auto tag, auto nt) {
      using T = decltype(tag);
      constexpr int NT = decltype(nt)::value;
      launch_kernel((dot_product_attention_forward_wmma_kernel<T, NT>), grid, dim3(32 * kTcWarps),
                    attention_wmma_smem_bytes(dt, p.hn), stream, ops, static_cast<T*>(context), p);
    });
    return;
  }
  dispatch_dtype(dt, op.c_str(), [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(ceil_div(p.sq, kAttnBQ), static_cast<unsigned>(p.np_local), static_cast<unsigned>(p.b));
    launch_kernel(dot_product_attention_forward_kernel<T>, grid, dim3(32 * kAttnWarps), attention_smem_bytes(p.hn),
                  stream, ops, static_cast<T*>(context), p);
  });
}

// qkv: the fused linear_qkv output of this rank (after qk-layernorm and RoPE), context:
// [sq, b, np_local * hn]. Self attention (sq == sk).
inline void dot_product_attention_forward(DType dt, const void* qkv, const QkvLayout& lay, void* context,
                                          const AttnParams& p, cudaStream_t stream) {
  require(qkv != nullptr, "dot_product_attention_forward: null qkv");
  dot_product_attention_forward(dt, AttnOperands::from_qkv(qkv, lay, p.b, p.hn, dtype_size(dt)), context, p, stream);
}

}  // namespace twin::opt::TWIN_BACKEND
