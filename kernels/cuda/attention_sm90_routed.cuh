// The routed (block-sparse) instance's pieces of the wgmma kernel (attention_sm90.cu, sparse.h): its
// shared state, the routed page list of a window, and the synthetic pages of the pooled pass.
// Internal to kernels/cuda: include only from attention_sm90.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_pages.cuh"

namespace kvpack::cuda::sm90 {

// ── The routed (block-sparse) instance (sparse.h) ───────────────────────────────────────────────
// A CTA takes one query block of the launch: block blockIdx.x, led by page route.leads[blockIdx.x]
// (its routing in slot = that page − first_page; no CTA runs for a partner page's slot), consumer
// group c the queries of the block's page c (none for c = 1 where the block has one page). Both
// groups walk one routed page list — the block's exact pages — through the dense kernel's pipeline.
// The last window's pipeline then goes on, without a drain, with the pooled pages as synthetic pages
// (PageDesc::reserved = kSyntheticPage): synthetic page i is the slice of pages 64·i … 64·i + 63 of the
// head, its K rows their mean keys and its V rows their V sums (the stored bf16 statistics, [H, P, d],
// so a slice is contiguous), copied by the producers straight into the tiles (on the INT8 MMA path
// K from the mean keys' int8 codes, AttentionParams::Route::mean_codes); key j counts n_j tokens
// in the softmax sum (weight) and is masked where the block does not pool its page. Slices that the
// block does not pool are skipped. (Compacting the pooled pages instead, as session 8 did, took one
// warp's serial scan and a dependent descriptor load per pooled page: a synthetic page cost ~7 exact
// ones on H3.)
inline constexpr uint32_t kSyntheticPage = 4;

template <bool kRouted, int kStages>
struct RoutedState {
  unsigned long long member[kStages];     // synthetic page of stage s: key j pooled by the block
  uint8_t weight[kStages][kPageTokens];   // its keys' token counts
  int n_synthetic;                        // slices that the block pools
  int64_t q0[2];                          // per consumer group: launch row of its page's first query,
  int64_t t0[2];                          // its token (position),
  int rows[2];                            // its queries (0: the block has no second page)
};
template <int kStages>
struct RoutedState<false, kStages> {};
// Synthetic pages that follow the exact ones in the last window (none for a dense launch).
template <int kStages>
__device__ __forceinline__ int SyntheticPages(const RoutedState<true, kStages>& state) { return state.n_synthetic; }
template <int kStages>
__device__ __forceinline__ int SyntheticPages(const RoutedState<false, kStages>&) { return 0; }

// The routed twin of CollectVisiblePages: pages of [w0, w0 + wn) that the CTA's block attends exactly,
// in page order. Same barriers.
template <int kThreads, int kWindow>
__device__ int CollectRoutedPages(const AttentionParams& p, int slot, int head, int w0, int wn,
                                  VisibleScratch<kThreads, kWindow>& scratch) {
  constexpr int kPerThread = kWindow / kThreads;
  const int tid = threadIdx.x;
  const AttentionParams::Route& route = p.route;
  const uint32_t* bits = route.exact_bits + (static_cast<int64_t>(slot) * p.kv.n_heads + head) * route.words;
  uint32_t mine = 0;  // bit i: page tid·kPerThread + i is routed
  int count = 0;
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = tid * kPerThread + i;
    if (idx >= wn) break;
    const int pg = w0 + idx;
    if (bits[pg >> 5] >> (pg & 31) & 1u) mine |= 1u << i, ++count;
  }
  int pos = VisibleSlot(scratch, tid, count);
  for (int i = 0; i < kPerThread; ++i) {
    if (mine >> i & 1u) scratch.visible[pos++] = static_cast<uint16_t>(tid * kPerThread + i);
  }
  const int n_visible = scratch.n_visible;
  __syncthreads();
  return n_visible;
}

// The pooled bits of the block whose routing is in `slot`, for one head.
struct PooledBits {
  const uint32_t* bits;
  int words;
  __device__ PooledBits(const AttentionParams& p, int slot, int head)
      : bits(p.route.pooled_bits + (static_cast<int64_t>(slot) * p.kv.n_heads + head) * p.route.words),
        words(p.route.words) {}
  // Bit j: page 64·slice + j is pooled.
  __device__ unsigned long long Slice(int slice) const {
    const int w = 2 * slice;
    const unsigned long long hi = w + 1 < words ? bits[w + 1] : 0u;
    return bits[w] | hi << 32;
  }
  __device__ bool Pooled(int slice) const { return Slice(slice) != 0; }
};

