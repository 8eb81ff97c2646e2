// gemm_cublaslt.cpp: the GPU GEMM, one cublasLtMatmul per call (CUDA builds only; needs a GPU).
//
// Design: one cuBLASLt handle and one 32 MiB workspace for the process (the current device at first
// use), compute type CUBLAS_COMPUTE_32F with fp32 scale type, layouts built from GemmArgs exactly
// (rows/cols of the stored matrix, ld, batch count and strided batch offset), the epilogue and
// bias pointer/dtype set on the descriptor, and the first algorithm of the heuristic. Arguments
// are validated first by validate_gemm, the same check the simulator applies. A grouped GEMM (the
// experts' linears) runs as ONE cublasGemmGroupedBatchedEx call over the groups it can take (one per
// dtype; split_grouped_gemm in gemm.cpp says which) and one matmul per other group; the call reads
// its pointer arrays from device memory, uploaded on the stream each time (the group sizes are host
// values after routing, so these calls are never captured in a graph). k == 0 (D = beta * C + bias, then the
// activation) is run as a k = 1 matmul of a zero column by a zero row, since cuBLASLt does not accept k = 0.
// libcublasLt (and libcublas, for the grouped call) are opened at first use (dynlib.h says why); the
// headers only give the types.
#include "optimized/runtime/cuda_check.h"
#include "optimized/runtime/dynlib.h"
#include "optimized/runtime/gemm.h"

#include <cublas_api.h>
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#ifndef TWIN_CUBLASLT_DIR
#define TWIN_CUBLASLT_DIR ""
#endif

namespace twin::rt {
namespace {

// Every cuBLASLt entry point this file calls; each is called as lt().<name>.
// An X-macro list, laid out by hand (clang-format would split the X(...) items).
// clang-format off
#define TWIN_CUBLASLT_FUNCTIONS(X)                                                               \
  X(cublasLtCreate) X(cublasLtMatrixLayoutCreate) X(cublasLtMatrixLayoutSetAttribute)              \
  X(cublasLtMatrixLayoutDestroy) X(cublasLtMatmulDescCreate) X(cublasLtMatmulDescDestroy)          \
  X(cublasLtMatmulDescSetAttribute) X(cublasLtMatmulPreferenceCreate)                              \
  X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulPreferenceSetAttribute)                       \
  X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmul)
// clang-format on

struct CublasLtApi {
  TWIN_CUBLASLT_FUNCTIONS(TWIN_DYNLIB_DECLARE_FN)
};

bool resolve_cublaslt(DynLib& lib, CublasLtApi& api) { return true TWIN_CUBLASLT_FUNCTIONS(TWIN_DYNLIB_RESOLVE_FN); }

// Opened at the first GEMM. The soname is that of the major version the header describes:
// another major is another ABI.
LazyLibrary<CublasLtApi>& cublaslt() {
  static LazyLibrary<CublasLtApi> lib(
      "cuBLASLt", library_candidates("libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR), TWIN_CUBLASLT_DIR),
      resolve_cublaslt);
  return lib;
}
const CublasLtApi& lt() { return cublaslt().api(); }

// The cuBLAS entry points of the grouped call.
// clang-format off
#define TWIN_CUBLAS_FUNCTIONS(X) X(cublasCreate_v2) X(cublasSetStream_v2) X(cublasGemmGroupedBatchedEx)
// clang-format on

struct CublasApi {
  TWIN_CUBLAS_FUNCTIONS(TWIN_DYNLIB_DECLARE_FN)
};

bool resolve_cublas(DynLib& lib, CublasApi& api) { return true TWIN_CUBLAS_FUNCTIONS(TWIN_DYNLIB_RESOLVE_FN); }

LazyLibrary<CublasApi>& cublas() {
  static LazyLibrary<CublasApi> lib(
      "cuBLAS", library_candidates("libcublas.so." + std::to_string(CUBLAS_VER_MAJOR), TWIN_CUBLASLT_DIR),
      resolve_cublas);
  return lib;
}

const char* status_name(cublasStatus_t st) {  // cublasGetStatusString lives in libcublas, not cublasLt
  switch (st) {
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "cuBLAS error";
  }
}

void lt_check(cublasStatus_t st, const std::string& call) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw CudaError(call + ": " + status_name(st) + " (" + std::to_string(static_cast<int>(st)) + ")");
}

