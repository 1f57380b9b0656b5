// kvpack packed K/V format, version 3 (docs/format.md).
//
// One definition for host and device code: the CPU reference, the CUDA kernels and the planner all
// include this header. Nothing here allocates, throws or knows about the server.
//
// ── What is stored ────────────────────────────────────────────────────────────────────────────────
// For every (token, head) row of d values (d = head_dim):
//   K row:  R_k · ((k − μ_k) / λ)      quantized per row
//   V row:  R_v · ((v − μ_v) / λ_v)    quantized per row
//   Q row:  R_k · (q ⊙ λ)              bf16, never stored in pages
// R = H_d · diag(s) / √d (rotation.h), or I for a head whose flags say plain (R_k for q and k, R_v for
// V: version 3); μ_k, μ_v, λ, λ_v per (head, channel), stored with the entry
// as four float[H·d] tables (layer_spec.h KvLayout); rotation, smoothing (μ) and balancing (λ, λ_v)
// each optional. q·k is preserved up to q·μ_k, which is the same for every key of a query row
// (softmax-invariant); the output is o = λ_v ⊙ R_vᵀ·(Σ p·v̂) + μ_v, exact because Σ p = 1 and the
// attention sum is linear per channel. λ_v takes V's outlier channels out of every row's step.
//
// ── Per-head transforms (version 2) ───────────────────────────────────────────────────────────────
// The transforms are chosen per head (kernels/transform_choice.h): a head may store K without μ_k
// or λ, and V with μ_v, ½·μ_v or no μ_v and with or without λ_v. The choice lives only in the
// head's rows of the four tables (μ row 0 = no smoothing, λ row 1 = no balancing). Version 3: a head
// of a rotated entry may also store q·k or V without R (bits 5, 6), which the row epilogues and the
// attention epilogue read (HeadRotatesK / V). The entry records the choice after the tables:
//   head_flags      uint32[H]     HeadTransformFlag bits   bit 0 μ_k │ 1 μ_v │ 2 ½·μ_v │ 3 λ │ 4 λ_v │
//                                                          5 plain q·k │ 6 plain V │ 8 chosen
//   head_estimates  float[H · 4]  estimated squared output error of the head's sample with every key
//                                 in INT4 │ INT8 │ BF16, then the sample's squared output norm
// (layer_spec.h KvLayout; version 1 entries end after λ_v).
//
// ── Pages ─────────────────────────────────────────────────────────────────────────────────────────
// A page holds kPageTokens = 64 consecutive tokens of ONE head in ONE format. Every token range
// starts a new page; a page knows how many of its slots are valid (PageDesc::n_valid) and kernels
// mask the rest (their bytes are zero). K and V of the same tokens live in separate pages of the
// same format. Inside a page, all code rows come first, then all metadata rows:
//
//   offset 0                                  64·CodeBytes(f,d)               PageBytes(f,d)
//   ├─ row 0 codes ─┼─ row 1 codes ─┼ … ┼─ row 63 ─┼─ meta 0 ─┼─ meta 1 ─┼ … ┼─ meta 63 ─┤
//
// Page sizes (bytes):          d = 64     d = 128
//   kInt4  (d/2 + 4)·64         2304       4352
//   kInt8  (d   + 2)·64         4224       8320
//   kBf16  (2d     )·64         8192      16384
// All are multiples of 128, so pages placed at 128-byte aligned offsets stay aligned.
//
// ── INT4 row (asymmetric) ─────────────────────────────────────────────────────────────────────────
//   codes: d/2 bytes; byte j holds channel 2j in its LOW nibble and channel 2j+1 in its HIGH nibble
//
//        byte 0              byte 1              byte j
//     ┌────────┬────────┐ ┌────────┬────────┐ ┌──────────┬────────┐
//     │ c1 7:4 │ c0 3:0 │ │ c3 7:4 │ c2 3:0 │ │ c2j+1    │ c2j    │
//     └────────┴────────┘ └────────┴────────┘ └──────────┴────────┘
//   meta: Int4RowMeta { fp16 scale; fp16 lo; }  (4 bytes, little-endian, scale first)
//   encode: [lo, hi] = [min x + i·δ, max x − j·δ], δ = ¼·(max x − min x)/15, of the 9 pairs i, j ∈
//           {0, 1, 2} the one of least squared row error (first of equals; (0, 0) = min–max; rows
//           with a subnormal-fp16 step keep min–max; ChooseInt4Row below); lo and scale = (hi − lo)/15
//           rounded to fp16 FIRST (scale: nearest, or the next fp16 up where the nearest is a
//           subnormal below it, RowScaleToHalf); then
//           code = clamp(rne((x − lo) · (1/scale)), 0, 15)   (fp32, 1/scale correctly rounded)
//   decode: x̂ = lo + code · scale
//
// ── INT8 row (symmetric) ──────────────────────────────────────────────────────────────────────────
//   codes: d bytes, two's complement, −127..127 (−128 never written)
//   meta: Int8RowMeta { fp16 scale; }  (2 bytes)
//   encode: scale = max|x| / 127 rounded to fp16 (nearest, or the next fp16 up where the nearest is a
//           subnormal below it, RowScaleToHalf); code = clamp(rne(x · (1/scale)), −127, 127)
//   decode: x̂ = code · scale
//
// ── BF16 row ──────────────────────────────────────────────────────────────────────────────────────
//   codes: d little-endian bf16 values (round to nearest even), no metadata.
//
// Encoding is defined in fp32 with round-to-nearest-even (rintf) and a correctly rounded reciprocal
// so that host and device produce identical codes from identical inputs.
//
// ── Codecs ────────────────────────────────────────────────────────────────────────────────────────
// Each format is one codec: PageCodec<F> (page_codec.h, host and device scalar reference: sizes, row
// encode and decode) and its device twin cuda::DevicePageCodec<F> (cuda/page_codec.cuh: the warp's row
// encoder, the decoders the attention kernels use). DispatchFormat below is the one place where a
// runtime PageFormat becomes a compile-time one; it names every format, and code per format is either
// a codec member (a format without one fails to compile) or an `if constexpr` chain closed by
// static_assert(kUnhandledFormat<F>). Adding a format means: the enum, its case in DispatchFormat
// (kNumPageFormats guards that), and both codecs — the compiler lists every other place.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVPACK_HD __host__ __device__
#else
#define KVPACK_HD
#endif

