// fit_table's models: H3's token layout, the PyTorch byte model, the planner-backed kvpack entry and
// the search for the longest sequence. kvpack's entries here plan with the CPU backend's byte
// functions (the tool's binary plans with the CUDA backend's; both go through the same PlanLayer).
#include "tools/fit_table/fit_table.h"

#include <gtest/gtest.h>

#include "kernels/cpu/layer.h"
#include "server/core/error_status.h"
#include "server/core/pool.h"

namespace kvpack::tools {
namespace {

constexpr int64_t kH3Tokens = 152263;
constexpr uint64_t kCard12 = 12 * kGiB;

server::PlannerCosts CpuCosts() {
  server::PlannerCosts costs;
  costs.supported = [](const LayerConfig& c) { return server::ToStatus(cpu::Supported(c)); };
  costs.kv_bytes = [](const LayerConfig& c) { return cpu::KvBytes(c); };
  costs.workspace_bytes = [](const LayerConfig& c) { return cpu::WorkspaceBytes(c); };
  return costs;
}

KvpackMode Int4(bool in_place) {
  const std::vector<PageFormat> f = {PageFormat::kInt4};
  return KvpackMode{"int4", f, f, f, in_place};
}

TEST(H3RangesTest, H3sOwnLayoutAndScaledOnes) {
  const TokenRanges h3 = H3Ranges(kH3Tokens);
  EXPECT_EQ(h3.text, 1063);
  EXPECT_EQ(h3.reference, 21 * 45 * 80);
  EXPECT_EQ(h3.generated, 21 * 45 * 80);
  for (int64_t n : {3, 7, 8192, 100003}) {
    const TokenRanges r = H3Ranges(n);
    EXPECT_GE(r.text, 1) << n;
    EXPECT_GE(r.reference, 1) << n;
    EXPECT_EQ(r.text + r.reference + r.generated, n);
  }
  EXPECT_EQ(H3Ranges(2).generated, 2);
}

TEST(TorchBytesTest, QkvIsTheRequestsSixGiBTensor) {
  const FitOptions o;
  const Breakdown b = TorchBytes(kH3Tokens, o);
  uint64_t qkv = 0;
  for (const auto& [name, bytes] : b.parts) {
    if (name == "qkv") qkv = bytes;
  }
  EXPECT_EQ(qkv, static_cast<uint64_t>(kH3Tokens) * 21504 * 2);  // 6.10 GiB
  // x + W + 7 [N, H·d] tensors + softmax stats + context + cuDNN workspace.
  const uint64_t a = static_cast<uint64_t>(kH3Tokens) * 7168 * 2;
  EXPECT_EQ(b.Total(), o.context_bytes + kH3Tokens * 5376ull * 2 + o.geometry.WeightBytes() + 7 * a +
                           kH3Tokens * 56ull * 4 + o.cudnn_workspace_bytes);
}

TEST(LongestFitTest, FindsTheBoundary) {
  EXPECT_EQ(LongestFit([](int64_t n) { return n <= 1000; }, 1 << 20), 1000);
  EXPECT_EQ(LongestFit([](int64_t) { return false; }, 1 << 20), 0);
  EXPECT_EQ(LongestFit([](int64_t) { return true; }, 4097), 4097);
  EXPECT_EQ(LongestFit([](int64_t n) { return n <= 1; }, 1 << 20), 1);
}

TEST(KvpackBytesTest, TheLongestFitFitsAndOneMoreDoesNot) {
  const FitOptions o;
  const server::PlannerCosts costs = CpuCosts();
  const int64_t n = LongestFit([&](int64_t k) { return KvpackBytes(k, kCard12, Int4(false), o, costs).fits; }, INT32_MAX);
  ASSERT_GT(n, kH3Tokens);  // H3's layer fits an empty 12 GiB card through kvpack
  const KvpackFit at = KvpackBytes(n, kCard12, Int4(false), o, costs);
  EXPECT_TRUE(at.fits);
  EXPECT_LE(at.bytes.Total(), kCard12);
  const KvpackFit next = KvpackBytes(n + 1, kCard12, Int4(false), o, costs);
  EXPECT_FALSE(next.fits);
  EXPECT_NE(next.reason.find("floor plan"), std::string::npos) << next.reason;
  // The K/V bytes are the backend's for the planned config, pool-rounded.
  EXPECT_EQ(at.plan.kv_bytes, server::PoolBytes(cpu::KvBytes(at.plan.config)));
  EXPECT_EQ(at.plan.ranges.size(), 3u);
}

TEST(KvpackBytesTest, PyTorchFitsFewerTokensThanKvpack) {
  const FitOptions o;
  const int64_t torch_n = LongestFit([&](int64_t n) { return TorchBytes(n, o).Total() <= kCard12; }, INT32_MAX);
  EXPECT_LT(torch_n, kH3Tokens);  // H3's layer alone overflows 12 GiB in PyTorch
  EXPECT_GT(torch_n, 0);
  EXPECT_TRUE(KvpackBytes(torch_n, kCard12, Int4(false), o, CpuCosts()).fits);
}

TEST(KvpackBytesTest, InPlaceNeedsHiddenEqualToHeadColumns) {
  FitOptions o;
  const KvpackFit h3 = KvpackBytes(4096, kCard12, Int4(true), o, CpuCosts());
  EXPECT_FALSE(h3.fits);
  EXPECT_NE(h3.reason.find("in place"), std::string::npos) << h3.reason;
  o.geometry.hidden = 7168;
  const KvpackFit square = KvpackBytes(4096, kCard12, Int4(true), o, CpuCosts());
  EXPECT_TRUE(square.fits) << square.reason;
  for (const auto& [name, bytes] : square.bytes.parts) EXPECT_NE(name, "out");
}

TEST(KvpackBytesTest, ACardSmallerThanTheFixedBytesFitsNothing) {
  const FitOptions o;
  const KvpackFit f = KvpackBytes(64, kGiB, Int4(false), o, CpuCosts());
  EXPECT_FALSE(f.fits);
}

}  // namespace
}  // namespace kvpack::tools
