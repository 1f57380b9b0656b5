#include "kernels/cpu/layer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <string>

#include "tests/kernels/cpu_test_layer.h"

namespace kvpack::cpu {
namespace {

using testing::DirectQkv;
using testing::MakeTestLayer;
using testing::RelL2;
using testing::RunTestLayer;
using testing::SetRope;
using testing::TestLayer;
using testing::VideoRope;

// Layer output vs FP64 attention on directly computed Q/K/V. BF16 pages: bf16 rounding of the
// projection, of Q, of K/V and of the output, each ~2^-9 relative. INT8: 1/254 of a row's range.
constexpr double kLayerRelL2Bf16 = 6e-3;
constexpr double kLayerRelL2Int8 = 5e-3;

std::vector<double> Reference(const TestLayer& L) {
  std::vector<float> q, k, v;
  DirectQkv(L, &q, &k, &v);
  const LayerShape& s = L.config.shape;
  std::vector<int32_t> seq(s.n_tokens);
  for (const TokenRange& r : L.config.ranges) {
    for (int64_t t = r.begin; t < r.end; ++t) seq[t] = r.seq_id;
  }
  QueryBlock queries;
  queries.q = q.data();
  queries.n_q = s.n_tokens;
  queries.seq_ids = seq.data();
  std::vector<double> out(q.size());
  ReferenceAttention(queries, k.data(), v.data(), seq.data(), s.n_tokens, s.n_heads, s.head_dim, L.config.attention,
                     out.data());
  return out;
}

TEST(Layer, MatchesFp64AttentionWithNormAndRope) {
  const struct {
    PageFormat format;
    RopeLayout layout;
    int norm_weight_len;  // head_dim: shared by the heads; H·d: per head
  } cases[] = {{PageFormat::kBf16, RopeLayout::kSplitHalves, 3 * 32},
               {PageFormat::kBf16, RopeLayout::kInterleaved, 32},
               {PageFormat::kInt8, RopeLayout::kSplitHalves, 32},
               {PageFormat::kInt8, RopeLayout::kInterleaved, 3 * 32}};
  for (const auto& c : cases) {
    TestLayer L = MakeTestLayer(211, 96, 3, 32, 11, c.format);
    L.config.qk_norm = {true, 1e-6f, c.norm_weight_len};
    SetRope(L, VideoRope(c.layout, 32));
    std::vector<uint16_t> out;
    ASSERT_TRUE(RunTestLayer(L, 2, &out).ok());
    const double rel = RelL2(out, Reference(L));
    EXPECT_LT(rel, c.format == PageFormat::kBf16 ? kLayerRelL2Bf16 : kLayerRelL2Int8)
        << "format " << int(c.format) << " layout " << int(c.layout) << " weight_len " << c.norm_weight_len;
  }
}

TEST(Layer, IsBitIdenticalForEveryChunkSizeAndThreadCount) {
  TestLayer L = MakeTestLayer(333, 80, 2, 64, 21, PageFormat::kInt4);
  L.config.ranges = {{0, 90, 0, PageFormat::kBf16}, {90, 200, 0, PageFormat::kInt4}, {200, 333, 0, PageFormat::kInt8}};
  SetRope(L, VideoRope(RopeLayout::kInterleaved, 64));
  L.config.projection_chunk = 333;
  L.config.query_chunk = 333;
  std::vector<uint16_t> base;
  std::vector<uint8_t> base_kv;
  ASSERT_TRUE(RunTestLayer(L, 1, &base, &base_kv).ok());
  const struct { int64_t tp, tq; int threads; } cases[] = {{1, 1, 2}, {7, 13, 3}, {64, 64, 2}, {100, 17, 4}, {1000, 1000, 2}};
  for (const auto& c : cases) {
    L.config.projection_chunk = c.tp;
    L.config.query_chunk = c.tq;
    std::vector<uint16_t> out;
    std::vector<uint8_t> kv;
    ASSERT_TRUE(RunTestLayer(L, c.threads, &out, &kv).ok());
    EXPECT_EQ(out, base) << "Tp " << c.tp << " Tq " << c.tq << " threads " << c.threads;
    EXPECT_EQ(kv, base_kv) << "Tp " << c.tp << " Tq " << c.tq << " threads " << c.threads;
  }
}

TEST(Layer, InPlaceOutputEqualsOutOfPlace) {
  TestLayer L = MakeTestLayer(150, 128, 2, 64, 31, PageFormat::kInt8);
  L.config.query_chunk = 37;
  std::vector<uint16_t> out_of_place, in_place;
  ASSERT_TRUE(RunTestLayer(L, 2, &out_of_place).ok());
  L.config.in_place = true;
  ASSERT_TRUE(RunTestLayer(L, 2, &in_place).ok());
  EXPECT_EQ(in_place, out_of_place);
}

// Statistics of a finished block, to run pieces of the layer with the same μ, λ and λ_v.
KvStats StatsOf(const TestLayer& L, const std::vector<uint8_t>& kv) {
  const KvLayout layout = PlanKvLayout(L.config.shape, L.config.ranges);
  const size_t hd = static_cast<size_t>(L.config.shape.HeadCols());
  KvStats s;
  const float* base = reinterpret_cast<const float*>(kv.data());
  s.mu_k.assign(base + layout.mu_k_offset / 4, base + layout.mu_k_offset / 4 + hd);
  s.mu_v.assign(base + layout.mu_v_offset / 4, base + layout.mu_v_offset / 4 + hd);
  s.lambda.assign(base + layout.lambda_offset / 4, base + layout.lambda_offset / 4 + hd);
  s.lambda_v.assign(base + layout.lambda_v_offset / 4, base + layout.lambda_v_offset / 4 + hd);
  const uint32_t* flags = reinterpret_cast<const uint32_t*>(kv.data() + layout.head_flags_offset);
  s.head_flags.assign(flags, flags + L.config.shape.n_heads);  // the heads' rotation goes with the tables
  return s;
}

// Tokens [begin, end) of L as a layer of their own.
TestLayer Slice(const TestLayer& L, int64_t begin, int64_t end) {
  TestLayer S = L;
  const LayerShape& s = L.config.shape;
  S.config.shape.n_tokens = end - begin;
  S.x.assign(L.x.begin() + begin * s.hidden, L.x.begin() + end * s.hidden);
  const int axes = L.config.rope.n_axes;
  if (axes > 0) S.positions.assign(L.positions.begin() + begin * axes, L.positions.begin() + end * axes);
  S.out.assign(static_cast<size_t>(end - begin) * s.HeadCols(), 0);
  return S;
}

TEST(Layer, SequenceIdsMaskLikeSeparateSequences) {
  TestLayer L = MakeTestLayer(301, 64, 2, 32, 41, PageFormat::kInt4);
  L.config.ranges = {{0, 100, 7, PageFormat::kInt4}, {100, 230, 3, PageFormat::kInt8}, {230, 301, 7, PageFormat::kBf16}};
  SetRope(L, VideoRope(RopeLayout::kInterleaved, 32));
  std::vector<uint16_t> packed;
  std::vector<uint8_t> kv;
  ASSERT_TRUE(RunTestLayer(L, 2, &packed, &kv).ok());
  const KvStats stats = StatsOf(L, kv);
  // Sequence 3 alone: tokens [100, 230).
  TestLayer S = Slice(L, 100, 230);
  S.config.ranges = {{0, 130, 3, PageFormat::kInt8}};
  S.config.stats = &stats;
  std::vector<uint16_t> alone;
  ASSERT_TRUE(RunTestLayer(S, 2, &alone).ok());
  const int64_t hd = L.config.shape.HeadCols();
  EXPECT_TRUE(std::equal(alone.begin(), alone.end(), packed.begin() + 100 * hd));
  // Sequence 7 alone: tokens [0, 100) ∪ [230, 301), two ranges (every range starts a page).
  TestLayer T = Slice(L, 0, 171);
  T.x.assign(L.x.begin(), L.x.begin() + 100 * L.config.shape.hidden);
  T.x.insert(T.x.end(), L.x.begin() + 230 * L.config.shape.hidden, L.x.end());
  T.positions.assign(L.positions.begin(), L.positions.begin() + 100 * 3);
  T.positions.insert(T.positions.end(), L.positions.begin() + 230 * 3, L.positions.end());
  T.config.ranges = {{0, 100, 7, PageFormat::kInt4}, {100, 171, 7, PageFormat::kBf16}};
  T.config.stats = &stats;
  std::vector<uint16_t> seven;
  ASSERT_TRUE(RunTestLayer(T, 3, &seven).ok());
  EXPECT_TRUE(std::equal(seven.begin(), seven.begin() + 100 * hd, packed.begin()));
  EXPECT_TRUE(std::equal(seven.begin() + 100 * hd, seven.end(), packed.begin() + 230 * hd));
}

TEST(Layer, CausalPrefixIgnoresLaterTokens) {
  TestLayer L = MakeTestLayer(260, 64, 2, 32, 51, PageFormat::kInt8);
  L.config.ranges = {{0, 77, 0, PageFormat::kBf16}, {77, 260, 0, PageFormat::kInt8}};  // mid-page start
  L.config.attention.causal = true;
  std::vector<uint16_t> full;
  std::vector<uint8_t> kv;
  ASSERT_TRUE(RunTestLayer(L, 2, &full, &kv).ok());
  const KvStats stats = StatsOf(L, kv);
  TestLayer P = Slice(L, 0, 150);
  P.config.ranges = {{0, 77, 0, PageFormat::kBf16}, {77, 150, 0, PageFormat::kInt8}};
  P.config.stats = &stats;
  std::vector<uint16_t> prefix;
  ASSERT_TRUE(RunTestLayer(P, 2, &prefix).ok());
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), full.begin()));
  L.config.ranges = {{0, 260, 0, PageFormat::kBf16}};
  ASSERT_TRUE(RunTestLayer(L, 2, &full).ok());
  EXPECT_LT(RelL2(full, Reference(L)), kLayerRelL2Bf16);
}

