#include "kernels/cpu/pack.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/layer.h"
#include "kernels/rotation.h"

namespace kvpack::cpu {
namespace {

// Decoded rows, un-rotated and un-smoothed, vs the input: half a quantization step of the stored
// (rotated) row, which is at most its range; bf16: 2^-8 relative.
constexpr double kInt8RowTolerance = 1.0 / 127;
constexpr double kInt4RowTolerance = 1.0 / 15;
constexpr double kBf16RowTolerance = 1.0 / 128;

std::vector<float> Heavy(std::mt19937_64& rng, size_t n, int d) {
  std::student_t_distribution<double> t(4.0);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(1.0 + 0.05 * (i % d) + t(rng) * (i % d == 7 ? 25.0 : 1.0));
  return x;
}

TEST(Pack, TokenPageMapFollowsRangesThatStartMidPage) {
  const std::vector<TokenRange> ranges = {{0, 70, 0, PageFormat::kInt4}, {70, 71, 1, PageFormat::kBf16},
                                          {71, 300, 0, PageFormat::kInt8}};
  const TokenPageMap map(ranges);
  const std::vector<PageDesc> pages = BuildPageLayout(ranges);
  for (int64_t t = 0; t < 300; ++t) {
    int page, slot;
    map.Locate(t, &page, &slot);
    ASSERT_LT(page, static_cast<int>(pages.size()));
    EXPECT_EQ(pages[page].token_begin + slot, t);
    EXPECT_LT(slot, pages[page].n_valid);
  }
  EXPECT_EQ(map.RangeOf(69), 0);
  EXPECT_EQ(map.RangeOf(70), 1);
  EXPECT_EQ(map.RangeOf(299), 2);
}

TEST(Pack, RowsDecodeBackAndInvalidSlotsStayZero) {
  std::mt19937_64 rng(16);
  const int heads = 2, d = 64;
  const int64_t n = 205;
  const LayerShape shape{n, heads * d, heads, d};
  const std::vector<TokenRange> ranges = {{0, 90, 0, PageFormat::kBf16}, {90, 150, 1, PageFormat::kInt4},
                                          {150, 205, 1, PageFormat::kInt8}};
  const std::vector<float> k = Heavy(rng, n * heads * d, d), v = Heavy(rng, n * heads * d, d);
  TransformOptions transforms;
  transforms.stats_sample_tokens = 64;
  const KvStats stats = ComputeStats(k.data(), v.data(), shape, transforms);
  const KvLayout layout = PlanKvLayout(shape, ranges);
  std::vector<uint8_t> block(layout.total_bytes, 0xcd);
  ASSERT_TRUE(PackKv(k.data(), v.data(), shape, ranges, stats, transforms, block.data(), CpuOptions{3}).ok());

  const KvEntryView view = MakeKvView(layout, shape, block.data(), transforms);
  ASSERT_EQ(view.n_pages, 2 + 1 + 1);
  EXPECT_EQ(0, memcmp(view.pages, layout.pages.data(), layout.pages.size() * sizeof(PageDesc)));
  EXPECT_EQ(0, memcmp(view.k_offsets, layout.k_offsets.data(), layout.k_offsets.size() * 8));
  EXPECT_EQ(0, memcmp(view.lambda, stats.lambda.data(), stats.lambda.size() * 4));
  EXPECT_EQ(0, memcmp(view.lambda_v, stats.lambda_v.data(), stats.lambda_v.size() * 4));
  EXPECT_EQ(0, memcmp(view.mu_v, stats.mu_v.data(), stats.mu_v.size() * 4));

  float row[kMaxHeadDimCpu];
  for (int h = 0; h < heads; ++h) {
    for (int p = 0; p < view.n_pages; ++p) {
      const PageDesc& page = view.pages[p];
      const PageFormat f = static_cast<PageFormat>(page.format);
      const double tolerance = f == PageFormat::kInt4 ? kInt4RowTolerance : f == PageFormat::kInt8 ? kInt8RowTolerance : kBf16RowTolerance;
      for (int kind = 0; kind < 2; ++kind) {
        const uint8_t* bytes = view.pool + (kind == 0 ? view.k_offsets : view.v_offsets)[h * view.n_pages + p];
        for (int slot = page.n_valid; slot < kPageTokens; ++slot) {  // invalid slots: zero codes and meta
          for (int b = 0; b < CodeBytesPerRow(f, d); ++b) ASSERT_EQ(bytes[slot * CodeBytesPerRow(f, d) + b], 0);
          for (int b = 0; b < MetaBytesPerRow(f); ++b) ASSERT_EQ(bytes[MetaOffset(f, d) + slot * MetaBytesPerRow(f) + b], 0);
        }
        for (int slot = 0; slot < page.n_valid; ++slot) {
          DecodePageRow(f, bytes, d, slot, row);
          double range = 0.0;
          for (int c = 0; c < d; ++c) range = std::max(range, std::fabs(double(row[c])));
          RotateInverse(row, d, transforms.seed);
          const int64_t t = page.token_begin + slot;
          const std::vector<float>& src = kind == 0 ? k : v;
          for (int c = 0; c < d; ++c) {
            const int64_t i = h * d + c;
            const double scale = kind == 0 ? stats.lambda[i] : stats.lambda_v[i];
            const double back = row[c] * scale + (kind == 0 ? stats.mu_k : stats.mu_v)[i];
            // Rotation spreads each code's error over all channels: bound by the row's step · √d.
            ASSERT_NEAR(back, src[(t * heads + h) * d + c], tolerance * range * scale * std::sqrt(double(d)) + 1e-4)
                << "head " << h << " token " << t << " channel " << c << " kind " << kind;
          }
        }
      }
    }
  }
}

TEST(Pack, RejectsStatsOfTheWrongSize) {
  const LayerShape shape{64, 32, 2, 16};
  std::vector<float> k(64 * 32, 1.0f);
  KvStats stats;
  stats.mu_k.assign(32, 0.0f);
  stats.mu_v.assign(32, 0.0f);
  stats.lambda.assign(32, 1.0f);
  stats.lambda_v.assign(31, 1.0f);
  std::vector<uint8_t> block(1 << 16);
  const Error e = PackKv(k.data(), k.data(), shape, {{0, 64, 0, PageFormat::kInt8}}, stats, TransformOptions{},
                         block.data(), CpuOptions{1});
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(e.message().find("stats"), std::string::npos);
}

}  // namespace
}  // namespace kvpack::cpu
