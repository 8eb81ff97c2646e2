// The in-process (threaded) collectives against direct computations, for 1-4 simulated ranks and
// random sizes (zero-size parts included), plus disagreement and missing-rank errors.
#include "tests/case_id.h"
#include "core/dtype.h"
#include "optimized/runtime/collectives.h"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using twin::DType;
using twin::rt::Communicator;

namespace {

std::vector<float> random_floats(std::mt19937& rng, std::size_t n) {
  std::uniform_real_distribution<float> d(-3.0f, 3.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
std::vector<std::uint16_t> random_bf16(std::mt19937& rng, std::size_t n) {
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = twin::float_to_bf16_bits(std::uniform_real_distribution<float>(-3.0f, 3.0f)(rng));
  return v;
}

// Sum in rank order with one bf16 rounding per addition, the documented reduction order.
std::vector<std::uint16_t> bf16_sum_in_rank_order(const std::vector<std::vector<std::uint16_t>>& x, std::size_t off,
                                                  std::size_t count) {
  std::vector<std::uint16_t> acc(x[0].begin() + off, x[0].begin() + off + count);
  for (std::size_t r = 1; r < x.size(); ++r)
    for (std::size_t i = 0; i < count; ++i)
      acc[i] = twin::float_to_bf16_bits(twin::bf16_bits_to_float(acc[i]) + twin::bf16_bits_to_float(x[r][off + i]));
  return acc;
}

}  // namespace

namespace {
// One collectives case: n ranks, count elements per rank, the broadcast root, the all_to_all
// counts (rank p to rank q, row-major, '.'-separated) and the seed of the data.
struct CollectivesCase : twin::proptest::PropertyCase {
  static constexpr const char* kKind = "collectives";
  int n = 1, count = 0, root = 0;
  std::string a2a = "0";
  std::uint64_t seed = 0;
  template <class V>
  void fields(V& v) {
    v("n", n);
    v("count", count);
    v("root", root);
    v("a2a", a2a);
    v("seed", seed);
  }
};
}  // namespace

// One random case with n ranks (rapidcheck property body).
void collectives_match_direct_computation(int n) {
  const CollectivesCase cc = *twin::proptest::rerunnable<CollectivesCase>(rc::gen::exec([n] {
    CollectivesCase c;
    c.n = n;
    c.count = *rc::gen::inRange(0, 40);
    c.root = *rc::gen::inRange(0, n);
    // all_to_all: counts[p][q] elements from rank p to rank q; zeros are frequent on purpose.
    c.a2a.clear();
    for (int i = 0; i < n * n; ++i)
      c.a2a += (i ? "." : "") + std::to_string(*rc::gen::weightedOneOf<std::size_t>(
                                    {{2, rc::gen::just<std::size_t>(0)}, {3, rc::gen::inRange<std::size_t>(1, 7)}}));
    c.seed = *rc::gen::arbitrary<std::uint32_t>();
    return c;
  }));
  if (cc.n != n) return;  // a TWIN_CASE rerun for another rank count: that count's check runs it
  const std::size_t count = static_cast<std::size_t>(cc.count);
  const int root = cc.root;
  std::vector<std::vector<std::size_t>> a2a(n, std::vector<std::size_t>(n));
  {
    std::size_t pos = 0;
    for (auto& row : a2a)
      for (auto& c : row) {
        const std::size_t end = std::min(cc.a2a.find('.', pos), cc.a2a.size());
        c = std::stoul(cc.a2a.substr(pos, end - pos));
        pos = end + 1;
      }
  }
  std::mt19937 rng(static_cast<std::uint32_t>(cc.seed));

  std::vector<std::vector<float>> f(n);                 // per rank [count]
  std::vector<std::vector<std::uint16_t>> h(n), hs(n);  // per rank [count] and [n * count]
  std::vector<std::vector<std::int32_t>> a2a_send(n);   // per rank, parts in destination order
  for (int r = 0; r < n; ++r) {
    f[r] = random_floats(rng, count);
    h[r] = random_bf16(rng, count);
    hs[r] = random_bf16(rng, n * count);
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < a2a[r][q]; ++i) a2a_send[r].push_back(1000000 * r + 1000 * q + static_cast<int>(i));
  }

  struct Out {
    std::vector<float> ar_f32, ag_f32, bc_f32;
    std::vector<std::uint16_t> ar_bf16, ar_inplace, rs_bf16;
    std::vector<std::int32_t> a2a;
  };
  std::vector<Out> out(n);
  auto comms = twin::rt::make_threaded_group(n);
  twin::rt::run_ranks(n, [&](int r) {
    Communicator& c = *comms[r];
    Out& o = out[r];
    o.ar_f32.resize(count);
    c.all_reduce(f[r].data(), o.ar_f32.data(), count, DType::F32, nullptr);
    o.ar_bf16.resize(count);
    c.all_reduce(h[r].data(), o.ar_bf16.data(), count, DType::BF16, nullptr);
    o.ar_inplace = h[r];
    c.all_reduce(o.ar_inplace.data(), o.ar_inplace.data(), count, DType::BF16, nullptr);
    o.ag_f32.resize(n * count);
    c.all_gather(f[r].data(), o.ag_f32.data(), count, DType::F32, nullptr);
    o.rs_bf16.resize(count);
    c.reduce_scatter(hs[r].data(), o.rs_bf16.data(), count, DType::BF16, nullptr);
    std::vector<std::size_t> send_counts(n), recv_counts(n);
    std::size_t total = 0;
    for (int q = 0; q < n; ++q) {
      send_counts[q] = a2a[r][q];
      recv_counts[q] = a2a[q][r];
      total += recv_counts[q];
    }
    o.a2a.assign(total, -1);
    c.all_to_all(a2a_send[r].data(), send_counts, o.a2a.data(), recv_counts, DType::I32, nullptr);
    o.bc_f32.assign(count, -1.0f);
    c.broadcast(r == root ? f[r].data() : nullptr, o.bc_f32.data(), count, DType::F32, root, nullptr);
  });

  // Direct computations.
  std::vector<float> sum_f32(count);
  for (std::size_t i = 0; i < count; ++i) {
    float acc = f[0][i];
    for (int r = 1; r < n; ++r) acc += f[r][i];  // rank order, fp32
    sum_f32[i] = acc;
  }
  const auto sum_bf16 = bf16_sum_in_rank_order(h, 0, count);
  std::vector<float> gathered;
  for (int r = 0; r < n; ++r) gathered.insert(gathered.end(), f[r].begin(), f[r].end());
  for (int r = 0; r < n; ++r) {
    const Out& o = out[r];
    const bool same_bits = count == 0 || std::memcmp(o.ar_f32.data(), sum_f32.data(), count * 4) == 0;
    RC_ASSERT(same_bits);
    RC_ASSERT(o.ar_bf16 == sum_bf16);
    RC_ASSERT(o.ar_inplace == sum_bf16);
    RC_ASSERT(o.ag_f32 == gathered);
    RC_ASSERT(o.rs_bf16 == bf16_sum_in_rank_order(hs, r * count, count));
    std::vector<std::int32_t> expect_a2a;
    for (int p = 0; p < n; ++p)
      for (std::size_t i = 0; i < a2a[p][r]; ++i) expect_a2a.push_back(1000000 * p + 1000 * r + static_cast<int>(i));
    RC_ASSERT(o.a2a == expect_a2a);
    RC_ASSERT(o.bc_f32 == f[root]);
  }
}

TEST(ThreadedCollectives, MatchDirectComputationFor1To4Ranks) {
  for (int n = 1; n <= 4; ++n)
    EXPECT_TRUE(rc::check(std::to_string(n) + " ranks", [n] { collectives_match_direct_computation(n); }))
        << n << " ranks";
}

TEST(ThreadedCollectives, RanksCallingDifferentCollectivesAllFail) {
  auto comms = twin::rt::make_threaded_group(2);
  std::vector<float> x(4, 1.0f), y(8);
  std::vector<std::string> errors(2);
  twin::rt::run_ranks(2, [&](int r) {
    try {
      if (r == 0)
        comms[r]->all_reduce(x.data(), y.data(), 4, DType::F32, nullptr);
      else
        comms[r]->all_gather(x.data(), y.data(), 4, DType::F32, nullptr);
    } catch (const twin::rt::CollectiveError& e) {
      errors[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("ranks disagree"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("all_gather"), std::string::npos) << errors[r];
  }
}

TEST(ThreadedCollectives, AllToAllCountMismatchIsReported) {
  auto comms = twin::rt::make_threaded_group(2);
  std::vector<std::int32_t> s(8), d(8);
  std::vector<std::string> errors(2);
  twin::rt::run_ranks(2, [&](int r) {
    // Rank 0 sends 3 elements to rank 1, but rank 1 expects 2.
    std::vector<std::size_t> send = r == 0 ? std::vector<std::size_t>{1, 3} : std::vector<std::size_t>{1, 1};
    std::vector<std::size_t> recv = r == 0 ? std::vector<std::size_t>{1, 1} : std::vector<std::size_t>{2, 1};
    try {
      comms[r]->all_to_all(s.data(), send, d.data(), recv, DType::I32, nullptr);
    } catch (const twin::rt::CollectiveError& e) {
      errors[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("rank 0 sends 3 elements to rank 1, which expects 2"), std::string::npos) << errors[r];
}

TEST(ThreadedCollectives, ARankThatNeverArrivesIsATimeoutError) {
  setenv("TWIN_COLLECTIVE_TIMEOUT_S", "0.2", 1);
  auto comms = twin::rt::make_threaded_group(3);
  std::vector<float> x(4, 1.0f), y(4);
  std::string error;
  twin::rt::run_ranks(3, [&](int r) {
    if (r == 2) return;  // never calls
    try {
      comms[r]->all_reduce(x.data(), y.data(), 4, DType::F32, nullptr);
    } catch (const twin::rt::CollectiveError& e) {
      if (r == 0) error = e.what();
    }
  });
  unsetenv("TWIN_COLLECTIVE_TIMEOUT_S");
  EXPECT_NE(error.find("for rank(s) 2, which never arrived"), std::string::npos) << error;
}
