// The page codecs of format v1, device twin of kernels/page_codec.h: per format, what the CUDA kernels
// need to write and read its rows. Internal to kernels/cuda: include only from .cu files.
//
//   DevicePageCodec<F>::StoreRow      a warp's rotated row (32 lanes × kPerLane values) → codes + meta
//                                     (the row epilogue; the same codes as PageCodec<F>::EncodeRow)
//   LoadUnit<F> / ConvertUnit<F>      8 channels of one row of a raw page → 8 bf16 in one uint4, as
//                                     PageCodec<F>::DecodeRow then bf16 rounding (split so that a
//                                     caller issues several loads before the first conversion)
//   DecodeUnit                        both over a runtime format (DispatchFormat)
//   Int4RowOf / Int4Bf16Unit          8 channels of an INT4 V row → 8 bf16 in bf16x2 arithmetic (close
//                                     to, not bit-equal to, the exact decode: see there)
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

// format.h's RowScaleToHalf with the hardware conversion: the nearest fp16 of a row's scale v ≥ 0, or the
// next one up where the nearest is a subnormal below v, or zero while `span` is not (so no code clips).
__device__ __forceinline__ uint16_t RowScaleBits(float v, float span) {
  const uint16_t h = FloatToHalfBits(v);
  if (h >= kHalfMinNormalBits) return h;
  return HalfBits(h) < v || (h == 0 && span > 0.0f) ? static_cast<uint16_t>(h + 1u) : h;
}

// Integer codes become floats through the exponent trick: the float with bits 0x4b000000 | c is
// 2^23 + c exactly (c < 2^23), so subtracting 2^23 gives c without an integer conversion (a
// quarter-rate instruction on sm_90).
inline constexpr uint32_t kExponent23 = 0x4b000000u;

template <PageFormat F>
struct DevicePageCodec;

// format.h's Int4ScalarArith with the hardware conversions: the same values for every row the search
// reaches (ChooseInt4Row: a normal step, so DivideByReciprocal is the IEEE quotient; half scales, so
// ReciprocalOfHalf is RN(1/scale)), and for the min–max rows as before.
struct Int4DeviceArith {
  __device__ __forceinline__ static float Step(float span) { return DivideByReciprocal(span, 15.0f, kInv15); }
  __device__ __forceinline__ static uint16_t ScaleBits(float span) {
    return RowScaleBits(ClampToHalfRange(DivideByReciprocal(span, 15.0f, kInv15)), span);
  }
  __device__ __forceinline__ static uint16_t LoBits(float lo) { return FloatToHalfBits(ClampToHalfRange(lo)); }
  __device__ __forceinline__ static float Half(uint16_t h) { return HalfBits(h); }
  __device__ __forceinline__ static float Reciprocal(float scale) { return scale > 0.0f ? ReciprocalOfHalf(scale) : 0.0f; }
};
// format.h's Int4Code in integers: rint then clamp to [0, 15] (NaN → 0, as there).
__device__ __forceinline__ uint32_t Int4DeviceCode(float x, float lo, float inv) {
  return static_cast<uint32_t>(min(max(__float2int_rn(__fmul_rn(x - lo, inv)), 0), 15));
}

// One value's term of a candidate's error: 2^23 + Int4ErrorUnits(x, lo, scale, Int4Code(x, lo, inv),
// unit) as float bits, without a conversion instruction (quarter rate on sm_90): the code is the
// clamped (x − lo)·inv rounded by adding and subtracting 1.5·2^23 (rint, for |t| ≤ 15, and clamping
// before rounding gives the same code, as both bounds are integers; NaN → 0 as in format.h), and the
// error in [0, 2^22] rounds to an integer in the low bits of e + 2^23. Summing n such terms in uint32
// gives n·0x4b000000 + Σ units (mod 2^32), the same for every lane order.
__device__ __forceinline__ uint32_t Int4ErrorTerm(float x, float lo, float scale, float inv, float unit) {
  constexpr float kRoundMagic = 12582912.0f;  // 1.5·2^23
  const float t = fminf(fmaxf(__fmul_rn(x - lo, inv), 0.0f), 15.0f);
  const float code = __fsub_rn(__fadd_rn(t, kRoundMagic), kRoundMagic);
  const float r = x - __fmaf_rn(code, scale, lo);  // code·scale is exact: one rounding, as lo + code·scale
  const float e = fminf(__fmul_rn(__fmul_rn(r, r), unit), kInt4ErrorClamp);
  return __float_as_uint(__fadd_rn(e, 8388608.0f));
}

