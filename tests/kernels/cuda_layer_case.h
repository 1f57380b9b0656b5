// One case of the CUDA layer engine's tests (cuda_layer_test.cc), run on the GPU and checked against the
// CPU backend, the host encoding of the same rows and FP64 attention (cuda_layer_case.cc says what each
// check holds). GPU only: callers skip without a device (SKIP_WITHOUT_GPU).
#pragma once

#include "tests/kernels/cuda_test_layer.h"

namespace kvpack::cuda {

// Runs one case; `check_exact` holds the error vs FP64 unquantized to the format's tolerance; `errors`
// (may be null) receives the errors vs FP64 over the decoded pages and unquantized.
void RunCase(const Case& c, CaseErrors* errors = nullptr, bool check_exact = true);

}  // namespace kvpack::cuda
