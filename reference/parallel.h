// The reference's threads. Work is split into chunks fixed by the data, never by the thread count,
// and each chunk is computed by one call alone, so every value is bitwise the same at any number of
// threads: the threads only choose which chunks they run. The pool is OpenMP's when the build has
// OpenMP, else one thread. Eigen's own GEMM threading is off in the reference
// (EIGEN_DONT_PARALLELIZE): its blocking of the inner dimension depends on the thread count, so its
// sums would too.
//
//   Mat y = gemm_nt(x, weight);   // x [n, in] @ weight^T [in, out] -> [n, out], row chunks of y
#pragma once

#include <functional>

#include "reference/precision.h"

namespace twin::reference {

// The threads the reference's loops use; >= 1 (std::invalid_argument otherwise). The default is 1:
// a library inside tests and benchmarks leaves the machine to its caller (`twin` sets all cores).
void set_threads(int n);
int threads();

// fn(begin, end) for every chunk [k chunk, min(n, (k + 1) chunk)) of [0, n), on any thread and in
// any order; fn must write only its chunk's outputs and count no rounding points (the counts are
// per thread: the caller counts each step once, after the loop). The first exception a chunk threw
// is rethrown once every chunk has run.
void for_chunks(Eigen::Index n, Eigen::Index chunk, const std::function<void(Eigen::Index, Eigen::Index)>& fn);

// The products of the readable mode, in chunks of the output's rows: each output element is its own
// sum over the inner dimension, computed by the same call at any thread count.
Mat gemm_nn(const Mat& a, const Mat& b);  // a [m, k] b [k, n] -> [m, n]
Mat gemm_nt(const Mat& a, const Mat& b);  // a [m, k] b^T, b [n, k] -> [m, n]
Mat gemm_tn(const Mat& a, const Mat& b);  // a^T b, a [k, m], b [k, n] -> [m, n]

// The same products with a parameter read in place, in its own dtype (a bf16 weight mapped from a
// golden stays bf16 there): each chunk of the weight's rows (or columns) is converted to double by
// the chunk's own call, so no double copy of a whole weight is ever made. Each output element is
// still one sum over the whole inner dimension.
Mat gemm_x_wt(const Mat& x, const Tensor& w);   // x [n, in] @ w^T, w [out, in] -> [n, out], column chunks
Mat gemm_dy_w(const Mat& dy, const Tensor& w);  // dy [n, out] @ w, w [out, in] -> [n, in], column chunks
// A weight's gradient dy^T x [out, in] in row chunks, each rounded by `round` in place and stored
// into `grad` ([out, in], its own dtype), so neither it nor its magnitude is ever whole in double.
// Returns the magnitude max over elements of (|dy|^T |x|) (ParamGrad).
double gemm_wgrad(const Mat& dy, const Mat& x, const std::function<void(Mat&)>& round, Tensor& grad);

}  // namespace twin::reference
