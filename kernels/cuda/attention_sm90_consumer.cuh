// The consumer warp groups of the sm90 attention kernel (MMA + softmax): each of the two groups owns
// 64 query rows; per visible page it computes S = Q·Kᵀ (wgmma, Q and K from shared memory), the logits
// from S and the page's key table, the masks (kernels/visibility.h) and the online softmax in registers,
// then O += P·V (wgmma, P from registers, V from shared memory). Internal to kernels/cuda: include only
// from attention_sm90.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_ptx.cuh"
#include "kernels/cuda/attention_sm90_shared.cuh"
#include "kernels/cuda/attention_sm90_tile.h"

namespace kvpack::cuda::sm90 {

// One consumer thread's state and steps. Warp w of consumer group c owns rows c·64 + w·16 + (g, g + 8)
// of the tile; fragments follow wgmma's accumulator layout: element (n, e) of a [64 × n·8] tile is row
// g + 8·(e / 2), column n·8 + 2t + (e mod 2).
template <class T>
struct Consumer {
  static constexpr int kDim = T::kDim;
  static constexpr int kONTiles = kDim / 8;  // 8-channel column groups of O
  const AttentionParams& p;
  SharedState<T>& sh;
  uint8_t* smem;
  int64_t t0;             // token (= position) of the tile's first query
  int consumer;           // 0, 1
  int warp_in_group, g, t;
  int row_base;           // this warp's first row in the tile
  float o[kONTiles][4];   // O rows (g, g+8) × channels (n·8 + 2t, +1)
  float row_max[2], row_sum[2];
  float q_sum[2];         // Σ_c q_c of rows g and g + 8 (the key table's b_j term)
  uint32_t full_phase;    // bit s: the parity of tile_full[s]'s next completion
  float s_cur[8][4];      // S rows (g, g+8) × keys (n·8 + 2t, +1)
  uint32_t a[4][4];       // P as the A fragments of the four 16-key steps of P·V

