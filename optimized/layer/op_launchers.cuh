/* One backend's single-op launchers as the OpLaunchers table (layer/kernels.h): included by the
 * backend's entry file (op_launchers_sim.cpp, op_launchers_cuda.cu), so each launcher is compiled
 * once per backend and the host code that calls it once. */
#pragma once

#include "optimized/activations.cuh"
#include "optimized/dot_product_attention.cuh"
#include "optimized/fused_bias_dropout.cuh"
#include "optimized/layer/backend_entries.h"
#include "optimized/linear.cuh"
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
  return ops;
}

}  // namespace twin::opt::TWIN_BACKEND
