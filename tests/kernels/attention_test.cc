#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/layer.h"
#include "kernels/cpu/quality.h"
#include "kernels/cpu/stats.h"
#include "kernels/rotation.h"
#include "kernels/transform_choice.h"

namespace kvpack::cpu {
namespace {

// AttendFloat with all transforms vs the FP64 reference (synthetic structured K/V, 10× outliers).
constexpr double kRelL2Int4 = 0.06;
constexpr double kRelL2Int8 = 4e-3;
constexpr double kRelL2Bf16 = 2e-3;
// A bf16 pipeline (Q, K, V rounded to bf16: 2^-9 relative each) against FP64, with or without the
// transforms; the two pipelines then differ by at most the sum of their errors.
constexpr double kBf16PipelineRelL2 = 5e-3;
// The transforms in double precision: exact up to FP64 rounding.
constexpr double kFp64Exactness = 1e-10;

struct Problem {
  SyntheticData data;
  int64_t n_q, n_k;
  int heads, d;
};

Problem MakeProblem(int64_t n_q, int64_t n_k, int heads, int d, uint64_t seed) {
  SyntheticOptions o;
  o.n_q = n_q;
  o.n_k = n_k;
  o.n_heads = heads;
  o.head_dim = d;
  o.outlier_scale = 10.0;
  o.seed = seed;
  return {MakeSyntheticData(o), n_q, n_k, heads, d};
}

std::vector<double> Reference(const Problem& p, const QueryBlock& queries, const int32_t* key_seq,
                              const AttentionOptions& attention) {
  std::vector<double> out(static_cast<size_t>(queries.n_q) * p.heads * p.d);
  ReferenceAttention(queries, p.data.k.data(), p.data.v.data(), key_seq, p.n_k, p.heads, p.d, attention, out.data());
  return out;
}

// Packs p's K/V with `ranges`, attends `queries`.
std::vector<float> Attend(const Problem& p, const std::vector<TokenRange>& ranges, const TransformOptions& transforms,
                          const QueryBlock& queries, const AttentionOptions& attention, int threads) {
  const LayerShape shape{p.n_k, p.heads * p.d, p.heads, p.d};
  const KvLayout layout = PlanKvLayout(shape, ranges);
  std::vector<uint8_t> block(layout.total_bytes);
  const KvStats stats = ComputeStats(p.data.k.data(), p.data.v.data(), shape, transforms);
  EXPECT_TRUE(PackKv(p.data.k.data(), p.data.v.data(), shape, ranges, stats, transforms, block.data(), CpuOptions{threads}).ok());
  std::vector<float> out(static_cast<size_t>(queries.n_q) * p.heads * p.d);
  EXPECT_TRUE(AttendFloat(MakeKvView(layout, shape, block.data(), transforms), queries, attention, out.data(),
                          CpuOptions{threads}).ok());
  return out;
}

QueryBlock AllQueries(const Problem& p) {
  QueryBlock q;
  q.q = p.data.q.data();
  q.n_q = p.n_q;
  return q;
}

TEST(Attention, MatchesFp64ReferenceForEachFormat) {
  const Problem p = MakeProblem(45, 397, 2, 64, 17);
  const QueryBlock queries = AllQueries(p);
  const std::vector<double> ref = Reference(p, queries, nullptr, {});
  for (PageFormat f : {PageFormat::kInt4, PageFormat::kInt8, PageFormat::kBf16}) {
    const std::vector<float> out = Attend(p, {{0, p.n_k, 0, f}}, TransformOptions{}, queries, {}, 2);
    const QualityResult r = CompareOutputs(ref.data(), out.data(), p.n_q, p.heads, p.d);
    const double tol = f == PageFormat::kInt4 ? kRelL2Int4 : f == PageFormat::kInt8 ? kRelL2Int8 : kRelL2Bf16;
    EXPECT_LT(r.rel_l2, tol) << "format " << int(f);
  }
}

// Format v3: a head whose flags say plain stores q·k (kHeadPlainK) or V (kHeadPlainV) without R. Heads
// plain on both sides attend exactly as the same head of an unrotated entry, heads plain on neither as a
// rotated one (bit for bit); heads plain on one side stay within INT8's bound of FP64.
TEST(Attention, PlainHeadsAttendAsAnUnrotatedEntry) {
  const Problem p = MakeProblem(37, 300, 4, 64, 31);
  const LayerShape shape{p.n_k, p.heads * p.d, p.heads, p.d};
  const std::vector<TokenRange> ranges = {{0, p.n_k, 0, PageFormat::kInt8}};
  const KvLayout layout = PlanKvLayout(shape, ranges);
  const QueryBlock queries = AllQueries(p);
  const auto attend = [&](const TransformOptions& t, const TransformRecord* record) {
    std::vector<uint8_t> block(layout.total_bytes);
    const KvStats stats = ComputeStats(p.data.k.data(), p.data.v.data(), shape, t);
    EXPECT_TRUE(PackKv(p.data.k.data(), p.data.v.data(), shape, ranges, stats, t, block.data(), CpuOptions{2}, record).ok());
    std::vector<float> out(static_cast<size_t>(p.n_q) * p.heads * p.d);
    EXPECT_TRUE(AttendFloat(MakeKvView(layout, shape, block.data(), t), queries, {}, out.data(), CpuOptions{2}).ok());
    return out;
  };
  TransformOptions rotated, unrotated;
  unrotated.rotate = false;
  TransformRecord record = FixedTransformRecord(shape, rotated);
  record.head_flags[0] |= kHeadPlainK | kHeadPlainV;
  record.head_flags[2] |= kHeadPlainK;
  record.head_flags[3] |= kHeadPlainV;
  const std::vector<float> mixed = attend(rotated, &record);
  const std::vector<float> all_rotated = attend(rotated, nullptr);
  const std::vector<float> none_rotated = attend(unrotated, nullptr);
  const auto head_equal = [&](const std::vector<float>& a, int h) {
    for (int64_t i = 0; i < p.n_q; ++i) {
      for (int c = 0; c < p.d; ++c) {
        const size_t at = (static_cast<size_t>(i) * p.heads + h) * p.d + c;
        if (a[at] != mixed[at]) return false;
      }
    }
    return true;
  };
  EXPECT_TRUE(head_equal(none_rotated, 0)) << "head 0 (plain q·k and V) as in an unrotated entry";
  EXPECT_TRUE(head_equal(all_rotated, 1)) << "head 1 (no plain bit) as in a rotated entry";
  EXPECT_FALSE(head_equal(all_rotated, 0));
  EXPECT_FALSE(head_equal(all_rotated, 2));
  EXPECT_FALSE(head_equal(all_rotated, 3));
  const std::vector<double> ref = Reference(p, queries, nullptr, {});
  EXPECT_LT(CompareOutputs(ref.data(), mixed.data(), p.n_q, p.heads, p.d).rel_l2, kRelL2Int8);
}

// An MMA path over all of p's keys in one format, beside the bf16 path: outputs and rel L2 errors.
struct PathRun {
  std::vector<float> out, exact;  // the path's output; the bf16 path's
  double error = 0.0;             // the path's vs FP64 (ref)
  double exact_error = 0.0;       // the bf16 path's vs FP64
  double own_error = 0.0;         // the path's vs the bf16 path's (mma_rel_l2)
};
PathRun RunPath(const Problem& p, const std::vector<double>& ref, PageFormat f, MmaPath path) {
  AttentionOptions bf16, quant;
  bf16.mma = MmaPath::kBf16;
  quant.mma = path;
  const std::vector<TokenRange> ranges = {{0, p.n_k, 0, f}};
  PathRun r;
  r.exact = Attend(p, ranges, TransformOptions{}, AllQueries(p), bf16, 2);
  r.out = Attend(p, ranges, TransformOptions{}, AllQueries(p), quant, 2);
  r.exact_error = CompareOutputs(ref.data(), r.exact.data(), p.n_q, p.heads, p.d).rel_l2;
  r.error = CompareOutputs(ref.data(), r.out.data(), p.n_q, p.heads, p.d).rel_l2;
  const std::vector<double> exact_d(r.exact.begin(), r.exact.end());
  r.own_error = CompareOutputs(exact_d.data(), r.out.data(), p.n_q, p.heads, p.d).rel_l2;
  return r;
}

// The INT8 MMA path (mma_path.h) against FP64, relative to the bf16 path's error on the same pages:
// the bounds (INT4 ×1.10, INT8 ×1.5).
constexpr double kInt8MmaErrorRatioInt4 = 1.10;
constexpr double kInt8MmaErrorRatioInt8 = 1.5;

TEST(Attention, Int8MmaPathStaysWithinItsBoundOfTheExactPath) {
  for (int d : {64, 128}) {
    const Problem p = MakeProblem(64, 1000, 2, d, 23 + d);
    const std::vector<double> ref = Reference(p, AllQueries(p), nullptr, {});
    for (PageFormat f : {PageFormat::kInt4, PageFormat::kInt8}) {
      const PathRun r = RunPath(p, ref, f, MmaPath::kInt8);
      std::printf("d=%d format %d: rel L2 vs FP64 bf16 path %.5f, int8 path %.5f (ratio %.3f); int8 vs bf16 path %.5f\n",
                  d, static_cast<int>(f), r.exact_error, r.error, r.error / r.exact_error, r.own_error);
      EXPECT_NE(r.out, r.exact) << "the INT8 path computes something of its own";
      EXPECT_LT(r.error, r.exact_error * (f == PageFormat::kInt4 ? kInt8MmaErrorRatioInt4 : kInt8MmaErrorRatioInt8));
    }
  }
}

// The FP8 path (mma_path.h kFp8; the CPU's emulation, no GPU kernel yet): on INT4 pages P·V from e4m3
// P' and centred codes, within the bounds (total error ×1.10 of the bf16 path, its own error
// mma_rel_l2 ≤ 0.02); on INT8 pages it is the INT8 path (P·V in bf16).
constexpr double kFp8MmaErrorRatioInt4 = 1.10;
constexpr double kFp8MmaRelL2Int4 = 0.02;

TEST(Attention, Fp8MmaPathStaysWithinItsBoundOfTheExactPath) {
  for (int d : {64, 128}) {
    const Problem p = MakeProblem(64, 1000, 2, d, 31 + d);
    const std::vector<double> ref = Reference(p, AllQueries(p), nullptr, {});
    const PathRun r = RunPath(p, ref, PageFormat::kInt4, MmaPath::kFp8);
    const PathRun s_int8 = RunPath(p, ref, PageFormat::kInt4, MmaPath::kInt8);
    const std::vector<double> int8_d(s_int8.out.begin(), s_int8.out.end());
    const double pv_rel_l2 = CompareOutputs(int8_d.data(), r.out.data(), p.n_q, p.heads, p.d).rel_l2;
    std::printf("d=%d INT4: rel L2 vs FP64 bf16 path %.5f, fp8 path %.5f (ratio %.3f); fp8 vs bf16 path %.5f, vs the "
                "int8 path (its P·V alone) %.5f\n",
                d, r.exact_error, r.error, r.error / r.exact_error, r.own_error, pv_rel_l2);
    EXPECT_GT(pv_rel_l2, 0.0) << "P·V in e4m3 computes something of its own";
    EXPECT_LT(r.own_error, kFp8MmaRelL2Int4);
    EXPECT_LT(r.error, r.exact_error * kFp8MmaErrorRatioInt4);
    AttentionOptions int8, fp8;
    int8.mma = MmaPath::kInt8;
    fp8.mma = MmaPath::kFp8;
    const std::vector<TokenRange> int8_pages = {{0, p.n_k, 0, PageFormat::kInt8}};
    EXPECT_EQ(Attend(p, int8_pages, TransformOptions{}, AllQueries(p), fp8, 2),
              Attend(p, int8_pages, TransformOptions{}, AllQueries(p), int8, 2))
        << "INT8 pages take P·V in bf16 on the FP8 path";
  }
  EXPECT_EQ(ResolveMmaPath(MmaPath::kFp8, /*has_bf16_pages=*/true, 128, true), MmaPath::kBf16);
  EXPECT_EQ(ResolveMmaPath(MmaPath::kFp8, false, 64, false), MmaPath::kFp8);
  EXPECT_NE(ResolveMmaPath(MmaPath::kAuto, false, 128, true), MmaPath::kFp8) << "auto never takes fp8 (not on a GPU)";
}

// Fp8E4m3Round against the e4m3 values themselves: each is kept; the midpoint of two neighbours goes to
// the one with the even code, a hair off it to the nearer; beyond 448 saturates; NaN stays NaN.
TEST(Attention, Fp8E4m3RoundIsRoundToNearestEvenSaturating) {
  std::vector<float> values;  // codes 0x00…0x7e, ascending
  for (int code = 0; code <= 0x7e; ++code) {
    const int e = code >> 3, m = code & 7;
    values.push_back(e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7));
  }
  ASSERT_EQ(values.back(), kE4m3Max);
  ASSERT_EQ(values[8], kE4m3MinNormal);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(Fp8E4m3Round(values[i]), values[i]) << "code " << i;
    EXPECT_EQ(Fp8E4m3Round(-values[i]), -values[i]) << "code " << i;
    if (i + 1 == values.size()) break;
    const float lo = values[i], hi = values[i + 1], mid = 0.5f * (lo + hi);
    EXPECT_EQ(Fp8E4m3Round(mid), i % 2 == 0 ? lo : hi) << "midpoint of codes " << i << ", " << i + 1;
    EXPECT_EQ(Fp8E4m3Round(std::nextafter(mid, 0.0f)), lo) << "below the midpoint of codes " << i << ", " << i + 1;
    EXPECT_EQ(Fp8E4m3Round(std::nextafter(mid, kE4m3Max)), hi) << "above the midpoint of codes " << i << ", " << i + 1;
  }
  for (float big : {448.5f, 464.0f, 479.9f, 480.0f, 1e6f, INFINITY}) EXPECT_EQ(Fp8E4m3Round(big), kE4m3Max) << big;
  EXPECT_EQ(Fp8E4m3Round(-1e6f), -kE4m3Max);
  EXPECT_EQ(Fp8E4m3Round(std::ldexp(1.0f, -11)), 0.0f);
  EXPECT_TRUE(std::isnan(Fp8E4m3Round(NAN)));
  EXPECT_EQ(Fp8PageFactor(0.0f), 0.0f);
  EXPECT_EQ(Fp8PageFactor(0.5f), 512.0f);
}

