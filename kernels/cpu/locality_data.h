// Synthetic Q/K/V with spatial-temporal locality, as video diffusion transformers have it: the test
// data of the block-sparse path (sparse_attention.h) and of `kvpack-eval --data locality`. Host-only
// evaluation code (allocates freely). client/python/kvpack/locality.py is the same generator in numpy
// (same formulas; its own random stream, so not the same numbers).
//
// Tokens: a leading text range of text_tokens tokens, then a frames × height × width grid in raster
// order (token text_tokens + (f·height + y)·width + x). Per head, independently, from one seed
// (std::mt19937_64):
//   grid position u = (f/frames, y/height, x/width) ∈ [0, 1)³
//   field F(u)[c] = Σ_{m<kLocalityModes} a_m[c] · cos(2π ω_m·u + φ_m) / √kLocalityModes
//                   ω_m integer frequencies in 0..kLocalityMaxFrequency per axis (low: smooth in
//                   space and time), a_m ~ N(0, I_d), φ_m ~ U[0, 2π)
//   K[t,c] = off_c + σ_c · (F_K(u_t)[c] + noise · z_tc),   z ~ N(0, 1) per token
//   V[t,c] likewise with its own field, offsets and scales
//   off_c ~ N(0, 1.5²), σ_c = exp(N(0, 0.3²)); kOutlierChannelsK (V: kOutlierChannelsV) channels
//   of each head have off_c and σ_c multiplied by outlier_scale
//   Q[t]   = g · (F_K(u_t) + noise · z'_t): correlated with the keys of nearby tokens (whose fields
//            are close), not with its own key's noise; g set so that the logits scale·q·k over a
//            sample have std kLocalityLogitStd
//   text tokens: field replaced by an i.i.d. N(0, I) row (no locality), same offsets and scales
// qk_norm: every q and k row RMS-normalised and multiplied by a per-head channel gain exp(N(0, 0.2²))
// (RMSNorm weights), then the temperature g re-set. iid: every token's field replaced by an i.i.d.
// N(0, I) row (the data without locality; same offsets and scales), and Q[t] built from the row of a
// random token π(t) instead of its own (a query still has keys it prefers, just not nearby ones).
#pragma once

#include <cstdint>

#include "kernels/cpu/quality.h"

namespace kvpack::cpu {

inline constexpr int kLocalityModes = 12;
inline constexpr int kLocalityMaxFrequency = 2;
inline constexpr double kLocalityNoise = 0.35;       // per-token noise against the unit-variance field
inline constexpr double kLocalityLogitStd = 3.0;     // temperature: std of scale · q · k over a sample

struct LocalityOptions {
  int frames = 4;
  int height = 16;
  int width = 16;
  int64_t text_tokens = 0;  // leading text range
  int n_heads = 1;
  int head_dim = 64;
  double outlier_scale = 5.0;
  bool qk_norm = false;
  bool iid = false;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(d)
  uint64_t seed = 1;

  int64_t Tokens() const { return text_tokens + static_cast<int64_t>(frames) * height * width; }
};

// q, k and v of Tokens() tokens each ([N, H, d]).
SyntheticData MakeLocalityData(const LocalityOptions& options);

}  // namespace kvpack::cpu
