// The warp-specialised wgmma attention kernel (attention_wgmma.cu), reached through attention.h's
// LaunchAttention with AttentionTilingChoice::kWgmma. Internal to kernels/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/attention.h"
#include "kernels/error.h"

namespace kvpack::cuda {

// Dynamic shared memory of one CTA (one CTA per SM): 1 KiB alignment slack, Q, two decoded K/V tile
// stages and three raw page stages of max_page_bytes each for K and V.
int AttentionWgmmaSharedBytes(int head_dim, int max_page_bytes);
// overlap: S of the next page is issued behind P·V of this one (kWgmmaOverlap).
// REQUIRES: AttentionSupported(params.kv).ok(), params.n_q > 0.
Error LaunchAttentionWgmma(const AttentionParams& params, bool overlap, cudaStream_t stream);

}  // namespace kvpack::cuda