TEST(Attention, Int8MmaOnAnEntryWithBf16PagesIsTheBf16Path) {
  const Problem p = MakeProblem(30, 300, 2, 64, 29);
  const QueryBlock queries = AllQueries(p);
  const std::vector<TokenRange> ranges = {{0, 100, 0, PageFormat::kBf16}, {100, p.n_k, 0, PageFormat::kInt4}};
  AttentionOptions bf16, int8;
  bf16.mma = MmaPath::kBf16;
  int8.mma = MmaPath::kInt8;
  EXPECT_EQ(Attend(p, ranges, TransformOptions{}, queries, int8, 2), Attend(p, ranges, TransformOptions{}, queries, bf16, 2));
  EXPECT_EQ(ResolveMmaPath(MmaPath::kInt8, /*has_bf16_pages=*/true, 128, true), MmaPath::kBf16);
  EXPECT_EQ(ResolveMmaPath(MmaPath::kInt8, false, 64, false), MmaPath::kInt8);
  EXPECT_EQ(ResolveMmaPath(MmaPath::kAuto, false, 128, true), MmaPath::kInt8);
  EXPECT_EQ(ResolveMmaPath(MmaPath::kAuto, false, 64, true), MmaPath::kBf16);
  EXPECT_EQ(ResolveMmaPath(MmaPath::kAuto, false, 128, false), MmaPath::kBf16);
  EXPECT_EQ(ResolveMmaPath(MmaPath::kAuto, true, 128, true), MmaPath::kBf16);
  EXPECT_EQ(ResolveMmaPath(MmaPath::kBf16, false, 128, true), MmaPath::kBf16);
}