namespace kvpack {

// 2: per-head transform record (head_flags, head_estimates); 3: plain (unrotated) q·k or V per head.
inline constexpr int kFormatVersion = 3;
inline constexpr int kPageTokens = 64;
inline constexpr int kMinHeadDimCpu = 16;
inline constexpr int kMaxHeadDimCpu = 256;

// Stable numeric values: they travel in the API and in page descriptors.
enum class PageFormat : uint8_t { kInt4 = 0, kInt8 = 1, kBf16 = 2 };
inline constexpr int kNumPageFormats = 3;

KVPACK_HD constexpr bool IsValidPageFormat(int f) { return f >= 0 && f < kNumPageFormats; }

// A format as a type, for code specialised per format.
template <PageFormat F>
struct FormatTag {
  static constexpr PageFormat kFormat = F;
};
// False for every format: closes an `if constexpr` chain over formats, so that a format the chain
// does not handle is a compile error rather than a silent fallback.
template <PageFormat F>
inline constexpr bool kUnhandledFormat = false;

// Calls fn(FormatTag<f>{}) and returns its result. The one runtime → compile-time dispatch over page
// formats (ggml's exhaustive switch). REQUIRES: IsValidPageFormat(f) — callers validate formats that
// come from outside (ValidateRanges); a page descriptor's format was validated when it was written.
template <class Fn>
KVPACK_HD constexpr decltype(auto) DispatchFormat(PageFormat f, Fn&& fn) {
  static_assert(kNumPageFormats == 3, "a new PageFormat needs its case here (and its codecs)");
  switch (f) {
    case PageFormat::kInt4: return fn(FormatTag<PageFormat::kInt4>{});
    case PageFormat::kInt8: return fn(FormatTag<PageFormat::kInt8>{});
    case PageFormat::kBf16: break;
  }
  return fn(FormatTag<PageFormat::kBf16>{});  // (an invalid value, which REQUIRES rules out, lands here too)
}

struct Int4RowMeta {
  uint16_t scale;  // fp16 bits
  uint16_t lo;     // fp16 bits
};
struct Int8RowMeta {
  uint16_t scale;  // fp16 bits
};
static_assert(sizeof(Int4RowMeta) == 4, "INT4 row metadata is two fp16");
static_assert(sizeof(Int8RowMeta) == 2, "INT8 row metadata is one fp16");

// One page of the shared token layout (the same for every head of an entry). 16 bytes so that a
// warp reads two descriptors per 32-byte sector.
struct PageDesc {
  int32_t token_begin;  // sequence position of slot 0
  int32_t seq_id;       // sequence id of every token in the page
  uint16_t n_valid;     // 1..kPageTokens valid slots, from slot 0
  uint8_t format;       // PageFormat
  uint8_t range_index;  // index of the token range the page belongs to (< 256 ranges per entry)
  uint32_t reserved;    // zero
};
static_assert(sizeof(PageDesc) == 16, "PageDesc is 16 bytes");

// ── Scalar conversions (bit-exact with CUDA's __float2half_rn / __float2bfloat16_rn) ─────────────

KVPACK_HD inline uint32_t FloatBits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
KVPACK_HD inline float BitsFloat(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// fp32 → fp16, round to nearest even, overflow to ±inf, NaN stays NaN.
KVPACK_HD inline uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65536
  if (ax < 0x38800000u) {                                                 // below 2^-14: subnormal
    const uint32_t e = ax >> 23;
    const uint32_t shift = 126u - e;  // value = m·2^(e−150), half unit 2^-24
    if (shift > 24u) return static_cast<uint16_t>(sign);
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (ax >> 13) - (112u << 10);  // rebias exponent 127 → 15
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into ±inf: correct
  return static_cast<uint16_t>(sign | h);
}

KVPACK_HD inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m · 2^-24, exact
    return sign ? -v : v;
  }
  if (e == 31) return BitsFloat(sign | 0x7f800000u | (m << 13));
  return BitsFloat(sign | ((e + 112u) << 23) | (m << 13));
}

