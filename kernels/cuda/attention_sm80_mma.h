// The mma.sync attention kernel (attention_sm80_mma.cu), reached through attention.h's LaunchAttention
// with AttentionTilingChoice::kTall or kWide. Internal to kernels/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/attention.h"
#include "kernels/error.h"

namespace kvpack::cuda {

// Dynamic shared memory of one CTA: Q, one decoded K and V page, two raw stages of K and V.
int AttentionSm80SharedBytes(int head_dim, int max_page_bytes);
// REQUIRES: AttentionSupported(params.kv).ok(), params.n_q > 0; tiling kTall or kWide (others: kTall).
Error LaunchAttentionSm80(const AttentionParams& params, AttentionTilingChoice tiling, cudaStream_t stream);
// CTAs of the kernel LaunchAttentionSm80 would run for `params` that one SM holds at once.
Error AttentionSm80CtasPerSm(const AttentionParams& params, AttentionTilingChoice tiling, int* ctas);

}  // namespace kvpack::cuda
