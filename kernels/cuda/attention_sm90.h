// The warp-specialised wgmma attention kernel for sm_90a (attention_sm90.cu), reached through
// attention.h's LaunchAttention with AttentionTilingChoice::kWgmma (the default on Hopper). Internal
// to kernels/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/attention.h"
#include "kernels/error.h"

namespace kvpack::cuda {

// Dynamic shared memory of one CTA (one CTA per SM): 1 KiB alignment slack, Q, two or four decoded
// K/V tile stages and three raw page stages of max_page_bytes each for K and V.
int AttentionSm90SharedBytes(int head_dim, int max_page_bytes);
// REQUIRES: AttentionSupported(params.kv).ok(), params.n_q > 0.
Error LaunchAttentionSm90(const AttentionParams& params, cudaStream_t stream);
// CTAs of the kernel LaunchAttentionSm90 would run for `params` that one SM holds at once.
Error AttentionSm90CtasPerSm(const AttentionParams& params, int* ctas);

}  // namespace kvpack::cuda