// format.h's ChooseInt4Row for a warp's row: the same candidates in the same order, the first of least
// error kept. Lane c < kInt4Candidates computes candidate c's parameters (Int4CandidateMeta) and the
// loop reads them by shuffles, so each lane converts one candidate instead of nine.
template <int kPerLane>
__device__ __forceinline__ Int4RowMeta SearchInt4Row(const float (&x)[kPerLane], int lane, float mn, float mx) {
  Int4RowMeta kept;
  kept.scale = Int4DeviceArith::ScaleBits(mx - mn);
  kept.lo = Int4DeviceArith::LoBits(mn);
  if (!Int4RowSearched(mn, mx)) return kept;  // mn, mx are the warp's: every lane takes the same branch
  const float step0 = Int4DeviceArith::Step(mx - mn);
  const float unit = Int4ErrorUnit(step0);
  const Int4RowMeta own = Int4CandidateMeta<Int4DeviceArith>(mn, mx, step0, lane % kInt4Candidates);
  const float own_scale = HalfBits(own.scale), own_lo = HalfBits(own.lo);
  const float own_inv = Int4DeviceArith::Reciprocal(own_scale);
  constexpr uint32_t kTermBias = 32u * kPerLane * 0x4b000000u;  // the warp's n·2^23 bits (mod 2^32)
  uint32_t best = 0xffffffffu;
  int best_cand = 0;
#pragma unroll
  for (int cand = 0; cand < kInt4Candidates; ++cand) {
    const float lo = __shfl_sync(kFullMask, own_lo, cand), scale = __shfl_sync(kFullMask, own_scale, cand);
    const float inv = __shfl_sync(kFullMask, own_inv, cand);
    uint32_t terms = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) terms += Int4ErrorTerm(x[i], lo, scale, inv, unit);
    const uint32_t err = WarpSumU32(terms) - kTermBias;
    if (err < best) best = err, best_cand = cand;
  }
  const uint32_t bits = __shfl_sync(kFullMask, own.scale | (static_cast<uint32_t>(own.lo) << 16), best_cand);
  kept.scale = static_cast<uint16_t>(bits & 0xffffu);
  kept.lo = static_cast<uint16_t>(bits >> 16);
  return kept;
}

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
    const Int4RowMeta m = SearchInt4Row(x, lane, mn, mx);
    const float scale = HalfBits(m.scale), lo = HalfBits(m.lo);
    const float inv = Int4DeviceArith::Reciprocal(scale);
    uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) packed |= Int4DeviceCode(x[i], lo, inv) << (4 * i);
    if constexpr (kPerLane == 4) {
      *reinterpret_cast<uint16_t*>(codes + 2 * lane) = static_cast<uint16_t>(packed);
    } else {
      codes[lane] = static_cast<uint8_t>(packed);
    }
    if (lane == 0) *reinterpret_cast<uint32_t*>(meta) = m.scale | (static_cast<uint32_t>(m.lo) << 16);
  }

};

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
    const uint16_t scale_bits = RowScaleBits(ClampToHalfRange(DivideByReciprocal(amax, 127.0f, kInv127)), amax);
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

};

// ── Decode: 8 channels of one row ───────────────────────────────────────────────────────────────
// Channels c8·8 … c8·8 + 7 of row r of a raw page (shared memory) in format F: LoadUnit reads the
// bytes, ConvertUnit makes 8 bf16 of them exactly as PageCodec<F>::DecodeRow then bf16 rounding (fp32:
// lo + code·scale with one rounding, or code·scale). Split so that a caller can issue several units'
// loads before their stores.
template <PageFormat F>
struct RawUnit {
  uint4 bits;  // INT4: x = codes (8 nibbles), y = meta (scale | lo << 16); INT8: x, y = codes, z = scale; BF16: values
};

