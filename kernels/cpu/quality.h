// Accuracy of packed attention against the FP64 reference, and the structured synthetic K/V the
// quality figures (docs/quality.md), the tests and kvpack-eval use. Host-only, allocates freely
// (O(N) vectors): this is evaluation code, not part of a layer's budgeted path.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/layer.h"

namespace kvpack::cpu {

// ── Synthetic data ──────────────────────────────────────────────────────────────────────────────
// Per head, independently (all from one seed, std::mt19937_64):
//   K[t,c] = off_c + σ_c · z_tc, z = 0.6 · (rank-8 token factors) + 0.8 · Student-t(ν = 4, unit var)
//            off_c ~ N(0, 1.5²), σ_c = exp(N(0, 0.3²)); kOutlierChannelsK channels per head have
//            off_c and σ_c multiplied by outlier_scale (the channels real K often has)
//   V[t,c] likewise with its own offsets and kOutlierChannelsV outlier channels
//   Q[t]   = g · (0.5·(K[π(t)] − off)/‖·‖ + 0.5·n_t/‖n_t‖), n_t Gaussian with per-channel scales:
//            half aligned with a random key, half noise; g sets the std of the logits
//            scale·q·k over a sample to kLogitStd (a temperature typical of trained heads)
inline constexpr int kOutlierChannelsK = 4;
inline constexpr int kOutlierChannelsV = 2;
inline constexpr double kLogitStd = 2.5;

struct SyntheticOptions {
  int64_t n_k = 0;
  int64_t n_q = 0;
  int n_heads = 0;
  int head_dim = 0;
  double outlier_scale = 20.0;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(d); the logit temperature is set for this scale
  uint64_t seed = 1;
};

struct SyntheticData {
  std::vector<float> q;  // [n_q, H, d]
  std::vector<float> k;  // [n_k, H, d]
  std::vector<float> v;  // [n_k, H, d]
};

SyntheticData MakeSyntheticData(const SyntheticOptions& options);

// ── Evaluation ──────────────────────────────────────────────────────────────────────────────────

struct QualityResult {
  double rel_l2 = 0.0;               // ‖o − o_ref‖ / ‖o_ref‖ over all queries and heads
  double cosine = 0.0;               // mean over (query, head) rows of cos(o, o_ref)
  std::vector<double> head_rel_l2;   // per head
  std::vector<double> head_cosine;   // per head, mean over queries
  double bits_per_value = 0.0;       // bytes of all K and V pages (partial pages included) · 8 / (2·N·H·d)
};

// Compares float outputs with the reference, both [n_q, H, d].
QualityResult CompareOutputs(const double* reference, const float* out, int64_t n_q, int n_heads, int head_dim);

// Packs k and v ([n_k, H, d], one range, sequence 0) in `format` with `transforms` (statistics from
// the strided sample), attends with q ([n_q, H, d], every query sees every key), writes out
// [n_q, H, d] and returns the stored bits per value in *bits_per_value.
Error AttendPackedFloat(const float* q, int64_t n_q, const float* k, const float* v, int64_t n_k, int n_heads,
                        int head_dim, PageFormat format, const TransformOptions& transforms,
                        const AttentionOptions& attention, const CpuOptions& options, float* out,
                        double* bits_per_value);

}  // namespace kvpack::cpu