TEST(Layer, WorkspaceIsExactlyWhatItUses) {
  for (bool own_stats : {false, true}) {
    TestLayer L = MakeTestLayer(199, 64, 2, 32, 61, PageFormat::kInt4);
    L.config.projection_chunk = 50;
    L.config.query_chunk = 120;
    L.config.transforms.stats_sample_tokens = 80;
    KvStats stats;
    if (own_stats) {
      stats.mu_k.assign(64, 0.1f);
      stats.mu_v.assign(64, -0.2f);
      stats.lambda.assign(64, 1.0f);
      stats.lambda_v.assign(64, 1.5f);
      L.config.stats = &stats;
    }
    const uint64_t hd = 64;
    // Sample: 80·3·H·d bf16 (Q, K, V for the per-head choice) — the largest; projection: 50·2·H·d;
    // queries: 120·H·d.
    const uint64_t expected = std::max({own_stats ? 0 : 80 * 3 * hd * 2, 50 * 2 * hd * 2, 120 * hd * 2});
    ASSERT_EQ(WorkspaceBytes(L.config), expected);
    constexpr uint8_t kSentinel = 0xa5;
    constexpr size_t kGuard = 4096;
    std::vector<uint8_t> ws(expected + kGuard, kSentinel);
    std::vector<uint8_t> kv(KvBytes(L.config));
    ASSERT_TRUE(RunLayer(L.config, L.Tensors(), kv.data(), ws.data(), CpuOptions{2}, nullptr).ok());
    size_t high_water = 0;
    for (size_t i = 0; i < ws.size(); ++i) {
      if (ws[i] != kSentinel) high_water = i + 1;
    }
    EXPECT_GE(high_water, expected - 8);  // the last bf16 values may equal the sentinel by chance
    EXPECT_LE(high_water, expected);
  }
}

