// The page codecs of format v1, device twin of kernels/page_codec.h: per format, what the CUDA kernels
// need to write and read its rows. Internal to kernels/cuda: include only from .cu files.
//
//   DevicePageCodec<F>::StoreRow      a warp's rotated row (32 lanes × kPerLane values) → codes + meta
//                                     (the row epilogue; the same codes as PageCodec<F>::EncodeRow)
//   DevicePageCodec<F>::Load/Convert  8 channels of one row of a raw page → 8 bf16 in one uint4, as
//                                     PageCodec<F>::DecodeRow then bf16 rounding (split so that a
//                                     caller issues several loads before the first conversion)
//   DevicePageCodec<F>::KeyFactors    how the sm90 kernel's K tile holds a key (its key table entry)
//   DecodeUnit                        Load + Convert over a runtime format (DispatchFormat)
// A format without a DevicePageCodec does not compile where it is dispatched; per-format code
// outside the codecs is an `if constexpr` chain closed by static_assert(kUnhandledFormat<F>).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/warp_row.cuh"
#include "kernels/format.h"

namespace kvpack::cuda {

// RN(1/15) and RN(1/127): the encoders' divisions by 15 and 127 through DivideByReciprocal.
inline constexpr float kInv15 = 1.0f / 15.0f, kInv127 = 1.0f / 127.0f;

// RN(1/s) of a positive half value s (2^-24 … 65504), as __frcp_rn: the approximate reciprocal and one
// Newton step, the operations of __frcp_rn's fast path, which rounds correctly wherever the reciprocal
// is a normal float — always for a half — so without its range check and slow-path branch.
__device__ __forceinline__ float ReciprocalOfHalf(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(s));
  return fmaf(fmaf(-s, r, 1.0f), r, r);
}

// Integer codes become floats through the exponent trick: the float with bits 0x4b000000 | c is
// 2^23 + c exactly (c < 2^23), so subtracting 2^23 gives c without an integer conversion (a
// quarter-rate instruction on sm_90).
inline constexpr uint32_t kExponent23 = 0x4b000000u;

template <PageFormat F>
struct DevicePageCodec;

// ── INT4 ────────────────────────────────────────────────────────────────────────────────────────
template <>
struct DevicePageCodec<PageFormat::kInt4> {
  static constexpr PageFormat kFormat = PageFormat::kInt4;
  // Lane l holds channels l·kPerLane …; its codes are kPerLane nibbles, channel 2j low, 2j+1 high.
  template <int kPerLane>
  __device__ __forceinline__ static void StoreRow(const float (&x)[kPerLane], int lane, int slot, uint8_t* page) {
    constexpr int kDim = 32 * kPerLane;
    uint8_t* codes = page + slot * PageCodec<kFormat>::CodeBytes(kDim);
    uint8_t* meta = page + MetaOffset(kFormat, kDim) + slot * PageCodec<kFormat>::kMetaBytes;
    float mn = x[0], mx = x[0];
#pragma unroll
    for (int i = 1; i < kPerLane; ++i) mn = fminf(mn, x[i]), mx = fmaxf(mx, x[i]);
    mn = WarpMin(mn), mx = WarpMax(mx);
    const uint16_t scale_bits = FloatToHalfBits(ClampToHalfRange(DivideByReciprocal(mx - mn, 15.0f, kInv15)));
    const uint16_t lo_bits = FloatToHalfBits(ClampToHalfRange(mn));
    const float scale = HalfBits(scale_bits), lo = HalfBits(lo_bits);
    const float inv = scale > 0.0f ? ReciprocalOfHalf(scale) : 0.0f;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {  // rint then clamp to [0, 15], as integers
      const int c = min(max(__float2int_rn(__fmul_rn(x[i] - lo, inv)), 0), 15);
      packed |= static_cast<uint32_t>(c) << (4 * i);
    }
    if constexpr (kPerLane == 4) {
      *reinterpret_cast<uint16_t*>(codes + 2 * lane) = static_cast<uint16_t>(packed);
    } else {
      codes[lane] = static_cast<uint8_t>(packed);
    }
    if (lane == 0) *reinterpret_cast<uint32_t*>(meta) = scale_bits | (static_cast<uint32_t>(lo_bits) << 16);
  }

