// kernels/cpu/sparse_layer.h: the block-sparse path inside the CPU layer — equal to the dense layer
// with every page routed, bit-identical for every chunk size and thread count, inside its workspace.
#include "kernels/cpu/sparse_layer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kernels/sparse_plan.h"
#include "tests/kernels/cpu_test_layer.h"

namespace kvpack::cpu::testing {
namespace {

Error RunSparse(TestLayer& L, int threads, std::vector<uint16_t>* out, SparseReport* report) {
  std::vector<uint8_t> kv(KvBytes(L.config));
  std::vector<uint8_t> ws(WorkspaceBytes(L.config));
  const Error e = RunLayer(L.config, L.Tensors(), kv.data(), ws.data(), CpuOptions{threads}, nullptr, report);
  *out = L.config.in_place ? L.x : L.out;
  return e;
}

TestLayer Layer() {
  TestLayer L = MakeTestLayer(700, 64, 2, 32, 41, PageFormat::kInt4);
  L.config.ranges = {{0, 90, 0, PageFormat::kBf16}, {90, 500, 0, PageFormat::kInt4}, {500, 700, 1, PageFormat::kInt8}};
  L.config.attention.causal = true;
  return L;
}

TEST(SparseLayer, EveryPageRoutedEqualsTheDenseLayer) {
  TestLayer L = Layer();
  std::vector<uint16_t> dense, sparse;
  ASSERT_TRUE(RunTestLayer(L, 2, &dense).ok());
  L.config.attention.sparse.enabled = true;
  L.config.attention.sparse.topk_ratio = 1.0f;
  SparseReport report;
  ASSERT_TRUE(RunSparse(L, 2, &sparse, &report).ok());
  EXPECT_EQ(sparse, dense);
  EXPECT_EQ(report.exact_pages, report.visible_pages);
  EXPECT_GT(report.visible_pages, 0);
}

// A range marked attend_densely gives its queries the dense layer's rows bit for bit; the others
// differ (top-k 10%).
TEST(SparseLayer, DenseRangeRowsEqualTheDenseLayer) {
  TestLayer L = Layer();
  L.config.attention.causal = false;
  std::vector<uint16_t> dense, sparse;
  ASSERT_TRUE(RunTestLayer(L, 2, &dense).ok());
  L.config.ranges[1].attend_densely = true;  // tokens [90, 500)
  L.config.ranges[0].always_attend = true;
  L.config.attention.sparse.enabled = true;
  L.config.attention.sparse.topk_ratio = 0.1f;
  SparseReport report;
  ASSERT_TRUE(RunSparse(L, 2, &sparse, &report).ok());
  const int64_t hd = L.config.shape.HeadCols();
  EXPECT_TRUE(std::equal(sparse.begin() + 90 * hd, sparse.begin() + 500 * hd, dense.begin() + 90 * hd));
  EXPECT_FALSE(std::equal(sparse.begin() + 500 * hd, sparse.end(), dense.begin() + 500 * hd));
  EXPECT_LT(report.RoutedFraction(), 1.0);
}

TEST(SparseLayer, IsBitIdenticalForEveryChunkSizeAndThreadCount) {
  TestLayer L = Layer();
  L.config.attention.sparse.enabled = true;
  L.config.attention.sparse.topk_ratio = 0.2f;
  L.config.query_chunk = 700;
  std::vector<uint16_t> base;
  SparseReport base_report;
  ASSERT_TRUE(RunSparse(L, 1, &base, &base_report).ok());
  EXPECT_GT(base_report.pooled_pages, 0);
  EXPECT_LT(base_report.RoutedFraction(), 1.0);
  EXPECT_LE(base_report.RoutedFraction(), RoutedFractionBound(L.config));
  const struct { int64_t tq; int threads; } cases[] = {{1, 2}, {37, 3}, {64, 2}, {130, 4}};
  for (const auto& c : cases) {
    L.config.query_chunk = c.tq;
    std::vector<uint16_t> out;
    SparseReport report;
    ASSERT_TRUE(RunSparse(L, c.threads, &out, &report).ok());
    EXPECT_EQ(out, base) << "Tq " << c.tq;
    EXPECT_EQ(report.exact_pages, base_report.exact_pages) << "Tq " << c.tq;
  }
}

TEST(SparseLayer, StaysInsideItsWorkspace) {
  TestLayer L = Layer();
  L.config.attention.sparse.enabled = true;
  L.config.query_chunk = 100;
  const uint64_t bytes = WorkspaceBytes(L.config);
  ASSERT_GT(RoutingBytes(L.config), 0u);
  constexpr uint8_t kSentinel = 0xa5;
  constexpr size_t kGuard = 4096;
  std::vector<uint8_t> ws(bytes + kGuard, kSentinel);
  std::vector<uint8_t> kv(KvBytes(L.config));
  ASSERT_TRUE(RunLayer(L.config, L.Tensors(), kv.data(), ws.data(), CpuOptions{2}, nullptr).ok());
  for (size_t i = bytes; i < ws.size(); ++i) ASSERT_EQ(ws[i], kSentinel) << "byte " << i;
}

TEST(SparseLayer, SupportedNamesTheSparseField) {
  TestLayer L = Layer();
  L.config.attention.sparse.enabled = true;
  L.config.attention.sparse.topk_ratio = 2.0f;
  EXPECT_NE(Supported(L.config).message().find("attention.sparse.topk_ratio"), std::string::npos);
  EXPECT_EQ(WorkspaceBytes(L.config), 0u);
}

// The GPU routing kernel's shared memory (sparse_plan.h), the figure the CUDA backend checks against
// a GPU's per-block limit: H3's 2,380 pages sort 4,096 keys; a 99 KB consumer GPU (101,376 bytes
// per block) routes 8,192 pages and refuses 8,193.
TEST(SparsePlan, RouteSharedBytesBoundTheEntryPerGpu) {
  constexpr int kConsumerBlockBytes = 101376;
  EXPECT_EQ(SparseRouteSharedBytes(1), 8 + 16);
  EXPECT_EQ(SparseRouteSharedBytes(2379), 4096 * 8 + 2384);
  EXPECT_LE(SparseRouteSharedBytes(8192), kConsumerBlockBytes);
  EXPECT_GT(SparseRouteSharedBytes(8193), kConsumerBlockBytes);
  EXPECT_EQ(SparseRouteSharedBytes(int64_t{1} << 40), 1 << 30);  // clamped, never wraps
}

}  // namespace
}  // namespace kvpack::cpu::testing
