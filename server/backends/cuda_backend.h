// The CUDA backend: the kernels of kernels/cuda/layer.h on one GPU, its pool in a VMM arena
// (vmm_arena.h). Inputs and outputs are device memory; the service copies inline and shared-memory
// tensors into pool memory first (IoBytes says how much the plan must reserve for that).
//
// Each call runs on its own stream from a small pool, and TakesTurns(): the engine's gate hands the
// GPU to one request per chunk (server/core/turns.h), so long layers of several requests interleave
// chunk by chunk. A CUDA error inside a call is sticky: Healthy() turns false and the daemon reports
// NOT_SERVING.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "server/backends/backend.h"

namespace kvpack::server {

struct CudaBackendOptions {
  int device = 0;
  uint64_t reserve_bytes = 0;                  // virtual range for the pool; 0: the device's memory
  uint64_t keep_mapped_bytes = 256ull << 20;   // idle physical memory kept mapped
  // Which attention kernel every call asks for (kernels/kernel_choice.h): kAuto, kWgmma or kMmaSync.
  AttentionTilingChoice attention_kernel = AttentionTilingChoice::kAuto;
};

// Null, with `why` set, when no device answers (no driver, no GPU) or the device cannot serve.
// Null with `refused` set (FAILED_PRECONDITION) when the device answers but cannot run
// options.attention_kernel (wgmma off Hopper or in a build without sm_90a): a forced kernel that
// cannot run stops the daemon instead of falling back.
std::unique_ptr<Backend> MakeCudaBackend(const CudaBackendOptions& options, std::string* why, absl::Status* refused);

}  // namespace kvpack::server
