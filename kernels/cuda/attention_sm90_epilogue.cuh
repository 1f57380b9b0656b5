// The epilogue of the sm90 attention kernel: each consumer warp normalises its 16 rows of O by the
// softmax sums, stages them as float rows in shared memory (over Q, K and V, which no MMA reads any
// more) and writes them through attention_device.cuh's WriteOutputRows (Rᵀ, ×λ_v, +μ_v, bf16).
// Internal to kernels/cuda: include only from attention_sm90.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_consumer.cuh"
#include "kernels/cuda/attention_sm90_tile.h"

namespace kvpack::cuda::sm90 {

// REQUIRES: every MMA of the CTA is done (the staging overwrites Q, K and V).
template <class T>
__device__ __forceinline__ void StoreOutputRows(const Consumer<T>& c, const QueryTileCoords& tile, int lane) {
  float* stage_rows = reinterpret_cast<float*>(c.smem) + c.row_base * T::kStagePitch;  // this warp's 16 rows
  float inv[2];
  InverseRowSums(c.row_sum, inv);
#pragma unroll
  for (int n = 0; n < Consumer<T>::kONTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      stage_rows[(c.g + (e >> 1) * 8) * T::kStagePitch + n * 8 + 2 * c.t + (e & 1)] = c.o[n][e] * inv[e >> 1];
    }
  }
  __syncwarp();
  const int warp_rows = tile.n_rows - c.row_base < 16 ? tile.n_rows - c.row_base : 16;
  if (warp_rows > 0) {
    WriteOutputRows<T::kDim>(c.p, tile.head, stage_rows, T::kStagePitch, warp_rows, tile.q0 + c.row_base, lane);
  }
}

}  // namespace kvpack::cuda::sm90
