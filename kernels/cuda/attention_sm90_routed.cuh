// The routed (block-sparse) instance's pieces of the wgmma kernel (attention_sm90.cu, sparse.h): its
// shared state, the routed page list of a window, and the synthetic pages of the pooled pass.
// Internal to kernels/cuda: include only from attention_sm90.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_pages.cuh"
#include "kernels/cuda/warp_row.cuh"

namespace kvpack::cuda::sm90 {

// ── The routed (block-sparse) instance (sparse.h) ───────────────────────────────────────────────
// A CTA takes query blocks 2·blockIdx.x and 2·blockIdx.x + 1 of the launch (pages first_page + b), one
// per consumer group. The visible list of a window holds the pages that either block attends exactly,
// each entry's bits 14–15 saying which (kRoutedMember: bit c = group c); a group masks whole pages it
// does not route. After the last window one more pass streams the union of the two blocks' pooled
// pages, 64 per synthetic page (PageDesc::reserved = kSyntheticPage): K rows their mean keys, V rows
// their V sums (the stored bf16 statistics, copied), built by the producers straight into the tiles;
// key j counts n_j tokens in the softmax sum (weight) and is masked for a group that does not pool its
// page.
inline constexpr int kRoutedOffsetBits = 14;
inline constexpr uint32_t kSyntheticPage = 4;

template <bool kRouted, int kStages>
struct RoutedState {
  unsigned long long member[kStages][2];  // synthetic page of stage s: key j pooled by group c
  uint8_t weight[kStages][kPageTokens];   // its keys' token counts
  uint16_t pages[kPageTokens];            // the pages of the synthetic page being built
  int cursor;                             // next page to look at for the pooled union
  int n_synthetic;
  int64_t q0[2];                          // per consumer group: launch row of the block's first query,
  int64_t t0[2];                          // its token (position),
  int rows[2];                            // its queries (0: no block)
};
template <int kStages>
struct RoutedState<false, kStages> {};

// The routed twin of CollectVisiblePages: pages of [w0, w0 + wn) that either block attends exactly,
// in page order, with their group bits. Same barriers.
template <int kThreads, int kWindow>
__device__ int CollectRoutedPages(const AttentionParams& p, int head, int w0, int wn,
                                  VisibleScratch<kThreads, kWindow>& scratch) {
  static_assert(kWindow <= (1 << kRoutedOffsetBits), "offsets below the group bits");
  constexpr int kPerThread = kWindow / kThreads;
  const int tid = threadIdx.x;
  const AttentionParams::Route& route = p.route;
  const uint32_t* bits[2];
  for (int c = 0; c < 2; ++c) {
    const int b = 2 * blockIdx.x + c;
    bits[c] = b < route.n_blocks ? route.exact_bits + (static_cast<int64_t>(b) * p.kv.n_heads + head) * route.words : nullptr;
  }
  uint32_t mine[2] = {0, 0};  // bit i: page tid·kPerThread + i is routed by group c
  int count = 0;
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = tid * kPerThread + i;
    if (idx >= wn) break;
    const int pg = w0 + idx;
    bool any = false;
    for (int c = 0; c < 2; ++c) {
      if (bits[c] != nullptr && (bits[c][pg >> 5] >> (pg & 31) & 1u)) mine[c] |= 1u << i, any = true;
    }
    count += any;
  }
  int pos = VisibleSlot(scratch, tid, count);
  for (int i = 0; i < kPerThread; ++i) {
    const uint32_t member = (mine[0] >> i & 1u) | (mine[1] >> i & 1u) << 1;
    if (member) scratch.visible[pos++] = static_cast<uint16_t>((tid * kPerThread + i) | member << kRoutedOffsetBits);
  }
  const int n_visible = scratch.n_visible;
  __syncthreads();
  return n_visible;
}

