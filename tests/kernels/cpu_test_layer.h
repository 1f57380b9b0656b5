// Seeded, structured inputs for the CPU layer tests: a LayerConfig and the tensors it reads, owned
// together. x has per-column offsets and Student-t tails; W_k has a few outlier output channels per
// head (×12) and the bias per-channel offsets, so K has the structure the transforms exist for;
// W_q shares directions with W_k, so queries partly align with keys.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/layer.h"
#include "kernels/format.h"

namespace kvpack::cpu::testing {

inline constexpr double kOutlierRowScale = 12.0;

struct TestLayer {
  LayerConfig config;
  std::vector<uint16_t> x, w;
  std::vector<float> bias, q_norm, k_norm, positions;
  std::vector<uint16_t> out;

  LayerTensors Tensors() {
    LayerTensors t;
    t.x = x.data();
    t.w_qkv = w.data();
    t.bias = config.has_bias ? bias.data() : nullptr;
    t.q_norm_weight = config.qk_norm.enabled ? q_norm.data() : nullptr;
    t.k_norm_weight = config.qk_norm.enabled ? k_norm.data() : nullptr;
    t.positions = config.rope.layout != RopeLayout::kNone ? positions.data() : nullptr;
    t.out = config.in_place ? x.data() : out.data();
    return t;
  }
};

inline double StudentT4(std::mt19937_64& rng) {
  std::student_t_distribution<double> t(4.0);
  return t(rng) / std::sqrt(2.0);
}

// A layer of n tokens, `hidden` columns, `heads` × `d`; one range of `format` unless changed later.
inline TestLayer MakeTestLayer(int64_t n, int hidden, int heads, int d, uint64_t seed,
                               PageFormat format = PageFormat::kInt8) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  TestLayer L;
  L.config.shape = {n, hidden, heads, d};
  L.config.ranges = {{0, n, 0, format}};
  L.config.has_bias = true;
  const int64_t hd = static_cast<int64_t>(heads) * d;
  std::vector<double> col_offset(hidden);
  for (double& o : col_offset) o = 0.5 * normal(rng);
  L.x.resize(static_cast<size_t>(n) * hidden);
  for (int64_t t = 0; t < n; ++t) {
    for (int c = 0; c < hidden; ++c) L.x[t * hidden + c] = FloatToBf16(static_cast<float>(col_offset[c] + StudentT4(rng)));
  }
  L.w.resize(static_cast<size_t>(3 * hd) * hidden);
  const double w_scale = 1.0 / std::sqrt(static_cast<double>(hidden));
  std::vector<double> wk(static_cast<size_t>(hd) * hidden);
  for (double& v : wk) v = normal(rng) * w_scale;
  for (int64_t j = 0; j < 3 * hd; ++j) {
    const int64_t block = j / hd, within = j % hd;
    const bool outlier = block == 1 && (within % d == 3 || within % d == d / 2 + 1);
    for (int c = 0; c < hidden; ++c) {
      double v = normal(rng) * w_scale;
      if (block == 0) v = 0.6 * wk[within * hidden + c] + 0.8 * v;  // W_q partly aligned with W_k
      if (block == 1) v = wk[within * hidden + c] * (outlier ? kOutlierRowScale : 1.0);
      L.w[j * hidden + c] = FloatToBf16(static_cast<float>(v));
    }
  }
  L.bias.resize(3 * hd);
  for (float& b : L.bias) b = static_cast<float>(1.5 * normal(rng));
  L.q_norm.resize(hd);
  L.k_norm.resize(hd);
  for (float& w : L.q_norm) w = static_cast<float>(1.0 + 0.2 * normal(rng));
  for (float& w : L.k_norm) w = static_cast<float>(1.0 + 0.2 * normal(rng));
  L.out.resize(static_cast<size_t>(n) * hd);
  L.config.projection_chunk = 100;
  L.config.query_chunk = 70;
  return L;
}

// Turns RoPE on with `rope` and fills positions [N, n_axes] as a (t, h, w) video grid of 4×6 frames
// (n_axes 3), (t, hw) (n_axes 2) or the token index (n_axes 1).
inline void SetRope(TestLayer& L, const RopeOptions& rope) {
  L.config.rope = rope;
  const int64_t n = L.config.shape.n_tokens;
  const int axes = rope.n_axes;
  L.positions.resize(static_cast<size_t>(n) * axes);
  for (int64_t t = 0; t < n; ++t) {
    const float grid[3] = {static_cast<float>(t / 24), static_cast<float>((t / 6) % 4), static_cast<float>(t % 6)};
    if (axes == 1) L.positions[t] = static_cast<float>(t);
    if (axes == 2) L.positions[t * 2] = grid[0], L.positions[t * 2 + 1] = static_cast<float>(t % 24);
    if (axes == 3) for (int a = 0; a < 3; ++a) L.positions[t * 3 + a] = grid[a];
  }
}

