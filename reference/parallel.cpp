#include "reference/parallel.h"

#include <atomic>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace twin::reference {

namespace {

std::atomic<int> n_threads{1};

// Rows per chunk of a product's output: small enough that a layer's GEMMs spread over the cores,
// large enough that each chunk is a GEMM and not a loop of dot products.
constexpr Eigen::Index kRowChunk = 64;

// A product worth more than one thread (below it a fork costs more than the work saves). The chunks
// are the same either way; this only decides whether the loop forks.
constexpr double kForkFlops = 1e6;

}  // namespace

void set_threads(int n) {
  if (n < 1) throw std::invalid_argument("reference threads: need at least one, got " + std::to_string(n));
  n_threads.store(n);
}

int threads() { return n_threads.load(); }

namespace {

void run_chunks(Eigen::Index n, Eigen::Index chunk, const std::function<void(Eigen::Index, Eigen::Index)>& fn,
                bool fork) {
  if (chunk < 1) throw std::invalid_argument("for_chunks: chunk must be >= 1");
  const Eigen::Index chunks = (n + chunk - 1) / chunk;
  std::exception_ptr first;
  std::mutex mu;
  auto one = [&](Eigen::Index k) {
    try {
      fn(k * chunk, std::min(n, (k + 1) * chunk));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!first) first = std::current_exception();
    }
  };
#ifdef _OPENMP
  const int t = fork ? static_cast<int>(std::min<Eigen::Index>(threads(), chunks)) : 1;
  if (t > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(t)
    for (Eigen::Index k = 0; k < chunks; ++k) one(k);
  } else {
    for (Eigen::Index k = 0; k < chunks; ++k) one(k);
  }
#else
  (void)fork;
  for (Eigen::Index k = 0; k < chunks; ++k) one(k);
#endif
  if (first) std::rethrow_exception(first);
}

}  // namespace

void for_chunks(Eigen::Index n, Eigen::Index chunk, const std::function<void(Eigen::Index, Eigen::Index)>& fn) {
  run_chunks(n, chunk, fn, true);
}

namespace {

// out [rows, cols], its row chunks [r, r + n) each `block(r, n)` (an Eigen product) alone; `inner`
// the products' inner dimension, for the fork's threshold.
template <class Block>
Mat by_row_chunks(Eigen::Index rows, Eigen::Index cols, Eigen::Index inner, const Block& block) {
  Mat out(rows, cols);
  run_chunks(
      rows, kRowChunk,
      [&](Eigen::Index r0, Eigen::Index r1) { out.middleRows(r0, r1 - r0).noalias() = block(r0, r1 - r0); },
      2.0 * double(rows) * double(cols) * double(inner) > kForkFlops);
  return out;
}

}  // namespace

Mat gemm_nn(const Mat& a, const Mat& b) {
  if (a.cols() != b.rows()) throw std::invalid_argument("gemm_nn: inner dimensions differ");
  return by_row_chunks(a.rows(), b.cols(), a.cols(),
                       [&](Eigen::Index r, Eigen::Index n) { return a.middleRows(r, n) * b; });
}

Mat gemm_nt(const Mat& a, const Mat& b) {
  if (a.cols() != b.cols()) throw std::invalid_argument("gemm_nt: inner dimensions differ");
  return by_row_chunks(a.rows(), b.rows(), a.cols(),
                       [&](Eigen::Index r, Eigen::Index n) { return a.middleRows(r, n) * b.transpose(); });
}

Mat gemm_tn(const Mat& a, const Mat& b) {
  if (a.rows() != b.rows()) throw std::invalid_argument("gemm_tn: inner dimensions differ");
  return by_row_chunks(a.cols(), b.cols(), a.rows(),
                       [&](Eigen::Index r, Eigen::Index n) { return a.middleCols(r, n).transpose() * b; });
}

}  // namespace twin::reference
