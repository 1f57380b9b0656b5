// kernels/cpu/sparse_attention.h: the block-sparse reference against the dense path (AttendFloat) and
// the FP64 reference, on data with locality (locality_data.h) and without.
#include "kernels/cpu/sparse_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/cpu/locality_data.h"
#include "kernels/cpu/quality.h"
#include "kernels/page_codec.h"
#include "kernels/sparse_plan.h"
#include "kernels/visibility.h"

namespace kvpack::cpu {
namespace {

// Top-k 20% + tail vs dense packed attention on the locality data below (8×16×16 grid + 64 text
// tokens, 2 heads, d = 64, INT4; 33 pages, routed fraction 0.255 with the diagonal). Measured
// (printed by the test): cos 0.9965 / rel L2 0.093, QK-normalised cos 0.9933 / rel L2 0.113 (with one
// routing per 64 queries, before session 18: 0.9978 / 0.076 and 0.9946 / 0.100 — on 33 pages a 128-query
// block's centroid is coarse; on 66 pages of d = 128, docs/quality.md, the two are within ±3% at 10–20%);
// the bounds leave 1.3× margin on the worse error.
constexpr double kLocalityTop20MinCosine = 0.99;
constexpr double kLocalityTop20MaxRelL2 = 0.15;
constexpr int kThreads = 2;
// The INT8 MMA path on the sparse path (d = 128, rotated, INT4 pages, top-k 10–30% with the tail):
// its error vs FP64 dense attention over the unquantized K/V within this factor of the bf16 path's
// on the same pages and routing (issue 12's bar for INT4, 1.10×), and the two within
// kSparseInt8VsBf16RelL2 of each other. Measured on the 2-head 8×16×16 grid: ratios 1.0000 at top-k
// 10/20/30% (rel L2 0.1012 / 0.0812 / 0.0650), int8 vs bf16 0.0006.
constexpr double kSparseInt8ErrorRatio = 1.10;
constexpr double kSparseInt8VsBf16RelL2 = 0.005;

struct Entry {
  LayerShape shape;
  std::vector<TokenRange> ranges;
  KvLayout layout;
  std::vector<uint8_t> block;
  TransformOptions transforms;
  KvEntryView View() const { return MakeKvView(layout, shape, block.data(), transforms); }
};

// Packs data's K/V; with `from`, with the μ and λ of that data (the strided sample of a changed
// copy would see the changes).
Entry Pack(const SyntheticData& data, int64_t n, int heads, int d, std::vector<TokenRange> ranges,
           const SyntheticData* from = nullptr) {
  Entry e;
  e.shape = LayerShape{n, heads * d, heads, d};
  e.ranges = std::move(ranges);
  e.layout = PlanKvLayout(e.shape, e.ranges);
  e.block.resize(e.layout.total_bytes);
  if (from == nullptr) from = &data;
  const KvStats stats = ComputeStats(from->k.data(), from->v.data(), e.shape, e.transforms);
  EXPECT_TRUE(
      PackKv(data.k.data(), data.v.data(), e.shape, e.ranges, stats, e.transforms, e.block.data(), CpuOptions{kThreads})
          .ok());
  return e;
}

LocalityOptions SmallGrid(bool iid = false, bool qk_norm = false) {
  LocalityOptions o;
  o.frames = 8;
  o.height = 16;
  o.width = 16;
  o.text_tokens = 64;
  o.n_heads = 2;
  o.head_dim = 64;
  o.iid = iid;
  o.qk_norm = qk_norm;
  o.seed = 1301;
  return o;
}

struct Queries {
  std::vector<int32_t> seq;
  std::vector<int64_t> pos;
  QueryBlock block;
};

Queries SelfQueries(const SyntheticData& data, const std::vector<TokenRange>& ranges, int64_t n) {
  Queries q;
  q.seq.resize(n);
  q.pos.resize(n);
  for (const TokenRange& r : ranges) {
    for (int64_t t = r.begin; t < r.end; ++t) q.seq[t] = r.seq_id;
  }
  for (int64_t t = 0; t < n; ++t) q.pos[t] = t;
  q.block = QueryBlock{data.q.data(), n, q.seq.data(), q.pos.data()};
  return q;
}

std::vector<float> Dense(const Entry& e, const QueryBlock& q, const AttentionOptions& attention) {
  std::vector<float> out(static_cast<size_t>(q.n_q) * e.shape.HeadCols());
  EXPECT_TRUE(AttendFloat(e.View(), q, attention, out.data(), CpuOptions{kThreads}).ok());
  return out;
}

std::vector<float> Sparse(const Entry& e, const QueryBlock& q, const AttentionOptions& attention,
                          SparseReport* report = nullptr) {
  std::vector<float> out(static_cast<size_t>(q.n_q) * e.shape.HeadCols());
  const Error err = SparseAttendFloat(e.View(), q, attention, e.ranges, out.data(), CpuOptions{kThreads}, report);
  EXPECT_TRUE(err.ok()) << err.message();
  return out;
}

AttentionOptions TopK(float ratio, bool causal = false, bool tail = true) {
  AttentionOptions a;
  a.causal = causal;
  a.sparse.enabled = true;
  a.sparse.topk_ratio = ratio;
  a.sparse.tail = tail;
  return a;
}

QualityResult Compare(const std::vector<float>& ref, const std::vector<float>& out, int64_t n, int heads, int d) {
  const std::vector<double> ref_d(ref.begin(), ref.end());
  return CompareOutputs(ref_d.data(), out.data(), n, heads, d);
}

TEST(SparseAttention, FullTopKIsDenseBitForBit) {
  const LocalityOptions o = SmallGrid();
  const int64_t n = o.Tokens();
  const SyntheticData data = MakeLocalityData(o);
  // Two sequences, partial pages, three formats.
  const std::vector<TokenRange> ranges = {{0, 64, 0, PageFormat::kBf16},
                                          {64, 1000, 0, PageFormat::kInt4},
                                          {1000, 1300, 1, PageFormat::kInt8},
                                          {1300, n, 1, PageFormat::kInt4}};
  const Entry e = Pack(data, n, o.n_heads, o.head_dim, ranges);
  const Queries q = SelfQueries(data, ranges, n);
  for (bool causal : {false, true}) {
    for (bool tail : {true, false}) {
      const std::vector<float> dense = Dense(e, q.block, TopK(1.0f, causal));
      SparseReport report;
      const std::vector<float> sparse = Sparse(e, q.block, TopK(1.0f, causal, tail), &report);
      EXPECT_EQ(0, memcmp(dense.data(), sparse.data(), dense.size() * sizeof(float))) << "causal " << causal;
      EXPECT_EQ(report.exact_pages, report.visible_pages);
      EXPECT_EQ(report.pooled_pages, 0);
    }
  }
  // rel_tau large enough routes every page too.
  AttentionOptions tau = TopK(1.0f);
  tau.sparse.mode = SparseMode::kRelTau;
  tau.sparse.rel_tau = 1e6f;
  const std::vector<float> dense = Dense(e, q.block, tau);
  const std::vector<float> sparse = Sparse(e, q.block, tau);
  EXPECT_EQ(0, memcmp(dense.data(), sparse.data(), dense.size() * sizeof(float)));
}

// The statistics are the bf16 rounding (FloatToBf16) of the float mean key and V sum of each page's
// decoded rows (double sums in slot order, rounded to float), recomputed here from DecodePageRow:
// every format, partial pages, two sequences; 4·d bytes per (page, head).
TEST(SparseAttention, PageStatsAreTheBf16RoundingOfTheFloatMeanAndSum) {
  const LocalityOptions o = SmallGrid();
  const int64_t n = o.Tokens();
  const SyntheticData data = MakeLocalityData(o);
  const Entry e = Pack(data, n, o.n_heads, o.head_dim,
                       {{0, 77, 0, PageFormat::kBf16}, {77, 1000, 0, PageFormat::kInt4},
                        {1000, n, 1, PageFormat::kInt8}});
  const KvEntryView kv = e.View();
  const int P = kv.n_pages, d = kv.head_dim;
  EXPECT_EQ(PageStatsBytes(kv.n_heads, d, P), 4ull * d * P * kv.n_heads);
  std::vector<uint16_t> mean_k(static_cast<size_t>(kv.n_heads) * P * d), v_sum(mean_k.size());
  ComputePageStats(kv, mean_k.data(), v_sum.data(), CpuOptions{kThreads});
  int64_t differ = 0, inexact = 0;
  for (int64_t item = 0; item < static_cast<int64_t>(kv.n_heads) * P; ++item) {
    const PageDesc& page = kv.pages[item % P];
    const PageFormat format = static_cast<PageFormat>(page.format);
    std::vector<double> k_acc(d, 0.0), v_acc(d, 0.0);
    std::vector<float> row(d);
    for (int j = 0; j < page.n_valid; ++j) {
      DecodePageRow(format, kv.pool + kv.k_offsets[item], d, j, row.data());
      for (int c = 0; c < d; ++c) k_acc[c] += row[c];
      DecodePageRow(format, kv.pool + kv.v_offsets[item], d, j, row.data());
      for (int c = 0; c < d; ++c) v_acc[c] += row[c];
    }
    for (int c = 0; c < d; ++c) {
      const float mean = static_cast<float>(k_acc[c] / page.n_valid), sum = static_cast<float>(v_acc[c]);
      differ += mean_k[item * d + c] != FloatToBf16(mean) || v_sum[item * d + c] != FloatToBf16(sum);
      inexact += Bf16ToFloat(mean_k[item * d + c]) != mean;
    }
  }
  EXPECT_EQ(differ, 0);
  EXPECT_GT(inexact, 0) << "the means are rounded (not already bf16 values)";
}

// Routes of every (block, head) of an entry whose queries are its own tokens (a block = the queries of
// a page pair, or of one page: LeadsQueryBlock).
struct Route {
  std::vector<int32_t> exact, pooled;
  int visible = 0;
  int block_pages = 1;
  int64_t token_begin = 0;  // the block's queries: tokens token_begin … + rows − 1 of head `head`
  int rows = 0;
  int head = 0;
};
std::vector<Route> RouteAll(const Entry& e, const SyntheticData& data, const AttentionOptions& attention) {
  const KvEntryView kv = e.View();
  const int P = kv.n_pages, d = kv.head_dim;
  std::vector<uint16_t> mean_k(static_cast<size_t>(kv.n_heads) * P * d), v_sum(mean_k.size());
  ComputePageStats(kv, mean_k.data(), v_sum.data(), CpuOptions{kThreads});
  const std::vector<uint8_t> flags = RangeFlags(e.ranges);
  std::vector<Route> routes;
  std::vector<float> scores(P);
  std::vector<int32_t> order(P), exact(P), pooled(P);
  std::vector<uint8_t> mark(P);
  for (int pg = 0; pg < P; ++pg) {
    if (!LeadsQueryBlock(kv.pages, P, pg)) continue;
    const int block_pages = QueryBlockPages(kv.pages, P, pg);
    const PageDesc& page = kv.pages[pg];
    const int n = QueryBlockRows(kv.pages, P, pg);
    for (int h = 0; h < kv.n_heads; ++h) {
      std::vector<float> stored(static_cast<size_t>(kQueryBlock) * d), centroid(d);
      StoredBlockQueries(kv, h, data.q.data(), page.token_begin, n, stored.data(), centroid.data());
      SparseReport report;
      int n_exact = 0, n_pooled = 0;
      RoutePages(kv, PageStatsView{mean_k.data(), v_sum.data()}, h, centroid.data(), page.seq_id, page.token_begin,
                 page.token_begin + n - 1, attention, EffectiveScale(attention, d), flags,
                 RouteScratch{scores.data(), order.data(), mark.data()}, exact.data(), &n_exact, pooled.data(),
                 &n_pooled, &report);
      routes.push_back({{exact.begin(), exact.begin() + n_exact}, {pooled.begin(), pooled.begin() + n_pooled},
                        static_cast<int>(report.visible_pages), block_pages, page.token_begin, n, h});
    }
  }
  return routes;
}

TEST(SparseAttention, RoutesTheAskedFractionAndTheFloor) {
  const LocalityOptions o = SmallGrid();
  const int64_t n = o.Tokens();
  const SyntheticData data = MakeLocalityData(o);
  const Entry e = Pack(data, n, o.n_heads, o.head_dim, {{0, n, 0, PageFormat::kInt4}});  // 33 pages
  for (float ratio : {0.1f, 0.2f, 0.5f}) {
    for (const Route& r : RouteAll(e, data, TopK(ratio))) {
      const int k = static_cast<int>(std::ceil(ratio * r.visible - 1e-6));
      // top-k ∪ the block's pages ±1 (at most block_pages + 2 pages more).
      EXPECT_GE(static_cast<int>(r.exact.size()), k);
      EXPECT_LE(static_cast<int>(r.exact.size()), k + r.block_pages + 2);
      EXPECT_EQ(r.exact.size() + r.pooled.size(), static_cast<size_t>(r.visible));
      EXPECT_TRUE(std::is_sorted(r.exact.begin(), r.exact.end()));
    }
  }
  AttentionOptions floor = TopK(0.01f, false, false);
  floor.sparse.min_exact_pages = 12;
  floor.sparse.sink_pages = 2;
  for (const Route& r : RouteAll(e, data, floor)) {
    EXPECT_GE(r.exact.size(), 12u);
    EXPECT_TRUE(r.pooled.empty());  // tail off
    EXPECT_EQ(r.exact[0], 0);
    EXPECT_EQ(r.exact[1], 1);
  }
}

// Swapping two K rows inside a page keeps its statistics (mean key; the double sums are exact here)
// and changes its exact attention: a pooled page leaves a block's rows unchanged bit for bit, an
// exact one does not.
TEST(SparseAttention, AlwaysAttendPagesAreExactAndDenseRangesMatchDense) {
  const LocalityOptions o = SmallGrid();
  const int64_t n = o.Tokens();
  SyntheticData data = MakeLocalityData(o);
  std::vector<TokenRange> ranges = {{0, 64, 0, PageFormat::kInt8}, {64, 1024, 0, PageFormat::kInt4},
                                    {1024, n, 0, PageFormat::kInt4}};
  ranges[0].always_attend = true;    // text: page 0
  ranges[2].attend_densely = true;   // its queries see everything exactly
  const int64_t hd = o.n_heads * o.head_dim;
  const AttentionOptions attention = TopK(0.1f);
  const Entry e = Pack(data, n, o.n_heads, o.head_dim, ranges);
  const Queries q = SelfQueries(data, ranges, n);
  SparseReport report;
  const std::vector<float> base = Sparse(e, q.block, attention, &report);
  const std::vector<float> dense = Dense(e, q.block, attention);
  for (int64_t t = 1024; t < n; ++t) {
    ASSERT_EQ(0, memcmp(base.data() + t * hd, dense.data() + t * hd, hd * sizeof(float))) << "token " << t;
  }
  for (const Route& r : RouteAll(e, data, attention)) EXPECT_EQ(r.exact[0], 0);  // text page always exact
  EXPECT_GT(report.pooled_pages, 0);

  auto swap_k_rows = [&](int64_t a, int64_t b) {
    SyntheticData s = data;
    for (int64_t c = 0; c < hd; ++c) std::swap(s.k[a * hd + c], s.k[b * hd + c]);
    return s;
  };
  // The text page (always exact): every query row of sequence 0 changes somewhere.
  {
    const SyntheticData s = swap_k_rows(3, 40);
    const Entry e2 = Pack(s, n, o.n_heads, o.head_dim, ranges, &data);
    const std::vector<float> out = Sparse(e2, q.block, attention);
    int64_t changed = 0;
    for (int64_t t = 0; t < n; ++t) changed += memcmp(out.data() + t * hd, base.data() + t * hd, hd * sizeof(float)) != 0;
    EXPECT_GT(changed, n * 9 / 10);
  }
  // Page 7 (tokens 448..511): pooled for far blocks; their rows do not change.
  {
    const SyntheticData s = swap_k_rows(450, 500);
    const Entry e2 = Pack(s, n, o.n_heads, o.head_dim, ranges, &data);
    const std::vector<float> out = Sparse(e2, q.block, attention);
    const std::vector<Route> routes = RouteAll(e, data, attention);

    int pooled_blocks = 0;
    for (const Route& r : routes) {
      if (!std::binary_search(r.pooled.begin(), r.pooled.end(), 7)) continue;
      ++pooled_blocks;
      for (int j = 0; j < r.rows; ++j) {
        const int64_t off = (r.token_begin + j) * hd + static_cast<int64_t>(r.head) * o.head_dim;
        ASSERT_EQ(0, memcmp(out.data() + off, base.data() + off, o.head_dim * sizeof(float))) << "token " << r.token_begin + j;
      }
    }
    EXPECT_GT(pooled_blocks, 5);
  }
}

TEST(SparseAttention, CausalAndSequenceIdsHold) {
  const LocalityOptions o = SmallGrid();
  const int64_t n = o.Tokens();
  const SyntheticData data = MakeLocalityData(o);
  const std::vector<TokenRange> ranges = {{0, 1100, 0, PageFormat::kInt4}, {1100, n, 1, PageFormat::kInt4}};
  const AttentionOptions attention = TopK(0.2f, /*causal=*/true);
  const Entry e = Pack(data, n, o.n_heads, o.head_dim, ranges);
  const Queries q = SelfQueries(data, ranges, n);
  const std::vector<float> base = Sparse(e, q.block, attention);
  // Change K and V of every token ≥ 900: sequence 0's queries < 900 must not move; sequence 1 is
  // all changed, so its rows are not checked.
  SyntheticData s = data;
  const int64_t hd = o.n_heads * o.head_dim;
  for (int64_t i = 900 * hd; i < n * hd; ++i) {
    s.k[i] = -2.0f * s.k[i] + 1.0f;
    s.v[i] = 3.0f * s.v[i] - 0.5f;
  }
  const Entry e3 = Pack(s, n, o.n_heads, o.head_dim, ranges, &data);
  const std::vector<float> out = Sparse(e3, q.block, attention);
  ASSERT_EQ(0, memcmp(out.data(), base.data(), 900 * hd * sizeof(float)));
}

TEST(SparseAttention, LocalityTop20WithTailIsCloseToDense) {
  for (bool qk_norm : {false, true}) {
    const LocalityOptions o = SmallGrid(false, qk_norm);
    const int64_t n = o.Tokens();
    const SyntheticData data = MakeLocalityData(o);
    const std::vector<TokenRange> ranges = {{0, 64, 0, PageFormat::kInt4}, {64, n, 0, PageFormat::kInt4}};
    const Entry e = Pack(data, n, o.n_heads, o.head_dim, ranges);
    const Queries q = SelfQueries(data, ranges, n);
    const std::vector<float> dense = Dense(e, q.block, {});
    for (float ratio : {0.1f, 0.2f, 0.3f}) {
      double tail_error = 0.0;
      for (bool tail : {true, false}) {
        SparseReport report;
        const std::vector<float> sparse = Sparse(e, q.block, TopK(ratio, false, tail), &report);
        const QualityResult r = Compare(dense, sparse, n, o.n_heads, o.head_dim);
        printf("locality%s topk %.1f tail %d: routed %.3f cos %.4f rel_l2 %.4f\n", qk_norm ? "+qknorm" : "", ratio,
               tail, report.RoutedFraction(), r.cosine, r.rel_l2);
        if (ratio == 0.2f && tail) {
          EXPECT_GT(r.cosine, kLocalityTop20MinCosine);
          EXPECT_LT(r.rel_l2, kLocalityTop20MaxRelL2);
        }
        if (tail) tail_error = r.rel_l2;
        if (!tail) {
          EXPECT_LT(tail_error, r.rel_l2) << "the pooled tail helps on local data";
        }
      }
    }
  }
}

TEST(SparseAttention, WithoutLocalityReportsTheFractionAndKeepsTheFloor) {
  const LocalityOptions o = SmallGrid(/*iid=*/true);
  const int64_t n = o.Tokens();
  const SyntheticData data = MakeLocalityData(o);
  const std::vector<TokenRange> ranges = {{0, n, 0, PageFormat::kInt4}};
  const Entry e = Pack(data, n, o.n_heads, o.head_dim, ranges);
  const Queries q = SelfQueries(data, ranges, n);
  const std::vector<float> dense = Dense(e, q.block, {});
  AttentionOptions a = TopK(0.2f);
  SparseReport report;
  QualityResult r = Compare(dense, Sparse(e, q.block, a, &report), n, o.n_heads, o.head_dim);
  printf("iid topk 0.2: routed %.3f cos %.4f rel_l2 %.4f\n", report.RoutedFraction(), r.cosine, r.rel_l2);
  EXPECT_GT(report.RoutedFraction(), 0.2);
  EXPECT_LT(report.RoutedFraction(), 0.2 + 4.0 / 33 + 0.01);  // top-k ∪ a block's 2 pages ±1
  a.sparse.min_exact_pages = 20;
  SparseReport floor_report;
  const QualityResult rf = Compare(dense, Sparse(e, q.block, a, &floor_report), n, o.n_heads, o.head_dim);
  printf("iid topk 0.2 floor 20: routed %.3f cos %.4f rel_l2 %.4f\n", floor_report.RoutedFraction(), rf.cosine,
         rf.rel_l2);
  EXPECT_GE(floor_report.RoutedFraction(), 20.0 / 33 - 1e-9);
  EXPECT_LT(rf.rel_l2, r.rel_l2);
}

// The INT8 MMA path (mma_path.h): exact pages take the dense path's INT8 logits (so with every page
// exact the result is AttendFloat's on that path, bit for bit), pooled pages their mean keys
// quantized as query rows; d = 128, rotated, where kAuto resolves to it.
TEST(SparseAttention, Int8MmaPathMatchesDenseAndStaysNearBf16) {
  LocalityOptions o = SmallGrid();
  o.head_dim = 128;
  const int64_t n = o.Tokens();
  const SyntheticData data = MakeLocalityData(o);
  const std::vector<TokenRange> ranges = {{0, 64, 0, PageFormat::kInt4}, {64, n, 0, PageFormat::kInt4}};
  const Entry e = Pack(data, n, o.n_heads, o.head_dim, ranges);
  ASSERT_EQ(ResolveMmaPath(MmaPath::kAuto, false, o.head_dim, e.transforms.rotate), MmaPath::kInt8);
  const Queries q = SelfQueries(data, ranges, n);
  auto with = [](AttentionOptions a, MmaPath mma) {
    a.mma = mma;
    return a;
  };
  for (bool causal : {false, true}) {
    const std::vector<float> dense = Dense(e, q.block, with(TopK(1.0f, causal), MmaPath::kInt8));
    const std::vector<float> sparse = Sparse(e, q.block, with(TopK(1.0f, causal), MmaPath::kInt8));
    EXPECT_EQ(0, memcmp(dense.data(), sparse.data(), dense.size() * sizeof(float))) << "causal " << causal;
  }
  std::vector<double> reference(static_cast<size_t>(n) * e.shape.HeadCols());
  ReferenceAttention(q.block, data.k.data(), data.v.data(), nullptr, n, o.n_heads, o.head_dim, AttentionOptions{},
                     reference.data());
  for (float ratio : {0.1f, 0.2f, 0.3f}) {
    SparseReport r8, r16;
    const std::vector<float> int8 = Sparse(e, q.block, with(TopK(ratio), MmaPath::kAuto), &r8);
    const std::vector<float> bf16 = Sparse(e, q.block, with(TopK(ratio), MmaPath::kBf16), &r16);
    EXPECT_EQ(r8.exact_pages, r16.exact_pages) << "the routing does not depend on the MMA path";
    const QualityResult e8 = CompareOutputs(reference.data(), int8.data(), n, o.n_heads, o.head_dim);
    const QualityResult e16 = CompareOutputs(reference.data(), bf16.data(), n, o.n_heads, o.head_dim);
    const QualityResult between = Compare(bf16, int8, n, o.n_heads, o.head_dim);
    printf("d = 128 topk %.1f: routed %.3f, rel L2 vs FP64 int8 %.5f bf16 %.5f (ratio %.4f), int8 vs bf16 %.5f\n",
           ratio, r8.RoutedFraction(), e8.rel_l2, e16.rel_l2, e8.rel_l2 / e16.rel_l2, between.rel_l2);
    EXPECT_LT(e8.rel_l2, kSparseInt8ErrorRatio * e16.rel_l2);
    EXPECT_LT(between.rel_l2, kSparseInt8VsBf16RelL2);
    EXPECT_GT(between.rel_l2, 0.0) << "kAuto took the INT8 path's logits";
  }
}

// QueryBlockLeads (the CUDA routed launch's CTA per block) over ranges that start on odd pages and end
// in partial ones, two sequences: leads ascend, every page belongs to exactly one block (its lead's or
// the lead's partner), and every query chunk of SparseChunkEnd starts at a lead and ends with a block.
TEST(SparseAttention, QueryBlockLeadsTileThePagesAndTheChunks) {
  LayerConfig config;
  config.shape = {1000, 64, 2, 64};
  config.ranges = {{0, 100, 0, PageFormat::kInt4, /*always_attend=*/true},
                   {100, 420, 0, PageFormat::kInt8},
                   {420, 1000, 1, PageFormat::kInt4}};
  config.attention.sparse.enabled = true;
  const std::vector<PageDesc> pages = BuildPageLayout(config.ranges);
  const int n_pages = static_cast<int>(pages.size());
  const std::vector<int32_t> leads = QueryBlockLeads(pages.data(), n_pages);
  ASSERT_FALSE(leads.empty());
  EXPECT_EQ(leads.front(), 0);
  std::vector<int> block_of(n_pages, -1);
  for (size_t k = 0; k < leads.size(); ++k) {
    ASSERT_TRUE(LeadsQueryBlock(pages.data(), n_pages, leads[k]));
    if (k > 0) {
      EXPECT_LT(leads[k - 1], leads[k]);
    }
    for (int i = 0; i < QueryBlockPages(pages.data(), n_pages, leads[k]); ++i) {
      EXPECT_EQ(block_of[leads[k] + i], -1) << "page " << leads[k] + i << " in two blocks";
      block_of[leads[k] + i] = static_cast<int>(k);
    }
  }
  for (int pg = 0; pg < n_pages; ++pg) EXPECT_GE(block_of[pg], 0) << "page " << pg << " in no block";
  EXPECT_LT(leads.size(), pages.size()) << "pages pair within a range";
  for (int64_t tq : {64, 128, 200, 384}) {
    config.query_chunk = tq;
    for (int64_t begin = 0; begin < config.shape.n_tokens;) {
      const int64_t end = SparseChunkEnd(config, pages.data(), n_pages, begin);
      ASSERT_GT(end, begin);
      int first = 0, last = 0;  // the chunk's pages [first, last)
      while (pages[first].token_begin < begin) ++first;
      last = first;
      while (last < n_pages && pages[last].token_begin < end) ++last;
      EXPECT_TRUE(LeadsQueryBlock(pages.data(), n_pages, first)) << "Tq " << tq << " chunk at " << begin;
      EXPECT_TRUE(last == n_pages || LeadsQueryBlock(pages.data(), n_pages, last)) << "Tq " << tq << " chunk at " << begin;
      EXPECT_LE(end - begin, tq + kSparseQueryBlock - 1);
      begin = end;
    }
  }
}

TEST(SparseAttention, RejectsBadOptions) {
  AttentionOptions a = TopK(0.0f);
  EXPECT_NE(ValidateSparse(a.sparse).message().find("topk_ratio"), std::string::npos);
  a = TopK(1.5f);
  EXPECT_FALSE(ValidateSparse(a.sparse).ok());
  a = TopK(0.2f);
  a.sparse.mode = SparseMode::kRelTau;
  a.sparse.rel_tau = std::nanf("");
  EXPECT_NE(ValidateSparse(a.sparse).message().find("rel_tau"), std::string::npos);
  a.sparse.rel_tau = -1.0f;
  EXPECT_FALSE(ValidateSparse(a.sparse).ok());
  a = TopK(0.2f);
  a.sparse.sink_pages = kMaxSinkPages + 1;
  EXPECT_NE(ValidateSparse(a.sparse).message().find("sink_pages"), std::string::npos);
  a = TopK(0.2f);
  a.sparse.min_exact_pages = -1;
  EXPECT_NE(ValidateSparse(a.sparse).message().find("min_exact_pages"), std::string::npos);
  EXPECT_TRUE(ValidateSparse(TopK(1.0f).sparse).ok());
}

}  // namespace
}  // namespace kvpack::cpu