  struct Raw {
    uint32_t codes;  // 8 nibbles, channel 2k in the low nibble of byte k
    uint32_t meta;   // scale | lo << 16 (fp16 bits)
  };
  template <int kDim>
  __device__ __forceinline__ static Raw Load(const uint8_t* raw, int r, int c8) {
    return {*reinterpret_cast<const uint32_t*>(raw + r * (kDim / 2) + c8 * 4),
            *reinterpret_cast<const uint32_t*>(raw + MetaOffset(kFormat, kDim) + r * 4)};
  }
  // fp32 lo + code·scale with one rounding (fmaf), then bf16.
  __device__ __forceinline__ static uint4 Convert(const Raw& u) {
    const float scale = HalfBits(u.meta & 0xffffu), lo = HalfBits(u.meta >> 16);
    const uint32_t even = u.codes & 0x0f0f0f0fu, odd = (u.codes >> 4) & 0x0f0f0f0fu;  // byte k: channel 2k / 2k+1
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // bytes (code, 0, 0, 0x4b): 2^23 + code
      v[2 * k] = fmaf(__uint_as_float(__byte_perm(even, kExponent23, 0x7540 + k)) - 8388608.0f, scale, lo);
      v[2 * k + 1] = fmaf(__uint_as_float(__byte_perm(odd, kExponent23, 0x7540 + k)) - 8388608.0f, scale, lo);
    }
    return make_uint4(PackBf16(v[0], v[1]), PackBf16(v[2], v[3]), PackBf16(v[4], v[5]), PackBf16(v[6], v[7]));
  }

  // The sm90 kernel keeps INT4 K as 128 + code in bf16 (exact) and folds each key's scale and lo into
  // its key table: k̂·q = scale·(S' − 128·Σq) + lo·Σq, S' the product with the tile as held (see
  // attention_sm90_producer.cuh). Returns (a_j, b_j) for logit·c = a_j·S' + b_j·Σq, c = scale_log2.
  static constexpr bool kKeyTileHoldsCodes = true;
  template <int kDim>
  __device__ __forceinline__ static float2 KeyFactors(const uint8_t* page, int slot, float scale_log2) {
    const uint32_t meta = *reinterpret_cast<const uint32_t*>(page + MetaOffset(kFormat, kDim) + slot * 4);
    const float scale = HalfBits(meta & 0xffffu), lo = HalfBits(meta >> 16);
    return make_float2(scale * scale_log2, fmaf(-128.0f, scale, lo) * scale_log2);
  }
};

