#include "kernels/cpu/locality_data.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace kvpack::cpu {
namespace {

constexpr double kTwoPi = 6.283185307179586;
constexpr int64_t kCalibrationQueries = 64;
constexpr int64_t kCalibrationKeys = 1024;

// A smooth random field over [0, 1)³: kLocalityModes low-frequency cosine modes in d channels.
struct Field {
  std::vector<double> amp;    // [modes, d]
  std::vector<double> omega;  // [modes, 3]
  std::vector<double> phase;  // [modes]

  Field(int d, std::mt19937_64& rng) : amp(kLocalityModes * d), omega(kLocalityModes * 3), phase(kLocalityModes) {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::uniform_int_distribution<int> freq(0, kLocalityMaxFrequency);
    std::uniform_real_distribution<double> uniform(0.0, kTwoPi);
    for (double& a : amp) a = normal(rng);
    for (double& w : omega) w = freq(rng);
    for (double& p : phase) p = uniform(rng);
  }
  void At(const double u[3], int d, double* out) const {
    std::fill(out, out + d, 0.0);
    const double norm = 1.0 / std::sqrt(static_cast<double>(kLocalityModes));
    for (int m = 0; m < kLocalityModes; ++m) {
      const double w = std::cos(kTwoPi * (omega[m * 3] * u[0] + omega[m * 3 + 1] * u[1] + omega[m * 3 + 2] * u[2]) +
                                phase[m]) * norm;
      for (int c = 0; c < d; ++c) out[c] += amp[m * d + c] * w;
    }
  }
};

struct Channels {
  std::vector<double> off, sigma;
};

Channels MakeChannels(int d, int n_outliers, double outlier_scale, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  Channels ch{std::vector<double>(d), std::vector<double>(d)};
  for (int c = 0; c < d; ++c) {
    ch.off[c] = 1.5 * normal(rng);
    ch.sigma[c] = std::exp(0.3 * normal(rng));
  }
  for (int i = 0; i < n_outliers; ++i) {
    const int c = static_cast<int>(rng() % static_cast<uint64_t>(d));
    ch.off[c] *= outlier_scale;
    ch.sigma[c] *= outlier_scale;
  }
  return ch;
}

void RmsNormRows(std::vector<float>* rows, int64_t n, int heads, int h, int d, const std::vector<double>& gain) {
  for (int64_t t = 0; t < n; ++t) {
    float* row = rows->data() + (t * heads + h) * d;
    double ss = 0.0;
    for (int c = 0; c < d; ++c) ss += static_cast<double>(row[c]) * row[c];
    const double inv = 1.0 / std::sqrt(ss / d + 1e-6);
    for (int c = 0; c < d; ++c) row[c] = static_cast<float>(row[c] * inv * gain[c]);
  }
}


}  // namespace

SyntheticData MakeLocalityData(const LocalityOptions& o) {
  const int64_t n = o.Tokens();
  const int heads = o.n_heads;
  const int d = o.head_dim;
  const double scale = o.softmax_scale > 0.0f ? o.softmax_scale : 1.0 / std::sqrt(static_cast<double>(d));
  SyntheticData data;
  data.q.resize(static_cast<size_t>(n) * heads * d);
  data.k.resize(data.q.size());
  data.v.resize(data.q.size());
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> fk(static_cast<size_t>(n) * d), fv(d);  // fk: every token's K field row of the head
  for (int h = 0; h < heads; ++h) {
    const Field field_k(d, rng), field_v(d, rng);
    const Channels ck = MakeChannels(d, kOutlierChannelsK, o.outlier_scale, rng);
    const Channels cv = MakeChannels(d, kOutlierChannelsV, o.outlier_scale, rng);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t g = t - o.text_tokens;  // grid index (negative: text)
      double* fkt = fk.data() + t * d;
      if (g < 0 || o.iid) {
        for (int c = 0; c < d; ++c) fkt[c] = normal(rng);
        for (int c = 0; c < d; ++c) fv[c] = normal(rng);
      } else {
        const int64_t plane = static_cast<int64_t>(o.height) * o.width;
        const double u[3] = {static_cast<double>(g / plane) / o.frames,
                             static_cast<double>((g % plane) / o.width) / o.height,
                             static_cast<double>(g % o.width) / o.width};
        field_k.At(u, d, fkt);
        field_v.At(u, d, fv.data());
      }
      float* k = data.k.data() + (t * heads + h) * d;
      float* v = data.v.data() + (t * heads + h) * d;
      for (int c = 0; c < d; ++c) {
        k[c] = static_cast<float>(ck.off[c] + ck.sigma[c] * (fkt[c] + kLocalityNoise * normal(rng)));
        v[c] = static_cast<float>(cv.off[c] + cv.sigma[c] * (fv[c] + kLocalityNoise * normal(rng)));
      }
    }
    // Q: the field at the token's own place (near keys share it; its own key's noise it does not),
    // or without locality the field row of a random other token.
    for (int64_t t = 0; t < n; ++t) {
      const int64_t src = o.iid ? static_cast<int64_t>(rng() % static_cast<uint64_t>(n)) : t;
      float* q = data.q.data() + (t * heads + h) * d;
      for (int c = 0; c < d; ++c) q[c] = static_cast<float>(fk[src * d + c] + kLocalityNoise * normal(rng));
    }
    if (o.qk_norm) {
      std::vector<double> gain_q(d), gain_k(d);
      for (double& x : gain_q) x = std::exp(0.2 * normal(rng));
      for (double& x : gain_k) x = std::exp(0.2 * normal(rng));
      RmsNormRows(&data.q, n, heads, h, d, gain_q);
      RmsNormRows(&data.k, n, heads, h, d, gain_k);
    }
    CalibrateLogitStd(&data, n, n, heads, h, d, scale, kLocalityLogitStd, kCalibrationQueries, kCalibrationKeys);
  }
  return data;
}

}  // namespace kvpack::cpu
