// Per-head transform choice and the output-error estimate (format v2, docs/format.md).
//
// Why: the format's transforms (format.h) are exact, but whether they help quantization depends on
// the head. On real activations "sink" heads put most of their attention on a few keys whose V is
// near zero; subtracting μ_v turns those rows into large ones and INT4 falls far below naive
// per-row quantization (mean cosine 0.91 vs 0.997, issue 15). So each head keeps the set of
// transforms that a small attention on its own sample says is best:
//
//   K: none | smoothing (μ_k) | smoothing + balancing (μ_k, λ)
//   V: μ_v scaled by α ∈ {0, ½, 1} (none, partial, full smoothing) × balancing (λ_v) off | on
//   and, in a rotated entry, each side rotated (R) or plain: q and k together, V on its own
//
// restricted to what TransformOptions allows (smooth off: no μ; balance off: no λ, λ_v; rotate off or
// choose_plain_k / _v off: rotation as the entry has it). μ and λ are expressed through the head's rows
// of the existing tables — μ_k row zero = no K smoothing, μ_v row α·mean, λ / λ_v rows ones = no
// balancing; a plain side through the head's flags (kHeadPlainK, kHeadPlainV), which the row
// epilogues (q, k, v) and the attention epilogue (Rᵀ of the output) read: HeadRotatesK / HeadRotatesV.
//
// The estimate: the head's sample (keys and values of the statistics pre-pass, a few queries)
// attended exactly in double (unquantized, no transforms) and through the candidate's stored form
// (q rounded to bf16 after λ and R, as the layer does; K and V rows encoded and decoded in the
// format of their token's range). The reported estimate is ‖o − o_ref‖ / ‖o_ref‖ over the sampled
// queries; candidates are ranked by the sum of per-query squared relative errors (ErrorSums). K
// candidates are compared with exact V and V candidates with exact probabilities, then the best
// pair and the options' full set are evaluated together and kept only if they rank below naive
// (no μ, no λ, no R where the rotation may be chosen), which is evaluated too: never worse than naive
// on the estimate. The pair replaces
// the full set only when its estimate is 1.25× lower (noise margin, transform_choice.cc). Every sum runs in a fixed order in double,
// so the same sample gives the same choice bit for bit on any backend and thread count.
//
// Host-only, allocates O((keys + queries)·d + queries·keys) per call. Thread-safe (no shared state).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/format.h"
#include "kernels/layer_spec.h"

