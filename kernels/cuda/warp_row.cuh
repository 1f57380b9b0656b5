// Device helpers for one (token, head) row of d values held by one warp: lane l holds the
// kPerLane = d/32 consecutive channels l·kPerLane … l·kPerLane + kPerLane − 1 in registers.
#pragma once

#include <cstdint>

#include "kernels/format.h"
#include "kernels/rotation.h"

namespace kvpack::cuda {

inline constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}
__device__ __forceinline__ float WarpMin(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fminf(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}

__device__ __forceinline__ float Bf16Lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  return static_cast<uint32_t>(FloatToBf16(lo)) | (static_cast<uint32_t>(FloatToBf16(hi)) << 16);
}

// Loads kPerLane bf16 values (aligned to their size) as floats.
template <int kPerLane>
__device__ __forceinline__ void LoadBf16(const uint16_t* p, float (&x)[kPerLane]) {
  static_assert(kPerLane == 2 || kPerLane == 4, "d = 64 or 128");
  if constexpr (kPerLane == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    x[0] = Bf16Lo(u.x), x[1] = Bf16Hi(u.x), x[2] = Bf16Lo(u.y), x[3] = Bf16Hi(u.y);
  } else {
    const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
    x[0] = Bf16Lo(u), x[1] = Bf16Hi(u);
  }
}

template <int kPerLane>
__device__ __forceinline__ void StoreBf16(uint16_t* p, const float (&x)[kPerLane]) {
  if constexpr (kPerLane == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(PackBf16(x[0], x[1]), PackBf16(x[2], x[3]));
  } else {
    *reinterpret_cast<uint32_t*>(p) = PackBf16(x[0], x[1]);
  }
}

// x ← H_d · x, the butterflies of rotation.h's WalshHadamard in the same order: stage `len` pairs
// channel j (bit len clear) with j + len as (a + b, a − b). Stages below kPerLane stay in the lane;
// the others pair lane l with lane l ^ (len / kPerLane).
template <int kPerLane>
__device__ __forceinline__ void WarpWalshHadamard(float (&x)[kPerLane], int lane) {
#pragma unroll
  for (int len = 1; len < kPerLane; len <<= 1) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if ((i & len) == 0) {
        const float a = x[i], b = x[i + len];
        x[i] = a + b;
        x[i + len] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float other = __shfl_xor_sync(kFullMask, x[i], m);
      x[i] = upper ? other - x[i] : x[i] + other;
    }
  }
}

// This lane's rotation signs s_c (rotation.h), computed once per warp and reused for every row.
template <int kPerLane>
__device__ __forceinline__ void LaneSigns(float (&sign)[kPerLane], int lane, uint64_t seed) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) sign[i] = RotationSign(seed, lane * kPerLane + i);
}

// x ← R · x (RotateForward), signs from LaneSigns.
template <int kPerLane>
__device__ __forceinline__ void WarpRotateForward(float (&x)[kPerLane], int lane, const float (&sign)[kPerLane]) {
  constexpr int kDim = 32 * kPerLane;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] *= sign[i];
  WarpWalshHadamard(x, lane);
  const float norm = 1.0f / sqrtf(static_cast<float>(kDim));
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] *= norm;
}

// x ← Rᵀ · x (RotateInverse), signs from LaneSigns.
template <int kPerLane>
__device__ __forceinline__ void WarpRotateInverse(float (&x)[kPerLane], int lane, const float (&sign)[kPerLane]) {
  constexpr int kDim = 32 * kPerLane;
  WarpWalshHadamard(x, lane);
  const float norm = 1.0f / sqrtf(static_cast<float>(kDim));
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) x[i] *= norm * sign[i];
}

// Index of the page that holds `token`: pages are sorted by token_begin and tile [0, N).
__device__ __forceinline__ int FindPage(const PageDesc* pages, int n_pages, int64_t token) {
  int lo = 0, hi = n_pages - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (pages[mid].token_begin <= token) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace kvpack::cuda
