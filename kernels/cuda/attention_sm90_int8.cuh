// The wgmma kernel's INT8 MMA path pieces (attention_sm90.cu, mma_path.h): the per-row query data, the
// quantized Q tile, and S accumulators read as floats on either path.
// Internal to kernels/cuda: include only from attention_sm90.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_tile.h"
#include "kernels/mma_path.h"

namespace kvpack::cuda::sm90 {

// The INT8 MMA path's per-row query data (mma_path.h): s_q and Σ_c q̂_c / s_q of each query row of the
// tile, written by QuantizeQueryTile; empty on the bf16 path.
template <bool kInt8Qk>
struct Int8QueryRows {
  float scale[kTileQueries];
  float sum_over_scale[kTileQueries];
};
template <>
struct Int8QueryRows<false> {};

// The INT8 MMA path's Q: every warp of the CTA quantizes rows warp, warp + kWarps, … of the tile from
// the bf16 stored-form Q (QueryScaleOf / QueryCode, as the CPU reference) into the swizzled int8 tile
// [2 groups][64 rows][128 bytes] (lane l's kDim/32 codes at byte l·kDim/32 of the row), and lane 0
// writes the row's s_q and Σq̂ / s_q (|Σq̂ / s_q| ≤ 127·kDim). Consumer group c's rows are launch rows
// group_q0[c] … + group_rows[c] − 1 (consecutive in the dense tile; a page each in the routed one);
// the rest are zero rows.
template <class T>
__device__ __forceinline__ void QuantizeQueryTile(const AttentionParams& p, const int64_t (&group_q0)[2],
                                                  const int (&group_rows)[2], int head, uint8_t* q_tile,
                                                  Int8QueryRows<true>& rows) {
  constexpr int kPerLane = T::kDim / 32;
  constexpr int kWarps = T::kThreads / 32;
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < kTileQueries; r += kWarps) {
    const int c = r / T::kGroupRows, rr = r % T::kGroupRows;
    const int64_t q0 = c ? group_q0[1] : group_q0[0];  // selects, not an indexed (local-memory) array
    const int n_rows = c ? group_rows[1] : group_rows[0];
    float x[kPerLane];
    uint32_t bits[kPerLane / 2] = {};
    if (rr < n_rows) {
      const uint16_t* src = p.q + (q0 + rr) * p.q_stride + head * T::kDim + lane * kPerLane;
      if constexpr (kPerLane == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(src);
        bits[0] = w.x, bits[1] = w.y;
      } else {
        bits[0] = *reinterpret_cast<const uint32_t*>(src);
      }
    }
    float amax = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      x[i] = __uint_as_float(i & 1 ? bits[i / 2] & 0xffff0000u : bits[i / 2] << 16);
      amax = fmaxf(amax, fabsf(x[i]));
      sum += x[i];
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, m));
      sum += __shfl_xor_sync(kFullMask, sum, m);
    }
    const QueryScale qs = QueryScaleOf(amax);
    uint32_t codes = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) codes |= (static_cast<uint32_t>(QueryCode(x[i], qs)) & 0xffu) << (8 * i);
    const int byte = lane * kPerLane;
    uint8_t* dst = q_tile + c * (T::kQBytes / 2) + rr * T::kInt8RowBytes +
                   (((byte >> 4) ^ (rr & 7)) << 4) + (byte & 15);
    if constexpr (kPerLane == 4) {
      *reinterpret_cast<uint32_t*>(dst) = codes;
    } else {
      *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(codes);
    }
    if (lane == 0) rows.scale[r] = qs.scale, rows.sum_over_scale[r] = sum / qs.scale;
  }
}

// S accumulators as floats: the bf16 path's are floats; the INT8 path's hold int32 until the softmax
// turns them into floats in the same registers. |S| < 2^22 (127 · 127 · 128 with INT8 keys, 127 · 15 · 128
// with INT4), so 2^23 + 2^22 + S is exact in fp32 and one integer add and one float subtract convert it.
__device__ __forceinline__ float AsFloat(float x) { return x; }
__device__ __forceinline__ float AsFloat(uint32_t x) { return __uint_as_float(x); }
__device__ __forceinline__ void SetFloat(float& d, float v) { d = v; }
__device__ __forceinline__ void SetFloat(uint32_t& d, float v) { d = __float_as_uint(v); }
__device__ __forceinline__ float AccumulatorValue(float x) { return x; }
__device__ __forceinline__ float AccumulatorValue(uint32_t s) { return __uint_as_float(s + 0x4B400000u) - 12582912.0f; }

}  // namespace kvpack::cuda::sm90
