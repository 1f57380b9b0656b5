// The attention kernel choice (kernels/kernel_choice.h) on each arch kvpack is built for, with that
// arch's real shared-memory limits (CUDA programming guide, "Technical specifications per compute
// capability"), every page format and head_dim 64 / 128.
#include "kernels/kernel_choice.h"

#include <gtest/gtest.h>

#include <string>

#include "kernels/attention_smem.h"
#include "kernels/page_codec.h"

namespace kvpack {
namespace {

constexpr int kKiB = 1024;

// {major, minor, opt-in per block, per SM, reserved per block, SMs, binary has sm_90a}
constexpr DeviceCaps kA100{8, 0, 163 * kKiB, 164 * kKiB, kKiB, 108, true};     // sm_80
constexpr DeviceCaps kRtx3060{8, 6, 99 * kKiB, 100 * kKiB, kKiB, 28, true};    // sm_86
constexpr DeviceCaps kRtx4070{8, 9, 99 * kKiB, 100 * kKiB, kKiB, 46, true};    // sm_89
constexpr DeviceCaps kH200{9, 0, 227 * kKiB, 228 * kKiB, kKiB, 132, true};     // sm_90
constexpr DeviceCaps kB200{10, 0, 227 * kKiB, 228 * kKiB, kKiB, 148, true};    // sm_100
constexpr DeviceCaps kRtx5090{12, 0, 99 * kKiB, 100 * kKiB, kKiB, 170, true};  // sm_120

constexpr PageFormat kFormats[] = {PageFormat::kInt4, PageFormat::kInt8, PageFormat::kBf16};
constexpr int kDims[] = {64, 128};

AttentionKernelChoice Choose(const DeviceCaps& caps, int dim, PageFormat f, AttentionTilingChoice request) {
  AttentionKernelChoice c;
  const Error e = ChooseAttentionKernel(caps, dim, PageBytes(f, dim), request, &c);
  EXPECT_TRUE(e.ok()) << ComputeCapabilityName(caps) << " d=" << dim << " format " << static_cast<int>(f) << ": "
                      << e.message();
  return c;
}

Error ChooseError(const DeviceCaps& caps, int dim, PageFormat f, AttentionTilingChoice request) {
  AttentionKernelChoice c;
  return ChooseAttentionKernel(caps, dim, PageBytes(f, dim), request, &c);
}

// What every successful choice must satisfy on its GPU: one CTA within the per-block limit, the
// reported CTAs within the SM, and the figure the kernels allocate.
void ExpectFits(const DeviceCaps& caps, int dim, PageFormat f, const AttentionKernelChoice& c) {
  ASSERT_GE(c.ctas_per_sm, 1);
  EXPECT_LE(c.smem_bytes, caps.smem_per_block_optin);
  EXPECT_LE(c.ctas_per_sm * (c.smem_bytes + caps.smem_reserved_per_block), caps.smem_per_sm);
  const int page = PageBytes(f, dim);
  if (c.tiling == AttentionTilingChoice::kWgmma) {
    EXPECT_GE(c.smem_bytes, WgmmaDynamicSmem(dim, page));
  } else {
    const int threads = c.tiling == AttentionTilingChoice::kTall ? kMmaSyncTallThreads : kMmaSyncWideThreads;
    EXPECT_EQ(c.smem_bytes, MmaSyncDynamicSmem(dim, page) + MmaSyncStaticSmem(threads));
  }
}

TEST(KernelChoice, HopperAutoIsWgmmaForEveryFormatAndDim) {
  for (int dim : kDims) {
    for (PageFormat f : kFormats) {
      const AttentionKernelChoice c = Choose(kH200, dim, f, AttentionTilingChoice::kAuto);
      EXPECT_EQ(c.tiling, AttentionTilingChoice::kWgmma);
      EXPECT_EQ(c.ctas_per_sm, 1);
      ExpectFits(kH200, dim, f, c);
    }
  }
}

TEST(KernelChoice, HopperMmaSyncIsTallWhereTwoCtasFitElseWide) {
  for (int dim : kDims) {
    for (PageFormat f : kFormats) {
      const AttentionKernelChoice c = Choose(kH200, dim, f, AttentionTilingChoice::kMmaSync);
      // Only BF16 pages at d = 128 (64 KiB of raw stages) leave room for one CTA (the measured case
      // where kWide beats kTall: 200 vs 148 TFLOP/s).
      const bool one_cta = dim == 128 && f == PageFormat::kBf16;
      EXPECT_EQ(c.tiling, one_cta ? AttentionTilingChoice::kWide : AttentionTilingChoice::kTall) << dim;
      EXPECT_EQ(c.ctas_per_sm, one_cta ? 1 : 2);
      ExpectFits(kH200, dim, f, c);
    }
  }
}

TEST(KernelChoice, HopperWithoutSm90aCodeFallsBackOrNamesTheBuild) {
  DeviceCaps caps = kH200;
  caps.has_sm90a_code = false;
  EXPECT_EQ(Choose(caps, 128, PageFormat::kInt4, AttentionTilingChoice::kAuto).tiling, AttentionTilingChoice::kTall);
  const Error e = ChooseError(caps, 128, PageFormat::kInt4, AttentionTilingChoice::kWgmma);
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  EXPECT_NE(e.message().find("built without sm_90a"), std::string::npos) << e.message();
}

TEST(KernelChoice, WgmmaOnAnyOtherArchNamesTheGpu) {
  for (const DeviceCaps& caps : {kA100, kRtx3060, kRtx4070, kB200, kRtx5090}) {
    const Error e = ChooseError(caps, 64, PageFormat::kInt4, AttentionTilingChoice::kWgmma);
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(e.message().find("wgmma kernel needs sm_90a; this GPU is " + ComputeCapabilityName(caps)),
              std::string::npos)
        << e.message();
  }
}

TEST(KernelChoice, A100FitsEveryFormatAndDim) {
  for (int dim : kDims) {
    for (PageFormat f : kFormats) {
      const AttentionKernelChoice c = Choose(kA100, dim, f, AttentionTilingChoice::kAuto);
      // 164 KB per SM: two kTall CTAs at d = 64 (≤ 76 KB each); at d = 128 (≥ 93 KB) one kWide CTA.
      EXPECT_EQ(c.tiling, dim == 64 ? AttentionTilingChoice::kTall : AttentionTilingChoice::kWide);
      ExpectFits(kA100, dim, f, c);
    }
  }
}

TEST(KernelChoice, B200UsesMmaSyncLikeHopperForcedToIt) {
  for (int dim : kDims) {
    for (PageFormat f : kFormats) {
      const AttentionKernelChoice c = Choose(kB200, dim, f, AttentionTilingChoice::kAuto);
      const AttentionKernelChoice h = Choose(kH200, dim, f, AttentionTilingChoice::kMmaSync);
      EXPECT_EQ(c.tiling, h.tiling);
      ExpectFits(kB200, dim, f, c);
    }
  }
}

// 99 KB per block: one kWide CTA where it fits; INT8 and BF16 pages at d = 128 need more than the
// mma.sync kernel's two raw stages leave (109696 and 141952 bytes), so they fail with the figures.
TEST(KernelChoice, ConsumerGpusFitD64AndInt4AtD128AndNameWhatDoesNot) {
  for (const DeviceCaps& caps : {kRtx3060, kRtx4070, kRtx5090}) {
    for (int dim : kDims) {
      for (PageFormat f : kFormats) {
        const bool fits = dim == 64 || f == PageFormat::kInt4;
        if (fits) {
          const AttentionKernelChoice c = Choose(caps, dim, f, AttentionTilingChoice::kAuto);
          EXPECT_EQ(c.tiling, AttentionTilingChoice::kWide) << ComputeCapabilityName(caps) << " d=" << dim;
          ExpectFits(caps, dim, f, c);
          continue;
        }
        const Error e = ChooseError(caps, dim, f, AttentionTilingChoice::kAuto);
        EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
        const std::string needed = std::to_string(MmaSyncDynamicSmem(dim, PageBytes(f, dim)) + MmaSyncStaticSmem(kMmaSyncWideThreads));
        EXPECT_NE(e.message().find("mma_sync kernel needs " + needed + " bytes"), std::string::npos) << e.message();
        EXPECT_NE(e.message().find(ComputeCapabilityName(caps) + ") allows 101376 per block"), std::string::npos)
            << e.message();
      }
    }
  }
}

TEST(KernelChoice, ForcedTilingRunsWhereOneCtaFits) {
  // kTall with one CTA per SM is slower but correct: a test or benchmark that asks for it gets it.
  const AttentionKernelChoice c = Choose(kH200, 128, PageFormat::kBf16, AttentionTilingChoice::kTall);
  EXPECT_EQ(c.tiling, AttentionTilingChoice::kTall);
  EXPECT_EQ(c.ctas_per_sm, 1);
  EXPECT_EQ(Choose(kH200, 64, PageFormat::kInt4, AttentionTilingChoice::kWide).tiling, AttentionTilingChoice::kWide);
  EXPECT_EQ(ChooseError(kRtx3060, 128, PageFormat::kBf16, AttentionTilingChoice::kTall).code(), ErrorCode::kUnsupported);
}

TEST(KernelChoice, RejectsHeadDimPageSizeAndUnknownRequests) {
  AttentionKernelChoice c;
  EXPECT_EQ(ChooseAttentionKernel(kH200, 96, 4096, AttentionTilingChoice::kAuto, &c).code(), ErrorCode::kUnsupported);
  EXPECT_EQ(ChooseAttentionKernel(kH200, 128, 0, AttentionTilingChoice::kAuto, &c).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(ChooseAttentionKernel(kH200, 64, PageBytes(PageFormat::kBf16, 64) + 1, AttentionTilingChoice::kAuto, &c).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(ChooseAttentionKernel(kH200, 64, 2304, static_cast<AttentionTilingChoice>(9), &c).code(),
            ErrorCode::kInvalidArgument);
}

TEST(KernelChoice, ParsesAndNamesTheDaemonFlag) {
  AttentionTilingChoice r = AttentionTilingChoice::kTall;
  ASSERT_TRUE(ParseAttentionKernel("auto", &r).ok());
  EXPECT_EQ(r, AttentionTilingChoice::kAuto);
  ASSERT_TRUE(ParseAttentionKernel("wgmma", &r).ok());
  EXPECT_EQ(r, AttentionTilingChoice::kWgmma);
  ASSERT_TRUE(ParseAttentionKernel("mma_sync", &r).ok());
  EXPECT_EQ(r, AttentionTilingChoice::kMmaSync);
  const Error e = ParseAttentionKernel("tall", &r);
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(e.message().find("attention_kernel"), std::string::npos);
  EXPECT_STREQ(AttentionKernelName(AttentionTilingChoice::kWide), "mma_sync");
  EXPECT_STREQ(AttentionKernelName(AttentionTilingChoice::kWgmma), "wgmma");
  EXPECT_EQ(ComputeCapabilityName(kRtx5090), "sm_120");
}

TEST(KernelChoice, BinaryRunsWhereItHoldsSassOfTheMajorOrOlderPtx) {
  const std::string all = "sm_80,sm_86,sm_89,sm_90a,sm_100,sm_120,compute_120";
  for (const DeviceCaps& caps : {kA100, kRtx3060, kRtx4070, kH200, kB200, kRtx5090}) {
    EXPECT_TRUE(BinaryRunsOn(all, caps).ok()) << ComputeCapabilityName(caps);
  }
  DeviceCaps later = kRtx5090;
  later.cc_major = 13;  // a GPU newer than the list: the PTX
  EXPECT_TRUE(BinaryRunsOn(all, later).ok());
  DeviceCaps sm87 = kRtx3060;
  sm87.cc_minor = 7;  // sm_86 SASS runs on 8.7
  EXPECT_TRUE(BinaryRunsOn("sm_86,compute_86", sm87).ok());
  EXPECT_TRUE(BinaryRunsOn("sm_90a,compute_90", kH200).ok());
  const Error e = BinaryRunsOn("sm_90a,compute_90", kRtx3060);  // a Hopper-only build on an RTX 3060
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  EXPECT_NE(e.message().find("none runs on sm_86"), std::string::npos) << e.message();
  EXPECT_FALSE(BinaryRunsOn("sm_90a", kB200).ok());  // arch-specific code runs on its own arch only
  EXPECT_FALSE(BinaryRunsOn("", kA100).ok());
}

// The wgmma figures the choice uses are the kernel's (attention.cu asserts the same against
// attention_sm90_tile.h at compile time): BF16 at d = 128 takes two decoded stages, the rest four.
TEST(KernelChoice, WgmmaStagesFollowTheKernel) {
  EXPECT_EQ(WgmmaStagesFor(128, PageBytes(PageFormat::kBf16, 128)), 2);
  EXPECT_EQ(WgmmaStagesFor(128, PageBytes(PageFormat::kInt8, 128)), 4);
  EXPECT_EQ(WgmmaStagesFor(64, PageBytes(PageFormat::kBf16, 64)), 4);
  // ptxas -v of the wgmma kernel: 12032 / 10960 bytes of static shared memory (13056 on the INT8 path).
  EXPECT_GE(WgmmaStaticSmemBound(4), 13056);
  EXPECT_GE(WgmmaStaticSmemBound(2), 10960);
}

// The INT8 path's raw stages: as many as fit the budget, from three to six.
TEST(KernelChoice, WgmmaRawStagesWithinTheBudget) {
  const int page = PageBytes(PageFormat::kInt4, 128), fixed = 100000;
  EXPECT_EQ(WgmmaRawStagesWithin(fixed, fixed, page), kWgmmaRawStages);  // three even where none fit
  EXPECT_EQ(WgmmaRawStagesWithin(fixed, fixed + 5 * 2 * page - 1, page), 4);
  EXPECT_EQ(WgmmaRawStagesWithin(fixed, fixed + 5 * 2 * page, page), 5);
  EXPECT_EQ(WgmmaRawStagesWithin(fixed, fixed + 100 * page, page), kWgmmaMaxRawStages);
}

}  // namespace
}  // namespace kvpack
