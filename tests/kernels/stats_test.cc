#include "kernels/cpu/stats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/layer.h"

namespace kvpack::cpu {
namespace {

constexpr double kStatsTolerance = 1e-5;

struct Kv {
  LayerShape shape;
  std::vector<float> k, v;
};

Kv MakeKv(int64_t n, int heads, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::student_t_distribution<double> t(4.0);
  Kv kv{{n, heads * d, heads, d}, {}, {}};
  kv.k.resize(static_cast<size_t>(n) * heads * d);
  kv.v.resize(kv.k.size());
  for (size_t i = 0; i < kv.k.size(); ++i) {
    const int c = static_cast<int>(i % d);
    kv.k[i] = static_cast<float>(0.3 * c - 2.0 + t(rng) * (c == 5 ? 30.0 : 1.0 + 0.01 * c));
    kv.v[i] = static_cast<float>(-0.1 * c + t(rng) * (c == 9 ? 20.0 : 1.0));
  }
  return kv;
}

TEST(Stats, SampleIsStridedAcrossTheSequence) {
  TransformOptions t;
  t.stats_sample_tokens = 100;
  EXPECT_EQ(StatsSampleCount(1000, t), 100);
  EXPECT_EQ(StatsSampleCount(37, t), 37);
  EXPECT_EQ(StatsSampleToken(0, 1000, 100), 0);
  EXPECT_EQ(StatsSampleToken(99, 1000, 100), 990);
  EXPECT_EQ(StatsSampleToken(1, 999, 100), 9);
}

TEST(Stats, MeanAndBalanceFollowTheirDefinitions) {
  const Kv kv = MakeKv(517, 3, 32, 12);
  TransformOptions t;
  t.stats_sample_tokens = 130;
  const KvStats s = ComputeStats(kv.k.data(), kv.v.data(), kv.shape, t);
  const int64_t n_sample = 130;
  for (int h = 0; h < 3; ++h) {
    double log_sum = 0.0, log_sum_v = 0.0;
    std::vector<double> range(32, 0.0), rms_v(32, 0.0);
    for (int c = 0; c < 32; ++c) {
      double sum_k = 0.0, sum_v = 0.0;
      for (int64_t i = 0; i < n_sample; ++i) {
        const int64_t tok = i * 517 / n_sample;
        sum_k += kv.k[(tok * 3 + h) * 32 + c];
        sum_v += kv.v[(tok * 3 + h) * 32 + c];
      }
      const double mu = sum_k / n_sample;
      EXPECT_NEAR(s.mu_k[h * 32 + c], mu, kStatsTolerance * (1 + std::fabs(mu)));
      EXPECT_NEAR(s.mu_v[h * 32 + c], sum_v / n_sample, kStatsTolerance * (1 + std::fabs(sum_v / n_sample)));
      for (int64_t i = 0; i < n_sample; ++i) {
        const int64_t tok = i * 517 / n_sample;
        range[c] = std::max(range[c], std::fabs(double(kv.k[(tok * 3 + h) * 32 + c]) - s.mu_k[h * 32 + c]));
        const double dv = double(kv.v[(tok * 3 + h) * 32 + c]) - s.mu_v[h * 32 + c];
        rms_v[c] += dv * dv / n_sample;
      }
      rms_v[c] = std::sqrt(rms_v[c]);
      log_sum += std::log(s.lambda[h * 32 + c]);
      log_sum_v += std::log(s.lambda_v[h * 32 + c]);
    }
    EXPECT_NEAR(log_sum / 32, 0.0, kStatsTolerance);  // geometric mean 1 per head
    // λ ∝ sqrt(range): the ratio of two channels is the sqrt of their ranges' ratio.
    EXPECT_NEAR(s.lambda[h * 32 + 5] / s.lambda[h * 32 + 0], std::sqrt(range[5] / range[0]), 1e-4);
    EXPECT_GT(s.lambda[h * 32 + 5], 3.0f);  // the outlier channel is balanced hardest
    // λ_v: the same rule on V's RMS around μ_v.
    EXPECT_NEAR(log_sum_v / 32, 0.0, kStatsTolerance);
    for (int c : {0, 3, 9, 31}) {
      EXPECT_NEAR(s.lambda_v[h * 32 + c] / s.lambda_v[h * 32 + 1], std::sqrt(rms_v[c] / rms_v[1]), 1e-4) << c;
    }
    EXPECT_GT(s.lambda_v[h * 32 + 9], 3.0f);
  }
}

TEST(Stats, SwitchesGiveZeroMeansAndUnitBalance) {
  const Kv kv = MakeKv(100, 2, 16, 13);
  TransformOptions t;
  t.smooth = false;
  KvStats s = ComputeStats(kv.k.data(), kv.v.data(), kv.shape, t);
  for (float m : s.mu_k) EXPECT_EQ(m, 0.0f);
  for (float m : s.mu_v) EXPECT_EQ(m, 0.0f);
  EXPECT_NE(s.lambda[0], 1.0f);
  EXPECT_NE(s.lambda_v[0], 1.0f);  // balancing alone: ranges around 0
  t.smooth = true;
  t.balance = false;
  s = ComputeStats(kv.k.data(), kv.v.data(), kv.shape, t);
  for (float l : s.lambda) EXPECT_EQ(l, 1.0f);
  for (float l : s.lambda_v) EXPECT_EQ(l, 1.0f);
  EXPECT_NE(s.mu_k[0], 0.0f);
}

TEST(Stats, ConstantChannelsHitTheFloorNotZero) {
  Kv kv = MakeKv(64, 1, 16, 14);
  for (int64_t t = 0; t < 64; ++t) kv.k[t * 16 + 3] = 2.5f;  // no spread at all
  const KvStats s = ComputeStats(kv.k.data(), kv.v.data(), kv.shape, TransformOptions{});
  EXPECT_GT(s.lambda[3], 0.0f);
  EXPECT_TRUE(std::isfinite(s.lambda[3]));
  for (int64_t t = 0; t < 64; ++t) {
    for (int c = 0; c < 16; ++c) kv.k[t * 16 + c] = 1.0f;  // a head with no spread: λ = 1
  }
  const KvStats flat = ComputeStats(kv.k.data(), kv.v.data(), kv.shape, TransformOptions{});
  for (float l : flat.lambda) EXPECT_EQ(l, 1.0f);
}

TEST(Stats, AreTheSameForAnyThreadCount) {
  const Kv kv = MakeKv(300, 5, 64, 15);
  const int64_t s = 77;
  TransformOptions t;
  auto row = [&](int64_t i, int h, float* k, float* v) {
    const int64_t tok = StatsSampleToken(i, 300, s);
    for (int c = 0; c < 64; ++c) k[c] = kv.k[(tok * 5 + h) * 64 + c], v[c] = kv.v[(tok * 5 + h) * 64 + c];
  };
  const KvStats one = StatsFromSample(s, kv.shape, t, row, 1);
  const KvStats three = StatsFromSample(s, kv.shape, t, row, 3);
  EXPECT_EQ(one.mu_k, three.mu_k);
  EXPECT_EQ(one.mu_v, three.mu_v);
  EXPECT_EQ(one.lambda, three.lambda);
  EXPECT_EQ(one.lambda_v, three.lambda_v);
}

}  // namespace
}  // namespace kvpack::cpu
