#include "kernels/cpu/epilogue.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/rotation.h"
#include "tests/kernels/cpu_test_layer.h"

namespace kvpack::cpu {
namespace {

// fp32 epilogue vs the direct double implementation, relative to the row's magnitude. RoPE angles
// are pos·inv_freq in fp32 (positions ≤ 100 here: angle error ~1e-5).
constexpr double kRopeTolerance = 5e-5;
constexpr double kNormTolerance = 1e-6;
// Stored forms keep q·k up to q·μ_k; fp32 with rotation and bf16-rounded q: 2^-8 of |q|·|k|.
constexpr double kDotTolerance = 4e-3;

std::vector<float> Row(std::mt19937_64& rng, int d) {
  std::student_t_distribution<double> t(4.0);
  std::vector<float> x(d);
  for (int c = 0; c < d; ++c) x[c] = static_cast<float>(0.4 * (c % 5) + t(rng) * (c % 29 == 2 ? 15.0 : 1.0));
  return x;
}

double Magnitude(const std::vector<float>& x) {
  double s = 0.0;
  for (float v : x) s += double(v) * v;
  return std::sqrt(s);
}

TEST(Epilogue, RopeMatchesDirectScalarForBothLayoutsAndAxes) {
  std::mt19937_64 rng(6);
  for (RopeLayout layout : {RopeLayout::kInterleaved, RopeLayout::kSplitHalves}) {
    for (int axes : {1, 2, 3}) {
      for (int d : {16, 64, 128}) {
        RopeOptions rope;
        rope.layout = layout;
        rope.n_axes = axes;
        rope.theta = axes == 1 ? 10000.0f : 256.0f;
        const int dims[3][3] = {{d, 0, 0}, {d / 2, d / 4, 0}, {d / 4, 3 * d / 8, d / 4}};
        for (int a = 0; a < axes; ++a) rope.axis_dims[a] = dims[axes - 1][a];
        for (int trial = 0; trial < 5; ++trial) {
          const float pos[3] = {float(trial * 7 + 1), float(trial * 13 % 17), float(99 - trial)};
          std::vector<float> x = Row(rng, d);
          std::vector<double> expected(x.begin(), x.end());
          testing::DirectRope(expected.data(), rope, pos);
          ApplyRope(x.data(), d, rope, pos);
          const double tol = kRopeTolerance * Magnitude(x);
          for (int c = 0; c < d; ++c) {
            ASSERT_NEAR(x[c], expected[c], tol) << "layout " << int(layout) << " axes " << axes << " d " << d << " c " << c;
          }
        }
      }
    }
  }
}

TEST(Epilogue, QkNormMatchesDirectScalar) {
  std::mt19937_64 rng(7);
  for (int d : {16, 128, 256}) {
    std::vector<float> x = Row(rng, d), w(d);
    for (int c = 0; c < d; ++c) w[c] = 0.5f + 0.01f * c;
    double ms = 0.0;
    for (float v : x) ms += double(v) * v;
    const double r = 1.0 / std::sqrt(ms / d + 1e-6);
    std::vector<double> expected(d);
    for (int c = 0; c < d; ++c) expected[c] = x[c] * r * w[c];
    ApplyQkNorm(x.data(), d, w.data(), 1e-6f);
    for (int c = 0; c < d; ++c) EXPECT_NEAR(x[c], expected[c], kNormTolerance * 20) << c;
  }
}

TEST(Epilogue, RowAppliesBiasNormAndRopeInOrderPerHead) {
  testing::TestLayer L = testing::MakeTestLayer(40, 64, 3, 32, 8);
  L.config.qk_norm = {true, 1e-5f, 3 * 32};  // per-head weights
  testing::SetRope(L, testing::VideoRope(RopeLayout::kSplitHalves, 32));
  const EpilogueParams p = MakeEpilogueParams(L.config, L.Tensors());
  std::mt19937_64 rng(9);
  for (int64_t t : {0, 17, 39}) {
    for (int h = 0; h < 3; ++h) {
      std::vector<float> src = Row(rng, 32);
      std::vector<uint16_t> bf(32);
      for (int c = 0; c < 32; ++c) bf[c] = FloatToBf16(src[c]);
      for (Proj proj : {Proj::kQ, Proj::kK, Proj::kV}) {
        std::vector<float> x(32);
        EpilogueRow(p, proj, t, h, bf.data(), x.data());
        std::vector<double> expected(32);
        const int64_t col0 = (int64_t(proj) * 3 + h) * 32;
        for (int c = 0; c < 32; ++c) expected[c] = double(Bf16ToFloat(bf[c])) + L.bias[col0 + c];
        if (proj != Proj::kV) {
          const float* w = (proj == Proj::kQ ? L.q_norm : L.k_norm).data() + h * 32;
          double ms = 0.0;
          for (double v : expected) ms += v * v;
          const double r = 1.0 / std::sqrt(ms / 32 + 1e-5);
          for (int c = 0; c < 32; ++c) expected[c] *= r * w[c];
          testing::DirectRope(expected.data(), L.config.rope, L.positions.data() + t * 3);
        }
        for (int c = 0; c < 32; ++c) {
          ASSERT_NEAR(x[c], expected[c], kRopeTolerance * 40) << "proj " << int(proj) << " h " << h << " c " << c;
        }
      }
    }
  }
}

TEST(Epilogue, StoredFormsKeepDotProductsUpToTheKeyMean) {
  std::mt19937_64 rng(10);
  const int d = 64;
  std::vector<float> mu_k = Row(rng, d), mu_v = Row(rng, d), lambda(d), lambda_v(d);
  for (int c = 0; c < d; ++c) lambda[c] = 0.25f + 0.05f * (c % 31);
  for (int c = 0; c < d; ++c) lambda_v[c] = 2.0f - 0.04f * (c % 37);
  for (bool rotate : {false, true}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> q = Row(rng, d), k = Row(rng, d), v = Row(rng, d);
      double expected = 0.0;
      for (int c = 0; c < d; ++c) expected += double(q[c]) * (k[c] - mu_k[c]);
      std::vector<float> qs = q, ks = k, vs = v;
      ToStoredQ(qs.data(), d, lambda.data(), rotate, 77);
      ToStoredK(ks.data(), d, mu_k.data(), lambda.data(), rotate, 77);
      ToStoredV(vs.data(), d, mu_v.data(), lambda_v.data(), rotate, 77);
      double got = 0.0;
      for (int c = 0; c < d; ++c) got += double(qs[c]) * ks[c];
      EXPECT_NEAR(got, expected, kDotTolerance * Magnitude(q) * Magnitude(k));
      for (int c = 0; c < d; ++c) EXPECT_EQ(qs[c], Bf16ToFloat(FloatToBf16(qs[c])));  // Q is bf16
      if (rotate) RotateInverse(vs.data(), d, 77);
      for (int c = 0; c < d; ++c) EXPECT_NEAR(vs[c] * lambda_v[c] + mu_v[c], v[c], 1e-5 * Magnitude(v));
    }
  }
}

}  // namespace
}  // namespace kvpack::cpu
