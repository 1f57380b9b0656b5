// μ_k, μ_v, λ and λ_v from a strided sample of tokens (format.h, DESIGN.md §2).
//
// Sample: S = min(N, transforms.stats_sample_tokens) tokens t_i = floor(i·N/S), i < S.
// For each head h and channel c, over the sample (values after bias / QK-norm / RoPE):
//   μ_k[h,c] = mean k_ic, μ_v[h,c] = mean v_ic           (both 0 when smoothing is off)
//   m_c      = max_i |k_ic − μ_k[h,c]|
//   λ'_c     = sqrt(max(m_c, kLambdaFloor · max_c' m_c'))  (λ' = 1 for the head if all m are 0)
//   λ[h,c]   = λ'_c / exp(mean_c log λ'_c)               (geometric mean 1 per head; 1 when off)
//   σ_c      = sqrt(mean_i (v_ic − μ_v[h,c])²)              (the channel's RMS around μ_v)
//   λ_v[h,c] = the rule of λ with σ_c in place of m_c
// Why λ_v = sqrt(σ): after rotation every stored V row is quantized with one step, set by the row's
// norm ‖(v − μ_v)/λ_v‖, and the output error of channel c is λ_v,c times that step (white in the
// rotated space). The expected error energy, ∝ (Σ_c λ_v,c²)·(Σ_c σ_c²/λ_v,c²), is smallest at
// λ_v,c ∝ sqrt(σ_c) (Cauchy–Schwarz); docs/quality.md has the measurements behind the choice.
// K keeps the range rule of DESIGN.md §2; whether σ would suit K as well is not measured.
// Sums and maxima in double, in increasing i, one head at a time (bit-identical for any thread
// count); results rounded to float once.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/layer_spec.h"
#include "kernels/transform_choice.h"

namespace kvpack::cpu {

// A channel whose sample range is below this fraction of its head's widest channel is balanced as
// if it were that wide: 1e-6 keeps λ within a factor 1000 of the head's widest channel.
inline constexpr double kLambdaFloor = 1e-6;

// Number of sampled tokens S and the token of sample i.
int64_t StatsSampleCount(int64_t n_tokens, const TransformOptions& transforms);
inline int64_t StatsSampleToken(int64_t i, int64_t n_tokens, int64_t n_sample) { return i * n_tokens / n_sample; }

// Fills k_row and v_row (head_dim floats each) with sample i of head h.
using SampleRowFn = std::function<void(int64_t i, int head, float* k_row, float* v_row)>;

// Statistics of n_sample rows delivered by `row`, which may be called several times for the same
// (i, head) and must return the same values each time. Runs heads in parallel.
KvStats StatsFromSample(int64_t n_sample, const LayerShape& shape, const TransformOptions& transforms,
                        const SampleRowFn& row, int n_threads);

// ── Per-head choice (transform_choice.h) ────────────────────────────────────────────────────────

// Fills q_row (head_dim floats) with query i of head h, i < n_queries.
using QueryRowFn = std::function<void(int64_t i, int head, float* q_row)>;

// What the entry records of the choice: its per-head flags and estimate tables (KvLayout).
struct TransformRecord {
  std::vector<uint32_t> head_flags;     // [H]
  std::vector<float> head_estimates;    // [H · kHeadEstimateFields]
};

// For each head (in parallel): gathers the estimate's keys (EstimateKeyIndex of the n_sample rows
// of `row`, each stored in format_of(i)) and queries (i·n_queries/m of `query`, m =
// min(n_queries, kEstimateQueries)), runs ChooseHeadTransforms on `stats` (computed by
// StatsFromSample with the same options) and records the result. An empty `query` (no queries
// known) keeps the options' set and records zero estimates.
TransformRecord ChooseTransforms(int64_t n_sample, int64_t n_queries, const LayerShape& shape,
                                 const TransformOptions& transforms, float softmax_scale, const SampleRowFn& row,
                                 const QueryRowFn& query, const std::function<PageFormat(int64_t i)>& format_of,
                                 KvStats* stats, int n_threads);

// The record of an entry whose tables were not chosen (caller's stats): the options' flags, zero
// estimates.
TransformRecord FixedTransformRecord(const LayerShape& shape, const TransformOptions& transforms);

}  // namespace kvpack::cpu
