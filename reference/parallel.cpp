#include "reference/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

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

enum class Along { Rows, Cols };

// out [rows, cols], its row (or column) chunks [r, r + n) each `block(r, n)` (an Eigen product)
// alone; `inner` the products' inner dimension, for the fork's threshold.
template <Along along, class Block>
Mat by_chunks(Eigen::Index rows, Eigen::Index cols, Eigen::Index inner, const Block& block) {
  Mat out(rows, cols);
  run_chunks(
      along == Along::Rows ? rows : cols, kRowChunk,
      [&](Eigen::Index r0, Eigen::Index r1) {
        if constexpr (along == Along::Rows)
          out.middleRows(r0, r1 - r0).noalias() = block(r0, r1 - r0);
        else
          out.middleCols(r0, r1 - r0).noalias() = block(r0, r1 - r0);
      },
      2.0 * double(rows) * double(cols) * double(inner) > kForkFlops);
  return out;
}

}  // namespace

Mat gemm_nn(const Mat& a, const Mat& b) {
  if (a.cols() != b.rows()) throw std::invalid_argument("gemm_nn: inner dimensions differ");
  return by_chunks<Along::Rows>(a.rows(), b.cols(), a.cols(),
                                [&](Eigen::Index r, Eigen::Index n) { return a.middleRows(r, n) * b; });
}

Mat gemm_nt(const Mat& a, const Mat& b) {
  if (a.cols() != b.cols()) throw std::invalid_argument("gemm_nt: inner dimensions differ");
  return by_chunks<Along::Rows>(a.rows(), b.rows(), a.cols(),
                                [&](Eigen::Index r, Eigen::Index n) { return a.middleRows(r, n) * b.transpose(); });
}

Mat gemm_tn(const Mat& a, const Mat& b) {
  if (a.rows() != b.rows()) throw std::invalid_argument("gemm_tn: inner dimensions differ");
  return by_chunks<Along::Rows>(a.cols(), b.cols(), a.rows(),
                                [&](Eigen::Index r, Eigen::Index n) { return a.middleCols(r, n).transpose() * b; });
}

namespace {

// w's rows [r, r + n) ([n, cols]) as doubles.
Mat weight_rows(const Tensor& w, Eigen::Index cols, Eigen::Index r, Eigen::Index n) {
  Mat out(n, cols);
  w.read_f64(r * cols, n * cols, out.data());
  return out;
}

// w's columns [c, c + n) ([rows, n]) as doubles.
Mat weight_cols(const Tensor& w, Eigen::Index rows, Eigen::Index cols, Eigen::Index c, Eigen::Index n) {
  Mat out(rows, n);
  for (Eigen::Index i = 0; i < rows; ++i) w.read_f64(i * cols + c, n, out.row(i).data());
  return out;
}

void expect_matrix(const Tensor& w, Eigen::Index rows, Eigen::Index cols, const char* what) {
  if (w.dim() != 2 || w.size(0) != rows || w.size(1) != cols)
    throw std::invalid_argument(std::string(what) + ": weight " + w.describe() + ", expected [" + std::to_string(rows) +
                                ", " + std::to_string(cols) + "]");
}

}  // namespace

Mat gemm_x_wt(const Mat& x, const Tensor& w) {
  const Eigen::Index out = w.dim() == 2 ? w.size(0) : 0;
  expect_matrix(w, out, x.cols(), "gemm_x_wt");
  return by_chunks<Along::Cols>(x.rows(), out, x.cols(), [&](Eigen::Index c, Eigen::Index n) -> Mat {
    const Mat wc = weight_rows(w, x.cols(), c, n);  // [n, in]
    return x * wc.transpose();                      // [rows, in] @ [in, n]
  });
}

Mat gemm_dy_w(const Mat& dy, const Tensor& w) {
  const Eigen::Index in = w.dim() == 2 ? w.size(1) : 0;
  expect_matrix(w, dy.cols(), in, "gemm_dy_w");
  return by_chunks<Along::Cols>(dy.rows(), in, dy.cols(), [&](Eigen::Index c, Eigen::Index n) -> Mat {
    const Mat wc = weight_cols(w, dy.cols(), in, c, n);  // [out, n]
    return dy * wc;                                      // [rows, out] @ [out, n]
  });
}

double gemm_wgrad(const Mat& dy, const Mat& x, const std::function<void(Mat&)>& round, Tensor& grad) {
  if (dy.rows() != x.rows()) throw std::invalid_argument("gemm_wgrad: inner dimensions differ");
  expect_matrix(grad, dy.cols(), x.cols(), "gemm_wgrad");
  const Eigen::Index chunks = (dy.cols() + kRowChunk - 1) / kRowChunk;
  std::vector<double> magnitude(static_cast<std::size_t>(chunks), 0.0);
  grad.raw_mut();                  // owned before the chunks write it
  const Mat x_abs = x.cwiseAbs();  // once: a product with x.cwiseAbs() would make it in every chunk
  run_chunks(
      dy.cols(), kRowChunk,
      [&](Eigen::Index r0, Eigen::Index r1) {
        Mat g = dy.middleCols(r0, r1 - r0).transpose() * x;  // [n, in]
        round(g);
        grad.write_f64(r0 * x.cols(), g.size(), g.data());
        // |dy| per chunk: a real-size layer's whole |dy| would be the largest buffer alive.
        const Mat m = dy.middleCols(r0, r1 - r0).cwiseAbs().transpose() * x_abs;
        if (m.size()) magnitude[static_cast<std::size_t>(r0 / kRowChunk)] = m.maxCoeff();
      },
      2.0 * double(dy.rows()) * double(dy.cols()) * double(x.cols()) > kForkFlops);
  return magnitude.empty() ? 0.0 : *std::max_element(magnitude.begin(), magnitude.end());
}

}  // namespace twin::reference
