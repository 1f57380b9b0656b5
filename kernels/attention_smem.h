// Shared memory of the two attention kernels, as host-only constexpr arithmetic (no CUDA headers), so
// that the kernel choice (kernel_choice.h, pure C++ and unit-tested) and the kernels that allocate it
// cannot disagree: attention_sm80_mma.cu sizes its launches with these functions and static_asserts
// its tile layout and static shared variables against them; attention.cu static_asserts the wgmma
// figures against attention_sm90_tile.h's Sm90DynamicSmem for every page format and head_dim.
//
// Static shared memory (QueryRuns, VisibleScratch, the wgmma kernel's descriptors and barriers) is
// counted too: it shares the per-block limit with the dynamic bytes.
#pragma once

#include "kernels/format.h"

namespace kvpack {

inline constexpr int kAttentionTileQueries = 128;  // = cuda::kTileQueries (attention.cu asserts it)

// Shared by both kernels (attention_device.cuh): QueryRuns (q_seq, seq, last [128] ints and n) and
// VisibleScratch<kThreads, kWindow> (uint16 visible[kWindow], int counts[kThreads], int n_visible).
constexpr int QueryRunsBytes() { return (3 * kAttentionTileQueries + 1) * 4; }
constexpr int VisibleScratchBytes(int threads, int window) { return window * 2 + threads * 4 + 4; }

// ── mma.sync kernel (attention_sm80_mma.cu) ──────────────────────────────────────────────────────
// Q [128][d + 8], decoded K and V [64][d + 8] (bf16; +8 keeps ldmatrix free of bank conflicts), then
// kMmaSyncRawStages raw stages of one K and one V page (max_page_bytes each). kTall (4 warps) and kWide
// (8 warps) share the layout; only the thread count in VisibleScratch differs.
inline constexpr int kMmaSyncRawStages = 2;
inline constexpr int kMmaSyncWindow = 2048;
inline constexpr int kMmaSyncTallThreads = 128;
inline constexpr int kMmaSyncWideThreads = 256;
constexpr int MmaSyncPitch(int head_dim) { return head_dim + 8; }
constexpr int MmaSyncRawOffset(int head_dim) {
  return (kAttentionTileQueries + 2 * kPageTokens) * MmaSyncPitch(head_dim) * 2;
}
constexpr int MmaSyncDynamicSmem(int head_dim, int max_page_bytes) {
  return MmaSyncRawOffset(head_dim) + kMmaSyncRawStages * 2 * max_page_bytes;
}
// The static variables, rounded up to 128 bytes: the dynamic array (__align__(128)) starts after
// them (ptxas -v: 6272 bytes for kTall, 6784 for kWide).
constexpr int MmaSyncStaticSmem(int threads) {
  return (QueryRunsBytes() + VisibleScratchBytes(threads, kMmaSyncWindow) + 127) / 128 * 128;
}

// ── wgmma kernel (attention_sm90.cu, attention_sm90_tile.h) ──────────────────────────────────────
// 1 KiB alignment slack, Q [128][d], kStages decoded K and V tiles [64][d], three raw stages of one K
// and one V page; four decoded stages where the CTA stays within kWgmmaDynamicLimit, else two. These are
// the bf16 MMA path's bytes, which bound the INT8 path's: its Q and K tiles are int8 ([rows][128]), and
// it spends what that leaves on more raw stages (WgmmaRawStagesWithin), up to six. (H200: +3 % on the
// INT8 path at N = 32768 and on H3; the same on the bf16 path cost 9 %, so it keeps three.)
inline constexpr int kWgmmaAlign = 1024;
inline constexpr int kWgmmaRawStages = 3;     // the bf16 path's, and the least
inline constexpr int kWgmmaMaxRawStages = 6;  // the most (the INT8 path)
inline constexpr int kWgmmaThreads = 512;
inline constexpr int kWgmmaWindow = 3072;
inline constexpr int kWgmmaDeepStages = 4;
inline constexpr int kWgmmaDynamicLimit = 216 * 1024;  // = kSm90MaxDynamicSmem (asserted in attention.cu)
constexpr int WgmmaDynamicSmemFor(int head_dim, int stages, int max_page_bytes) {
  return kWgmmaAlign + kAttentionTileQueries * head_dim * 2 + 2 * stages * kPageTokens * head_dim * 2 +
         kWgmmaRawStages * 2 * max_page_bytes;
}
constexpr int WgmmaStagesFor(int head_dim, int max_page_bytes) {
  return WgmmaDynamicSmemFor(head_dim, kWgmmaDeepStages, max_page_bytes) <= kWgmmaDynamicLimit
             ? kWgmmaDeepStages
             : 2;
}
constexpr int WgmmaDynamicSmem(int head_dim, int max_page_bytes) {
  return WgmmaDynamicSmemFor(head_dim, WgmmaStagesFor(head_dim, max_page_bytes), max_page_bytes);
}
// Raw stages when `fixed` dynamic bytes (alignment, Q and the decoded tiles) come first and the whole
// stays within `budget`: as many as fit, from kWgmmaRawStages to kWgmmaMaxRawStages.
constexpr int WgmmaRawStagesWithin(int fixed, int budget, int max_page_bytes) {
  const int fit = (budget - fixed) / (2 * max_page_bytes);
  return fit < kWgmmaRawStages ? kWgmmaRawStages : fit > kWgmmaMaxRawStages ? kWgmmaMaxRawStages : fit;
}
// The kernel's static shared variables: QueryRuns, VisibleScratch<512, 3072>, raw/tile PageDesc
// (16 B), raw/tile mbarriers (8 B; the raw ones for six stages), one uint32, the key table (float4
// [stages][32]) and the INT8 path's query scales (float [2][128]); plus 64 bytes for the compiler's
// alignment padding between them: an upper bound (ptxas -v: 12032 bytes with four stages, 10960 with
// two, 13056 on the INT8 path; the bound is 13116 and 12044).
constexpr int WgmmaStaticSmemBound(int stages) {
  return QueryRunsBytes() + VisibleScratchBytes(kWgmmaThreads, kWgmmaWindow) + (kWgmmaMaxRawStages + stages) * (16 + 8) +
         4 + stages * (kPageTokens / 2) * 16 + 2 * kAttentionTileQueries * 4 + 64;
}

}  // namespace kvpack
