#include "kernels/layer_spec.h"

#include <gtest/gtest.h>

#include <random>

namespace kvpack {
namespace {

std::vector<TokenRange> TwoRanges() {
  return {{0, 77, 0, PageFormat::kBf16}, {77, 300, 0, PageFormat::kInt4}};
}

TEST(PageLayout, EveryRangeStartsAPage) {
  const std::vector<PageDesc> pages = BuildPageLayout(TwoRanges());
  ASSERT_EQ(pages.size(), 2u + 4u);  // 77 → 64 + 13; 223 → 64·3 + 31
  EXPECT_EQ(pages[1].token_begin, 64);
  EXPECT_EQ(pages[1].n_valid, 13);
  EXPECT_EQ(pages[2].token_begin, 77);
  EXPECT_EQ(pages[2].format, static_cast<uint8_t>(PageFormat::kInt4));
  EXPECT_EQ(pages[5].n_valid, 31);
  EXPECT_EQ(pages[5].range_index, 1);
}

TEST(ValidateRanges, AcceptsATiling) { EXPECT_TRUE(ValidateRanges(300, TwoRanges()).ok()); }

TEST(ValidateRanges, NamesTheProblem) {
  struct Case {
    std::vector<TokenRange> ranges;
    int64_t n;
    const char* needle;
  };
  const Case cases[] = {
      {{}, 10, "at least one"},
      {{{0, 50, 0, PageFormat::kInt4}, {40, 100, 0, PageFormat::kInt4}}, 100, "ranges[1].begin = 40 overlaps"},
      {{{0, 50, 0, PageFormat::kInt4}, {60, 100, 0, PageFormat::kInt4}}, 100, "leaves tokens [50, 60)"},
      {{{0, 120, 0, PageFormat::kInt4}}, 100, "ranges[0].end = 120 is past"},
      {{{0, 50, 0, PageFormat::kInt4}}, 100, "ends at 50"},
      {{{0, 0, 0, PageFormat::kInt4}}, 100, "ranges[0].end = 0 is not after"},
      {{{0, 100, 0, static_cast<PageFormat>(7)}}, 100, "ranges[0].format = 7"},
  };
  for (const Case& c : cases) {
    const Error e = ValidateRanges(c.n, c.ranges);
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find(c.needle), std::string::npos) << e.message();
  }
}

TEST(ValidateShape, HeadDimLimits) {
  LayerShape s{100, 96, 3, 32};
  EXPECT_TRUE(ValidateShape(s, false).ok());
  EXPECT_EQ(ValidateShape(s, true).code(), ErrorCode::kUnsupported);
  s.head_dim = 48;
  EXPECT_NE(ValidateShape(s, false).message().find("head_dim = 48"), std::string::npos);
  s.head_dim = 128;
  s.n_tokens = 0;
  EXPECT_NE(ValidateShape(s, false).message().find("n_tokens"), std::string::npos);
}

TEST(ValidateRope, ChecksAxes) {
  RopeOptions r;
  r.layout = RopeLayout::kInterleaved;
  r.n_axes = 3;
  r.axis_dims[0] = 16;
  r.axis_dims[1] = 56;
  r.axis_dims[2] = 56;
  EXPECT_TRUE(ValidateRope(r, 128).ok());
  r.axis_dims[2] = 58;
  EXPECT_NE(ValidateRope(r, 128).message().find("sum to 130"), std::string::npos);
  r.axis_dims[2] = 55;
  EXPECT_NE(ValidateRope(r, 128).message().find("axis_dims[2]"), std::string::npos);
}

}  // namespace
}  // namespace kvpack

namespace kvpack {
namespace {

TEST(KvLayout, PagesThenTablesAligned) {
  const LayerShape shape{300, 256, 2, 128};
  const KvLayout layout = PlanKvLayout(shape, TwoRanges());
  const uint64_t per_head = 2 * PageBytes(PageFormat::kBf16, 128) + 4 * PageBytes(PageFormat::kInt4, 128);
  EXPECT_EQ(layout.page_bytes, 2 * 2 * per_head);  // K and V, two heads
  EXPECT_EQ(layout.k_offsets[6], per_head);        // head 1, page 0
  EXPECT_EQ(layout.v_offsets[0], 2 * per_head);
  for (uint64_t o : layout.k_offsets) EXPECT_EQ(o % 128, 0u);
  EXPECT_EQ(layout.pages_offset % 256, 0u);
  const uint64_t stats_bytes = 2 * 128 * sizeof(float);  // one float per (head, channel)
  const uint64_t tables[] = {layout.mu_k_offset, layout.mu_v_offset, layout.lambda_offset, layout.lambda_v_offset};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(tables[i] % 256, 0u) << "table " << i;
    if (i > 0) {
      EXPECT_GE(tables[i], tables[i - 1] + stats_bytes) << "table " << i << " overlaps the one before";
    }
  }
  EXPECT_GE(layout.total_bytes, layout.lambda_v_offset + stats_bytes);

  std::vector<uint8_t> block(layout.total_bytes, 0xab);
  WriteKvTables(layout, block.data() + layout.pages_offset);
  const KvEntryView view = MakeKvView(layout, shape, block.data(), TransformOptions{});
  EXPECT_EQ(view.n_pages, 6);
  EXPECT_EQ(view.pages[2].token_begin, 77);
  EXPECT_EQ(view.v_offsets[7], layout.v_offsets[7]);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(view.lambda), block.data() + layout.lambda_offset);
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(view.lambda_v), block.data() + layout.lambda_v_offset);
}

}  // namespace
}  // namespace kvpack

namespace kvpack {
namespace {

TEST(KvLayout, BytesWithoutTablesEqualTheFullLayout) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int d = 16 << (trial % 5);
    const LayerShape shape{0, 64, 1 + static_cast<int>(rng() % 7), d};
    std::vector<TokenRange> ranges;
    int64_t begin = 0;
    for (int r = 0, n = 1 + static_cast<int>(rng() % 5); r < n; ++r) {
      const int64_t len = 1 + static_cast<int64_t>(rng() % 300);
      ranges.push_back({begin, begin + len, r % 2, static_cast<PageFormat>(rng() % kNumPageFormats)});
      begin += len;
    }
    EXPECT_EQ(KvLayoutBytes(shape, ranges), PlanKvLayout(shape, ranges).total_bytes) << "trial " << trial;
  }
}

}  // namespace
}  // namespace kvpack