// INT4 decode in bf16x2 arithmetic (the sm90 kernel's V tiles). (0x4300 | code) is the bf16 of
// 128 + code, so one byte permute and one mask make a channel pair and an exact subtraction gives the
// codes. lo is split into a bf16 high part and a bf16 rest (exact to 2^-17), scale is rounded to bf16:
// code·scale + lo_high rounds once near the value and adding lo_rest rounds again. Against format.h's
// exact decode (bench/int4_v_decode_error.py, in quantization steps, RMS): 0.019 on centred rows (0.009
// for the fp32 decode rounded to bf16, 0.012 with scale split too, at one more instruction per channel
// pair; the quantization's own error is 0.25); on uncentred rows (|lo| ≫ the step, no smoothing) the
// bf16 output rounding dominates (0.44 either way vs 0.32), while an unsplit lo would add |lo|·2^-9
// (run 23: the untransformed INT4 case's rel L2 vs the CPU went from under 0.015 to 0.024). Only V
// takes this path: an error in V reaches the output linearly, averaged over keys, while K's error is a
// logit error that softmax amplifies — rounding a K row's scale to bf16 took cuda_layer_test's INT4
// case from rel L2 0.004 to 0.017 — so K stays exact (codes and the fp32 key table).
struct Int4RowBf16 {
  __nv_bfloat162 scale, lo_high, lo_rest;
};
__device__ __forceinline__ Int4RowBf16 Int4RowOf(uint32_t meta) {
  const float scale = HalfBits(meta & 0xffffu), lo = HalfBits(meta >> 16);
  const uint32_t scale2 = PackBf16(scale, scale), lo_high = PackBf16(lo, lo);
  const float rest = lo - __uint_as_float(lo_high << 16);
  const uint32_t lo_rest = PackBf16(rest, rest);
  Int4RowBf16 row;
  row.scale = *reinterpret_cast<const __nv_bfloat162*>(&scale2);
  row.lo_high = *reinterpret_cast<const __nv_bfloat162*>(&lo_high);
  row.lo_rest = *reinterpret_cast<const __nv_bfloat162*>(&lo_rest);
  return row;
}
// 8 INT4 codes → the bf16 of 128 + code, channel pairs (2j, 2j + 1) in word j.
// `exponent` is 0x43004300 read from shared memory (kBf16Exponent), so that mask-and-or is one LOP3
// (it takes one immediate; a constant ptxas can see becomes a second LOP3).
inline constexpr uint32_t kBf16Exponent = 0x43004300u;
__device__ __forceinline__ uint4 Int4CodesPlus128(uint32_t codes, uint32_t exponent) {
  const uint32_t high = codes >> 4;  // byte j of `high` has channel 2j + 1 in its low nibble
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = (__byte_perm(codes, high, 0x4400 + 0x1111 * j) & 0x000f000fu) | exponent;
  return make_uint4(out[0], out[1], out[2], out[3]);
}
__device__ __forceinline__ uint4 Int4Bf16Unit(uint32_t codes, const Int4RowBf16& row, uint32_t exponent) {
  const uint4 plus128 = Int4CodesPlus128(codes, exponent);
  const uint32_t pairs[4] = {plus128.x, plus128.y, plus128.z, plus128.w};
  const __nv_bfloat162 bias = __floats2bfloat162_rn(128.0f, 128.0f);
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 code = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&pairs[j]), bias);
    const __nv_bfloat162 v = __hadd2(__hfma2(code, row.scale, row.lo_high), row.lo_rest);
    out[j] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// ── INT8 ────────────────────────────────────────────────────────────────────────────────────────
template <>
struct DevicePageCodec<PageFormat::kInt8> {
  static constexpr PageFormat kFormat = PageFormat::kInt8;
  template <int kPerLane>
  __device__ __forceinline__ static void StoreRow(const float (&x)[kPerLane], int lane, int slot, uint8_t* page) {
    constexpr int kDim = 32 * kPerLane;
    uint8_t* codes = page + slot * PageCodec<kFormat>::CodeBytes(kDim);
    uint8_t* meta = page + MetaOffset(kFormat, kDim) + slot * PageCodec<kFormat>::kMetaBytes;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) amax = fmaxf(amax, fabsf(x[i]));
    amax = WarpMax(amax);
    const uint16_t scale_bits = FloatToHalfBits(ClampToHalfRange(DivideByReciprocal(amax, 127.0f, kInv127)));
    const float scale = HalfBits(scale_bits);
    const float inv = scale > 0.0f ? ReciprocalOfHalf(scale) : 0.0f;
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = min(max(__float2int_rn(__fmul_rn(x[i], inv)), -127), 127);
      packed |= (static_cast<uint32_t>(c) & 0xffu) << (8 * i);
    }
    if constexpr (kPerLane == 4) {
      *reinterpret_cast<uint32_t*>(codes + 4 * lane) = packed;
    } else {
      *reinterpret_cast<uint16_t*>(codes + 2 * lane) = static_cast<uint16_t>(packed);
    }
    if (lane == 0) *reinterpret_cast<uint16_t*>(meta) = scale_bits;
  }

  struct Raw {
    uint32_t lo, hi;  // 8 codes, channel k in byte k of lo (k < 4) or hi
    uint32_t meta;    // scale (fp16 bits)
  };
  template <int kDim>
  __device__ __forceinline__ static Raw Load(const uint8_t* raw, int r, int c8) {
    const uint2 codes = *reinterpret_cast<const uint2*>(raw + r * kDim + c8 * 8);
    return {codes.x, codes.y, *reinterpret_cast<const uint16_t*>(raw + MetaOffset(kFormat, kDim) + r * 2)};
  }
  // fp32 code·scale, then bf16.
  __device__ __forceinline__ static uint4 Convert(const Raw& u) {
    const float scale = HalfBits(u.meta);
    const uint32_t x = u.lo ^ 0x80808080u, y = u.hi ^ 0x80808080u;  // each byte: code + 128
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = (__uint_as_float(__byte_perm(x, kExponent23, 0x7540 + k)) - 8388736.0f) * scale;  // 2^23 + 128
      v[4 + k] = (__uint_as_float(__byte_perm(y, kExponent23, 0x7540 + k)) - 8388736.0f) * scale;
    }
    return make_uint4(PackBf16(v[0], v[1]), PackBf16(v[2], v[3]), PackBf16(v[4], v[5]), PackBf16(v[6], v[7]));
  }

  // The K tile holds k̂ itself (bf16): a_j = c, b_j = 0.
  static constexpr bool kKeyTileHoldsCodes = false;
  template <int kDim>
  __device__ __forceinline__ static float2 KeyFactors(const uint8_t*, int, float scale_log2) {
    return make_float2(scale_log2, 0.0f);
  }
};