inline RopeOptions VideoRope(RopeLayout layout, int d) {
  RopeOptions rope;
  rope.layout = layout;
  rope.n_axes = 3;
  rope.axis_dims[0] = d / 4;
  rope.axis_dims[1] = d / 4;
  rope.axis_dims[2] = d / 4;  // 3d/4 rotary channels, the rest untouched
  return rope;
}

// Runs the layer with fresh buffers; returns the output (x after the call when in_place).
inline Error RunTestLayer(TestLayer& L, int threads, std::vector<uint16_t>* result,
                          std::vector<uint8_t>* kv_out = nullptr) {
  std::vector<uint8_t> kv(KvBytes(L.config));
  std::vector<uint8_t> ws(WorkspaceBytes(L.config));
  CpuOptions options;
  options.n_threads = threads;
  const Error e = RunLayer(L.config, L.Tensors(), kv.data(), ws.data(), options, nullptr);
  *result = L.config.in_place ? L.x : L.out;
  if (kv_out != nullptr) *kv_out = std::move(kv);
  return e;
}

}  // namespace kvpack::cpu::testing

namespace kvpack::cpu::testing {

// Direct scalar RoPE in double: pair j of the rotary channels, j in axis a's section, i = j − s_a.
inline void DirectRope(double* x, const RopeOptions& rope, const float* pos) {
  int rotary = 0;
  for (int a = 0; a < rope.n_axes; ++a) rotary += rope.axis_dims[a];
  int j = 0;
  for (int a = 0; a < rope.n_axes; ++a) {
    for (int i = 0; i < rope.axis_dims[a] / 2; ++i, ++j) {
      const double angle = pos[a] * std::pow(static_cast<double>(rope.theta), -2.0 * i / rope.axis_dims[a]);
      const int c0 = rope.layout == RopeLayout::kInterleaved ? 2 * j : j;
      const int c1 = rope.layout == RopeLayout::kInterleaved ? 2 * j + 1 : j + rotary / 2;
      const double x0 = x[c0], x1 = x[c1];
      x[c0] = x0 * std::cos(angle) - x1 * std::sin(angle);
      x[c1] = x0 * std::sin(angle) + x1 * std::cos(angle);
    }
  }
}

// Q, K, V ([N, H, d]) of the layer computed directly in double from x and W (bias, QK-norm, RoPE),
// then rounded to float: the input of ReferenceAttention.
inline void DirectQkv(const TestLayer& L, std::vector<float>* q, std::vector<float>* k, std::vector<float>* v) {
  const LayerShape& s = L.config.shape;
  const int d = s.head_dim;
  const int64_t hd = s.HeadCols();
  std::vector<float>* outs[3] = {q, k, v};
  for (std::vector<float>* o : outs) o->assign(static_cast<size_t>(s.n_tokens) * hd, 0.0f);
  std::vector<double> row(d);
  for (int64_t t = 0; t < s.n_tokens; ++t) {
    for (int p = 0; p < 3; ++p) {
      for (int h = 0; h < s.n_heads; ++h) {
        for (int c = 0; c < d; ++c) {
          const int64_t j = p * hd + h * d + c;
          double acc = 0.0;
          for (int i = 0; i < s.hidden; ++i) acc += double(Bf16ToFloat(L.x[t * s.hidden + i])) * Bf16ToFloat(L.w[j * s.hidden + i]);
          row[c] = acc + (L.config.has_bias ? L.bias[j] : 0.0);
        }
        if (p < 2 && L.config.qk_norm.enabled) {
          const float* w = (p == 0 ? L.q_norm : L.k_norm).data() + (L.config.qk_norm.weight_len == d ? 0 : h * d);
          double ms = 0.0;
          for (int c = 0; c < d; ++c) ms += row[c] * row[c];
          const double r = 1.0 / std::sqrt(ms / d + L.config.qk_norm.eps);
          for (int c = 0; c < d; ++c) row[c] *= r * w[c];
        }
        if (p < 2 && L.config.rope.layout != RopeLayout::kNone) {
          DirectRope(row.data(), L.config.rope, L.positions.data() + t * L.config.rope.n_axes);
        }
        for (int c = 0; c < d; ++c) (*outs[p])[t * hd + h * d + c] = static_cast<float>(row[c]);
      }
    }
  }
}

// ‖a − b‖ / ‖b‖ of a bf16 output against a double reference.
inline double RelL2(const std::vector<uint16_t>& out, const std::vector<double>& ref) {
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double diff = Bf16ToFloat(out[i]) - ref[i];
    err += diff * diff;
    norm += ref[i] * ref[i];
  }
  return std::sqrt(err / norm);
}

}  // namespace kvpack::cpu::testing