// fp32 → bf16, round to nearest even; NaN stays a quiet NaN.
KVPACK_HD inline uint16_t FloatToBf16(float f) {
  uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}
KVPACK_HD inline float Bf16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

inline constexpr float kHalfMax = 65504.0f;

KVPACK_HD inline float ClampToHalfRange(float v) {
  return v > kHalfMax ? kHalfMax : (v < -kHalfMax ? -kHalfMax : v);
}

// fp16 bits of the smallest normal value, 2^-14: below it the spacing is a fixed 2^-24.
inline constexpr uint16_t kHalfMinNormalBits = 0x0400u;

// A row's fp16 scale from v = span / 127 (INT8, span = max|x|) or span / 15 (INT4, span = max − min),
// v ≥ 0: the nearest fp16, except where that is subnormal or zero and below v — or zero while span
// is not (v underflows fp32 for span < 127·2^-149) — then the next fp16 up. Subnormals are 2^-24
// apart, so the nearest can be up to half below v (v = 1.5·2^-24 → 2^-24) and the row's largest codes
// would clip: an INT8 row with x = −1.1e-5 decoded to −8.0e-6 (found by page_fuzz). Rounded up, every
// code fits and the error stays within half a step. A normal nearest errs by ≤ 2^-11 relative: the
// largest code comes to ≤ 127.07 (INT8) or 15.008 (INT4, lo's own rounding aside), which round to 127
// and 15, so rows with a normal scale — max|x| ≥ 127·2^-14 ≈ 7.8e-3 (INT8), max − min ≥ 15·2^-14 ≈
// 9.2e-4 (INT4) — keep the codes the nearest gives. The CUDA encoders (cuda/page_codec.cuh
// RowScaleBits) make the same choice; `span` settles the one case where their divisions may differ
// (an fp32-subnormal quotient, zero in one and not the other).
KVPACK_HD inline uint16_t RowScaleToHalf(float v, float span) {
  const uint16_t h = FloatToHalf(v);
  if (h >= kHalfMinNormalBits) return h;
  return HalfToFloat(h) < v || (h == 0 && span > 0.0f) ? static_cast<uint16_t>(h + 1u) : h;
}

