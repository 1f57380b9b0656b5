// kernels/page_codec.h: every format has a codec reached through DispatchFormat; the codecs' sizes
// make the page layout of format.h; a row survives EncodePageRow → DecodePageRow within the format's
// quantization step, and the runtime-format functions equal the codec's own.
#include "kernels/page_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <vector>

namespace kvpack {
namespace {

// INT4 / INT8: half a step plus the fp16 rounding of the metadata; BF16: half a bf16 ulp (2^-9 relative).
constexpr float kHalfStepSlack = 0.5f + 1e-3f;
// INT4: plus the fp16 rounding of lo and scale (2^-11 of |lo| ≤ max|x| and of the span ≤ 2·max|x|),
// which a value clipped by the search's shrunk range (format.h kInt4MaxShift ≤ ½ step) carries whole.
constexpr float kLoRelative = 3 * 0x1p-11f;
constexpr float kBf16Relative = 1.0f / 256.0f;

std::vector<float> Row(std::mt19937_64& rng, int d) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(d);
  for (int i = 0; i < d; ++i) x[i] = 0.4f + normal(rng) * (i % 13 == 5 ? 18.0f : 1.0f);  // offset + outliers
  return x;
}

TEST(PageCodec, DispatchVisitsEveryFormatOnce) {
  std::set<int> seen;
  for (int f = 0; f < kNumPageFormats; ++f) {
    const PageFormat got = DispatchFormat(static_cast<PageFormat>(f), [](auto tag) { return decltype(tag)::kFormat; });
    EXPECT_EQ(static_cast<int>(got), f);
    seen.insert(static_cast<int>(got));
  }
  EXPECT_EQ(static_cast<int>(seen.size()), kNumPageFormats);
}

TEST(PageCodec, SizesAreTheCodecs) {
  for (int d : {16, 64, 128, 256}) {
    EXPECT_EQ(CodeBytesPerRow(PageFormat::kInt4, d), PageCodec<PageFormat::kInt4>::CodeBytes(d));
    EXPECT_EQ(CodeBytesPerRow(PageFormat::kInt8, d), PageCodec<PageFormat::kInt8>::CodeBytes(d));
    EXPECT_EQ(CodeBytesPerRow(PageFormat::kBf16, d), PageCodec<PageFormat::kBf16>::CodeBytes(d));
    for (int f = 0; f < kNumPageFormats; ++f) {
      const PageFormat format = static_cast<PageFormat>(f);
      EXPECT_EQ(PageBytes(format, d), kPageTokens * (CodeBytesPerRow(format, d) + MetaBytesPerRow(format)));
      EXPECT_EQ(MetaOffset(format, d), kPageTokens * CodeBytesPerRow(format, d));
    }
  }
  EXPECT_EQ(MetaBytesPerRow(PageFormat::kInt4), 4);
  EXPECT_EQ(MetaBytesPerRow(PageFormat::kInt8), 2);
  EXPECT_EQ(MetaBytesPerRow(PageFormat::kBf16), 0);
}

TEST(PageCodec, RowsRoundTripWithinTheirStepAndLeaveOtherSlotsAlone) {
  std::mt19937_64 rng(0x70616765);
  for (int d : {32, 128}) {
    for (int f = 0; f < kNumPageFormats; ++f) {
      const PageFormat format = static_cast<PageFormat>(f);
      std::vector<uint8_t> page(PageBytes(format, d), 0xa5);
      std::vector<std::vector<float>> rows;
      for (int slot = 0; slot < kPageTokens; slot += 7) {
        rows.push_back(Row(rng, d));
        EncodePageRow(format, rows.back().data(), d, slot, page.data());
      }
      std::vector<float> got(d);
      for (int slot = 0, r = 0; slot < kPageTokens; slot += 7, ++r) {
        DecodePageRow(format, page.data(), d, slot, got.data());
        const std::vector<float>& x = rows[r];
        float lo = x[0], hi = x[0], amax = 0;
        for (float v : x) lo = std::min(lo, v), hi = std::max(hi, v), amax = std::max(amax, std::fabs(v));
        const float bound = format == PageFormat::kInt4   ? kHalfStepSlack * (hi - lo) / 15.0f + kLoRelative * amax
                            : format == PageFormat::kInt8 ? kHalfStepSlack * amax / 127.0f
                                                          : 0.0f;
        for (int i = 0; i < d; ++i) {
          const float tol = format == PageFormat::kBf16 ? kBf16Relative * std::fabs(x[i]) : bound;
          ASSERT_LE(std::fabs(got[i] - x[i]), tol) << "format " << f << " d " << d << " slot " << slot << " channel " << i;
        }
      }
      // Slot 1 was never written: its code bytes keep the fill.
      for (int b = 0; b < CodeBytesPerRow(format, d); ++b) ASSERT_EQ(page[CodeBytesPerRow(format, d) + b], 0xa5);
    }
  }
}

TEST(PageCodec, TypedCodecEqualsTheRuntimeFunctions) {
  std::mt19937_64 rng(11);
  const int d = 64;
  const std::vector<float> x = Row(rng, d);
  std::vector<uint8_t> a(PageBytes(PageFormat::kInt4, d)), b(a.size());
  EncodePageRow(PageFormat::kInt4, x.data(), d, 3, a.data());
  using Codec = PageCodec<PageFormat::kInt4>;
  Codec::EncodeRow(x.data(), d, b.data() + 3 * Codec::CodeBytes(d), b.data() + MetaOffset(PageFormat::kInt4, d) + 3 * Codec::kMetaBytes);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace kvpack