TEST(Attention, QueryCodesOfEdgeRows) {
  const QueryScale zero = QueryScaleOf(0.0f);  // an all-zero row: codes 0, a positive scale
  EXPECT_EQ(zero.scale, 1.0f);
  EXPECT_EQ(QueryCode(0.0f, zero), 0);
  const QueryScale s = QueryScaleOf(2.54f);
  EXPECT_EQ(QueryCode(2.54f, s), 127);
  EXPECT_EQ(QueryCode(-2.54f, s), -127);
  EXPECT_EQ(QueryCode(0.01f, s), 0);
  EXPECT_EQ(QueryCode(0.03f, s), 2);  // 1.5 in fp32: ties go to even
  EXPECT_EQ(QueryCode(0.05f, s), 2);  // 2.5
  const QueryScale inf = QueryScaleOf(INFINITY);
  EXPECT_EQ(QueryCode(1.0f, inf), 0);
  EXPECT_EQ(QueryCode(NAN, s), 0);
}

TEST(Attention, TransformsChangeNothingOnBf16Pages) {
  const Problem p = MakeProblem(40, 300, 3, 32, 18);
  const QueryBlock queries = AllQueries(p);
  TransformOptions off;
  off.rotate = off.smooth = off.balance = false;
  const std::vector<float> plain = Attend(p, {{0, p.n_k, 0, PageFormat::kBf16}}, off, queries, {}, 2);
  const std::vector<float> full = Attend(p, {{0, p.n_k, 0, PageFormat::kBf16}}, TransformOptions{}, queries, {}, 2);
  const std::vector<double> ref = Reference(p, queries, nullptr, {});
  const double plain_err = CompareOutputs(ref.data(), plain.data(), p.n_q, p.heads, p.d).rel_l2;
  const double full_err = CompareOutputs(ref.data(), full.data(), p.n_q, p.heads, p.d).rel_l2;
  EXPECT_LT(plain_err, kBf16PipelineRelL2);
  EXPECT_LT(full_err, kBf16PipelineRelL2);
  std::vector<double> plain_d(plain.begin(), plain.end());
  EXPECT_LT(CompareOutputs(plain_d.data(), full.data(), p.n_q, p.heads, p.d).rel_l2, 2 * kBf16PipelineRelL2);
}

