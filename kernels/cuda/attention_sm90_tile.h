// Tile configuration of the sm90 attention kernel (attention_sm90.cu): warp roles, register split,
// stages and the shared-memory plan, as compile-time constants with the asserts that hold them
// together, and the one function that chooses an instance for (head_dim, largest page).
//
// A CTA of four warp groups takes kTileQueries = 128 query rows of one head:
//   groups 0, 1  producers (attention_sm90_producer.cuh): bulk-copy raw pages, decode them into tiles
//   groups 2, 3  consumers (attention_sm90_consumer.cuh): 64 query rows each, wgmma and the softmax
// Shared memory (dynamic, from a 1024-byte aligned base, as the 128-byte swizzle needs):
//   Q      [2 groups][64 rows][kDim]   bf16, swizzled     kQBytes
//   K      [kStages][64 keys][kDim]    bf16, swizzled     kStages · kKTileBytes
//   V      [kStages][64 keys][kDim]    bf16, swizzled     kStages · kTileBytes
//   raw    [raw stages][K page | V page]                  3 to 6 stages · 2 · max_page_bytes
// On the INT8 MMA path (kInt8Qk, mma_path.h) Q and K hold int8 codes instead, one 128-byte swizzled
// row per query or key ([rows][128] int8; at d = 64 the second half of each row is unused, so that
// both head sizes share the 128-byte swizzle), so Q is 16 KiB and a K stage 8 KiB.
// The epilogue stages float rows [128][kDim + 4] over Q, K and V once every MMA is done.
#pragma once

#include "kernels/attention_smem.h"
#include "kernels/cuda/attention.h"
#include "kernels/format.h"

#ifndef KVPACK_SM90_EXPERIMENT
#define KVPACK_SM90_EXPERIMENT 0
#endif

