// The per-head transform choice's decision (transform_choice.h), host and device alike: which
// candidate sets are evaluated in which order and which one is kept. What an evaluation computes is
// the evaluator's: HeadEstimator on the host (transform_choice.cc), one CTA per head on the GPU
// (cuda/head_estimate.cu). Both evaluate with the same arithmetic in the same order — each sum
// sequential, ChoiceExp below instead of the libraries' exp, no multiply-add contraction (the .cu is
// built with --fmad=false; x86-64 hosts have no FMA in the base ISA) — so the two make the same
// choice and report the same estimates, bit for bit.
#pragma once

#include <cstdint>

#include "kernels/format.h"
#include "kernels/layer_spec.h"
#include "kernels/rotation.h"
#include "kernels/transform_choice.h"

namespace kvpack {

// How much lower than the options' full set another set's estimate must be to replace it. The
// estimate of 32 queries lands within 0.8–1.3× of the measured error (docs/quality.md); without a
// margin the choice followed that noise on data where every transform helps (the 5-seed table of
// docs/quality.md lost 2–6% of its gains), while on sink heads the chosen set is several times
// better and clears it easily.
inline constexpr double kChoiceMargin = 1.25;
// How much lower than naive's (no μ, no λ, no R where the rotation may be chosen: format v3) any set's
// estimate must be to replace naive. On docs/quality.md's real activations (MiniLM, 216 heads per
// format) the INT4 heads whose measured cosine fell below naive's went 16 → 9 → 4 → 2 → 0 for margins
// 1.0, 1.05, 1.15, 1.2, 1.3 (INT8 17 → 1, by 2e-7), with mean cosines within ±1e-4; where the
// transforms matter (outlier channels, sink heads) they beat naive several times over.
inline constexpr double kNaiveMargin = 1.3;

// e^x in double from +, −, ×, floor and exponent bits only, so that host and device agree bit for
// bit (the libraries' exp differ in the last place): x = k·ln2 + r with |r| ≤ ln2/2 (ln2 split so
// that k·ln2_hi is exact), Taylor to r¹² (relative error < 2e-16), times 2^k. The choice calls it
// with x ≤ 0 (logit − row max); any x works: below −708 it is 0, above 709 +inf, NaN stays NaN.
KVPACK_HD inline double ChoiceExp(double x) {
  if (x != x) return x;
  if (x < -708.0) return 0.0;
  if (x > 709.0) return INFINITY;
  const double kLog2e = 1.4426950408889634;
  const double kLn2Hi = 6.93147180369123816490e-01;  // 32 significant bits: k·kLn2Hi is exact
  const double kLn2Lo = 1.90821492927058770002e-10;
  const double k = floor(x * kLog2e + 0.5);
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  double p = 2.08767569878681e-09;  // 1/12!
  p = p * r + 2.505210838544172e-08;
  p = p * r + 2.755731922398589e-07;
  p = p * r + 2.7557319223985893e-06;
  p = p * r + 2.48015873015873e-05;
  p = p * r + 0.0001984126984126984;
  p = p * r + 0.001388888888888889;
  p = p * r + 0.008333333333333333;
  p = p * r + 0.041666666666666664;
  p = p * r + 0.16666666666666666;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // 2^k for k in [−1022, 1023] from its bits; k = −1022 with p < 1 rounds into the subnormals.
  const int64_t e = static_cast<int64_t>(k) + 1023;
  uint64_t bits = static_cast<uint64_t>(e) << 52;
  double scale;
  memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The softmax scale of the estimate: the layer's, or 1/√d where the layer leaves it 0.
inline double EstimateSoftmaxScale(float softmax_scale, int head_dim) {
  return softmax_scale > 0.0f ? softmax_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// The pieces every evaluation is made of, one row at a time (both evaluators call these):
// A K or V row as the layer stores it and reads it back: x = R·((row − μ)/λ) in float, encoded and
// decoded in `format` (as ToStoredK/V and EncodePageRow compute it).
KVPACK_HD inline void StoredRowOf(const float* row, int d, const float* mu, const float* lambda, bool rotate,
                                  uint64_t seed, PageFormat format, float* out) {
  float x[kMaxHeadDimCpu];
  uint8_t codes[2 * kMaxHeadDimCpu];
  x[0] = 0.0f;  // d ≥ 1 always; says so to the compiler's uninitialised-read check
  for (int c = 0; c < d; ++c) x[c] = (row[c] - mu[c]) / lambda[c];
  if (rotate) RotateForward(x, d, seed);
  switch (format) {
    case PageFormat::kInt4: {
      Int4RowMeta m;
      EncodeRowInt4(x, d, codes, &m);
      DecodeRowInt4(codes, m, d, out);
      break;
    }
    case PageFormat::kInt8: {
      Int8RowMeta m;
      EncodeRowInt8(x, d, reinterpret_cast<int8_t*>(codes), &m);
      DecodeRowInt8(reinterpret_cast<const int8_t*>(codes), m, d, out);
      break;
    }
    case PageFormat::kBf16:
      for (int c = 0; c < d; ++c) out[c] = Bf16ToFloat(FloatToBf16(x[c]));
      break;
  }
}

// A query as the layer stores it: q ⊙ λ, R, bf16.
KVPACK_HD inline void StoredQueryOf(const float* q, int d, const float* lambda, bool rotate, uint64_t seed,
                                    float* out) {
  for (int c = 0; c < d; ++c) out[c] = q[c] * lambda[c];
  if (rotate) RotateForward(out, d, seed);
  for (int c = 0; c < d; ++c) out[c] = Bf16ToFloat(FloatToBf16(out[c]));
}

// One query's output o = Σ_j p_j v_j (in the stored space, already summed in double and rounded to
// float; rewritten here) back to the model's space, o ⊙ λ_v + μ_v after Rᵀ, against the reference:
// the squared error and the reference's squared norm, summed over channels in order.
KVPACK_HD inline void QueryErrorOf(float* o, int d, const float* mu, const float* lambda_v, bool rotate, uint64_t seed,
                                   const double* ref, double* err, double* norm) {
  if (rotate) RotateInverse(o, d, seed);
  double e = 0.0, n = 0.0;
  for (int c = 0; c < d; ++c) {
    const double out = static_cast<double>(o[c]) * lambda_v[c] + mu[c];
    const double r = ref[c];
    e += (out - r) * (out - r);
    n += r * r;
  }
  *err = e;
  *norm = n;
}

// A head's totals over its queries, in query order.
KVPACK_HD inline void AddQueryError(double err, double norm, ErrorSums* e) {
  e->err += err;
  e->ref += norm;
  e->query_rel += norm > 0.0 ? err / norm : err;
}

// One candidate set of a head's transforms.
struct ChoiceCandidate {
  bool smooth_k = false;
  bool balance_k = false;
  int v_smooth_halves = 0;  // μ_v scaled by v_smooth_halves / 2: 0 none, 1 partial, 2 full
  bool balance_v = false;
  bool plain_k = false;     // q and k without R (in a rotated entry)
  bool plain_v = false;     // V without R

  KVPACK_HD uint32_t Flags() const {
    return (smooth_k ? kHeadSmoothK : 0u) | (balance_k ? kHeadBalanceK : 0u) |
           (v_smooth_halves == 2 ? kHeadSmoothV : 0u) | (v_smooth_halves == 1 ? kHeadSmoothVHalf : 0u) |
           (balance_v ? kHeadBalanceV : 0u) | (plain_k ? kHeadPlainK : 0u) | (plain_v ? kHeadPlainV : 0u);
  }
  // Whether the candidate's q and k (V) go through R in an entry whose switch is `entry_rotates`.
  KVPACK_HD bool RotatesK(bool entry_rotates) const { return entry_rotates && !plain_k; }
  KVPACK_HD bool RotatesV(bool entry_rotates) const { return entry_rotates && !plain_v; }
  // Channel c of the four rows the candidate stores with, from the full tables (every allowed
  // transform on): μ_k, λ, μ_v, λ_v.
  KVPACK_HD float MuK(const float* full_mu_k, int c) const { return smooth_k ? full_mu_k[c] : 0.0f; }
  KVPACK_HD float Lambda(const float* full_lambda, int c) const { return balance_k ? full_lambda[c] : 1.0f; }
  KVPACK_HD float MuV(const float* full_mu_v, int c) const {
    return 0.5f * static_cast<float>(v_smooth_halves) * full_mu_v[c];  // 0, ½ or 1: exact in float
  }
  KVPACK_HD float LambdaV(const float* full_lambda_v, int c) const { return balance_v ? full_lambda_v[c] : 1.0f; }
};

KVPACK_HD inline uint32_t FixedFlagsOf(const TransformOptions& t) {
  return (t.smooth ? kHeadSmoothK | kHeadSmoothV : 0u) | (t.balance ? kHeadBalanceK | kHeadBalanceV : 0u);
}

// The options' full set.
KVPACK_HD inline ChoiceCandidate FixedCandidate(const TransformOptions& t) {
  ChoiceCandidate fixed;
  fixed.smooth_k = t.smooth;
  fixed.balance_k = t.balance;
  fixed.v_smooth_halves = t.smooth ? 2 : 0;
  fixed.balance_v = t.balance;
  return fixed;
}

// Whether the choice may store q and k (V) without R: a rotated entry whose options allow it.
KVPACK_HD inline bool MayPlainK(const TransformOptions& t) { return t.rotate && t.choose_plain_k; }
KVPACK_HD inline bool MayPlainV(const TransformOptions& t) { return t.rotate && t.choose_plain_v; }

// The decision, given an evaluator with
//   ErrorSums KOnly(const ChoiceCandidate&)       the candidate's K side, exact V
//   ErrorSums VOnly(const ChoiceCandidate&)       exact probabilities, the candidate's V side
//   ErrorSums Both(const ChoiceCandidate&, int f) both sides, keys in format f (−1: their own)
// (on the device every thread of the CTA calls it, and the evaluator's calls are collective).
// K candidates with exact V, V candidates with exact probabilities (each side rotated, then plain
// where MayPlainK / MayPlainV), in a fixed order, the first of equal estimates kept; then the options'
// set against naive and the best pair against the one kept: a set must beat naive by kNaiveMargin,
// and the pair the options' set by kChoiceMargin. Writes the kept set to *kept.
// REQUIRES: t.choose_per_head.
template <class Eval>
KVPACK_HD HeadChoice SelectHeadTransforms(Eval& est, const TransformOptions& t, ChoiceCandidate* kept) {
  HeadChoice choice;
  ChoiceCandidate naive;
  naive.plain_k = MayPlainK(t);
  naive.plain_v = MayPlainV(t);
  const ChoiceCandidate fixed = FixedCandidate(t);
  choice.naive = est.Both(naive, -1);

  // Each side's candidates rotated first (the entry's way), then plain where allowed.
  ChoiceCandidate best;
  double best_k = INFINITY, best_v = INFINITY;
  for (int plain = 0; plain <= (MayPlainK(t) ? 1 : 0); ++plain) {
    for (int k = 0; k < 3; ++k) {
      ChoiceCandidate c;
      c.smooth_k = k >= 1;
      c.balance_k = k == 2;
      c.plain_k = plain == 1;
      if ((c.smooth_k && !t.smooth) || (c.balance_k && !t.balance)) continue;
      const double e = est.KOnly(c).query_rel;
      if (e < best_k) best_k = e, best.smooth_k = c.smooth_k, best.balance_k = c.balance_k, best.plain_k = c.plain_k;
    }
  }
  for (int plain = 0; plain <= (MayPlainV(t) ? 1 : 0); ++plain) {
    for (int halves = 0; halves <= 2; ++halves) {
      for (int bal = 0; bal <= 1; ++bal) {
        ChoiceCandidate c;
        c.v_smooth_halves = halves;
        c.balance_v = bal == 1;
        c.plain_v = plain == 1;
        if ((halves > 0 && !t.smooth) || (c.balance_v && !t.balance)) continue;
        const double e = est.VOnly(c).query_rel;
        if (e < best_v) {
          best_v = e, best.v_smooth_halves = halves, best.balance_v = c.balance_v, best.plain_v = c.plain_v;
        }
      }
    }
  }

  *kept = naive;
  choice.chosen = choice.naive;
  const ErrorSums fixed_error = est.Both(fixed, -1);
  const bool fixed_kept = fixed_error.query_rel * kNaiveMargin < choice.chosen.query_rel;
  if (fixed_kept) choice.chosen = fixed_error, *kept = fixed;
  if (best.Flags() != fixed.Flags() && best.Flags() != naive.Flags()) {
    const ErrorSums e = est.Both(best, -1);
    if (e.query_rel * (fixed_kept ? kChoiceMargin : kNaiveMargin) < choice.chosen.query_rel) choice.chosen = e, *kept = best;
  }
  for (int f = 0; f < kNumPageFormats; ++f) choice.by_format[f] = est.Both(*kept, f);
  choice.flags = kept->Flags() | kHeadChosen;
  return choice;
}

}  // namespace kvpack