// R as a dense double matrix: R[i][j] = H[i][j] · s_j / √d.
std::vector<double> RotationMatrix(int d, uint64_t seed) {
  std::vector<double> r(static_cast<size_t>(d) * d);
  for (int i = 0; i < d; ++i) {
    for (int j = 0; j < d; ++j) {
      const int parity = __builtin_popcount(static_cast<unsigned>(i & j)) & 1;
      r[i * d + j] = (parity ? -1.0 : 1.0) * RotationSign(seed, j) / std::sqrt(double(d));
    }
  }
  return r;
}

TEST(Attention, SmoothingBalancingAndRotationAreExactInFp64) {
  const Problem p = MakeProblem(20, 150, 2, 32, 19);
  const int d = p.d, H = p.heads;
  const LayerShape shape{p.n_k, H * d, H, d};
  const TransformOptions transforms;
  const KvStats s = ComputeStats(p.data.k.data(), p.data.v.data(), shape, transforms);
  // Both balancings are at work: the outlier channels of K and V get factors well above 1.
  EXPECT_GT(*std::max_element(s.lambda.begin(), s.lambda.end()), 2.0f);
  EXPECT_GT(*std::max_element(s.lambda_v.begin(), s.lambda_v.end()), 2.0f);
  const std::vector<double> r = RotationMatrix(d, transforms.seed);
  const double scale = 1.0 / std::sqrt(double(d));
  auto rotate = [&](const std::vector<double>& x) {
    std::vector<double> y(d, 0.0);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) y[i] += r[i * d + j] * x[j];
    }
    return y;
  };
  const std::vector<double> ref = Reference(p, AllQueries(p), nullptr, {});
  for (int64_t t = 0; t < p.n_q; ++t) {
    for (int h = 0; h < H; ++h) {
      std::vector<double> q(d);
      for (int c = 0; c < d; ++c) q[c] = p.data.q[(t * H + h) * d + c] * double(s.lambda[h * d + c]);
      q = rotate(q);
      std::vector<double> scores(p.n_k), acc(d, 0.0);
      double best = -1e300, sum = 0.0;
      for (int64_t j = 0; j < p.n_k; ++j) {
        std::vector<double> k(d);
        for (int c = 0; c < d; ++c) k[c] = (p.data.k[(j * H + h) * d + c] - double(s.mu_k[h * d + c])) / s.lambda[h * d + c];
        k = rotate(k);
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot += q[c] * k[c];
        scores[j] = dot * scale;
        best = std::max(best, scores[j]);
      }
      for (int64_t j = 0; j < p.n_k; ++j) {
        std::vector<double> v(d);
        for (int c = 0; c < d; ++c) v[c] = (p.data.v[(j * H + h) * d + c] - double(s.mu_v[h * d + c])) / s.lambda_v[h * d + c];
        v = rotate(v);
        const double e = std::exp(scores[j] - best);
        sum += e;
        for (int c = 0; c < d; ++c) acc[c] += e * v[c];
      }
      for (int i = 0; i < d; ++i) {  // o = λ_v ⊙ Rᵀ·(acc/ℓ) + μ_v
        double o = 0.0;
        for (int j = 0; j < d; ++j) o += r[j * d + i] * acc[j] / sum;
        o = o * s.lambda_v[h * d + i] + s.mu_v[h * d + i];
        const double expected = ref[(t * H + h) * d + i];
        ASSERT_NEAR(o, expected, kFp64Exactness * (1.0 + std::fabs(expected))) << "t " << t << " h " << h << " c " << i;
      }
    }
  }
}

