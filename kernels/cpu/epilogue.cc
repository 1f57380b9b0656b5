#include "kernels/cpu/epilogue.h"

#include <cmath>

#include "kernels/format.h"
#include "kernels/rotation.h"

namespace kvpack::cpu {

EpilogueParams MakeEpilogueParams(const LayerConfig& config, const LayerTensors& tensors) {
  EpilogueParams p;
  p.n_heads = config.shape.n_heads;
  p.head_dim = config.shape.head_dim;
  p.bias = config.has_bias ? tensors.bias : nullptr;
  p.qk_norm = config.qk_norm;
  if (config.qk_norm.enabled) {
    p.q_norm_weight = tensors.q_norm_weight;
    p.k_norm_weight = tensors.k_norm_weight;
  }
  p.rope = config.rope;
  p.positions = config.rope.layout == RopeLayout::kNone ? nullptr : tensors.positions;
  return p;
}

void ApplyQkNorm(float* x, int d, const float* w, float eps) {
  float sum_sq = 0.0f;
  for (int c = 0; c < d; ++c) sum_sq += x[c] * x[c];
  const float scale = 1.0f / sqrtf(sum_sq / static_cast<float>(d) + eps);
  for (int c = 0; c < d; ++c) x[c] = x[c] * scale * w[c];
}

void ApplyRope(float* x, int d, const RopeOptions& rope, const float* position) {
  (void)d;
  int rotary = 0;
  for (int a = 0; a < rope.n_axes; ++a) rotary += rope.axis_dims[a];
  const int half = rotary / 2;
  int section_begin = 0;
  for (int a = 0; a < rope.n_axes; ++a) {
    const int pairs = rope.axis_dims[a] / 2;
    const float pos = position[a];
    for (int i = 0; i < pairs; ++i) {
      const int j = section_begin + i;
      const float inv_freq = static_cast<float>(
          std::pow(static_cast<double>(rope.theta), -2.0 * i / static_cast<double>(rope.axis_dims[a])));
      const float angle = pos * inv_freq;
      const float c = cosf(angle);
      const float s = sinf(angle);
      const int c0 = rope.layout == RopeLayout::kInterleaved ? 2 * j : j;
      const int c1 = rope.layout == RopeLayout::kInterleaved ? 2 * j + 1 : j + half;
      const float x0 = x[c0];
      const float x1 = x[c1];
      x[c0] = x0 * c - x1 * s;
      x[c1] = x0 * s + x1 * c;
    }
    section_begin += pairs;
  }
}

void EpilogueRow(const EpilogueParams& p, Proj proj, int64_t token, int head, const uint16_t* row, float* x) {
  const int d = p.head_dim;
  const int64_t col0 = (static_cast<int64_t>(proj) * p.n_heads + head) * d;
  for (int c = 0; c < d; ++c) x[c] = Bf16ToFloat(row[c]);
  if (p.bias != nullptr) {
    for (int c = 0; c < d; ++c) x[c] += p.bias[col0 + c];
  }
  if (proj == Proj::kV) return;
  if (p.qk_norm.enabled) {
    const float* w = proj == Proj::kQ ? p.q_norm_weight : p.k_norm_weight;
    if (p.qk_norm.weight_len != d) w += static_cast<int64_t>(head) * d;
    ApplyQkNorm(x, d, w, p.qk_norm.eps);
  }
  if (p.rope.layout != RopeLayout::kNone) ApplyRope(x, d, p.rope, p.positions + token * p.rope.n_axes);
}

void ToStoredK(float* x, int d, const float* mu, const float* lambda, bool rotate, uint64_t seed) {
  for (int c = 0; c < d; ++c) x[c] = (x[c] - mu[c]) / lambda[c];
  if (rotate) RotateForward(x, d, seed);
}

void ToStoredV(float* x, int d, const float* mu, const float* lambda_v, bool rotate, uint64_t seed) {
  for (int c = 0; c < d; ++c) x[c] = (x[c] - mu[c]) / lambda_v[c];
  if (rotate) RotateForward(x, d, seed);
}

void ToStoredQ(float* x, int d, const float* lambda, bool rotate, uint64_t seed) {
  for (int c = 0; c < d; ++c) x[c] *= lambda[c];
  if (rotate) RotateForward(x, d, seed);
  for (int c = 0; c < d; ++c) x[c] = Bf16ToFloat(FloatToBf16(x[c]));
}

}  // namespace kvpack::cpu