// ── BF16 ────────────────────────────────────────────────────────────────────────────────────────
template <>
struct DevicePageCodec<PageFormat::kBf16> {
  static constexpr PageFormat kFormat = PageFormat::kBf16;
  template <int kPerLane>
  __device__ __forceinline__ static void StoreRow(const float (&x)[kPerLane], int lane, int slot, uint8_t* page) {
    constexpr int kDim = 32 * kPerLane;
    uint8_t* codes = page + slot * PageCodec<kFormat>::CodeBytes(kDim);
    StoreBf16(reinterpret_cast<uint16_t*>(codes) + kPerLane * lane, x);
  }

  struct Raw {
    uint4 bits;  // the 8 values
  };
  template <int kDim>
  __device__ __forceinline__ static Raw Load(const uint8_t* raw, int r, int c8) {
    return {*reinterpret_cast<const uint4*>(raw + r * kDim * 2 + c8 * 16)};
  }
  __device__ __forceinline__ static uint4 Convert(const Raw& u) { return u.bits; }

  static constexpr bool kKeyTileHoldsCodes = false;
  template <int kDim>
  __device__ __forceinline__ static float2 KeyFactors(const uint8_t*, int, float scale_log2) {
    return make_float2(scale_log2, 0.0f);
  }
};

// ── Over a runtime format ───────────────────────────────────────────────────────────────────────

// Channels c8·8 … c8·8 + 7 of row r of a raw page in `format` as 8 bf16; zeros for rows at or past
// n_valid.
template <int kDim>
__device__ __forceinline__ uint4 DecodeUnit(const uint8_t* raw, PageFormat format, int n_valid, int r, int c8) {
  return DispatchFormat(format, [&](auto tag) {
    using Codec = DevicePageCodec<decltype(tag)::kFormat>;
    if (r >= n_valid) return make_uint4(0, 0, 0, 0);
    return Codec::Convert(Codec::template Load<kDim>(raw, r, c8));
  });
}

// A warp's row into slot `slot` of a page in `format`.
template <int kPerLane>
__device__ __forceinline__ void StorePageRow(const float (&x)[kPerLane], int lane, PageFormat format, int slot,
                                             uint8_t* page) {
  DispatchFormat(format, [&](auto tag) {
    DevicePageCodec<decltype(tag)::kFormat>::template StoreRow<kPerLane>(x, lane, slot, page);
  });
}

}  // namespace kvpack::cuda
