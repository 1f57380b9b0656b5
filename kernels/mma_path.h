// Which tensor-core arithmetic computes attention over the packed pages (issue 12, part 2).
//
//   kBf16  S = Q·Kᵀ and O += P·V in bf16 with fp32 accumulation, from pages decoded to bf16: the exact
//          path (the CPU reference computes it in fp32).
//   kInt8  S in INT8: each query row of the stored-form Q (bf16) is quantized symmetrically to int8
//          (QuantizeQueryRow below, the same bits on host and device), INT4 K codes (0…15) and INT8 K
//          codes (−127…127) are multiplied as stored, exactly, into int32; the logit is then
//              s_q · scale_j · Σ_c q_c·code_jc  +  Σ_c q̂_c · lo_j        (INT4; INT8 pages have lo = 0)
//          where Σ_c q̂_c is the sum of the bf16 query row itself. P·V stays bf16. Only pages in INT4
//          or INT8 can take it: an entry holding any BF16 page runs kBf16 (ResolveMmaPath).
//   kFp8   S as on kInt8; O += P·V of INT4 pages with FP8 (e4m3) operands, as Hopper's FP8 wgmma would
//          take them: V as its centred codes code − 8 (−8…7, exact in e4m3), each key's V scale folded
//          into P before the rounding, the offset apart in fp32. For a page with V rows
//          v̂_j = lo_j + s_j·code_j and s_max = max_j s_j over its valid rows:
//              g_j   = s_j · RN(256 / s_max)                       (Fp8PageFactor; 0 when s_max = 0)
//              P'_j  = e4m3(p_j · g_j)                             (Fp8E4m3Round: RN-even, saturating)
//              O    += (s_max / 256) · Σ_j P'_j · (code_j − 8)     (a fresh accumulator per page, added
//                                                                   into O in fp32: FP8 accumulation keeps
//                                                                   ~13 bits and must not run across pages)
//              off  += Σ_j p_j · (lo_j + 8·s_j)                    (fp32, a scalar per query row; o = (O + off) / ℓ)
//          The 256 keeps p down to ~2^-17 out of e4m3's subnormals (P' ≤ 256 < 448). INT8 pages take P·V
//          in bf16 on this path (their codes are not exact in e4m3); BF16 pages run kBf16 as for kInt8.
//          The CPU reference emulates it (cpu/attention.h); no GPU kernel runs it yet: the CUDA backend
//          refuses it (cuda/layer.h ResolveLayerKernel), and no client API carries it.
//   kAuto  the fastest path that meets the accuracy bounds for the entry (ResolveMmaPath).
// The path is a layer option (AttentionOptions::mma); kernels receive the resolved one.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/format.h"