template <PageFormat F, int kDim>
__device__ __forceinline__ RawUnit<F> LoadUnit(const uint8_t* raw, int r, int c8) {
  RawUnit<F> u;
  if constexpr (F == PageFormat::kInt4) {
    u.bits.x = *reinterpret_cast<const uint32_t*>(raw + r * (kDim / 2) + c8 * 4);
    u.bits.y = *reinterpret_cast<const uint32_t*>(raw + MetaOffset(PageFormat::kInt4, kDim) + r * 4);
  } else if constexpr (F == PageFormat::kInt8) {
    const uint2 codes = *reinterpret_cast<const uint2*>(raw + r * kDim + c8 * 8);
    u.bits.x = codes.x, u.bits.y = codes.y;
    u.bits.z = *reinterpret_cast<const uint16_t*>(raw + MetaOffset(PageFormat::kInt8, kDim) + r * 2);
  } else if constexpr (F == PageFormat::kBf16) {
    u.bits = *reinterpret_cast<const uint4*>(raw + r * kDim * 2 + c8 * 16);
  } else {
    static_assert(kUnhandledFormat<F>, "LoadUnit has no case for this format");
  }
  return u;
}

template <PageFormat F>
__device__ __forceinline__ uint4 ConvertUnit(const RawUnit<F>& u) {
  if constexpr (F == PageFormat::kBf16) {
    return u.bits;
  } else {
    float v[8];
    if constexpr (F == PageFormat::kInt4) {
      const float scale = HalfBits(u.bits.y & 0xffffu), lo = HalfBits(u.bits.y >> 16);
      const uint32_t even = u.bits.x & 0x0f0f0f0fu, odd = (u.bits.x >> 4) & 0x0f0f0f0fu;  // byte k: channel 2k / 2k+1
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // bytes (code, 0, 0, 0x4b): 2^23 + code
        v[2 * k] = fmaf(__uint_as_float(__byte_perm(even, kExponent23, 0x7540 + k)) - 8388608.0f, scale, lo);
        v[2 * k + 1] = fmaf(__uint_as_float(__byte_perm(odd, kExponent23, 0x7540 + k)) - 8388608.0f, scale, lo);
      }
    } else if constexpr (F == PageFormat::kInt8) {
      const float scale = HalfBits(u.bits.z);
      const uint32_t x = u.bits.x ^ 0x80808080u, y = u.bits.y ^ 0x80808080u;  // each byte: code + 128
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[k] = (__uint_as_float(__byte_perm(x, kExponent23, 0x7540 + k)) - 8388736.0f) * scale;  // 2^23 + 128
        v[4 + k] = (__uint_as_float(__byte_perm(y, kExponent23, 0x7540 + k)) - 8388736.0f) * scale;
      }
    } else {
      static_assert(kUnhandledFormat<F>, "ConvertUnit has no case for this format");
    }
    return make_uint4(PackBf16(v[0], v[1]), PackBf16(v[2], v[3]), PackBf16(v[4], v[5]), PackBf16(v[6], v[7]));
  }
}

// One unit, zeros for rows at or past n_valid.
template <PageFormat F, int kDim>
__device__ __forceinline__ uint4 DecodeUnitOf(const uint8_t* raw, int n_valid, int r, int c8) {
  if (r >= n_valid) return make_uint4(0, 0, 0, 0);
  return ConvertUnit<F>(LoadUnit<F, kDim>(raw, r, c8));
}