TEST(Layer, CancellationStopsBetweenChunks) {
  TestLayer L = MakeTestLayer(200, 64, 2, 32, 71);
  L.config.projection_chunk = 40;
  std::vector<uint8_t> kv(KvBytes(L.config)), ws(WorkspaceBytes(L.config));
  std::atomic<int> polls{0};
  const ChunkGate cancel = CancelGate([&] { return ++polls > 3; });
  const Error e = RunLayer(L.config, L.Tensors(), kv.data(), ws.data(), CpuOptions{2}, cancel);
  EXPECT_EQ(e.code(), ErrorCode::kCancelled);
  EXPECT_NE(e.message().find("projection"), std::string::npos) << e.message();
}

TEST(Layer, CancellationDuringAttentionIsReported) {
  TestLayer L = MakeTestLayer(200, 64, 2, 32, 72);
  L.config.projection_chunk = 200;  // statistics, one projection chunk, then query chunks
  L.config.query_chunk = 50;
  std::vector<uint8_t> kv(KvBytes(L.config)), ws(WorkspaceBytes(L.config));
  std::atomic<int> polls{0};
  const ChunkGate cancel = CancelGate([&] { return ++polls > 3; });
  const Error e = RunLayer(L.config, L.Tensors(), kv.data(), ws.data(), CpuOptions{2}, cancel);
  EXPECT_EQ(e.code(), ErrorCode::kCancelled);
  EXPECT_NE(e.message().find("attention"), std::string::npos) << e.message();
}