namespace kvpack {

enum class MmaPath : uint8_t { kAuto = 0, kBf16 = 1, kInt8 = 2, kFp8 = 3 };

inline const char* MmaPathName(MmaPath path) {
  switch (path) {
    case MmaPath::kAuto: return "auto";
    case MmaPath::kBf16: return "bf16";
    case MmaPath::kInt8: return "int8";
    case MmaPath::kFp8: return "fp8";
  }
  return "unknown";
}

// What a request for `requested` runs on an entry of head_dim, rotated or not, with or without BF16
// pages. kInt8 needs INT4/INT8 pages only. kAuto takes kInt8 where it measured faster and within its
// accuracy bounds (H200, bench/RESULTS.md session 6): d = 128 on rotated entries — INT4 attention
// 384 vs 363 TFLOP/s, INT8 369 vs 328, the path's own error ≤ 0.006; at d = 64 it was 5% slower, and
// without the rotation Q's outlier channels coarsen each row's int8 step (rel L2 vs FP64 0.083 vs 0.006).
// kFp8 is taken only when asked for (not measured on a GPU yet), under kInt8's condition.
inline MmaPath ResolveMmaPath(MmaPath requested, bool has_bf16_pages, int head_dim, bool rotated) {
  if (has_bf16_pages) return MmaPath::kBf16;
  if (requested == MmaPath::kInt8 || requested == MmaPath::kFp8) return requested;
  if (requested == MmaPath::kAuto && head_dim == 128 && rotated) return MmaPath::kInt8;
  return MmaPath::kBf16;
}

// Whether the path computes S from the queries' int8 codes (kInt8 and kFp8).
constexpr bool Int8Logits(MmaPath path) { return path == MmaPath::kInt8 || path == MmaPath::kFp8; }

// ── The INT8 path's query quantization (host and device: the same bits from the same bf16 row) ──
// A row q[0, d) of the stored-form query: amax = max |q_c|; s_q = amax / 127 (correctly rounded);
// code_c = rne(q_c · (1 / s_q)) (the reciprocal correctly rounded), within ±127. An all-zero row has
// s_q = 1 and codes 0, so that its logits are 0 and a masked key's −∞ stays −∞ (not 0 · ∞).
inline constexpr float kQueryCodeMax = 127.0f;
struct QueryScale {
  float scale;  // s_q
  float inv;    // 1 / s_q, or 0 for an all-zero row
};
KVPACK_HD inline QueryScale QueryScaleOf(float amax) {
  if (!(amax > 0.0f)) return {1.0f, 0.0f};
  const float scale = amax / kQueryCodeMax;
  return {scale, 1.0f / scale};
}
// (A non-finite q, which validated inputs never give, codes as 0 rather than an undefined conversion.)
KVPACK_HD inline int8_t QueryCode(float q, const QueryScale& s) {
  float c = rintf(q * s.inv);
  c = c > kQueryCodeMax ? kQueryCodeMax : (c < -kQueryCodeMax ? -kQueryCodeMax : c);
  return c == c ? static_cast<int8_t>(c) : 0;
}
// The whole row, one value at a time (the host's form; the kernels spread it over a warp): codes[0, d)
// and its scale. The INT8 path's pooled keys (sparse attention) are quantized the same way.
KVPACK_HD inline QueryScale QuantizeQueryRow(const float* q, int d, int8_t* codes) {
  float amax = 0.0f;
  for (int c = 0; c < d; ++c) amax = fmaxf(amax, fabsf(q[c]));
  const QueryScale s = QueryScaleOf(amax);
  for (int c = 0; c < d; ++c) codes[c] = QueryCode(q[c], s);
  return s;
}

// ── The FP8 path's P·V operands (kFp8 above) ────────────────────────────────────────────────────
// x rounded to OCP e4m3 (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinities) as
// cvt.rn.satfinite.e4m3x2.f32 rounds: to nearest, ties to even; finite values beyond the largest
// (448) become ±448; normals from 2^-6, subnormals 2^-9 apart below it; NaN stays NaN.
inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kE4m3MinNormal = 0.015625f;  // 2^-6
KVPACK_HD inline float Fp8E4m3Round(float x) {
  if (x != x) return x;
  const float a = fabsf(x);
  float r;
  if (a >= kE4m3Max) {
    r = kE4m3Max;
  } else if (a < kE4m3MinNormal) {
    r = rintf(a * 512.0f) * 0.001953125f;  // multiples of 2^-9, exact scalings
  } else {  // keep 3 of the 23 mantissa bits, ties to even (a carry moves into the exponent)
    uint32_t bits;
    memcpy(&bits, &a, sizeof(bits));
    bits += 0x7ffffu + ((bits >> 20) & 1u);
    bits &= 0xfff00000u;
    memcpy(&r, &bits, sizeof(r));  // a < 448 rounds to at most 448
  }
  return x < 0.0f ? -r : r;
}
// How far P is scaled before its rounding: P' = p·g_j ≤ 256 (p ≤ 1, g_j ≤ 256).
inline constexpr float kFp8PScale = 256.0f;
// RN(256 / s_max) for a page whose largest valid V scale is s_max ≥ 0 (0 for s_max = 0: every row of
// such a page is its offset alone). g_j = s_j · Fp8PageFactor(s_max); the page's sum is unscaled by
// s_max / 256 (exact: a power of two).
KVPACK_HD inline float Fp8PageFactor(float s_max) { return s_max > 0.0f ? kFp8PScale / s_max : 0.0f; }

}  // namespace kvpack
