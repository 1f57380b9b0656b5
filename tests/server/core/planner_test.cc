#include "server/core/planner.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "server/core/pool.h"

namespace kvpack::server {
namespace {

// Workspace model for the tests: 4 bytes per (chunk token, qkv column), like an fp32 GEMM tile.
PlannerCosts TestCosts() {
  PlannerCosts costs;
  costs.kv_bytes = [](const LayerConfig& c) { return KvLayoutBytes(c.shape, c.ranges); };
  costs.workspace_bytes = [](const LayerConfig& c) {
    return static_cast<uint64_t>(c.projection_chunk) * static_cast<uint64_t>(c.shape.QkvCols()) * 4;
  };
  return costs;
}

LayerRequest ThreeRanges() {
  LayerRequest r;
  r.shape = {3000, 256, 4, 64};
  r.ranges = {MakeRange(0, 200, 0, {PageFormat::kBf16}),                                         // text: bf16 only
              MakeRange(200, 1000, 0, {PageFormat::kBf16, PageFormat::kInt8, PageFormat::kInt4}),  // reference
              MakeRange(1000, 3000, 0, {PageFormat::kInt8, PageFormat::kInt4})};                   // generated
  return r;
}

uint64_t KvAt(const LayerRequest& r, std::vector<PageFormat> f) {
  return PoolBytes(PlanKvLayout(r.shape, MakeLayerConfig(r, f, 64, 64).ranges).total_bytes);
}

// PlanResult.routing_bytes is the backend's own figure for the chosen config (the CPU and CUDA
// routing regions differ), asked once the chunks are chosen; no backend figure, no bytes.
TEST(Planner, RoutingBytesComeFromTheBackendForTheChosenChunk) {
  PlannerCosts costs = TestCosts();
  int64_t asked_chunk = 0;
  costs.routing_bytes = [&](const LayerConfig& c) {
    asked_chunk = c.query_chunk;
    return static_cast<uint64_t>(c.query_chunk) * 3 + 7;
  };
  absl::StatusOr<LayerPlan> p = PlanLayer(ThreeRanges(), 1ull << 40, costs);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(asked_chunk, p->query_chunk);
  EXPECT_EQ(p->routing_bytes, static_cast<uint64_t>(p->query_chunk) * 3 + 7);
  p = PlanLayer(ThreeRanges(), 1ull << 40, TestCosts());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->routing_bytes, 0u);
}

TEST(Planner, BestFormatsAndLargestChunkWhenRoomy) {
  absl::StatusOr<LayerPlan> p = PlanLayer(ThreeRanges(), 1ull << 40, TestCosts());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits);
  EXPECT_EQ(p->ranges[0].format, PageFormat::kBf16);
  EXPECT_EQ(p->ranges[1].format, PageFormat::kBf16);
  EXPECT_EQ(p->ranges[2].format, PageFormat::kInt8);
  EXPECT_EQ(p->downgrades, 0);
  EXPECT_EQ(p->projection_chunk, 3000);  // 16384 clamped to N
  EXPECT_EQ(p->peak_bytes, p->kv_bytes + p->workspace_bytes + p->io_bytes);
  EXPECT_EQ(p->ranges[2].tokens, 2000);
}

TEST(Planner, ShrinksChunksBeforePrecision) {
  const LayerRequest r = ThreeRanges();
  const uint64_t kv = KvAt(r, {PageFormat::kBf16, PageFormat::kBf16, PageFormat::kInt8});
  const uint64_t ws512 = PoolBytes(512ull * r.shape.QkvCols() * 4);
  absl::StatusOr<LayerPlan> p = PlanLayer(r, kv + ws512 + 100, TestCosts());
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->fits);
  EXPECT_EQ(p->downgrades, 0);
  EXPECT_EQ(p->projection_chunk, 512);
  EXPECT_EQ(p->query_chunk, 512);
  EXPECT_EQ(p->peak_bytes, kv + ws512);
}

TEST(Planner, DowngradesTheBiggestSavingFirstAndOnlyAsFarAsAllowed) {
  const LayerRequest r = ThreeRanges();
  const uint64_t ws64 = PoolBytes(64ull * r.shape.QkvCols() * 4);
  // Room for: range 2 at int4 (2000 tokens, the biggest saving), the others at their best.
  const uint64_t kv = KvAt(r, {PageFormat::kBf16, PageFormat::kBf16, PageFormat::kInt4});
  absl::StatusOr<LayerPlan> p = PlanLayer(r, kv + ws64, TestCosts());
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p->fits) << p->reason;
  EXPECT_EQ(p->ranges[0].format, PageFormat::kBf16);
  EXPECT_EQ(p->ranges[1].format, PageFormat::kBf16);
  EXPECT_EQ(p->ranges[2].format, PageFormat::kInt4);
  EXPECT_TRUE(p->ranges[2].downgraded);
  EXPECT_EQ(p->downgrades, 1);

  // Floor: every range at its last format.
  const uint64_t floor_kv = KvAt(r, {PageFormat::kBf16, PageFormat::kInt4, PageFormat::kInt4});
  p = PlanLayer(r, floor_kv + ws64, TestCosts());
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(p->fits) << p->reason;
  EXPECT_EQ(p->ranges[0].format, PageFormat::kBf16);  // never below what it allows
  EXPECT_EQ(p->ranges[1].format, PageFormat::kInt4);
  EXPECT_EQ(p->downgrades, 2);
  EXPECT_EQ(p->projection_chunk, 64);
}

