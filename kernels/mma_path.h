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
//   kAuto  the fastest path that meets the accuracy bounds for the entry (ResolveMmaPath).
// The path is a layer option (AttentionOptions::mma); kernels receive the resolved one.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/format.h"

namespace kvpack {

enum class MmaPath : uint8_t { kAuto = 0, kBf16 = 1, kInt8 = 2 };

inline const char* MmaPathName(MmaPath path) {
  switch (path) {
    case MmaPath::kAuto: return "auto";
    case MmaPath::kBf16: return "bf16";
    case MmaPath::kInt8: return "int8";
  }
  return "unknown";
}

// What a request for `requested` runs on an entry of head_dim, rotated or not, with or without BF16
// pages. kInt8 needs INT4/INT8 pages only. kAuto takes kInt8 where it measured faster and within its
// accuracy bounds (H200, bench/RESULTS.md session 6): d = 128 on rotated entries — INT4 attention
// 384 vs 363 TFLOP/s, INT8 369 vs 328, the path's own error ≤ 0.006; at d = 64 it was 5% slower, and
// without the rotation Q's outlier channels coarsen each row's int8 step (rel L2 vs FP64 0.083 vs 0.006).
inline MmaPath ResolveMmaPath(MmaPath requested, bool has_bf16_pages, int head_dim, bool rotated) {
  if (has_bf16_pages) return MmaPath::kBf16;
  if (requested == MmaPath::kInt8) return MmaPath::kInt8;
  if (requested == MmaPath::kAuto && head_dim == 128 && rotated) return MmaPath::kInt8;
  return MmaPath::kBf16;
}

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

}  // namespace kvpack