// ── INT4 V rows in bf16x2 arithmetic (the attention kernels' V decode) ───────────────────────────
// 8 INT4 V codes (one 32-bit word, channel 2j in the low nibble of byte j) → 8 bf16 lo + code·scale,
// in bf16x2 arithmetic: (0x4300 | code) is the bf16 of 128 + code, so one byte permute and one mask
// make a channel pair and an exact subtraction gives the codes. lo is split into a bf16 high part and
// a bf16 rest (exact to 2^-17), scale is rounded to bf16: code·scale + lo_high rounds once near the
// value and adding lo_rest rounds again. Against format.h's exact decode (bench/int4_v_decode_error.py,
// in quantization steps, RMS): 0.019 on centred rows (0.009 for the fp32 decode rounded to bf16,
// 0.012 with scale split too, at one more instruction per channel pair; the quantization's own error
// is 0.25); on uncentred rows (|lo| ≫ the step, no smoothing) the bf16 output rounding dominates
// (0.44 either way vs 0.32), while an unsplit lo would add |lo|·2^-9 (run 23: the untransformed INT4
// case's rel L2 vs the CPU went from under 0.015 to 0.024). Only V pages take this path: an error in
// V reaches the output linearly, averaged over keys, while K's error is a logit error that softmax
// amplifies — rounding a K row's scale to bf16 took cuda_layer_test's INT4 case from rel L2 0.004 to
// 0.017 — so K pages keep the exact fp32 decode.
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

// ── Integer codes: 16 channels of one row (the INT8 MMA path's K operand, mma_path.h) ───────────
// Channels c16·16 … c16·16 + 15 of row r of a raw page as 16 int8 codes, channel order kept: INT4's
// nibbles widened to bytes (0…15, which are int8 values too), INT8's bytes as stored. With the row's
// IntegerRowAffine (scale, lo), x̂_c = lo + code_c · scale, as PageCodec<F>::IntegerRow. Formats without
// integer codes (PageCodec<F>::kIntegerCodes false) have no case.
template <PageFormat F, int kDim>
__device__ __forceinline__ uint4 IntegerCodesUnit(const uint8_t* raw, int r, int c16) {
  if constexpr (F == PageFormat::kInt4) {
    const uint2 w = *reinterpret_cast<const uint2*>(raw + r * (kDim / 2) + c16 * 8);
    const uint32_t even0 = w.x & 0x0f0f0f0fu, odd0 = (w.x >> 4) & 0x0f0f0f0fu;  // byte k: channel 2k / 2k+1
    const uint32_t even1 = w.y & 0x0f0f0f0fu, odd1 = (w.y >> 4) & 0x0f0f0f0fu;
    return make_uint4(__byte_perm(even0, odd0, 0x5140), __byte_perm(even0, odd0, 0x7362),
                      __byte_perm(even1, odd1, 0x5140), __byte_perm(even1, odd1, 0x7362));
  } else if constexpr (F == PageFormat::kInt8) {
    return *reinterpret_cast<const uint4*>(raw + r * kDim + c16 * 16);
  } else {
    static_assert(kUnhandledFormat<F>, "IntegerCodesUnit: only formats with integer codes (PageCodec::kIntegerCodes)");
    return make_uint4(0, 0, 0, 0);
  }
}
template <PageFormat F, int kDim>
__device__ __forceinline__ float2 IntegerRowAffine(const uint8_t* raw, int r) {  // (scale, lo)
  if constexpr (F == PageFormat::kInt4) {
    const uint32_t meta = *reinterpret_cast<const uint32_t*>(raw + MetaOffset(PageFormat::kInt4, kDim) + r * 4);
    return make_float2(HalfBits(meta & 0xffffu), HalfBits(meta >> 16));
  } else if constexpr (F == PageFormat::kInt8) {
    return make_float2(HalfBits(*reinterpret_cast<const uint16_t*>(raw + MetaOffset(PageFormat::kInt8, kDim) + r * 2)), 0.0f);
  } else {
    static_assert(kUnhandledFormat<F>, "IntegerRowAffine: only formats with integer codes (PageCodec::kIntegerCodes)");
    return make_float2(0.0f, 0.0f);
  }
}

// ── Over a runtime format ───────────────────────────────────────────────────────────────────────

// DecodeUnitOf for a page's runtime format.
template <int kDim>
__device__ __forceinline__ uint4 DecodeUnit(const uint8_t* raw, PageFormat format, int n_valid, int r, int c8) {
  return DispatchFormat(format, [&](auto tag) { return DecodeUnitOf<decltype(tag)::kFormat, kDim>(raw, n_valid, r, c8); });
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
