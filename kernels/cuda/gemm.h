// One cuBLASLt BF16 GEMM shape of the layer: C[M, N] = A[M, K] · B[N, K]ᵀ, all row-major bf16,
// fp32 accumulation (the nn.Linear product x · Wᵀ).
//
// cuBLASLt is column-major, so this runs Cᵀ = B · Aᵀ ("TN": op(B) transposed, op(A) not), which
// is cuBLAS's best-supported layout. The algorithm is chosen once per (M, N, K) by the heuristic and
// kept, so the streamed chunks of one layer pay for the heuristic once.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/error.h"

namespace kvpack::cuda {

inline constexpr uint64_t kBlasWorkspaceBytes = 32ull << 20;  // cuBLASLt's recommendation for Hopper

struct GemmArgs {
  const uint16_t* a = nullptr;  // [m, k] row-major, row stride lda elements
  const uint16_t* b = nullptr;  // [n, k] row-major, row stride ldb elements
  uint16_t* c = nullptr;        // [m, n] row-major, row stride ldc elements
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
};

class BlasGemm {
 public:
  // `workspace`: kBlasWorkspaceBytes of device memory owned by the caller.
  BlasGemm(cublasLtHandle_t handle, void* workspace) : handle_(handle), workspace_(workspace) {}
  BlasGemm(const BlasGemm&) = delete;
  BlasGemm& operator=(const BlasGemm&) = delete;
  ~BlasGemm();

  Error Run(const GemmArgs& args, cudaStream_t stream);

 private:
  Error Prepare(const GemmArgs& args);
  void Release();

  cublasLtHandle_t handle_;
  void* workspace_;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t layout_a_ = nullptr, layout_b_ = nullptr, layout_c_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  GemmArgs shape_{};  // the shape the descriptors were made for (pointers unused)
  bool ready_ = false;
};

}  // namespace kvpack::cuda