// ── INT4 row search ─────────────────────────────────────────────────────────────────────────────
// A row's [lo, hi] need not be [min, max]: a range shrunk by a fraction of a step rounds the bulk of a
// near-Gaussian row (what rotation makes of it) more finely at the cost of clipping one or two
// extremes. The encoder tries lo = min + i·δ, hi = max − j·δ for i, j < kInt4Shifts with
// δ = kInt4ShiftStep · (max − min)/15, in the order (i, j) = (0, 0), (0, 1), …, (2, 2), and keeps the
// first candidate of least squared error of the decoded row. (0, 0) is min–max, so no row's error
// grows; on rotated rows the squared error falls by 14–17% (docs/quality.md). The error is summed in
// integers (Int4ErrorUnits), so any order of summation — a warp's butterfly on the GPU, a loop here —
// gives the same choice and so the same codes. Rows whose step is not a normal fp16 (max − min below
// 15·2^-14), whose range or ends exceed fp16, or with a NaN min or max keep min–max unsearched.
inline constexpr int kInt4Shifts = 3;
inline constexpr int kInt4Candidates = kInt4Shifts * kInt4Shifts;
inline constexpr float kInt4ShiftStep = 0.25f;
// The farthest an end moves, in steps of min–max: at most half a step, so a clipped value still decodes
// within half a min–max step of itself (plus the fp16 rounding of lo), as every value did before.
inline constexpr float kInt4MaxShift = (kInt4Shifts - 1) * kInt4ShiftStep;
static_assert(kInt4MaxShift <= 0.5f, "the INT4 search keeps every value within half a min–max step");
// A value's squared error in units of 2^-18·4^E, where 2^E ≤ (max − min)/15 < 2^(E+1), clamped at
// 2^22 units (a residual of 2–4 steps; the candidates clip by at most about one) so that a row of 256
// values sums below 2^30 in a uint32.
inline constexpr int kInt4ErrorFractionBits = 18;
inline constexpr float kInt4ErrorClamp = 4194304.0f;

