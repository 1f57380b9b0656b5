#include "kernels/cpu/projection.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/format.h"

namespace kvpack::cpu {
namespace {

// fp32 accumulation of D products of bf16 values: error ≤ ~D·2^-24 · Σ|a·b|; D ≤ 1000 here.
constexpr double kDotRelTolerance = 1e-4;

std::vector<uint16_t> RandomBf16(std::mt19937_64& rng, int n, double offset) {
  std::student_t_distribution<double> t(3.0);
  std::vector<uint16_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = FloatToBf16(static_cast<float>(offset + t(rng) * (i % 31 == 5 ? 20.0 : 1.0)));
  return v;
}

TEST(Projection, DotMatchesDoubleWithinFp32Error) {
  std::mt19937_64 rng(3);
  for (int n : {1, 7, 8, 9, 100, 333, 1000}) {
    const std::vector<uint16_t> a = RandomBf16(rng, n, 0.3), b = RandomBf16(rng, n, -0.1);
    double exact = 0.0, magnitude = 0.0;
    for (int i = 0; i < n; ++i) {
      exact += double(Bf16ToFloat(a[i])) * Bf16ToFloat(b[i]);
      magnitude += std::fabs(double(Bf16ToFloat(a[i])) * Bf16ToFloat(b[i]));
    }
    EXPECT_NEAR(DotBf16(a.data(), b.data(), n), exact, kDotRelTolerance * magnitude) << "n " << n;
  }
}

TEST(Projection, DotFollowsTheDocumentedOrder) {
  std::mt19937_64 rng(4);
  const int n = 37;
  const std::vector<uint16_t> a = RandomBf16(rng, n, 1.0), b = RandomBf16(rng, n, 2.0);
  float s[8] = {};
  for (int i = 0; i < n; ++i) s[i % 8] += Bf16ToFloat(a[i]) * Bf16ToFloat(b[i]);
  const float expected = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
  EXPECT_EQ(DotBf16(a.data(), b.data(), n), expected);
}

TEST(Projection, RowIsBf16RoundedDotOfEachWeightRow) {
  std::mt19937_64 rng(5);
  const int hidden = 45, cols = 11;
  const std::vector<uint16_t> x = RandomBf16(rng, hidden, 0.5);
  const std::vector<uint16_t> w = RandomBf16(rng, hidden * 20, 0.0);
  std::vector<uint16_t> out(cols);
  ProjectRow(x.data(), w.data(), hidden, 6, cols, out.data());
  for (int j = 0; j < cols; ++j) {
    EXPECT_EQ(out[j], FloatToBf16(DotBf16(x.data(), w.data() + (6 + j) * hidden, hidden))) << j;
  }
}

}  // namespace
}  // namespace kvpack::cpu
