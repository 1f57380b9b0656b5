// The per-head transform choice (kernels/transform_choice.h) through the CPU pre-pass entry point
// (stats.h ChooseTransforms), on the synthetic sink data (quality.h) that shows why it exists.
#include "kernels/transform_choice.h"

#include <gtest/gtest.h>

#include <vector>

#include "kernels/cpu/estimate.h"
#include "kernels/cpu/quality.h"
#include "kernels/cpu/stats.h"

namespace kvpack::cpu {
namespace {

constexpr int64_t kKeys = 1500;
constexpr int64_t kQueries = 96;
constexpr int kHeads = 4;
constexpr int kHeadDim = 64;
constexpr int kSampleTokens = 700;  // fewer than kKeys so that the stride matters

struct ChoiceCase {
  SyntheticData data;
  LayerShape shape{kKeys, kHeads * kHeadDim, kHeads, kHeadDim};
  TransformOptions transforms;
};

ChoiceCase MakeCase(SyntheticKind kind) {
  SyntheticOptions o;
  o.n_k = kKeys;
  o.n_q = kQueries;
  o.n_heads = kHeads;
  o.head_dim = kHeadDim;
  o.outlier_scale = 2.0;
  o.seed = 77;
  o.kind = kind;
  ChoiceCase s;
  s.data = MakeSyntheticData(o);
  s.transforms.stats_sample_tokens = kSampleTokens;
  return s;
}

// ChooseTransforms on the setup's data, every key in `format`; *stats receives the chosen tables.
TransformRecord Choose(const ChoiceCase& s, PageFormat format, int threads, bool with_queries, KvStats* stats) {
  const int64_t hd = s.shape.HeadCols();
  const int64_t n_sample = StatsSampleCount(kKeys, s.transforms);
  *stats = ComputeStats(s.data.k.data(), s.data.v.data(), s.shape, s.transforms);
  QueryRowFn query;
  if (with_queries) {
    query = [&](int64_t i, int h, float* q) {
      const float* row = s.data.q.data() + i * hd + h * kHeadDim;
      std::copy(row, row + kHeadDim, q);
    };
  }
  return ChooseTransforms(
      n_sample, kQueries, s.shape, s.transforms, 0.0f,
      [&](int64_t i, int h, float* k, float* v) {
        const int64_t at = StatsSampleToken(i, kKeys, n_sample) * hd + h * kHeadDim;
        std::copy(s.data.k.begin() + at, s.data.k.begin() + at + kHeadDim, k);
        std::copy(s.data.v.begin() + at, s.data.v.begin() + at + kHeadDim, v);
      },
      query, [&](int64_t) { return format; }, stats, threads);
}

bool RowIs(const std::vector<float>& table, int h, float value) {
  for (int c = 0; c < kHeadDim; ++c) {
    if (table[h * kHeadDim + c] != value) return false;
  }
  return true;
}

TEST(TransformChoice, TablesExpressTheFlags) {
  const ChoiceCase s = MakeCase(SyntheticKind::kSinks);
  KvStats full = ComputeStats(s.data.k.data(), s.data.v.data(), s.shape, s.transforms);
  KvStats chosen;
  const TransformRecord r = Choose(s, PageFormat::kInt4, 2, true, &chosen);
  for (int h = 0; h < kHeads; ++h) {
    const uint32_t f = r.head_flags[h];
    SCOPED_TRACE("head " + std::to_string(h) + " flags " + std::to_string(f));
    EXPECT_TRUE(f & kHeadChosen);
    EXPECT_EQ(RowIs(chosen.mu_k, h, 0.0f), !(f & kHeadSmoothK));
    EXPECT_EQ(RowIs(chosen.lambda, h, 1.0f), !(f & kHeadBalanceK));
    EXPECT_EQ(RowIs(chosen.lambda_v, h, 1.0f), !(f & kHeadBalanceV));
    const float alpha = (f & kHeadSmoothV) ? 1.0f : (f & kHeadSmoothVHalf) ? 0.5f : 0.0f;
    for (int c = 0; c < kHeadDim; ++c) EXPECT_EQ(chosen.mu_v[h * kHeadDim + c], alpha * full.mu_v[h * kHeadDim + c]);
  }
  // The heaviest sink head (h % 4 == 2: 95% of the attention on near-zero V rows) must not subtract
  // the full μ_v; that is the failure the choice exists for.
  EXPECT_FALSE(r.head_flags[2] & kHeadSmoothV);
}

TEST(TransformChoice, NeverRanksBelowNaiveAndReportsBothEstimates) {
  const ChoiceCase s = MakeCase(SyntheticKind::kSinks);
  const int64_t hd = s.shape.HeadCols();
  KvStats stats = ComputeStats(s.data.k.data(), s.data.v.data(), s.shape, s.transforms);
  const int64_t n_sample = StatsSampleCount(kKeys, s.transforms);
  for (int h = 0; h < kHeads; ++h) {
    const int64_t n_keys = EstimateKeyCount(n_sample);
    std::vector<float> q(kEstimateQueries * kHeadDim), k(n_keys * kHeadDim), v(k.size());
    std::vector<PageFormat> formats(n_keys, PageFormat::kInt4);
    for (int64_t j = 0; j < n_keys; ++j) {
      const int64_t at = StatsSampleToken(EstimateKeyIndex(j, n_sample), kKeys, n_sample) * hd + h * kHeadDim;
      std::copy(s.data.k.begin() + at, s.data.k.begin() + at + kHeadDim, k.begin() + j * kHeadDim);
      std::copy(s.data.v.begin() + at, s.data.v.begin() + at + kHeadDim, v.begin() + j * kHeadDim);
    }
    for (int i = 0; i < kEstimateQueries; ++i) {
      const int64_t at = (i * kQueries / kEstimateQueries) * hd + h * kHeadDim;
      std::copy(s.data.q.begin() + at, s.data.q.begin() + at + kHeadDim, q.begin() + i * kHeadDim);
    }
    const HeadSample sample{kHeadDim, n_keys, kEstimateQueries, q.data(), k.data(), v.data(), formats.data()};
    const int64_t at = h * kHeadDim;
    const HeadTables tables{stats.mu_k.data() + at, stats.mu_v.data() + at, stats.lambda.data() + at,
                            stats.lambda_v.data() + at};
    const HeadChoice c = ChooseHeadTransforms(sample, s.transforms, 0.0f, tables);
    EXPECT_LE(c.chosen.query_rel, c.naive.query_rel) << "head " << h;
    EXPECT_GT(c.naive.err, 0.0);
    EXPECT_GT(c.chosen.ref, 0.0);
    // INT4's estimate is the chosen one (every key was INT4), and the formats rank as they should.
    EXPECT_DOUBLE_EQ(c.by_format[0].err, c.chosen.err) << "head " << h;
    EXPECT_GT(c.by_format[0].Rel(), c.by_format[1].Rel());
    EXPECT_GT(c.by_format[1].Rel(), c.by_format[2].Rel());
    // The tables now hold the kept set: estimating them again gives the same figure.
    EXPECT_DOUBLE_EQ(EstimateHeadError(sample, s.transforms, 0.0f, tables, c.flags, PageFormat::kInt4).err, c.chosen.err);
    // Each format's figure (from the estimator's reused K and V sides) is a fresh estimate's.
    for (int f = 0; f < kNumPageFormats; ++f) {
      EXPECT_DOUBLE_EQ(EstimateHeadError(sample, s.transforms, 0.0f, tables, c.flags, static_cast<PageFormat>(f)).err,
                       c.by_format[f].err) << "head " << h << " format " << f;
    }
  }
}

TEST(TransformChoice, IsTheSameForAnyThreadCount) {
  const ChoiceCase s = MakeCase(SyntheticKind::kSinks);
  KvStats one, three;
  const TransformRecord a = Choose(s, PageFormat::kInt8, 1, true, &one);
  const TransformRecord b = Choose(s, PageFormat::kInt8, 3, true, &three);
  EXPECT_EQ(a.head_flags, b.head_flags);
  EXPECT_EQ(a.head_estimates, b.head_estimates);
  EXPECT_EQ(one.mu_k, three.mu_k);
  EXPECT_EQ(one.mu_v, three.mu_v);
  EXPECT_EQ(one.lambda, three.lambda);
  EXPECT_EQ(one.lambda_v, three.lambda_v);
}

TEST(TransformChoice, OptionsBoundTheCandidates) {
  ChoiceCase s = MakeCase(SyntheticKind::kSinks);
  s.transforms.smooth = false;
  KvStats stats;
  TransformRecord r = Choose(s, PageFormat::kInt4, 2, true, &stats);
  for (int h = 0; h < kHeads; ++h) {
    EXPECT_EQ(r.head_flags[h] & (kHeadSmoothK | kHeadSmoothV | kHeadSmoothVHalf), 0u) << "head " << h;
    EXPECT_TRUE(RowIs(stats.mu_k, h, 0.0f) && RowIs(stats.mu_v, h, 0.0f)) << "head " << h;
  }
  s.transforms.smooth = true;
  s.transforms.choose_per_head = false;
  r = Choose(s, PageFormat::kInt4, 2, true, &stats);
  const KvStats full = ComputeStats(s.data.k.data(), s.data.v.data(), s.shape, s.transforms);
  EXPECT_EQ(stats.mu_v, full.mu_v);
  EXPECT_EQ(r.head_flags, std::vector<uint32_t>(kHeads, FixedHeadFlags(s.transforms)));
  EXPECT_GT(EstimatedRelError(r.head_estimates.data(), kHeads, PageFormat::kInt4), 0.0);  // still estimated
}

// Rows already on INT4's grid (every row holds each integer in [−8, 7]) are stored exactly without R
// and inexactly with it: the choice stores q·k and V plain (format v3), and only where the options
// allow it.
TEST(TransformChoice, KeepsRowsOnTheGridPlainWhereAllowed) {
  constexpr int d = 64, n_keys = 256, n_q = kEstimateQueries;
  std::vector<float> q(n_q * d), k(n_keys * d), v(n_keys * d);
  for (int j = 0; j < n_keys; ++j) {
    for (int c = 0; c < d; ++c) {
      k[j * d + c] = static_cast<float>((j + c) % 16 - 8);
      v[j * d + c] = static_cast<float>((3 * j + 5 * c) % 16 - 8);
    }
  }
  for (int i = 0; i < n_q * d; ++i) q[i] = static_cast<float>((i * 37) % 11 - 5) / 16.0f;  // bf16-exact
  const std::vector<PageFormat> formats(n_keys, PageFormat::kInt4);
  const HeadSample sample{d, n_keys, n_q, q.data(), k.data(), v.data(), formats.data()};
  const auto choose = [&](const TransformOptions& t) {
    std::vector<float> mu_k(d, 0.25f), mu_v(d, -0.5f), lambda(d, 1.5f), lambda_v(d, 0.75f);
    return ChooseHeadTransforms(sample, t, 0.0f, HeadTables{mu_k.data(), mu_v.data(), lambda.data(), lambda_v.data()});
  };
  TransformOptions t;
  const HeadChoice plain = choose(t);
  EXPECT_EQ(plain.flags & (kHeadPlainK | kHeadPlainV), kHeadPlainK | kHeadPlainV);
  EXPECT_LT(plain.chosen.Rel(), 1e-6) << "exact rows";
  TransformOptions no_plain_k = t;
  no_plain_k.choose_plain_k = false;  // as ChoiceTransforms sets it on the INT8 MMA path
  const HeadChoice v_only = choose(no_plain_k);
  EXPECT_EQ(v_only.flags & (kHeadPlainK | kHeadPlainV), kHeadPlainV);
  EXPECT_GT(v_only.chosen.Rel(), plain.chosen.Rel());
  TransformOptions unrotated = t;
  unrotated.rotate = false;  // nothing to drop
  EXPECT_EQ(choose(unrotated).flags & (kHeadPlainK | kHeadPlainV), 0u);
}

// A Plan's estimate from a sample (PlanRequest.sample) chooses among the candidates the layer would:
// where an entry of the format runs the INT8 MMA path q·k stays rotated (ChoiceTransforms), so its
// INT4 / INT8 estimates are those of the options without plain K; BF16 entries run bf16 MMAs.
// Rows on INT4's grid make plain K the bf16 path's choice, so the two paths' estimates differ.
TEST(TransformChoice, SampleEstimateFollowsTheMmaPath) {
  constexpr int d = 64, heads = 2, n = 256;
  const LayerShape shape{n, heads * d, heads, d};
  std::vector<float> q(n * heads * d), k(q.size()), v(q.size());
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < heads * d; ++i) {
      const int c = i % d, at = j * heads * d + i;
      k[at] = static_cast<float>((j + c + i / d) % 16 - 8);
      v[at] = static_cast<float>((3 * j + 5 * c) % 16 - 8);
      q[at] = static_cast<float>((at * 37) % 11 - 5) / 16.0f;
    }
  }
  const TransformOptions t;
  TransformOptions no_plain_k = t;
  no_plain_k.choose_plain_k = false;
  const auto estimate = [&](const TransformOptions& o, MmaPath mma) {
    return EstimateFromSample(q.data(), k.data(), v.data(), n, shape, o, mma, 0.0f, 1);
  };
  const auto int8_path = estimate(t, MmaPath::kInt8), bf16_path = estimate(t, MmaPath::kBf16);
  const auto without_plain_k = estimate(no_plain_k, MmaPath::kBf16);
  for (PageFormat f : {PageFormat::kInt4, PageFormat::kInt8}) {
    const int i = static_cast<int>(f);
    EXPECT_EQ(int8_path[i], without_plain_k[i]) << "format " << i;
    EXPECT_GT(int8_path[i], bf16_path[i]) << "format " << i << ": plain K is the bf16 path's choice on grid rows";
  }
  const int b = static_cast<int>(PageFormat::kBf16);
  EXPECT_EQ(int8_path[b], bf16_path[b]);
  // auto resolves to INT8 only at d = 128 (mma_path.h): at d = 64 it is the bf16 path's estimate.
  EXPECT_EQ(estimate(t, MmaPath::kAuto), bf16_path);
}

TEST(TransformChoice, WithoutQueriesKeepsTheOptionsSet) {
  const ChoiceCase s = MakeCase(SyntheticKind::kSinks);
  KvStats stats;
  const TransformRecord r = Choose(s, PageFormat::kInt4, 2, false, &stats);
  const KvStats full = ComputeStats(s.data.k.data(), s.data.v.data(), s.shape, s.transforms);
  EXPECT_EQ(stats.mu_k, full.mu_k);
  EXPECT_EQ(stats.mu_v, full.mu_v);
  EXPECT_EQ(r.head_flags, std::vector<uint32_t>(kHeads, kHeadSmoothK | kHeadSmoothV | kHeadBalanceK | kHeadBalanceV));
  EXPECT_EQ(EstimatedRelError(r.head_estimates.data(), kHeads, PageFormat::kInt4), 0.0);
}

}  // namespace
}  // namespace kvpack::cpu