  __device__ Consumer(const AttentionParams& params, SharedState<T>& shared, uint8_t* smem_base, int64_t first_token,
                      int tid)
      : p(params), sh(shared), smem(smem_base), t0(first_token) {
    const int lane = tid & 31;
    warp_in_group = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    consumer = (tid >> 7) - T::kProducerGroups;
    row_base = consumer * T::kGroupRows + warp_in_group * 16;
#pragma unroll
    for (int n = 0; n < kONTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    row_max[0] = row_max[1] = -INFINITY, row_sum[0] = row_sum[1] = 0.0f;
    full_phase = 0;
    SumQueryRows();
  }

  // q_sum from the bf16 Q the MMAs read: the four threads of a row pair each add a quarter of the channels.
  __device__ __forceinline__ void SumQueryRows() {
    constexpr int kUnitsPerRow = kDim / 8;  // 16-byte chunks per bf16 row
    const uint8_t* q_rows = smem + consumer * (T::kQBytes / 2);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_in_group * 16 + g + 8 * r;
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kUnitsPerRow / 4; ++c) {
        const uint4 v = *reinterpret_cast<const uint4*>(q_rows + SwizzledOffset<T::kGroupRows>(row, t * (kUnitsPerRow / 4) + c));
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) sum += __uint_as_float(w[k] << 16) + __uint_as_float(w[k] & 0xffff0000u);
      }
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      q_sum[r] = sum + __shfl_xor_sync(kFullMask, sum, 2);
    }
  }

  // S[64 × 64] = Q[64 × d] · Kᵀ[d × 64] of visible page i, once the producer has filled its stage;
  // k-step kc reads 32 bytes into a 128-byte swizzled row. `wait` = false re-issues a page the group
  // already holds (the last page's S(i+1): a wasted 1/n_visible of the MMAs, so that no wgmma sits in a
  // branch, which would serialise them all).
  __device__ __forceinline__ void IssueS(float (&sc)[8][4], int i, bool wait) {
    const uint64_t q_desc = Desc(SmemAddr(smem + consumer * (T::kQBytes / 2)), 16, 1024);  // this group's Q [64 × d]
    const uint64_t k_desc = Desc(SmemAddr(smem + T::kKOffset + (i % T::kStages) * T::kTileBytes), 16, 1024);
    if (wait) {
      const int s = i % T::kStages;
      MbarWait(SmemAddr(&sh.tile_full[s]), (full_phase >> s) & 1u);
      full_phase ^= 1u << s;
    }
    FenceRegs(sc);
    WgmmaFence();
#pragma unroll
    for (int kc = 0; kc < kDim / 16; ++kc) {
      const uint32_t off = (kc >> 2) * (kPageTokens * 128) + (kc & 3) * 32;
      WgmmaSS64(sc, q_desc + (off >> 4), k_desc + (off >> 4), kc > 0);
    }
    WgmmaCommit();
  }

  // The key table of page i (keys n·8 + 2t and + 1), read ahead of the S wait.
  __device__ __forceinline__ void LoadKeys(float4 (&keys)[8], int i) {
#pragma unroll
    for (int n = 0; n < 8; ++n) keys[n] = sh.key_table[i % T::kStages][n * 4 + t];
  }

  // Logits of page i from S and the key table (S holds Q·Kᵀ over the tile as stored), masks and the
  // online softmax (log2 domain, rows g and g + 8): sc becomes P, unrounded; corr rescales O.
  __device__ __forceinline__ void Softmax(float (&sc)[8][4], const float4 (&keys)[8], int i, float (&corr)[2]) {
    const PageDesc page = sh.tile_desc[i % T::kStages];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float a_j = e & 1 ? keys[n].z : keys[n].x, b_j = e & 1 ? keys[n].w : keys[n].y;
        sc[n][e] = fmaf(sc[n][e], a_j, q_sum[e >> 1] * b_j);
      }
    }
    if (p.visibility.PageNeedsMask(page, sh.runs.n == 1, t0)) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row_base + g + (e >> 1) * 8;
          if (!p.visibility.KeyVisible(page, n * 8 + 2 * t + (e & 1), sh.runs.q_seq[row], t0 + row)) sc[n][e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(row_max[r], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row so far
      corr[r] = Exp2Ftz(row_max[r] - m_use);
      row_max[r] = m_new;
      row_sum[r] *= corr[r];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          if constexpr (kSm90Experiment == Sm90Experiment::kNoExp) {
            sc[n][e] = sc[n][e] - m_use;  // timing only
          } else {
            sc[n][e] = Exp2Ftz(sc[n][e] - m_use);
          }
          row_sum[r] += sc[n][e];
        }
      }
    }
  }

  // O is rescaled only when some row of the warp has a new maximum (after the first pages almost
  // never; ×1 would change no bit).
  __device__ __forceinline__ void RescaleO(const float (&corr)[2]) {
    if (__any_sync(kFullMask, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
      for (int n = 0; n < kONTiles; ++n) o[n][0] *= corr[0], o[n][1] *= corr[0], o[n][2] *= corr[1], o[n][3] *= corr[1];
    }
  }

  // P as bf16 A fragments: k-step kk of P·V takes keys kk·16 … +15 (two 8-key row groups).
  __device__ __forceinline__ void PackP(const float (&sc)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      a[kk][0] = PackBf16(sc[2 * kk][0], sc[2 * kk][1]);
      a[kk][1] = PackBf16(sc[2 * kk][2], sc[2 * kk][3]);
      a[kk][2] = PackBf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      a[kk][3] = PackBf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
  }

  // O[64 × d] += P[64 × 64] · V[64 × d] of page i, one commit group.
  __device__ __forceinline__ void IssuePv(int i) {
    const uint64_t v_desc = Desc(SmemAddr(smem + T::kVOffset + (i % T::kStages) * T::kTileBytes), kPageTokens * 128, 1024);
    FenceRegs(o);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) WgmmaRS(o, a[kk], v_desc + kk * (2048 >> 4));
    WgmmaCommit();
  }

  // Deep ring: at the top of step i, P(i) is in `a` and O is scaled to page i's row maxima. The group
  // issues S(i+1) and P(i)·V back to back, then computes the softmax of page i + 1 while P(i)·V runs.
  // With kPingPong the two consumer groups take turns to issue (kTurnBar), so that one group's softmax
  // runs while the other's MMAs occupy the tensor cores (FlashAttention-3's ping-pong).
  __device__ __forceinline__ void RunDeepRing(int n_visible) {
    const int turn = T::kTurnBar + consumer, other_turn = T::kTurnBar + (consumer ^ 1);
    float corr[2];
    float4 keys[8];
    IssueS(s_cur, 0, true);
    LoadKeys(keys, 0);
    WgmmaWait<0>();
    FenceRegs(s_cur);
    Softmax(s_cur, keys, 0, corr);
    PackP(s_cur);
    if (T::kPingPong && consumer == 1) BarArrive(T::kTurnBar, 2 * 128);  // group 0 issues first
    for (int i = 0; i < n_visible; ++i) {
      const bool more = i + 1 < n_visible;
      if (T::kPingPong) BarSync(turn, 2 * 128);
      IssueS(s_cur, more ? i + 1 : i, more);
      IssuePv(i);
      if (T::kPingPong && (consumer == 0 || more)) BarArrive(other_turn, 2 * 128);
      LoadKeys(keys, more ? i + 1 : i);
      WgmmaWait<1>();
      FenceRegs(s_cur);
      if (more) Softmax(s_cur, keys, i + 1, corr);
      WgmmaWait<0>();
      FenceRegs(o);
      FenceRegs(a);
      if (i + T::kStages < n_visible) BarArrive(T::kEmptyBar + i % T::kStages, T::kThreads);
      if (more) {
        RescaleO(corr);
        PackP(s_cur);
      }
    }
  }

  // Two stages: the producer needs page i − 1's stage back before it can fill page i + 1's, so every
  // MMA is waited for first (which hands page i − 1 back), the softmax of page i runs while the producer
  // decodes page i + 1, and S(i+1) goes in behind P(i)·V. (A wait for all MMAs where only P(i−1)·V is
  // needed costs little: a group's MMAs run in order.)
  __device__ __forceinline__ void TwoStageStep(int i, int n_visible, float (&sc)[8][4], float (&s_other)[8][4]) {
    float4 keys[8];
    LoadKeys(keys, i);
    WgmmaWait<0>();
    FenceRegs(o);
    FenceRegs(sc);
    FenceRegs(a);
    if (i > 0 && i - 1 + T::kStages < n_visible) BarArrive(T::kEmptyBar + (i - 1) % T::kStages, T::kThreads);
    float corr[2];
    Softmax(sc, keys, i, corr);
    RescaleO(corr);
    PackP(sc);
    IssuePv(i);
    if (i + 1 < n_visible) IssueS(s_other, i + 1, true);
  }
  __device__ __forceinline__ void RunTwoStage(int n_visible) {
    float s_next[8][4];  // the second S tile
    IssueS(s_cur, 0, true);
    int i = 0;
    for (; i + 1 < n_visible; i += 2) {  // the two S tiles alternate (unrolled by two: they stay registers)
      TwoStageStep(i, n_visible, s_cur, s_next);
      TwoStageStep(i + 1, n_visible, s_next, s_cur);
    }
    if (i < n_visible) TwoStageStep(i, n_visible, s_cur, s_next);
  }

  // Every visible page of one window, then every MMA waited for.
  __device__ __forceinline__ void ConsumeWindow(int n_visible) {
    if constexpr (T::kDeepRing) {
      RunDeepRing(n_visible);
    } else {
      RunTwoStage(n_visible);
    }
    WgmmaWait<0>();
    FenceRegs(o);
  }
};

}  // namespace kvpack::cuda::sm90