// The number of slices that the block pools; every thread of the CTA calls it (its barrier).
__device__ __forceinline__ int CountPooledSlices(const AttentionParams& p, int slot, int head, int& shared_count) {
  const PooledBits pooled(p, slot, head);
  const int n_slices = (p.kv.n_pages + kPageTokens - 1) / kPageTokens;
  int mine = 0;
  for (int i = threadIdx.x; i < n_slices; i += blockDim.x) mine += pooled.Pooled(i);
  if (threadIdx.x == 0) shared_count = 0;
  __syncthreads();
  if (mine) atomicAdd(&shared_count, mine);
  __syncthreads();
  return shared_count;
}

// The first slice at or after `slice` that the block pools (every producer thread finds the same).
__device__ __forceinline__ int NextPooledSlice(const PooledBits& pooled, int n_pages, int slice) {
  const int n_slices = (n_pages + kPageTokens - 1) / kPageTokens;
  while (slice < n_slices && !pooled.Pooled(slice)) ++slice;
  return slice;
}

// All producer threads: synthetic page `slice` into stage s — its tiles copied from the bf16
// statistics by 16-byte asynchronous copies (rows past the slice's pages zero-filled; on the INT8 MMA
// path K from the mean keys' int8 codes, in the int8 tile's layout: Int8KUnits), its key table (bf16
// keys: a_j = c, b_j = 0; int8 codes: a_j = s_k·c), weights, member mask and descriptor. The tiles are
// complete for the wgmma once every producer thread has passed its wait and proxy fence.
template <int kDim, int kStages, bool kInt8Qk>
__device__ void BuildSyntheticPage(const AttentionParams& p, int head, const PooledBits& pooled, int slice, int s,
                                   RoutedState<true, kStages>& state, PageDesc& desc, uint8_t* k_tile,
                                   uint8_t* v_tile, float2* keys, float scale_log2, int ptid) {
  using U = ProducerUnits<kDim>;
  const U u(ptid);
  const int first = slice * kPageTokens;
  const int count = p.kv.n_pages - first < kPageTokens ? p.kv.n_pages - first : kPageTokens;
  const int64_t at = (static_cast<int64_t>(head) * p.kv.n_pages + first) * kDim;
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
    const int row = u.Row(r) < count ? u.Row(r) : 0, bytes = u.Row(r) < count ? 16 : 0;
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      const int64_t unit = at + row * kDim + (b * 8 + u.c8) * 8;
      if constexpr (!kInt8Qk) CpAsync16Fill(k_tile + u.TileOffset(r, b), p.route.mean_k + unit, bytes);
      CpAsync16Fill(v_tile + u.TileOffset(r, b), p.route.v_sum + unit, bytes);
    }
  }
  if constexpr (kInt8Qk) {
    using KU = Int8KUnits<kDim>;
    const KU ku(ptid);
#pragma unroll
    for (int r = 0; r < KU::kRowSteps; ++r) {
      const int row = ku.Row(r) < count ? ku.Row(r) : 0, bytes = ku.Row(r) < count ? 16 : 0;
      CpAsync16Fill(k_tile + ku.TileOffset(r), p.route.mean_codes + at + row * kDim + ku.chunk * 16, bytes);
    }
  }
  CpAsyncCommit();
  if (ptid < kPageTokens) {
    const float a = kInt8Qk && ptid < count ? p.route.mean_scales[at / kDim + ptid] : 1.0f;
    keys[ptid] = make_float2(a * scale_log2, 0.0f);
    state.weight[s][ptid] = ptid < count ? static_cast<uint8_t>(p.kv.pages[first + ptid].n_valid) : 0;
  }
  if (ptid == 0) {
    const unsigned long long valid = count == kPageTokens ? ~0ull : (1ull << count) - 1;
    state.member[s] = pooled.Slice(slice) & valid;
    desc = PageDesc{};
    desc.n_valid = static_cast<uint16_t>(count);
    desc.format = static_cast<uint8_t>(PageFormat::kBf16);
    desc.reserved = kSyntheticPage;
  }
  CpAsyncWait<0>();
}

}  // namespace kvpack::cuda::sm90