TEST(Layer, ProjectThenAttendEqualsRunLayer) {
  TestLayer L = MakeTestLayer(180, 64, 2, 32, 73, PageFormat::kInt4);
  std::vector<uint16_t> whole;
  ASSERT_TRUE(RunTestLayer(L, 2, &whole).ok());
  std::vector<uint8_t> kv(KvBytes(L.config)), ws(WorkspaceBytes(L.config));
  ASSERT_TRUE(ProjectKv(L.config, L.Tensors(), kv.data(), ws.data(), CpuOptions{3}, nullptr).ok());
  // A kept entry is read through its own tables: the view is all AttendLayer needs of it.
  const KvEntryView view = MakeKvView(PlanKvLayout(L.config.shape, L.config.ranges), L.config.shape, kv.data(),
                                      L.config.transforms);
  std::fill(L.out.begin(), L.out.end(), 0);
  std::vector<uint8_t> other_ws(WorkspaceBytes(L.config));
  ASSERT_TRUE(AttendLayer(L.config, L.Tensors(), view, other_ws.data(), CpuOptions{1}, nullptr).ok());
  EXPECT_EQ(L.out, whole);
  KvEntryView wrong = view;
  wrong.n_heads = 3;
  EXPECT_EQ(AttendLayer(L.config, L.Tensors(), wrong, other_ws.data(), CpuOptions{1}, nullptr).code(),
            ErrorCode::kInvalidArgument);
}

struct BadCase {
  const char* needle;
  ErrorCode code;
  void (*mutate)(LayerConfig&);
};

