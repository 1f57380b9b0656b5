// kernels/cpu/locality_data.h: deterministic, finite, and local where asked (attention mass of a
// query near its own page well above a uniform share; i.i.d. data near the uniform share).
#include "kernels/cpu/locality_data.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kvpack::cpu {
namespace {

// Share of a query's softmax mass on keys within ±kNear tokens, its own key left out (FP64, head 0,
// every 7th query).
constexpr int64_t kNear = 96;
// Measured on the grid below: locality ≈ 0.3–0.5 near mass, i.i.d. ≈ the uniform share (≈ 0.09).
constexpr double kMinLocalNearMass = 0.25;
constexpr double kMaxIidNearMass = 0.15;

LocalityOptions Grid(bool iid, bool qk_norm) {
  LocalityOptions o;
  o.frames = 4;
  o.height = 16;
  o.width = 32;
  o.text_tokens = 64;
  o.n_heads = 2;
  o.head_dim = 64;
  o.iid = iid;
  o.qk_norm = qk_norm;
  o.seed = 77;
  return o;
}

double NearMass(const SyntheticData& data, const LocalityOptions& o) {
  const int64_t n = o.Tokens();
  const int d = o.head_dim, heads = o.n_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double total = 0.0;
  int count = 0;
  std::vector<double> s(n);
  for (int64_t i = o.text_tokens; i < n; i += 7) {
    const float* q = data.q.data() + i * heads * d;
    double mx = -1e300;
    for (int64_t j = 0; j < n; ++j) {
      const float* k = data.k.data() + j * heads * d;
      double dot = 0.0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(q[c]) * k[c];
      s[j] = dot * scale;
      mx = std::max(mx, s[j]);
    }
    double all = 0.0, near = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      if (j == i) continue;  // its own key, near in both kinds of data
      const double e = std::exp(s[j] - mx);
      all += e;
      if (std::llabs(j - i) <= kNear) near += e;
    }
    total += near / all;
    ++count;
  }
  return total / count;
}

TEST(LocalityData, IsDeterministicAndFinite) {
  const LocalityOptions o = Grid(false, false);
  const SyntheticData a = MakeLocalityData(o), b = MakeLocalityData(o);
  ASSERT_EQ(a.q.size(), static_cast<size_t>(o.Tokens() * o.n_heads * o.head_dim));
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
  for (float x : a.k) ASSERT_TRUE(std::isfinite(x));
  LocalityOptions other = o;
  other.seed = 78;
  EXPECT_NE(MakeLocalityData(other).k, a.k);
}

TEST(LocalityData, LocalDataAttendsNearbyAndIidDoesNot) {
  for (bool qk_norm : {false, true}) {
    const LocalityOptions o = Grid(false, qk_norm);
    const double local = NearMass(MakeLocalityData(o), o);
    const LocalityOptions iid = Grid(true, qk_norm);
    const double flat = NearMass(MakeLocalityData(iid), iid);
    printf("qk_norm %d: near mass local %.3f iid %.3f (uniform %.3f)\n", qk_norm, local, flat,
           (2.0 * kNear + 1) / o.Tokens());
    EXPECT_GT(local, kMinLocalNearMass);
    EXPECT_LT(flat, kMaxIidNearMass);
  }
}

TEST(LocalityData, QkNormRowsHaveUnitRmsBeforeTheirGain) {
  const LocalityOptions o = Grid(false, true);
  const SyntheticData data = MakeLocalityData(o);
  // RMS of a k row is the RMS of the gains (≈ 1 within the gains' spread exp(N(0, 0.2²))).
  for (int64_t t = 0; t < o.Tokens(); t += 101) {
    const float* k = data.k.data() + t * o.n_heads * o.head_dim;
    double ss = 0.0;
    for (int c = 0; c < o.head_dim; ++c) ss += static_cast<double>(k[c]) * k[c];
    const double rms = std::sqrt(ss / o.head_dim);
    EXPECT_GT(rms, 0.7);
    EXPECT_LT(rms, 1.4);
  }
}

}  // namespace
}  // namespace kvpack::cpu