TEST(Planner, FloorThatDoesNotFitSaysWhyWithNumbers) {
  const LayerRequest r = ThreeRanges();
  absl::StatusOr<LayerPlan> p = PlanLayer(r, 1000, TestCosts());
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->fits);
  EXPECT_NE(p->reason.find("only 1000 bytes"), std::string::npos) << p->reason;
  EXPECT_NE(p->reason.find(std::to_string(p->peak_bytes)), std::string::npos) << p->reason;
  EXPECT_EQ(p->projection_chunk, 64);
}

TEST(Planner, Deterministic) {
  const LayerRequest r = ThreeRanges();
  for (uint64_t cap : {1ull << 22, 1ull << 23, 5000000ull}) {
    absl::StatusOr<LayerPlan> a = PlanLayer(r, cap, TestCosts());
    absl::StatusOr<LayerPlan> b = PlanLayer(r, cap, TestCosts());
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->peak_bytes, b->peak_bytes);
    EXPECT_EQ(a->projection_chunk, b->projection_chunk);
    for (size_t i = 0; i < r.ranges.size(); ++i) EXPECT_EQ(a->ranges[i].format, b->ranges[i].format);
  }
}

TEST(Planner, RejectsBadRequestsNamingTheField) {
  LayerRequest r = ThreeRanges();
  r.ranges[1].allowed.clear();
  absl::StatusOr<LayerPlan> p = PlanLayer(r, 1ull << 30, TestCosts());
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("ranges[1].allowed_formats"), std::string::npos);

  r = ThreeRanges();
  r.ranges[2].begin = 1100;
  p = PlanLayer(r, 1ull << 30, TestCosts());
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("ranges[2].begin"), std::string::npos) << p.status();

  r = ThreeRanges();
  r.in_place = true;  // hidden 256 == 4·64: fine
  EXPECT_TRUE(PlanLayer(r, 1ull << 30, TestCosts()).ok());
  r.shape.hidden = 300;
  p = PlanLayer(r, 1ull << 30, TestCosts());
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("in place"), std::string::npos);

  PlannerCosts costs = TestCosts();
  costs.supported = [](const LayerConfig&) { return absl::InvalidArgumentError("not supported: head_dim = 64"); };
  p = PlanLayer(ThreeRanges(), 1ull << 30, costs);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("head_dim"), std::string::npos);
}

// A backend whose K/V bytes are not the page arithmetic of PlanKvLayout: the planner notices at the
// end and plans with the backend's numbers.
TEST(Planner, TrustsTheBackendsKvBytesOverPageArithmetic) {
  PlannerCosts costs = TestCosts();
  costs.kv_bytes = [](const LayerConfig& c) {
    uint64_t extra = 0;
    for (const TokenRange& r : c.ranges) extra += r.format == PageFormat::kInt4 ? 100000 : 0;
    return PlanKvLayout(c.shape, c.ranges).total_bytes + extra;
  };
  const LayerRequest r = ThreeRanges();
  const uint64_t ws64 = PoolBytes(64ull * r.shape.QkvCols() * 4);
  // Enough for range 2 at int4 by page arithmetic, but not with the backend's extra bytes.
  const uint64_t kv = KvAt(r, {PageFormat::kBf16, PageFormat::kBf16, PageFormat::kInt4});
  absl::StatusOr<LayerPlan> p = PlanLayer(r, kv + ws64 + 50000, costs);
  ASSERT_TRUE(p.ok());
  if (p->fits) {
    EXPECT_LE(p->peak_bytes, kv + ws64 + 50000);
    std::vector<PageFormat> f;
    for (const RangePlan& rp : p->ranges) f.push_back(rp.format);
    EXPECT_EQ(p->kv_bytes, PoolBytes(costs.kv_bytes(MakeLayerConfig(r, f, 64, 64))));
  } else {
    EXPECT_GT(p->peak_bytes, kv + ws64 + 50000);
  }
}

TEST(Planner, MaxChunkCapsChunks) {
  LayerRequest r = ThreeRanges();
  r.max_chunk = 1000;
  absl::StatusOr<LayerPlan> p = PlanLayer(r, 1ull << 40, TestCosts());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->projection_chunk, 512);
  EXPECT_EQ(p->query_chunk, 512);
}

TEST(Planner, IoBytesCount) {
  PlannerCosts costs = TestCosts();
  costs.io_bytes = [](const LayerConfig& c, const TensorResidency&) { return static_cast<uint64_t>(c.shape.n_tokens) * c.shape.hidden * 4; };
  absl::StatusOr<LayerPlan> p = PlanLayer(ThreeRanges(), 1ull << 40, costs);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->io_bytes, PoolBytes(3000ull * 256 * 4));
  EXPECT_EQ(p->peak_bytes, p->kv_bytes + p->workspace_bytes + p->io_bytes);
}