// Float arithmetic rounded once per operation on host and device alike (nvcc may otherwise contract
// a·b + c into one FMA in device code built with --fmad=true).
KVPACK_HD inline float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVPACK_HD inline float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Whether a row with this min and max is searched (else it keeps min–max). Written so that NaN fails.
KVPACK_HD inline bool Int4RowSearched(float mn, float mx) {
  const float range = mx - mn;
  return range >= 15.0f * 0x1p-14f && range <= kHalfMax && mn >= -kHalfMax && mx <= kHalfMax;
}
// 2^(kInt4ErrorFractionBits − 2E) for step0 = (max − min)/15 in [2^E, 2^(E+1)), E from its bits.
// REQUIRES: Int4RowSearched (step0 is then a normal float in [2^-14, 2^13)).
KVPACK_HD inline float Int4ErrorUnit(float step0) {
  const int e = static_cast<int>((FloatBits(step0) >> 23) & 0xffu) - 127;
  return BitsFloat(static_cast<uint32_t>(127 + kInt4ErrorFractionBits - 2 * e) << 23);
}
// One value's code under (lo, scale), inv = RN(1/scale): rne((x − lo)·inv) clamped to [0, 15] (NaN → 0).
// Clamped first, then rounded by adding and subtracting 1.5·2^23 (the same code, as both bounds are
// integers; no libm rintf call on a baseline x86-64 host, no conversion instruction on the GPU).
inline constexpr float kInt4RoundMagic = 12582912.0f;  // 1.5·2^23: t + it has t's nearest integer in its low bits
KVPACK_HD inline uint32_t Int4Code(float x, float lo, float inv) {
  float t = MulRn(x - lo, inv);
  t = t > 0.0f ? t : 0.0f;
  t = t < 15.0f ? t : 15.0f;
  return FloatBits(AddRn(t, kInt4RoundMagic)) - FloatBits(kInt4RoundMagic);
}
// One value's squared error x − (lo + code·scale) in the row's integer units, rounded to nearest even
// (the bits of e + 2^23; NaN counts as the clamp).
KVPACK_HD inline uint32_t Int4ErrorUnits(float x, float lo, float scale, uint32_t code, float unit) {
  const float r = x - AddRn(lo, MulRn(static_cast<float>(code), scale));  // code·scale is exact
  const float e = MulRn(MulRn(r, r), unit);
  return FloatBits(AddRn(e < kInt4ErrorClamp ? e : kInt4ErrorClamp, 8388608.0f)) - 0x4b000000u;
}

// The conversions of the INT4 row parameters, format.h's scalar ones (the CPU codec, the GPU estimate).
// The CUDA row epilogue has a twin with the hardware conversions (cuda/page_codec.cuh), equal wherever
// the search reaches (normal quotients, half scales).
struct Int4ScalarArith {
  KVPACK_HD static float Step(float span) { return span / 15.0f; }
  KVPACK_HD static uint16_t ScaleBits(float span) { return RowScaleToHalf(ClampToHalfRange(span / 15.0f), span); }
  KVPACK_HD static uint16_t LoBits(float lo) { return FloatToHalf(ClampToHalfRange(lo)); }
  KVPACK_HD static float Half(uint16_t h) { return HalfToFloat(h); }
  KVPACK_HD static float Reciprocal(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }
};

// Candidate `cand` (i = cand / kInt4Shifts, j = cand % kInt4Shifts) of a searched row, step0 = the row's
// Arith::Step(max − min).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Arith>
KVPACK_HD inline Int4RowMeta Int4CandidateMeta(float mn, float mx, float step0, int cand) {
  const float delta = MulRn(step0, kInt4ShiftStep);
  const float lo = AddRn(mn, MulRn(static_cast<float>(cand / kInt4Shifts), delta));
  const float hi = AddRn(mx, -MulRn(static_cast<float>(cand % kInt4Shifts), delta));
  Int4RowMeta m;
  m.scale = Arith::ScaleBits(AddRn(hi, -lo));
  m.lo = Arith::LoBits(lo);
  return m;
}

// The row's metadata by the search above, from its min and max and row_error(lo, scale, inv, unit):
// Σ Int4ErrorUnits(x, lo, scale, Int4Code(x, lo, inv), unit) over the row's values (a loop on the
// host, a warp's sum on the GPU; every caller gets the same total). Candidates in order, the first of
// least error kept; the CUDA row epilogue (cuda/page_codec.cuh) runs the same loop with the
// candidates' parameters computed one per lane.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Arith, class RowError>
KVPACK_HD inline Int4RowMeta ChooseInt4Row(float mn, float mx, RowError&& row_error) {
  Int4RowMeta kept;
  kept.scale = Arith::ScaleBits(mx - mn);
  kept.lo = Arith::LoBits(mn);
  if (!Int4RowSearched(mn, mx)) return kept;
  const float step0 = Arith::Step(mx - mn);
  const float unit = Int4ErrorUnit(step0);
  uint32_t best = 0xffffffffu;
  for (int cand = 0; cand < kInt4Candidates; ++cand) {
    const Int4RowMeta m = Int4CandidateMeta<Arith>(mn, mx, step0, cand);
    const float scale = Arith::Half(m.scale);
    const uint32_t err = row_error(Arith::Half(m.lo), scale, Arith::Reciprocal(scale), unit);
    if (err < best) best = err, kept = m;
  }
  return kept;
}