TEST(Attention, SequenceIdsAndCausalMaskLikeTheReference) {
  const Problem p = MakeProblem(300, 300, 2, 32, 20);
  const std::vector<TokenRange> ranges = {{0, 100, 4, PageFormat::kBf16}, {100, 170, 9, PageFormat::kBf16},
                                          {170, 300, 4, PageFormat::kBf16}};
  std::vector<int32_t> seq(300);
  std::vector<int64_t> pos(300);
  for (const TokenRange& r : ranges) {
    for (int64_t t = r.begin; t < r.end; ++t) seq[t] = r.seq_id, pos[t] = t;
  }
  QueryBlock queries = AllQueries(p);
  queries.seq_ids = seq.data();
  queries.positions = pos.data();
  for (bool causal : {false, true}) {
    AttentionOptions attention;
    attention.causal = causal;
    const std::vector<double> ref = Reference(p, queries, seq.data(), attention);
    const std::vector<float> out = Attend(p, ranges, TransformOptions{}, queries, attention, 3);
    EXPECT_LT(CompareOutputs(ref.data(), out.data(), p.n_q, p.heads, p.d).rel_l2, kRelL2Bf16) << "causal " << causal;
  }
}

TEST(Attention, QueryThatSeesNoKeyGetsZeros) {
  const Problem p = MakeProblem(3, 100, 1, 16, 21);
  const int32_t seq[3] = {0, 5, 0};
  QueryBlock queries = AllQueries(p);
  queries.seq_ids = seq;
  const std::vector<float> out = Attend(p, {{0, 100, 0, PageFormat::kInt8}}, TransformOptions{}, queries, {}, 1);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(out[16 + c], 0.0f);
  EXPECT_NE(out[0], 0.0f);
}

TEST(Attention, IsBitIdenticalForAnyThreadCount) {
  const Problem p = MakeProblem(77, 250, 3, 64, 22);
  const std::vector<TokenRange> ranges = {{0, 130, 0, PageFormat::kInt4}, {130, 250, 0, PageFormat::kInt8}};
  const std::vector<float> one = Attend(p, ranges, TransformOptions{}, AllQueries(p), {}, 1);
  const std::vector<float> four = Attend(p, ranges, TransformOptions{}, AllQueries(p), {}, 4);
  EXPECT_EQ(one, four);
}

TEST(Attention, EffectiveScaleDefaultsToInverseSqrtD) {
  EXPECT_FLOAT_EQ(EffectiveScale({}, 64), 0.125f);
  AttentionOptions a;
  a.softmax_scale = 0.3f;
  EXPECT_EQ(EffectiveScale(a, 64), 0.3f);
}

}  // namespace
}  // namespace kvpack::cpu