namespace kvpack {

// Bits of one head's entry in the per-head flags table (KvLayout::head_flags_offset, uint32 per head).
enum HeadTransformFlag : uint32_t {
  kHeadSmoothK = 1u << 0,       // μ_k row is the sample mean (else zero)
  kHeadSmoothV = 1u << 1,       // μ_v row is the sample mean (else zero, or half with the next bit)
  kHeadSmoothVHalf = 1u << 2,   // μ_v row is half the sample mean
  kHeadBalanceK = 1u << 3,      // λ row from K's spreads (else ones)
  kHeadBalanceV = 1u << 4,      // λ_v row from V's spreads (else ones)
  kHeadPlainK = 1u << 5,        // q and k stored without R although the entry rotates (format v3)
  kHeadPlainV = 1u << 6,        // V stored without R (and the output not un-rotated) although the entry rotates
  kHeadChosen = 1u << 8,        // chosen by the estimate (else fixed by TransformOptions or the caller's stats)
};

// Sizes of the estimate's sample, taken from the statistics pre-pass sample of S tokens: keys
// j·S/n_keys (j < n_keys = min(S, kEstimateKeys)) and queries i·S/n_q (i < min(S, kEstimateQueries)).
// 512 × 32 keeps the choice under ~15 M multiply-adds per head per candidate and the CUDA backend's
// host copy at (2·512 + 32)·d floats per head.
inline constexpr int kEstimateKeys = 512;
inline constexpr int kEstimateQueries = 32;
int64_t EstimateKeyCount(int64_t n_sample);
int64_t EstimateQueryCount(int64_t n_sample);
inline int64_t EstimateKeyIndex(int64_t j, int64_t n_sample) { return j * n_sample / EstimateKeyCount(n_sample); }
inline int64_t EstimateQueryIndex(int64_t i, int64_t n_sample) { return i * n_sample / EstimateQueryCount(n_sample); }

// One head's sample, rows after bias / QK-norm / RoPE, untransformed.
struct HeadSample {
  int head_dim = 0;
  int64_t n_keys = 0;
  int64_t n_queries = 0;             // 0 (or q null): no queries, the options' set is kept
  const float* q = nullptr;          // [n_queries, d]
  const float* k = nullptr;          // [n_keys, d]
  const float* v = nullptr;          // [n_keys, d]
  const PageFormat* formats = nullptr;  // [n_keys] the format of each key's range
};

// The head's rows of the four tables (d floats each). In: the statistics with every allowed
// transform on (stats.h); out: the chosen set's rows.
struct HeadTables {
  float* mu_k;
  float* mu_v;
  float* lambda;
  float* lambda_v;
};

// Squared error and squared reference norm of a head's sampled outputs: rel error sqrt(err / ref);
// heads and ranges add up before the square root. query_rel = Σ_i ‖o_i − o_ref,i‖² / ‖o_ref,i‖²
// over the sampled queries: what the choice minimises, because it weighs every query alike as the
// mean cosine does (≈ 2·(1 − cos) per query), where err would let the few queries with large
// outputs decide — on sink heads those are the ones that do not attend to the sinks.
struct ErrorSums {
  double err = 0.0;
  double ref = 0.0;
  double query_rel = 0.0;
  double Rel() const;
};

// Whether head h's q and k (V) are rotated: the entry's switch, unless the head's flags say plain.
// flags may be null (every head as the entry).
KVPACK_HD inline bool HeadRotatesK(bool entry_rotates, const uint32_t* flags, int h) {
  return entry_rotates && !(flags != nullptr && (flags[h] & kHeadPlainK));
}
KVPACK_HD inline bool HeadRotatesV(bool entry_rotates, const uint32_t* flags, int h) {
  return entry_rotates && !(flags != nullptr && (flags[h] & kHeadPlainV));
}

struct HeadChoice {
  uint32_t flags = 0;
  ErrorSums chosen;  // the estimate of the kept set
  ErrorSums naive;   // no μ, no λ; no R where the choice may drop it, else rotation as the entry has it
  // The kept set with every sampled key stored in format f (index PageFormat): what the layer's
  // error would be in one format, for the reported figures and the error-budget planner.
  ErrorSums by_format[kNumPageFormats];
};

// Chooses the head's transforms and rewrites `tables` to express them (see the top of this file).
// Without queries or with transforms.choose_per_head off, keeps the options' set (flags without
// kHeadChosen) and still estimates it when queries are given; without queries every estimate is 0/0.
HeadChoice ChooseHeadTransforms(const HeadSample& sample, const TransformOptions& transforms, float softmax_scale,
                                const HeadTables& tables);

// The estimate of the head's current tables and flags (kHeadPlainK / V) with every sampled key stored
// in `format`.
ErrorSums EstimateHeadError(const HeadSample& sample, const TransformOptions& transforms, float softmax_scale,
                            const HeadTables& tables, uint32_t flags, PageFormat format);

// The relative error estimated for an entry's heads (head_estimates table, KvLayout) with every key
// in `format`: sqrt(Σ_h err_f / Σ_h ref). 0 when no estimate ran.
double EstimatedRelError(const float* head_estimates, int n_heads, PageFormat format);

// The flags a head gets from the options alone (smooth → μ_k, μ_v; balance → λ, λ_v).
uint32_t FixedHeadFlags(const TransformOptions& transforms);

// The flags of head h in a layer given the caller's statistics: the options' set plus the plain bits
// of stats.head_flags (when present and the entry rotates). REQUIRES: stats.head_flags empty or sized H.
uint32_t CallerStatsHeadFlags(const TransformOptions& transforms, const KvStats& stats, int h);

}  // namespace kvpack