// Producer warp 0: the next synthetic page of the pooled union from state.cursor — its pages, their
// group bits, weights and descriptor (stage s). 32 words (1024 pages) per step, one per lane, so that
// the bit loads run side by side (thread 0 alone, one dependent load per page, cost H3's layer 0.5 s).
template <int kStages>
__device__ void NextSyntheticPage(const AttentionParams& p, int head, int s, RoutedState<true, kStages>& state,
                                  PageDesc& desc, int lane) {
  const AttentionParams::Route& route = p.route;
  const uint32_t* bits[2];
  for (int c = 0; c < 2; ++c) {
    const int b = 2 * blockIdx.x + c;
    bits[c] = b < route.n_blocks ? route.pooled_bits + (static_cast<int64_t>(b) * p.kv.n_heads + head) * route.words : nullptr;
  }
  __shared__ uint8_t member_of[kPageTokens];
  const int cursor = state.cursor;
  int count = 0, next = p.kv.n_pages;  // pages found; the page after the last one taken
  for (int w0 = cursor >> 5; w0 < route.words && count < kPageTokens; w0 += 32) {
    const int w = w0 + lane;
    uint32_t word[2] = {0, 0};
    if (w < route.words) {
      for (int c = 0; c < 2; ++c) word[c] = bits[c] != nullptr ? bits[c][w] : 0u;
      if (w == cursor >> 5) word[0] &= ~0u << (cursor & 31), word[1] &= ~0u << (cursor & 31);
    }
    uint32_t any = word[0] | word[1];
    const int mine = __popc(any);
    int before = mine;  // inclusive prefix over lanes
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(kFullMask, before, o);
      if (lane >= o) before += x;
    }
    const int total = __shfl_sync(kFullMask, before, 31);
    int slot = count + before - mine;
    while (any != 0 && slot < kPageTokens) {
      const int bit = __ffs(any) - 1;
      any &= any - 1;
      const int pg = w * 32 + bit;
      state.pages[slot] = static_cast<uint16_t>(pg);
      state.weight[s][slot] = static_cast<uint8_t>(p.kv.pages[pg].n_valid);
      member_of[slot] = static_cast<uint8_t>((word[0] >> bit & 1u) | (word[1] >> bit & 1u) << 1);
      if (slot == kPageTokens - 1) next = pg + 1;
      ++slot;
    }
    count += total;
    next = __reduce_min_sync(kFullMask, static_cast<unsigned>(next));
  }
  count = count < kPageTokens ? count : kPageTokens;
  __syncwarp();
  unsigned long long member[2] = {0, 0};
  for (int half = 0; half < 2; ++half) {
    const int j = half * 32 + lane;
    const uint8_t m = j < count ? member_of[j] : 0;
    for (int c = 0; c < 2; ++c) member[c] |= static_cast<unsigned long long>(__ballot_sync(kFullMask, m >> c & 1)) << (32 * half);
  }
  if (lane == 0) {
    state.cursor = next;
    state.member[s][0] = member[0], state.member[s][1] = member[1];
    desc = PageDesc{};
    desc.n_valid = static_cast<uint16_t>(count);
    desc.format = static_cast<uint8_t>(PageFormat::kBf16);
    desc.reserved = kSyntheticPage;
  }
}

// All producer threads: the synthetic page's tiles from the bf16 statistics, 16 bytes per load, copied
// (rows past its count zero), and its key table (bf16 keys: a_j = c, b_j = 0).
template <int kDim, int kStages>
__device__ void BuildSyntheticTiles(const AttentionParams& p, int head, int count, const RoutedState<true, kStages>& state,
                                    uint8_t* k_tile, uint8_t* v_tile, float2* keys, float scale_log2, int ptid) {
  const ProducerUnits<kDim> u(ptid);
  using U = ProducerUnits<kDim>;
  const int64_t base = static_cast<int64_t>(head) * p.kv.n_pages * kDim;
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
    const int row = u.Row(r);
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      uint4 k8 = make_uint4(0, 0, 0, 0), v8 = make_uint4(0, 0, 0, 0);
      if (row < count) {
        const int64_t at = base + static_cast<int64_t>(state.pages[row]) * kDim + (b * 8 + u.c8) * 8;
        k8 = *reinterpret_cast<const uint4*>(p.route.mean_k + at);
        v8 = *reinterpret_cast<const uint4*>(p.route.v_sum + at);
      }
      *reinterpret_cast<uint4*>(k_tile + u.TileOffset(r, b)) = k8;
      *reinterpret_cast<uint4*>(v_tile + u.TileOffset(r, b)) = v8;
    }
  }
  if (ptid < kPageTokens) keys[ptid] = make_float2(scale_log2, 0.0f);
}

// A visible-list entry's page offset (the routed list carries group bits above it).
template <bool kRouted>
__device__ __forceinline__ int VisibleOffset(uint16_t entry) {
  if constexpr (kRouted) return entry & ((1 << kRoutedOffsetBits) - 1);
  return entry;
}

}  // namespace kvpack::cuda::sm90