// The MiniMax H3 shape of DESIGN.md §1; Plan must answer in well under a millisecond.
// Error budgets (RangeRequest::max_rel_error) against an estimate of INT4 5%, INT8 0.4%, BF16 0.1%.
LayerRequest BudgetRanges(double text, double reference, double generated) {
  LayerRequest r = ThreeRanges();
  const double budgets[] = {text, reference, generated};
  for (int i = 0; i < 3; ++i) r.ranges[i].max_rel_error = budgets[i];
  r.estimate.present = true;
  r.estimate.rel_error[static_cast<int>(PageFormat::kInt4)] = 0.05;
  r.estimate.rel_error[static_cast<int>(PageFormat::kInt8)] = 0.004;
  r.estimate.rel_error[static_cast<int>(PageFormat::kBf16)] = 0.001;
  return r;
}

TEST(Planner, ErrorBudgetPicksTheCheapestFormatThatMeetsIt) {
  absl::StatusOr<LayerPlan> p = PlanLayer(BudgetRanges(1e-4, 0.01, 0.1), 1ull << 40, TestCosts());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->ranges[0].format, PageFormat::kBf16);  // nothing meets 1e-4: the most precise
  EXPECT_EQ(p->ranges[1].format, PageFormat::kInt8);
  EXPECT_EQ(p->ranges[2].format, PageFormat::kInt4);
  EXPECT_EQ(p->downgrades, 0);
  EXPECT_EQ(p->ranges[0].estimated_rel_error, 0.001);
  EXPECT_EQ(p->ranges[1].estimated_rel_error, 0.004);
  EXPECT_EQ(p->ranges[2].estimated_rel_error, 0.05);
  // Exactly at the estimate meets the budget.
  EXPECT_EQ(AllowedForErrorBudget(0.004, BudgetRanges(0, 0, 0).estimate),
            (std::vector<PageFormat>{PageFormat::kInt8, PageFormat::kInt4}));
}

TEST(Planner, ErrorBudgetThenTheVramBudgetDecides) {
  const LayerRequest r = BudgetRanges(0.002, 0.01, 0.1);  // BF16, INT8, INT4 by the estimate
  const uint64_t roomy = KvAt(r, {PageFormat::kBf16, PageFormat::kInt8, PageFormat::kInt4});
  const uint64_t ws64 = PoolBytes(64ull * r.shape.QkvCols() * 4);
  absl::StatusOr<LayerPlan> p = PlanLayer(r, roomy + ws64 - 1, TestCosts());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits);
  EXPECT_GE(p->downgrades, 1);  // below the budget's format, reported like any downgrade
  EXPECT_TRUE(p->ranges[0].downgraded || p->ranges[1].downgraded);
  EXPECT_EQ(p->ranges[2].format, PageFormat::kInt4);
  EXPECT_FALSE(p->ranges[2].downgraded);
}

TEST(Planner, ErrorBudgetNeedsAnEstimateAndAPositiveValue) {
  LayerRequest r = BudgetRanges(0.0, 0.01, 0.0);
  r.estimate.present = false;
  absl::StatusOr<LayerPlan> p = PlanLayer(r, 1ull << 40, TestCosts());
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("ranges[1].max_rel_error needs an error estimate"), std::string::npos);
  r = BudgetRanges(0.0, -0.5, 0.0);
  p = PlanLayer(r, 1ull << 40, TestCosts());
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("ranges[1].max_rel_error = -0.5"), std::string::npos);
}

TEST(Planner, LongSequenceLatency) {
  LayerRequest r;
  r.shape = {152263, 7168, 56, 128};
  r.ranges = {MakeRange(0, 512, 0, {PageFormat::kBf16}),
              MakeRange(512, 20000, 0, {PageFormat::kBf16, PageFormat::kInt8, PageFormat::kInt4}),
              MakeRange(20000, 40000, 0, {PageFormat::kInt8, PageFormat::kInt4}),
              MakeRange(40000, 152263, 0, {PageFormat::kInt8, PageFormat::kInt4})};
  const PlannerCosts costs = TestCosts();
  constexpr int kIters = 20;
  const auto start = std::chrono::steady_clock::now();
  int downgrades = 0;
  for (int i = 0; i < kIters; ++i) {
    absl::StatusOr<LayerPlan> p = PlanLayer(r, 2ull << 30, costs);  // 2 GiB: three ranges step down
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(p->fits);
    downgrades = p->downgrades;
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / kIters;
  std::printf("PlanLayer, N = 152263, H = 56, d = 128, 4 ranges, %d downgrades: %.3f ms per plan\n", downgrades, ms);
  EXPECT_LT(ms, 20.0);  // loose for shared CI machines; the figure above is what counts
}

}  // namespace
}  // namespace kvpack::server
