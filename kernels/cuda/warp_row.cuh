// Device helpers for one (token, head) row of d values held by one warp: lane l holds the
// kPerLane = d/32 consecutive channels l·kPerLane … l·kPerLane + kPerLane − 1 in registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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
// An integer sum, the same in any order (format.h's INT4 search compares such sums with the host's).
__device__ __forceinline__ uint32_t WarpSumU32(uint32_t v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_add_sync(kFullMask, v);
#else
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
#endif
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
// Two floats → bf16x2 (lo in the low half), round to nearest even: format.h's FloatToBf16 for every
// finite value, in one instruction.
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// format.h's FloatToHalf / HalfToFloat for finite values, by the hardware conversions (HalfBits reads
// the low 16 bits).
__device__ __forceinline__ uint16_t FloatToHalfBits(float f) { return __half_as_ushort(__float2half_rn(f)); }
__device__ __forceinline__ float HalfBits(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// RN(a / b) given r = RN(1 / b): Markstein's correction, one product and two FMAs instead of a
// division; equal to IEEE a / b wherever the quotient is a normal number.
__device__ __forceinline__ float DivideByReciprocal(float a, float b, float r) {
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(__fmaf_rn(-q, b, a), r, q);
}

// kPerLane bf16 values of one lane as loaded (aligned to their size): the loads go out first and the
// conversion waits until the values are needed.
template <int kPerLane>
struct Bf16Lanes {
  static_assert(kPerLane == 2 || kPerLane == 4, "d = 64 or 128");
  uint32_t w[kPerLane / 2];
};
template <int kPerLane>
__device__ __forceinline__ Bf16Lanes<kPerLane> LoadBf16Lanes(const uint16_t* p) {
  Bf16Lanes<kPerLane> v;
  if constexpr (kPerLane == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    v.w[0] = u.x, v.w[1] = u.y;
  } else {
    v.w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
  return v;
}
template <int kPerLane>
__device__ __forceinline__ void UnpackBf16(const Bf16Lanes<kPerLane>& v, float (&x)[kPerLane]) {
#pragma unroll
  for (int i = 0; i < kPerLane / 2; ++i) x[2 * i] = Bf16Lo(v.w[i]), x[2 * i + 1] = Bf16Hi(v.w[i]);
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
    // The lower lane keeps a + b, the upper b − a: one FMA with a ±1 factor rounds as the add does.
    const float own = (lane & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const float other = __shfl_xor_sync(kFullMask, x[i], m);
      x[i] = __fmaf_rn(own, x[i], other);
    }
  }
}

// This lane's rotation signs s_c (rotation.h), computed once per warp and reused for every row.
template <int kPerLane>
__device__ __forceinline__ void LaneSigns(float (&sign)[kPerLane], int lane, uint64_t seed) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) sign[i] = RotationSign(seed, lane * kPerLane + i);
}

// x ← R · x (RotateForward) for a row already multiplied by its signs s (the row epilogue folds them
// into its per-column factors): H · x / √d.
template <int kPerLane>
__device__ __forceinline__ void WarpRotateForwardSigned(float (&x)[kPerLane], int lane) {
  constexpr int kDim = 32 * kPerLane;
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