KVPACK_HD inline void EncodeRowInt4(const float* x, int head_dim, uint8_t* codes, Int4RowMeta* meta) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < head_dim; ++i) {
    mn = x[i] < mn ? x[i] : mn;
    mx = x[i] > mx ? x[i] : mx;
  }
  *meta = ChooseInt4Row<Int4ScalarArith>(mn, mx, [&](float lo, float scale, float inv, float unit) {
    uint32_t err = 0;
    for (int i = 0; i < head_dim; ++i) err += Int4ErrorUnits(x[i], lo, scale, Int4Code(x[i], lo, inv), unit);
    return err;
  });
  const float scale = HalfToFloat(meta->scale);
  const float lo = HalfToFloat(meta->lo);
  const float inv = Int4ScalarArith::Reciprocal(scale);
  for (int j = 0; j < head_dim / 2; ++j) {
    codes[j] = static_cast<uint8_t>(Int4Code(x[2 * j], lo, inv) | (Int4Code(x[2 * j + 1], lo, inv) << 4));
  }
}

KVPACK_HD inline float DecodeInt4(uint8_t byte, int nibble, Int4RowMeta meta) {
  const int code = nibble ? (byte >> 4) : (byte & 0xf);
  return HalfToFloat(meta.lo) + static_cast<float>(code) * HalfToFloat(meta.scale);
}

KVPACK_HD inline void DecodeRowInt4(const uint8_t* codes, Int4RowMeta meta, int head_dim, float* out) {
  for (int i = 0; i < head_dim; ++i) out[i] = DecodeInt4(codes[i / 2], i & 1, meta);
}

KVPACK_HD inline void EncodeRowInt8(const float* x, int head_dim, int8_t* codes, Int8RowMeta* meta) {
  float amax = 0.0f;
  for (int i = 0; i < head_dim; ++i) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
  meta->scale = RowScaleToHalf(ClampToHalfRange(amax / 127.0f), amax);
  const float scale = HalfToFloat(meta->scale);
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int i = 0; i < head_dim; ++i) {
    float c = rintf(x[i] * inv);
    c = c < -127.0f ? -127.0f : (c > 127.0f ? 127.0f : c);
    codes[i] = static_cast<int8_t>(c);
  }
}

KVPACK_HD inline void DecodeRowInt8(const int8_t* codes, Int8RowMeta meta, int head_dim, float* out) {
  const float scale = HalfToFloat(meta.scale);
  for (int i = 0; i < head_dim; ++i) out[i] = static_cast<float>(codes[i]) * scale;
}

KVPACK_HD inline void EncodeRowBf16(const float* x, int head_dim, uint16_t* codes) {
  for (int i = 0; i < head_dim; ++i) codes[i] = FloatToBf16(x[i]);
}

KVPACK_HD inline void DecodeRowBf16(const uint16_t* codes, int head_dim, float* out) {
  for (int i = 0; i < head_dim; ++i) out[i] = Bf16ToFloat(codes[i]);
}

}  // namespace kvpack

// The codecs (sizes, row encode and decode per format) complete the format: every user of format.h
// gets them. page_codec.h includes this file first, so either may be included alone.
#include "kernels/page_codec.h"  // IWYU pragma: export