cudaDataType_t to_cuda(DType dt) {
  switch (dt) {
    case DType::F32:
      return CUDA_R_32F;
    case DType::BF16:
      return CUDA_R_16BF;
    case DType::F16:
      return CUDA_R_16F;
    default:
      throw GemmError(std::string("gemm [cuBLASLt]: unsupported dtype ") + dtype_name(dt));
  }
}

cublasLtEpilogue_t to_cuda(Epilogue e) {
  switch (e) {
    case Epilogue::Default:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case Epilogue::Relu:
      return CUBLASLT_EPILOGUE_RELU;
    case Epilogue::Gelu:
      return CUBLASLT_EPILOGUE_GELU;
    case Epilogue::Bias:
      return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::ReluBias:
      return CUBLASLT_EPILOGUE_RELU_BIAS;
    case Epilogue::GeluBias:
      return CUBLASLT_EPILOGUE_GELU_BIAS;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// RAII wrappers of the descriptors.
struct Layout {
  cublasLtMatrixLayout_t h = nullptr;
  Layout(DType dt, std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t batch, std::int64_t stride) {
    lt_check(lt().cublasLtMatrixLayoutCreate(&h, to_cuda(dt), static_cast<std::uint64_t>(rows),
                                             static_cast<std::uint64_t>(cols), ld),
             "cublasLtMatrixLayoutCreate");
    if (batch > 1) {
      int b = static_cast<int>(batch);
      lt_check(lt().cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b, sizeof(b)),
               "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)");
      lt_check(lt().cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                     sizeof(stride)),
               "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
    }
  }
  ~Layout() {
    if (h) cublaslt().loaded_api().cublasLtMatrixLayoutDestroy(h);
  }
};
struct MatmulDesc {
  cublasLtMatmulDesc_t h = nullptr;
  MatmulDesc() {
    lt_check(lt().cublasLtMatmulDescCreate(&h, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  }
  ~MatmulDesc() {
    if (h) cublaslt().loaded_api().cublasLtMatmulDescDestroy(h);
  }
  template <class T>
  void set(cublasLtMatmulDescAttributes_t a, const T& v, const char* name) {
    lt_check(lt().cublasLtMatmulDescSetAttribute(h, a, &v, sizeof(v)),
             std::string("cublasLtMatmulDescSetAttribute(") + name + ")");
  }
};

class CublasLtGemm final : public Gemm {
 public:
  Backend backend() const override { return Backend::Cuda; }

  void run(const GemmArgs& g, cudaStream_t stream) override {
    validate_gemm(g, "gemm [cuBLASLt]");
    declare_gemm_cost(g);
    matmul(g, stream);
  }
  void run_grouped(const std::vector<GemmArgs>& groups, cudaStream_t stream) override {
    for (std::size_t i = 0; i < groups.size(); ++i) {
      std::string who = "grouped gemm [cuBLASLt] group " + std::to_string(i);
      validate_gemm(groups[i], who.c_str());
    }
    for (const auto& g : groups) declare_gemm_cost(g, "grouped_gemm");
    const GroupedGemmCalls calls = split_grouped_gemm(groups);
    for (std::size_t i : calls.alone) matmul(groups[i], stream);
    for (const std::vector<std::size_t>& call : calls.grouped) grouped_matmul(groups, call, stream);
  }

 private:
  void init() {
    std::call_once(once_, [this] {
      lt_check(lt().cublasLtCreate(&handle_), "cublasLtCreate");
      cuda_check(cudaMalloc(&workspace_, kWorkspace), "cudaMalloc(cuBLASLt workspace)");
    });
  }

  void matmul(const GemmArgs& g_in, cudaStream_t stream) {
    if (g_in.m == 0 || g_in.n == 0) return;
    init();
    GemmArgs g = g_in;
    if (g.k == 0) {  // op(A) = 0 [m, 1], op(B) = 0 [1, n]: the product adds exactly zero
      const void* zeros = zero_buffer(static_cast<std::size_t>(std::max(g.m, g.n)) * dtype_size(g.ab_dtype), stream);
      g.k = 1;
      g.transa = Op::N, g.a = zeros, g.lda = g.m, g.stride_a = 0;
      g.transb = Op::N, g.b = zeros, g.ldb = 1, g.stride_b = 0;
    }
    MatmulDesc desc;
    cublasOperation_t ta = g.transa == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
    cublasOperation_t tb = g.transb == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
    desc.set(CUBLASLT_MATMUL_DESC_TRANSA, ta, "TRANSA");
    desc.set(CUBLASLT_MATMUL_DESC_TRANSB, tb, "TRANSB");
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, to_cuda(g.epilogue), "EPILOGUE");
    if (g.bias) {
      desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias, "BIAS_POINTER");
      desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, to_cuda(g.bias_dtype), "BIAS_DATA_TYPE");
    }
    const std::int64_t a_rows = g.transa == Op::N ? g.m : g.k, a_cols = g.transa == Op::N ? g.k : g.m;
    const std::int64_t b_rows = g.transb == Op::N ? g.k : g.n, b_cols = g.transb == Op::N ? g.n : g.k;
    Layout la(g.ab_dtype, a_rows, a_cols, g.lda, g.batch, g.stride_a);
    Layout lb(g.ab_dtype, b_rows, b_cols, g.ldb, g.batch, g.stride_b);
    const bool reads_c = g.beta != 0.0f;
    Layout lc(g.cd_dtype, g.m, g.n, reads_c ? g.ldc : g.ldd, g.batch, reads_c ? g.stride_c : g.stride_d);
    Layout ld(g.cd_dtype, g.m, g.n, g.ldd, g.batch, g.stride_d);

    cublasLtMatmulPreference_t pref = nullptr;
    lt_check(lt().cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    std::unique_ptr<void, void (*)(void*)> pref_guard(pref, [](void* p) {
      cublaslt().loaded_api().cublasLtMatmulPreferenceDestroy(static_cast<cublasLtMatmulPreference_t>(p));
    });
    std::size_t ws = kWorkspace;
    lt_check(lt().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
             "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
    cublasLtMatmulHeuristicResult_t heur{};
    int found = 0;
    lt_check(lt().cublasLtMatmulAlgoGetHeuristic(handle_, desc.h, la.h, lb.h, lc.h, ld.h, pref, 1, &heur, &found),
             "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0)
      throw CudaError("cublasLtMatmulAlgoGetHeuristic: no algorithm for m=" + std::to_string(g.m) +
                      " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) + " dtype " + dtype_name(g.ab_dtype) +
                      " -> " + dtype_name(g.cd_dtype) + " epilogue " + epilogue_name(g.epilogue));
    const void* c = reads_c ? g.c : g.d;
    lt_check(lt().cublasLtMatmul(handle_, desc.h, &g.alpha, g.a, la.h, g.b, lb.h, &g.beta, c, lc.h, g.d, ld.h,
                                 &heur.algo, workspace_, kWorkspace, stream),
             "cublasLtMatmul");
  }

  // groups[i] for i in `call` (one dtype, each taken by grouped_call_refusal) as one
  // cublasGemmGroupedBatchedEx call of one problem per group: sizes, ops, scalars on the host; the
  // A, B, C pointer arrays in a stream-ordered device allocation. The copy from pageable memory is
  // staged before cudaMemcpyAsync returns, so the host vector may go right after; it also waits for
  // the stream's earlier work, as the experts' phases already do for the routing's counts.
  void grouped_matmul(const std::vector<GemmArgs>& groups, const std::vector<std::size_t>& call, cudaStream_t stream) {
    const std::size_t count = call.size();
    std::vector<cublasOperation_t> ta(count), tb(count);
    std::vector<int> m(count), n(count), k(count), lda(count), ldb(count), ldc(count), size(count, 1);
    std::vector<float> alpha(count), beta(count);
    std::vector<const void*> pointers(3 * count);  // [A..., B..., C...]
    for (std::size_t j = 0; j < count; ++j) {
      const GemmArgs& g = groups[call[j]];
      ta[j] = g.transa == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
      tb[j] = g.transb == Op::N ? CUBLAS_OP_N : CUBLAS_OP_T;
      m[j] = int(g.m), n[j] = int(g.n), k[j] = int(g.k), lda[j] = int(g.lda), ldb[j] = int(g.ldb), ldc[j] = int(g.ldd);
      alpha[j] = g.alpha, beta[j] = g.beta;
      pointers[j] = g.a, pointers[count + j] = g.b, pointers[2 * count + j] = g.d;  // C is D (refusal's rule)
    }
    const cudaDataType_t dt = to_cuda(groups[call[0]].ab_dtype);
    const std::size_t bytes = pointers.size() * sizeof(void*);
    void* device_pointers = nullptr;
    cuda_check(cudaMallocAsync(&device_pointers, bytes, stream), "cudaMallocAsync(grouped gemm pointers)");
    cuda_check(cudaMemcpyAsync(device_pointers, pointers.data(), bytes, cudaMemcpyHostToDevice, stream),
               "cudaMemcpyAsync(grouped gemm pointers)");
    const void* const* a = static_cast<const void* const*>(device_pointers);
    {
      std::lock_guard<std::mutex> lock(cublas_mutex_);  // one handle's stream is set per call
      cublasHandle_t h = cublas_handle();
      lt_check(cublas().api().cublasSetStream_v2(h, stream), "cublasSetStream");
      lt_check(cublas().api().cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m.data(), n.data(), k.data(),
                                                         alpha.data(), a, dt, lda.data(), a + count, dt, ldb.data(),
                                                         beta.data(), const_cast<void* const*>(a + 2 * count), dt,
                                                         ldc.data(), int(count), size.data(), CUBLAS_COMPUTE_32F),
               "cublasGemmGroupedBatchedEx(" + std::to_string(count) + " groups, " +
                   dtype_name(groups[call[0]].ab_dtype) + ")");
    }
    cuda_check(cudaFreeAsync(device_pointers, stream), "cudaFreeAsync(grouped gemm pointers)");
  }

  // The cuBLAS handle of the current device (a handle belongs to the device it was made on);
  // called under cublas_mutex_.
  cublasHandle_t cublas_handle() {
    int device = 0;
    cuda_check(cudaGetDevice(&device), "cudaGetDevice");
    cublasHandle_t& h = cublas_handles_[device];
    if (!h) lt_check(cublas().api().cublasCreate_v2(&h), "cublasCreate");
    return h;
  }

  // A zeroed device buffer of at least `bytes` (grown on demand, kept for later calls).
  const void* zero_buffer(std::size_t bytes, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(zero_mutex_);
    if (zero_bytes_ < bytes) {
      if (zeros_) cuda_check(cudaFree(zeros_), "cudaFree(gemm zero buffer)");
      cuda_check(cudaMalloc(&zeros_, bytes), "cudaMalloc(gemm zero buffer)");
      cuda_check(cudaMemsetAsync(zeros_, 0, bytes, stream), "cudaMemsetAsync(gemm zero buffer)");
      zero_bytes_ = bytes;
    }
    return zeros_;
  }

  static constexpr std::size_t kWorkspace = 32u << 20;
  std::mutex zero_mutex_;
  void* zeros_ = nullptr;
  std::size_t zero_bytes_ = 0;
  std::mutex cublas_mutex_;
  std::map<int, cublasHandle_t> cublas_handles_;  // per device, kept for the process
  std::once_flag once_;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

}  // namespace

std::string load_cublaslt() { return cublaslt().error(); }
std::string load_cublas() { return cublas().error(); }

Gemm& cublaslt_gemm() {
  static CublasLtGemm g;
  return g;
}

}  // namespace twin::rt
