/* One backend's single-op launchers as the OpLaunchers table (layer/kernels.h): included by the
 * backend's entry file (op_launchers_sim.cpp, op_launchers_cuda.cu), so each launcher is compiled
 * once per backend and the host code that calls it once. */
#pragma once

#include "optimized/activations.cuh"
#include "optimized/attention_backward.cuh"
#include "optimized/dot_product_attention.cuh"
#include "optimized/dot_product_attention_backward.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/layer/backend_entries.h"
#include "optimized/linear.cuh"
#include "optimized/mlp_backward.cuh"
#include "optimized/retro/retro_kernels.cuh"
#include "optimized/torch_norm.cuh"

namespace twin::opt::TWIN_BACKEND {

OpLaunchers op_launchers() {
  OpLaunchers ops;
  ops.norm_forward = norm_forward;
  ops.linear_forward = linear_forward;
  ops.dot_product_attention_forward =
      static_cast<void (*)(DType, const AttnOperands&, void*, const AttnParams&, cudaStream_t)>(
          dot_product_attention_forward);
  ops.bias_dropout_add_forward = bias_dropout_add_forward;
  ops.bias_activation_forward = bias_activation_forward;
  ops.retro_gather_rows = retro_gather_rows;
  ops.retro_decoder_bias_dropout_add = retro_decoder_bias_dropout_add;
  ops.retro_encoder_bias_dropout_add = retro_encoder_bias_dropout_add;
  ops.norm_backward = norm_backward;
  ops.norm_backward_workspace_bytes = norm_backward_workspace_bytes;
  ops.linear_backward_dgrad = linear_backward_dgrad;
  ops.linear_backward_wgrad = linear_backward_wgrad;
  ops.linear_backward_bias = linear_backward_bias;
  ops.linear_backward_bias_workspace_bytes = linear_backward_bias_workspace_bytes;
  ops.dot_product_attention_backward =
      static_cast<void (*)(DType, const AttnOperands&, const void*, const AttnGradOperands&, const float*,
                           const AttnParams&, void*, std::size_t, cudaStream_t)>(dot_product_attention_backward);
  ops.dot_product_attention_backward_workspace_bytes = dot_product_attention_backward_workspace_bytes;
  ops.bias_dropout_add_backward = bias_dropout_add_backward;
  ops.grad_sum = grad_sum;
  ops.retro_scatter_rows = retro_scatter_rows;
  ops.attention_half_backward = attention_half_backward;
  ops.attention_half_backward_workspace_bytes = attention_half_backward_workspace_bytes;
  ops.mlp_half_backward = mlp_half_backward;
  ops.mlp_half_backward_workspace_bytes = mlp_half_backward_workspace_bytes;
  return ops;
}

}  // namespace twin::opt::TWIN_BACKEND