TEST(Layer, SupportedRejectsBadConfigsNamingTheField) {
  const BadCase cases[] = {
      {"n_tokens = 0", ErrorCode::kInvalidArgument, [](LayerConfig& c) { c.shape.n_tokens = 0; }},
      {"hidden = -3", ErrorCode::kInvalidArgument, [](LayerConfig& c) { c.shape.hidden = -3; }},
      {"head_dim = 48", ErrorCode::kUnsupported, [](LayerConfig& c) { c.shape.head_dim = 48; }},
      {"head_dim = 512", ErrorCode::kUnsupported, [](LayerConfig& c) { c.shape.head_dim = 512; }},
      {"ranges[1].begin = 40 overlaps", ErrorCode::kInvalidArgument,
       [](LayerConfig& c) { c.ranges = {{0, 50, 0, PageFormat::kInt4}, {40, 100, 0, PageFormat::kInt4}}; }},
      {"leaves tokens [50, 60)", ErrorCode::kInvalidArgument,
       [](LayerConfig& c) { c.ranges = {{0, 50, 0, PageFormat::kInt4}, {60, 100, 0, PageFormat::kInt4}}; }},
      {"ranges[0].end = 140 is past", ErrorCode::kInvalidArgument,
       [](LayerConfig& c) { c.ranges = {{0, 140, 0, PageFormat::kInt4}}; }},
      {"ranges[0].format = 9", ErrorCode::kInvalidArgument,
       [](LayerConfig& c) { c.ranges = {{0, 100, 0, static_cast<PageFormat>(9)}}; }},
      {"rope.n_axes = 4", ErrorCode::kInvalidArgument,
       [](LayerConfig& c) { c.rope.layout = RopeLayout::kInterleaved, c.rope.n_axes = 4; }},
      {"rope.axis_dims sum to 40", ErrorCode::kInvalidArgument,
       [](LayerConfig& c) { c.rope = {RopeLayout::kSplitHalves, 10000.0f, 2, {20, 20, 0}}; }},
      {"qk_norm.weight_len = 5", ErrorCode::kInvalidArgument, [](LayerConfig& c) { c.qk_norm = {true, 1e-6f, 5}; }},
      {"projection_chunk = 0", ErrorCode::kInvalidArgument, [](LayerConfig& c) { c.projection_chunk = 0; }},
      {"query_chunk = -1", ErrorCode::kInvalidArgument, [](LayerConfig& c) { c.query_chunk = -1; }},
      {"in_place needs hidden (96)", ErrorCode::kInvalidArgument,
       [](LayerConfig& c) { c.in_place = true, c.shape.hidden = 96; }},
      {"softmax_scale", ErrorCode::kInvalidArgument, [](LayerConfig& c) { c.attention.softmax_scale = -1.0f; }},
      {"stats_sample_tokens = 0", ErrorCode::kInvalidArgument,
       [](LayerConfig& c) { c.transforms.stats_sample_tokens = 0; }},
  };
  for (const BadCase& bad : cases) {
    TestLayer L = MakeTestLayer(100, 64, 2, 32, 81);
    bad.mutate(L.config);
    const Error e = Supported(L.config);
    EXPECT_EQ(e.code(), bad.code) << bad.needle;
    EXPECT_NE(e.message().find(bad.needle), std::string::npos) << "wanted '" << bad.needle << "' in: " << e.message();
    EXPECT_EQ(WorkspaceBytes(L.config), 0u);
    EXPECT_EQ(KvBytes(L.config), 0u);
    std::vector<uint8_t> kv(64), ws(64);
    EXPECT_EQ(RunLayer(L.config, L.Tensors(), kv.data(), ws.data(), CpuOptions{1}, nullptr).code(), bad.code);
  }
}

TEST(Layer, RejectsWrongStatsAndMissingTensors) {
  TestLayer L = MakeTestLayer(100, 64, 2, 32, 91);
  KvStats stats;
  stats.mu_k.assign(10, 0.0f);
  L.config.stats = &stats;
  EXPECT_NE(Supported(L.config).message().find("stats.mu_k has 10 entries"), std::string::npos);
  stats.mu_k.assign(64, 0.0f);
  stats.mu_v.assign(64, 0.0f);
  stats.lambda.assign(64, 1.0f);
  EXPECT_NE(Supported(L.config).message().find("stats.lambda_v has 0 entries"), std::string::npos);
  stats.lambda_v.assign(64, 1.0f);
  EXPECT_TRUE(Supported(L.config).ok()) << Supported(L.config).message();
  stats.lambda_v[7] = 0.0f;  // V rows are divided by λ_v
  EXPECT_NE(Supported(L.config).message().find("stats.lambda_v holds a value that is not positive"), std::string::npos);
  L.config.stats = nullptr;
  SetRope(L, VideoRope(RopeLayout::kInterleaved, 32));
  LayerTensors t = L.Tensors();
  t.positions = nullptr;
  std::vector<uint8_t> kv(KvBytes(L.config)), ws(WorkspaceBytes(L.config));
  const Error e = RunLayer(L.config, t, kv.data(), ws.data(), CpuOptions{1}, nullptr);
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(e.message().find("tensors.positions"), std::string::npos) << e.message();
}

}  // namespace
}  // namespace kvpack::cpu
