// Ranks as processes (optimized/runtime/processes.h, optimized/layer/rank_runner.h), run by CTest
// under `mpirun -np 2` and `mpirun -np 4`: the collectives over MPI, and random dense and MoE
// layers whose N ranks are the N processes, are bitwise what the same N ranks give as threads of
// one process (which every process also runs, to compare). Each process holds every rank's results
// (gathered), so every process reaches the same verdict on a layer; the exit status is the largest.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "optimized/layer/rank_runner.h"
#include "optimized/runtime/collectives.h"
#include "optimized/runtime/processes.h"
#include "optimized/transformer_layer.h"
#include "parity/dense_case.h"
#include "parity/dense_run.h"
#include "tests/optimized/moe_case.h"
#include "tests/parity/dense_case_gen.h"

using namespace twin;

namespace {

int nranks() { return rt::process_count(); }

bool bitwise(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// Two records entry by entry: keys, values, rounding counts, magnitudes, block magnitudes.
void assert_records_bitwise_equal(const Record& got, const Record& want) {
  RC_ASSERT(got.entries.size() == want.entries.size());
  for (std::size_t i = 0; i < got.entries.size(); ++i) {
    const RecordEntry &a = got.entries[i], &b = want.entries[i];
    RC_LOG() << a.key() << "\n";
    RC_ASSERT(a.key() == b.key());
    RC_ASSERT(bitwise(a.value, b.value));
    RC_ASSERT(a.rounding == b.rounding);
    RC_ASSERT(a.magnitude == b.magnitude);
    RC_ASSERT(bitwise(a.block_magnitude, b.block_magnitude));
  }
}

// ---- collectives -------------------------------------------------------------------------------

// Rank r's operand of `count` elements of dt, the same on every process (seeded by r).
std::vector<char> operand(int r, std::size_t count, DType dt) {
  std::mt19937 rng(1234 + unsigned(r));
  std::uniform_real_distribution<double> d(-3.0, 3.0);
  std::vector<double> v(count);
  for (double& x : v) x = d(rng);
  const Tensor t = Tensor::from_doubles(dt, {std::int64_t(count)}, v);
  return std::vector<char>(reinterpret_cast<const char*>(t.raw()), reinterpret_cast<const char*>(t.raw()) + t.nbytes());
}

// Every collective of `c` (rank c.rank() of a group of n) on the operands, its results concatenated.
std::vector<char> run_collectives(rt::Communicator& c, DType dt) {
  const int n = c.size(), r = c.rank();
  const std::size_t count = 37, es = dtype_size(dt);
  std::vector<char> in = operand(r, count * std::size_t(n), dt), out;
  auto append = [&](const std::vector<char>& v) { out.insert(out.end(), v.begin(), v.end()); };
  std::vector<char> ar(count * es), inplace(in.begin(), in.begin() + std::ptrdiff_t(count * es)),
      ag(count * es * std::size_t(n)), rs(count * es), bc(count * es);
  c.all_reduce(in.data(), ar.data(), count, dt, nullptr);
  c.all_reduce(inplace.data(), inplace.data(), count, dt, nullptr);
  c.all_gather(in.data(), ag.data(), count, dt, nullptr);
  c.reduce_scatter(in.data(), rs.data(), count, dt, nullptr);
  c.broadcast(in.data(), bc.data(), count, dt, n - 1, nullptr);
  // all_to_all: rank p sends (p + q) % 3 elements to rank q (zero-size parts included)
  std::vector<std::size_t> sc, rc;
  for (int q = 0; q < n; ++q) {
    sc.push_back(std::size_t((r + q) % 3));
    rc.push_back(std::size_t((q + r) % 3));
  }
  std::size_t total = 0;
  for (auto x : rc) total += x;
  std::vector<char> a2a(std::max<std::size_t>(total, 1) * es);
  c.all_to_all(in.data(), sc, a2a.data(), rc, dt, nullptr);
  a2a.resize(total * es);
  for (const auto* v : {&ar, &inplace, &ag, &rs, &bc, &a2a}) append(*v);
  return out;
}

TEST(ProcessCollectives, AreBitwiseTheThreadedGroups) {
  const int n = nranks();
  ASSERT_GT(n, 1) << "run under mpirun -np N, N > 1";
  for (DType dt : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
    SCOPED_TRACE(dtype_name(dt));
    std::vector<std::vector<char>> threaded(static_cast<std::size_t>(n));
    auto group = rt::make_threaded_group(n);
    rt::run_ranks(n, [&](int r) { threaded[std::size_t(r)] = run_collectives(*group[std::size_t(r)], dt); });
    auto mine = rt::make_process_communicator(rt::Backend::Sim);
    ASSERT_EQ(mine->rank(), rt::process_rank());
    EXPECT_TRUE(run_collectives(*mine, dt) == threaded[std::size_t(rt::process_rank())]);
  }
}

// ---- dense layers --------------------------------------------------------------------------------

// The case's layer at its tp (as processes or threads): forward with taps and the activations
// kept, backward with magnitudes; the taps, the output and every gradient in one record.
Record dense_run(const parity::DenseCase& c, bool processes) {
  const parity::DenseInputs in = parity::make_inputs(c);
  opt::LayerOptions lo = parity::optimized_layer_options(c, in);
  lo.processes = processes;
  opt::DenseTransformerLayer layer(in.config, in.params, lo);
  opt::ForwardOptions fo;
  fo.training = in.training;
  fo.seed = in.dropout_seed;
  fo.record_taps = true;
  fo.keep_for_backward = true;
  CountRoundings counting;
  opt::LayerOutput out = layer.forward(in.hidden_states, in.attention_mask.defined() ? &in.attention_mask : nullptr,
                                       in.rotary_pos_emb.defined() ? &in.rotary_pos_emb : nullptr, fo);
  Record rec = std::move(out.record);
  rec.add(Role::Output, "hidden_states", out.hidden_states);
  if (layer.backward_unsupported()) return rec;
  std::vector<double> d(std::size_t(shape_numel(out.hidden_states.shape())));
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = double(int(i * 7919 % 17) - 8) / 8.0;
  const Tensor dout = Tensor::from_doubles(c.dtype, out.hidden_states.shape(), d);
  const opt::LayerGradients g = layer.backward(dout, /*with_magnitudes=*/true);
  rec.add(Role::Grad, "hidden_states", g.hidden_states);
  for (const opt::ParamGradient& p : g.params) rec.add(Role::Grad, p.name, p.value).magnitude = p.magnitude;
  return rec;
}

// A dense layer at tp = N (with or without sequence parallelism, dropout, every dtype), its ranks
// the N processes: the taps, output, gradients and magnitudes bitwise the threaded ranks'.
RC_GTEST_PROP(ProcessLayers, DenseIsBitwiseTheThreadedRanks, ()) {
  parity::CaseLimits limits;
  limits.force_tp = true;
  limits.tp = nranks();
  limits.allow_dropout = true;
  const parity::DenseCase c = *parity::gen_dense_case(limits);
  RC_LOG() << parity::to_id(c) << "\n";
  RC_TAG(c.sp ? "sp" : "no sp", dtype_name(c.dtype));
  assert_records_bitwise_equal(dense_run(c, true), dense_run(c, false));
}

// ---- MoE layers ------------------------------------------------------------------------------------

// An MoE layer whose N ranks are expert-parallel (tp 1), tensor-parallel with sequence parallelism,
// or both at once (ep = tp), its ranks the N processes: the forward's record, the output and the
// gradients with their magnitudes bitwise the threaded ranks'.
RC_GTEST_PROP(ProcessLayers, MoEIsBitwiseTheThreadedRanks, ()) {
  using namespace twin::moe_case;
  const int n = nranks();
  const std::string layout = *rc::gen::element<std::string>("ep", "tp", "tp = ep");
  const bool tp = layout != "ep", ep = layout != "tp";
  OptMoECase o = *gen_opt_moe_case(ep ? n : 1);
  o.bias = false;
  if (tp) shape_for_tensor_parallel(o, n);
  const MoECase m = make_case(o, tp ? 4 : 2);
  RC_LOG() << describe(m) << " " << layout << " " << n << "\n";
  RC_TAG(layout, dtype_name(m.dense.dtype));
  const Tensor dout = output_gradient(m);
  const int e = ep ? n : 1, t = tp ? n : 1;
  assert_records_bitwise_equal(optimized_with_gradients(m, dout, e, t, true),
                               optimized_with_gradients(m, dout, e, t, false));
}

}  // namespace

// MPI started first (every process runs every test in the same order: the collectives pair them);
// every process exits with the largest status. 10 cases per property and launch unless RC_PARAMS
// says otherwise: each case runs its layer twice on every process, N processes on CI's 2 cores
// (40 layers per CI run over the two launch sizes; RC_PARAMS=max_success=100 for more).
int main(int argc, char** argv) {
  const char* params = std::getenv("RC_PARAMS");
  const std::string given = params ? params : "";
  if (given.find("max_success=") == std::string::npos) setenv("RC_PARAMS", (given + " max_success=10").c_str(), 1);
  rt::init_processes(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  return rt::finish_processes(RUN_ALL_TESTS());
}
