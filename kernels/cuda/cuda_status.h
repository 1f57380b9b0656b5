// CUDA and cuBLASLt return codes → kvpack::Error (ErrorCode::kInternal with the library's text).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <string>

#include "kernels/error.h"

namespace kvpack::cuda {

inline Error CudaError(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return Error::Ok();
  return Error(ErrorCode::kInternal, std::string(what) + ": " + cudaGetErrorName(status) + " (" +
                                         cudaGetErrorString(status) + ")");
}

inline Error BlasError(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return Error::Ok();
  return Error(ErrorCode::kInternal, std::string(what) + ": cuBLASLt status " + std::to_string(status));
}

}  // namespace kvpack::cuda

// Returns from the enclosing function (which returns kvpack::Error) when `expr` is not OK.
#define KVPACK_RETURN_IF_ERROR(expr)       \
  do {                                     \
    ::kvpack::Error kvpack_error_ = (expr); \
    if (!kvpack_error_.ok()) return kvpack_error_; \
  } while (0)
#define KVPACK_CUDA_RETURN(call) KVPACK_RETURN_IF_ERROR(::kvpack::cuda::CudaError((call), #call))
// After a launch: the launch error (bad configuration), not the kernel's asynchronous outcome.
#define KVPACK_CUDA_RETURN_LAUNCH(what) KVPACK_RETURN_IF_ERROR(::kvpack::cuda::CudaError(cudaGetLastError(), what))