namespace kvpack::cuda {

// Timing experiments (CMake -DKVPACK_SM90_EXPERIMENT=nodecode|noexp|nopingpong): one part of the
// kernel removed to see what limits it (bench/h200.sh EXPERIMENTS=...). kNoDecode and kNoExp give
// wrong outputs and exist for timing only; kNoPingPong is a correct kernel.
enum class Sm90Experiment { kNone = 0, kNoDecode = 1, kNoExp = 2, kNoPingPong = 3 };
inline constexpr Sm90Experiment kSm90Experiment = static_cast<Sm90Experiment>(KVPACK_SM90_EXPERIMENT);

template <int kDimT, int kStagesT, bool kInt8QkT = false>
struct Sm90Tile {
  static constexpr int kDim = kDimT;
  static constexpr bool kInt8Qk = kInt8QkT;
  static_assert(kDim == 64 || kDim == 128, "head_dim 64 or 128");
  static constexpr int kConsumerGroups = 2;
  static constexpr int kGroupRows = 64;  // wgmma M
  static_assert(kConsumerGroups * kGroupRows == kTileQueries, "consumer groups cover the query tile");
  // Two producer groups, so a scheduler holds two producer warps whose latencies hide each other's
  // (with one, the producer limited the kernel); both decode half of each tile.
  static constexpr int kProducerGroups = 2;
  static constexpr int kProducerThreads = 128 * kProducerGroups;
  static constexpr int kThreads = kProducerThreads + 128 * kConsumerGroups;
  // Registers per thread after setmaxnreg: the decode needs few, the consumers' S tiles, O and P
  // many: 256·56 + 256·200 = 65536, the register file (the launch's 512·128).
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 200;
  static_assert(kProducerThreads * kProducerRegisters + 128 * kConsumerGroups * kConsumerRegisters <= 65536,
                "register file");
  static constexpr int kStages = kStagesT;  // decoded K/V tiles in flight: 4 where shared memory allows, else 2
  // Raw pages in flight (one being decoded, the others arriving): Sm90RawStages of them, 3 to 6.
  static constexpr int kMinRawStages = kWgmmaRawStages, kMaxRawStages = kWgmmaMaxRawStages;
  static constexpr int kTileBytes = kPageTokens * kDim * 2;               // a bf16 V (or K) tile
  static constexpr int kInt8RowBytes = 128;                                // an int8 Q or K row
  static constexpr int kKTileBytes = kInt8Qk ? kPageTokens * kInt8RowBytes : kTileBytes;
  static constexpr int kQBytes = kInt8Qk ? kTileQueries * kInt8RowBytes : kTileQueries * kDim * 2;
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKTileBytes;
  static constexpr int kRawOffset = kVOffset + kStages * kTileBytes;
  static constexpr int kAlign = 1024;  // the swizzle pattern repeats every 8 rows × 128 bytes
  static constexpr int kStagePitch = kDim + 4;
  static_assert(kTileQueries * kStagePitch * 4 <= kRawOffset, "epilogue staging fits over Q, K and V");
  static_assert(kTileBytes % kAlign == 0 && kKTileBytes % kAlign == 0 && kQBytes % kAlign == 0,
                "tiles keep the swizzle alignment");
  static constexpr int kWindow = 3072;  // pages examined per visibility pass
  // Named barriers (0 is __syncthreads).
  static constexpr int kProducerBar = 1;
  static constexpr int kEmptyBar = 2;                   // + s: consumers are done with stage s
  static constexpr int kTurnBar = kEmptyBar + kStages;  // + c: consumer group c may issue its MMAs
  static_assert(kTurnBar + kConsumerGroups <= 16, "16 hardware barriers");
  // The deep ring (≥ 3 stages) overlaps S(i+1) and P(i)·V with the next softmax and lets the two
  // consumer groups take turns to issue (ping-pong); two stages serialise them.
  static constexpr bool kDeepRing = kStages >= 3;
  static constexpr bool kPingPong = kDeepRing && kSm90Experiment != Sm90Experiment::kNoPingPong;
};

template <int kDim, int kStages, bool kInt8Qk = false>
constexpr int Sm90DynamicSmem(int max_page_bytes);
// The raw stages of an instance: three on the bf16 path; on the INT8 path as many (up to six) as fit
// within the bf16 path's bytes for the same page (attention_smem.h). The kernel computes the same
// figure from max_page_bytes.
template <int kDim, int kStages, bool kInt8Qk = false>
__host__ __device__ constexpr int Sm90RawStages(int max_page_bytes) {
  using T = Sm90Tile<kDim, kStages, kInt8Qk>;
  if constexpr (!kInt8Qk) {
    return T::kMinRawStages;
  } else {
    return WgmmaRawStagesWithin(T::kAlign + T::kRawOffset, Sm90DynamicSmem<kDim, kStages, false>(max_page_bytes),
                                max_page_bytes);
  }
}
template <int kDim, int kStages, bool kInt8Qk>
constexpr int Sm90DynamicSmem(int max_page_bytes) {
  using T = Sm90Tile<kDim, kStages, kInt8Qk>;
  return T::kAlign + T::kRawOffset + Sm90RawStages<kDim, kStages, kInt8Qk>(max_page_bytes) * 2 * max_page_bytes;
}

// Four decoded stages where they fit beside the static shared memory (~12 KB) in the 227 KB of an
// SM: every format at d = 64, INT4 and INT8 at d = 128; BF16 pages at d = 128 take two. (The
// consumers hold two pages — S(i+1) runs while page i is in P·V — and hand a page back mid-way
// through the next, so with three stages the producer had half a page's time to decode each.)
inline constexpr int kSm90MaxDynamicSmem = 216 * 1024;
inline constexpr int kSm90DeepStages = 4;
template <int kDim>
constexpr int Sm90Stages(int max_page_bytes) {
  return Sm90DynamicSmem<kDim, kSm90DeepStages>(max_page_bytes) <= kSm90MaxDynamicSmem ? kSm90DeepStages : 2;
}
// The INT8 MMA path never meets a BF16 page (ResolveMmaPath), so it always takes four stages.
static_assert(Sm90DynamicSmem<128, kSm90DeepStages, true>(PageBytes(PageFormat::kInt8, 128)) <= kSm90MaxDynamicSmem,
              "the INT8 MMA path takes four stages with INT4 and INT8 pages");
static_assert(Sm90DynamicSmem<64, kSm90DeepStages>(PageBytes(PageFormat::kBf16, 64)) <= kSm90MaxDynamicSmem,
              "d = 64 takes four stages with any page (so it has no two-stage instance)");
static_assert(Sm90RawStages<128, kSm90DeepStages, true>(PageBytes(PageFormat::kInt4, 128)) == 6 &&
                  Sm90RawStages<128, kSm90DeepStages, true>(PageBytes(PageFormat::kInt8, 128)) == 5,
              "the INT8 path's raw stages at d = 128 (attention_smem.h)");

}  // namespace kvpack::cuda
