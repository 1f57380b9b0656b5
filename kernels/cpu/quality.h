// Accuracy of packed attention against the FP64 reference, and the structured synthetic K/V the
// quality figures (docs/quality.md), the tests and kvpack-eval use. Host-only, allocates freely
// (O(N) vectors): this is evaluation code, not part of a layer's budgeted path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/layer.h"
#include "kernels/cpu/stats.h"

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

// What real activations add to the generator above (each kind starts from it; pass outlier_scale
// 1.3–2.7 for the mild outliers real K/V have, 10–50 for the structured data format v1 was tuned on):
//   kSinks   attention sinks: in every head but each 4th (h % 4 == 3), kSinkTokens keys (token 0
//            and random others) take a share m_h of each query's attention, m_h spread over
//            [kSinkMassMin, kSinkMassMax] across heads, and their V rows are near zero
//            (kSinkValueScale × the channel spread, no offset), as on separator and punctuation
//            tokens of pretrained text encoders. Queries get a shared component a·u (a = half the
//            median ‖q‖, u a random unit vector) and sink keys the offset plus b·u, with b set so the
//            sinks' logit lead gives m_h against N keys of logit std kLogitStd.
//   kQkNorm  QK-normalised q and k: every q and k row RMS-normalised and multiplied by a per-head
//            channel gain exp(N(0, 0.2²)) (as RMSNorm weights do), then q's temperature re-set.
enum class SyntheticKind { kOutliers, kSinks, kQkNorm };
inline constexpr int kSinkTokens = 3;
inline constexpr double kSinkMassMin = 0.5;
inline constexpr double kSinkMassMax = 0.95;
inline constexpr double kSinkValueScale = 0.03;

struct SyntheticOptions {
  int64_t n_k = 0;
  int64_t n_q = 0;
  int n_heads = 0;
  int head_dim = 0;
  double outlier_scale = 20.0;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(d); the logit temperature is set for this scale
  uint64_t seed = 1;
  SyntheticKind kind = SyntheticKind::kOutliers;
};

// "outliers", "sinks", "qknorm"; false for any other name.
bool ParseSyntheticKind(const std::string& name, SyntheticKind* kind);
const char* SyntheticKindName(SyntheticKind kind);

struct SyntheticData {
  std::vector<float> q;  // [n_q, H, d]
  std::vector<float> k;  // [n_k, H, d]
  std::vector<float> v;  // [n_k, H, d]
};

// Scales the q rows of head h (data->q [n_q, heads, d]) so that the mean over calibration_queries
// sampled queries of the std over calibration_keys sampled keys of scale·q·k is logit_std: the
// temperature of the synthetic generators (MakeSyntheticData, locality_data.h).
void CalibrateLogitStd(SyntheticData* data, int64_t n_q, int64_t n_k, int heads, int h, int d, double scale,
                       double logit_std, int64_t calibration_queries, int64_t calibration_keys);

SyntheticData MakeSyntheticData(const SyntheticOptions& options);

// ── Evaluation ──────────────────────────────────────────────────────────────────────────────────

struct QualityResult {
  double rel_l2 = 0.0;               // ‖o − o_ref‖ / ‖o_ref‖ over all queries and heads
  double cosine = 0.0;               // mean over (query, head) rows of cos(o, o_ref)
  std::vector<double> head_rel_l2;   // per head
  std::vector<double> head_cosine;   // per head, mean over queries
  int worst_head = 0;                // the head of the lowest mean cosine
  double worst_head_cosine = 0.0;
  double bits_per_value = 0.0;       // bytes of all K and V pages (partial pages included) · 8 / (2·N·H·d)
};

// Compares float outputs with the reference, both [n_q, H, d].
QualityResult CompareOutputs(const double* reference, const float* out, int64_t n_q, int n_heads, int head_dim);

// Packs k and v ([n_k, H, d], one range, sequence 0) in `format` with `transforms` (statistics from
// the strided sample; with transforms.choose_per_head the per-head choice as the layer makes it,
// its queries the strided sample of q), attends with q ([n_q, H, d], every query sees every key),
// writes out [n_q, H, d], the stored bits per value in *bits_per_value and the entry's per-head
// flags and estimates in *record (either may be null). With attention.sparse the block-sparse path
// runs (sparse_attention.h) and adds its tallies to *sparse_report (may be null); its query blocks
// follow the pages of the queries' positions: query i at position i when n_q == n_k (self-attention,
// the layer's blocks), otherwise every query at n_k − 1 (blocks of 128 consecutive queries).
// bf16_path_out (may be null): also the bf16 MMA path's output over the same entry (the same pages and
// per-head choice, which a run with attention.mma = bf16 may choose differently), [n_q, H, d].
Error AttendPackedFloat(const float* q, int64_t n_q, const float* k, const float* v, int64_t n_k, int n_heads,
                        int head_dim, PageFormat format, const TransformOptions& transforms,
                        const AttentionOptions& attention, const CpuOptions& options, float* out,
                        double* bits_per_value, TransformRecord* record = nullptr,
                        SparseReport* sparse_report = nullptr, float* bf16_path_out = nullptr);

}  // namespace kvpack::cpu
