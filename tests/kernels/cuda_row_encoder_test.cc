// The row epilogue's warp encoders (kernels/cuda/row_epilogue.h) against the host encoder
// (kernels/page_codec.h): the same bytes for rows of every magnitude. GPU tests skip with a message
// when no CUDA device answers.
#include "kernels/cuda/row_epilogue.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/format.h"
#include "kernels/page_codec.h"
#include "tests/kernels/cuda_test_layer.h"

namespace kvpack::cuda {
namespace {

// The quantizers' reciprocal of a row scale skips __frcp_rn's range check (a half's reciprocal is
// always a normal float): the same bits for every positive half.
TEST(CudaRowEncoder, HalfReciprocalsAreFrcpRn) {
  SKIP_WITHOUT_GPU();
  int mismatches = -1;
  ASSERT_OK(CountHalfReciprocalMismatches(&mismatches));
  EXPECT_EQ(mismatches, 0);
}

// The warp row encoders write the host encoder's bytes, codes and fp16 metadata, for rows of every
// magnitude: max|x| from 1e-9 (scale below fp16's smallest subnormal) through fp16's subnormal scales
// (INT8 max|x| < 127·2^-14 ≈ 7.8e-3, INT4 range < 15·2^-14), where the scale rounds up so no code clips,
// to 1e3; plus the page_fuzz findings' rows (x = −1.1e-5 among small values; fp32 subnormals) and rows at
// the edges of INT4's range search.
TEST(CudaRowEncoder, RowEncodersWriteTheHostsBytesAtEveryMagnitude) {
  SKIP_WITHOUT_GPU();
  constexpr int kRows = 64 * kPageTokens;
  constexpr double kMinLog10 = -9.0, kMaxLog10 = 3.0;
  for (int d : {64, 128}) {
    std::mt19937_64 rng(0x656e636f + d);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> rows(static_cast<size_t>(kRows) * d);
    for (int r = 0; r < kRows; ++r) {
      const float magnitude = static_cast<float>(std::pow(10.0, kMinLog10 + (kMaxLog10 - kMinLog10) * r / (kRows - 1)));
      const float offset = r % 3 == 0 ? magnitude * 0.5f : 0.0f;  // INT4's lo away from 0 in some rows
      for (int e = 0; e < d; ++e) rows[static_cast<size_t>(r) * d + e] = offset + magnitude * normal(rng);
    }
    for (int e = 0; e < d; ++e) rows[e] = (e == 5 ? -1.1e-5f : 1e-7f * normal(rng));  // the fuzz finding's row
    for (int e = 0; e < d; ++e) rows[d + e] = std::ldexp(1.0f, -149) * (e % 7);  // fp32 subnormals: span / 127 = 0
    // INT4's range search (format.h ChooseInt4Row) at its edges: a row on an exact grid (min–max has no
    // error; every other candidate ties or loses, so the first is kept), a range exactly at the search's
    // lower limit 15·2^-14 and one just under it, ends near fp16's largest value (searched) and past it
    // (not searched).
    const float grid_step = 0.37f, at_limit = 15.0f * std::ldexp(1.0f, -14);
    for (int e = 0; e < d; ++e) {
      rows[2 * d + e] = -1.5f + grid_step * static_cast<float>(e % 16);
      rows[3 * d + e] = e == 0 ? at_limit : (e == 1 ? 0.0f : at_limit * 0.5f * (1.0f + 0.5f * normal(rng) / 4.0f));
      rows[4 * d + e] = e == 0 ? std::nextafter(at_limit, 0.0f) : (e == 1 ? 0.0f : at_limit * 0.25f);
      rows[5 * d + e] = e == 0 ? 32000.0f : (e == 1 ? -32000.0f : 9000.0f * normal(rng));
      rows[6 * d + e] = e == 0 ? 70000.0f : 900.0f * normal(rng);
    }
    for (PageFormat f : {PageFormat::kInt4, PageFormat::kInt8}) {
      const size_t bytes = static_cast<size_t>(kRows / kPageTokens) * PageBytes(f, d);
      std::vector<uint8_t> gpu(bytes), host(bytes, 0);
      ASSERT_OK(EncodeRowsOnDevice(f, d, rows.data(), kRows, gpu.data()));
      int subnormal_scales = 0;
      for (int r = 0; r < kRows; ++r) {
        uint8_t* page = host.data() + static_cast<size_t>(r / kPageTokens) * PageBytes(f, d);
        EncodePageRow(f, rows.data() + static_cast<size_t>(r) * d, d, r % kPageTokens, page);
        uint16_t scale;
        std::memcpy(&scale, page + MetaOffset(f, d) + (r % kPageTokens) * MetaBytesPerRow(f), 2);
        subnormal_scales += scale < kHalfMinNormalBits;
      }
      int64_t differing = 0;
      for (size_t b = 0; b < bytes; ++b) differing += gpu[b] != host[b];
      std::printf("[row encoders] %s d %d: %d rows (%d with a subnormal or zero fp16 scale), bytes differing from "
                  "the host encoder: %lld of %zu -> %s\n",
                  f == PageFormat::kInt4 ? "int4" : "int8", d, kRows, subnormal_scales,
                  static_cast<long long>(differing), bytes, differing == 0 ? "PASS" : "FAIL");
      EXPECT_EQ(differing, 0) << (f == PageFormat::kInt4 ? "int4" : "int8") << " d " << d;
      EXPECT_GT(subnormal_scales, kRows / 8) << "the sweep must reach fp16's subnormal scales";
    }
  }
}

}  // namespace
}  // namespace kvpack::cuda
