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

}  // namespace twin::reference
