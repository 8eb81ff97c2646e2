#include "reference/retro/encoder_attention.h"

#include <string>

#include "reference/retro/chunking.h"

namespace twin::reference::retro {

AttentionOutput RetroEncoderCrossAttention::forward(const Mat& hidden_states, const AttentionArgs& args,
                                                    const Taps& taps) {
  auto tuples = std::make_shared<RetroEncoderAttentionTuples>();
  tuples->tuples = forward_tuples(hidden_states, args, taps);
  tuples->batch = args.key_value_states->size(1);
  AttentionOutput out;
  out.extra = tuples;
  return out;
}

namespace {

// What the module's backward reads from its forward.
struct RetroEncoderSaved {
  std::int64_t r = 0, N = 0, k = 0, sk = 0;  // N = bs*l, sk = m
  std::vector<CrossAttentionSaved> attn;     // per neighbour
};

}  // namespace

AttentionOutput RetroEncoderCrossAttention::forward_saving(const Mat& hidden_states, const AttentionArgs& args,
                                                           const Taps& taps, std::shared_ptr<void>* saved) {
  if (!saved) return forward(hidden_states, args, taps);
  auto st = std::make_shared<RetroEncoderSaved>();
  auto tuples = std::make_shared<RetroEncoderAttentionTuples>();
  tuples->tuples = forward_tuples(hidden_states, args, taps, &st->attn);
  tuples->batch = args.key_value_states->size(1);
  st->r = retro_retrieved_length;
  st->k = retro_num_neighbors;
  st->N = tuples->batch;
  st->sk = args.key_value_states->size(0);
  *saved = st;
  AttentionOutput out;
  out.extra = tuples;
  return out;
}

CrossAttentionWithBdaGrads RetroEncoderCrossAttention::backward_with_bda(const Mat& d, const Mat* d_context,
                                                                         void* saved, const AttentionArgs& args,
                                                                         const CrossAttentionBdaArgs& bda) const {
  const auto* st = static_cast<const RetroEncoderSaved*>(saved);
  if (!st || st->attn.size() != static_cast<std::size_t>(st->k) || st->k <= 0)
    throw std::logic_error("RetroEncoderCrossAttention backward: `saved` was not filled by forward_saving");
  if (d_context) throw std::logic_error("RetroEncoderCrossAttention backward: the module returns no context");
  const std::int64_t r = st->r, N = st->N, k = st->k, sk = st->sk, h = config_.hidden_size;
  const Eigen::Index rows = static_cast<Eigen::Index>(r * N);  // one neighbour's [r, bs*l] rows
  if (d.rows() != k * rows || d.cols() != h)
    throw ShapeError("RetroEncoderCrossAttention backward: d has " + std::to_string(d.rows()) + " x " +
                     std::to_string(d.cols()) + " rows, expected [r, k*bs*l, d] = [" + std::to_string(r) + ", " +
                     std::to_string(k * N) + ", " + std::to_string(h) + "]");
  // RetroEncoderBiasDropoutAdd: the stack's transpose, the k outputs one after another.
  const Mat douts = scatter_rows(d, stack_neighbors_map(r, N, k), k * rows);
  CrossAttentionWithBdaGrads g;
  g.hidden_states = Mat::Zero(k * rows, h);
  Mat dkv;  // [m * bs*l, d]
  ParamGrads params;
  for (std::int64_t n = 0; n < k; ++n) {
    const Mat dout = douts.middleRows(n * rows, rows);  // [r, bs*l, d]; also d residual_n
    const Mat dx = dropout_backward(dout, bda.hidden_dropout, bda.training, neighbour_rng(bda.rng, n), p_);
    CrossAttentionGrads ag =
        attn.backward(dx, st->attn[static_cast<std::size_t>(n)], static_cast<int>(r), static_cast<int>(sk),
                      static_cast<int>(N), /*attention_mask=*/nullptr, args.training, neighbour_rng(args.rng, n));
    // chunked_output_n fed the attention's query and the residual: autograd sums the two (stored).
    const Mat dchunked = p_.act(ag.hidden_states + dout);  // rounds: accumulated gradient, activation dtype
    p_.count_act();
    g.hidden_states += scatter_rows(dchunked, split_neighbors_map(r, N, k, n), k * rows);  // disjoint rows
    if (n == 0) {
      dkv = std::move(ag.key_value_states);
      params = std::move(ag.params);
      continue;
    }
    dkv = p_.act(dkv + ag.key_value_states);  // rounds: accumulated gradient, activation dtype
    for (std::size_t i = 0; i < params.size(); ++i) {
      // rounds: accumulated .grad, param dtype
      params[i] =
          ParamGrad(params[i].name, p_.act(params[i].mat() + ag.params[i].mat()), params[i].shape, params[i].magnitude);
      // max over elements of the summed |terms| <= the sum of the neighbours' maxima
      params[i].magnitude += ag.params[i].magnitude;
    }
    p_.count_act();
  }
  g.key_value_states = std::move(dkv);
  for (ParamGrad& pg : params) g.params.push_back({"attn." + pg.name, std::move(pg.value), pg.shape, pg.magnitude});
  return g;  // no residual gradient: the bda does not read the layer's residual
}

std::vector<RetroEncoderAttentionTuple> RetroEncoderCrossAttention::forward_tuples(
    const Mat& hidden_states, const AttentionArgs& args, const Taps& taps, std::vector<CrossAttentionSaved>* saved) {
  if (!args.key_value_states)
    throw std::invalid_argument(
        "RetroEncoderCrossAttention: key_value_states (the chunked decoder hidden states) "
        "cannot be None");
  const Tensor& kv = *args.key_value_states;  // [ m, bs*l, d ]
  const std::int64_t r = retro_retrieved_length, k = retro_num_neighbors, d = config_.hidden_size;
  if (kv.dim() != 3 || kv.size(2) != d)
    throw ShapeError("RetroEncoderCrossAttention: key_value_states expected shape [m, bs*l, " + std::to_string(d) +
                     "], got " + shape_str(kv.shape()));
  const std::int64_t sk = kv.size(0), N = kv.size(1);  // N = bs*l
  // Input shape. [ r, bs*l*k, d ]
  if (args.s != r || args.b != k * N || hidden_states.rows() != static_cast<Eigen::Index>(args.s) * args.b ||
      hidden_states.cols() != d)
    throw ShapeError("RetroEncoderCrossAttention: neighbour hidden states [" + std::to_string(args.s) + ", " +
                     std::to_string(args.b) + ", " + std::to_string(hidden_states.cols()) +
                     "] do not fit [r, k * bs*l, d] = [" + std::to_string(r) + ", " + std::to_string(k * N) + ", " +
                     std::to_string(d) + "] (r = retro_retrieved_length, k = retro_num_neighbors, bs*l = " +
                     std::to_string(N) + " from key_value_states " + shape_str(kv.shape()) + ")");
  const Mat key_value_states = to_mat(kv, sk * N, d, "key_value_states");

  // Per-chunk attention. Each neighbour's attention is a branch from the input, and its residual
  // is the input itself: none inherits another's roundings (they join after the loop).
  const RoundingCount at_input = rounding_now();
  RoundingCount neighbours_end = at_input;
  std::vector<RetroEncoderAttentionTuple> attention_output_tuples;
  for (std::int64_t n = 0; n < k; ++n) {
    rounding_set(at_input);
    // Attend to current neighboring chunks.
    // - chunked_output:   [ r, bs*l, d ]  (hidden_states.reshape(r, -1, k, d)[:, :, n])
    // - key_value_states: [ m, bs*l, d ]
    // - attention_output: [ r, bs*l, d ]
    // - attention_bias:   [ d ]
    const Mat chunked_output = gather_rows(hidden_states, split_neighbors_map(r, N, k, n));
    if (saved) saved->emplace_back();
    AttentionOutput attention =
        attn.forward_mats(chunked_output, static_cast<int>(r), static_cast<int>(N), key_value_states,
                          static_cast<int>(sk), /*attention_mask=*/nullptr, args.training, neighbour_rng(args.rng, n),
                          taps.child("attn"), saved ? &saved->back() : nullptr);

    // Residual connection. [ r, bs*l, d ]
    const std::string i = std::to_string(n);
    RetroEncoderAttentionTuple t;
    t.attention_output = taps.record(i + ".0", attention.output, {r, N, d}, p_);
    t.attention_bias = std::move(attention.bias);
    if (t.attention_bias && taps.enabled()) taps.record_param(i + ".1", p_.to_tensor(*t.attention_bias, {d}));
    neighbours_end.join(rounding_now());
    rounding_set(at_input);
    t.residual = taps.record(i + ".2", chunked_output, {r, N, d}, p_);
    neighbours_end.join(rounding_now());
    attention_output_tuples.push_back(std::move(t));
  }
  rounding_set(neighbours_end);
  return attention_output_tuples;
}

Mat retro_encoder_bias_dropout_add(const std::vector<RetroEncoderAttentionTuple>& x_with_bias, std::int64_t batch,
                                   double prob, bool training, const DropoutRng& rng, const Precision& prec) {
  if (x_with_bias.empty()) throw ShapeError("RetroEncoderBiasDropoutAdd: no neighbour outputs");
  const std::int64_t k = static_cast<std::int64_t>(x_with_bias.size());
  const std::int64_t rows = x_with_bias[0].attention_output.rows(), d = x_with_bias[0].attention_output.cols();
  if (batch <= 0 || rows % batch != 0)
    throw ShapeError("RetroEncoderBiasDropoutAdd: " + std::to_string(rows) +
                     " rows are not [r, bs*l = " + std::to_string(batch) + "]");
  const std::int64_t r = rows / batch;

  // Per-neighbor bias-dropout-add.
  // - attention_output: [ r, bs*l, d ], attention_bias: [ d ], residual: [ r, bs*l, d ]
  Mat outputs(k * rows, d);  // the k outputs one after another
  for (std::int64_t n = 0; n < k; ++n) {
    const auto& [attention_output, attention_bias, residual] = x_with_bias[static_cast<std::size_t>(n)];
    if (attention_output.rows() != rows || residual.rows() != rows)
      throw ShapeError("RetroEncoderBiasDropoutAdd: neighbour " + std::to_string(n) + " has " +
                       std::to_string(attention_output.rows()) + " rows, neighbour 0 has " + std::to_string(rows));
    outputs.middleRows(n * rows, rows) =
        bias_dropout_add(attention_output, attention_bias, residual, prob, training, neighbour_rng(rng, n), prec);
  }
  // Concatenate outputs: torch.stack(outputs, dim=1).reshape(r, -1, d). [ r, k*bs*l, d ]
  return gather_rows(outputs, stack_neighbors_map(r, batch, k));
}

BdaBuilder retro_encoder_bias_dropout_add_builder() {
  return [](bool training, bool /*fused: same math*/, DropoutRng rng, Precision p) -> BdaFunc {
    return [training, rng, p](const AttentionOutput& x_with_bias, const Mat& /*residual*/, double prob) {
      const auto* tuples = static_cast<const RetroEncoderAttentionTuples*>(x_with_bias.extra.get());
      if (!tuples) throw std::logic_error("RetroEncoderBiasDropoutAdd needs the output of RetroEncoderCrossAttention");
      return retro_encoder_bias_dropout_add(tuples->tuples, tuples->batch, prob, training, rng, p);
    };
  };
}

RetroEncoderLayerNorm::RetroEncoderLayerNorm(int k, std::unique_ptr<Norm> n)
    : norm(std::move(n)), retro_num_neighbors(k) {}

void RetroEncoderLayerNorm::load_state_dict(const StateDict& sd, const std::string& prefix) {
  norm->load_state_dict(sd, prefix + "norm.");
}

Mat RetroEncoderLayerNorm::forward(const Mat& x) const { return norm->forward(x); }

NormGrads RetroEncoderLayerNorm::backward(const Mat& dy, const Mat& x) const {
  NormGrads g = norm->backward(dy, x);
  g.param_prefix = "norm." + g.param_prefix;
  return g;
}

Mat RetroEncoderLayerNorm::forward_split(const Mat& input, std::int64_t K) const {
  // Input shape: [ r, k*bs*l, d ]. Split into 'num_neighbors' column blocks.
  const std::int64_t k = retro_num_neighbors;
  if (K <= 0 || K % k != 0 || input.rows() % K != 0)
    throw ShapeError("RetroEncoderLayerNorm: input of " + std::to_string(input.rows()) + " rows with " +
                     std::to_string(K) + " columns per position cannot be split into " + std::to_string(k) +
                     " neighbours of equal size");
  const std::int64_t r = input.rows() / K, chunk_size = K / k;
  Mat outputs(input.rows(), input.cols());  // the k normed blocks one after another
  for (std::int64_t n = 0; n < k; ++n) {
    RowMap block(static_cast<std::size_t>(r * chunk_size));  // inputs[n] = input[:, n*chunk_size : (n+1)*chunk_size]
    for (std::int64_t t = 0; t < r; ++t)
      for (std::int64_t j = 0; j < chunk_size; ++j)
        block[static_cast<std::size_t>(t * chunk_size + j)] = t * K + n * chunk_size + j;
    outputs.middleRows(n * r * chunk_size, r * chunk_size) = norm->forward(gather_rows(input, block));
  }
  // Concatenate layer norms: torch.stack(outputs, dim=1).reshape(r, -1, d). [ r, k*bs*l, d ]
  return gather_rows(outputs, stack_neighbors_map(r, chunk_size, k));
}

}  // namespace twin::reference::retro
