#include "kernels/cuda/gemm.h"

#include "kernels/cuda/cuda_status.h"

namespace kvpack::cuda {

BlasGemm::~BlasGemm() { Release(); }

void BlasGemm::Release() {
  if (layout_a_) cublasLtMatrixLayoutDestroy(layout_a_);
  if (layout_b_) cublasLtMatrixLayoutDestroy(layout_b_);
  if (layout_c_) cublasLtMatrixLayoutDestroy(layout_c_);
  if (op_) cublasLtMatmulDescDestroy(op_);
  layout_a_ = layout_b_ = layout_c_ = nullptr;
  op_ = nullptr;
  ready_ = false;
}

Error BlasGemm::Prepare(const GemmArgs& args) {
  if (ready_ && args.m == shape_.m && args.n == shape_.n && args.k == shape_.k && args.lda == shape_.lda &&
      args.ldb == shape_.ldb && args.ldc == shape_.ldc) {
    return Error::Ok();
  }
  Release();
  // Column-major view: C_cm [n, m] = op(A_cm = B as [k, n])ᵀ · (B_cm = A as [k, m]).
  KVPACK_RETURN_IF_ERROR(BlasError(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc"));
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  KVPACK_RETURN_IF_ERROR(BlasError(
      cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)), "transa"));
  KVPACK_RETURN_IF_ERROR(BlasError(
      cublasLtMatmulDescSetAttribute(op_, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)), "transb"));
  KVPACK_RETURN_IF_ERROR(
      BlasError(cublasLtMatrixLayoutCreate(&layout_a_, CUDA_R_16BF, args.k, args.n, args.ldb), "layout of W"));
  KVPACK_RETURN_IF_ERROR(
      BlasError(cublasLtMatrixLayoutCreate(&layout_b_, CUDA_R_16BF, args.k, args.m, args.lda), "layout of x"));
  KVPACK_RETURN_IF_ERROR(
      BlasError(cublasLtMatrixLayoutCreate(&layout_c_, CUDA_R_16BF, args.n, args.m, args.ldc), "layout of C"));

  cublasLtMatmulPreference_t pref = nullptr;
  KVPACK_RETURN_IF_ERROR(BlasError(cublasLtMatmulPreferenceCreate(&pref), "preference"));
  const uint64_t ws = kBlasWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, op_, layout_a_, layout_b_, layout_c_,
                                                               layout_c_, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  KVPACK_RETURN_IF_ERROR(BlasError(status, "cublasLtMatmulAlgoGetHeuristic"));
  if (found == 0) return Error(ErrorCode::kInternal, "cuBLASLt found no algorithm for the projection GEMM");
  algo_ = result.algo;
  shape_ = args;
  ready_ = true;
  return Error::Ok();
}

Error BlasGemm::Run(const GemmArgs& args, cudaStream_t stream) {
  KVPACK_RETURN_IF_ERROR(Prepare(args));
  const float alpha = 1.0f, beta = 0.0f;
  return BlasError(cublasLtMatmul(handle_, op_, &alpha, args.b, layout_a_, args.a, layout_b_, &beta, args.c,
                                  layout_c_, args.c, layout_c_, &algo_, workspace_, kBlasWorkspaceBytes, stream),
                   "cublasLtMatmul");
}

}  // namespace kvpack::cuda
