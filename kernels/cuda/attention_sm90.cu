// Attention over packed pages on Hopper's asynchronous warp-group MMA (wgmma, sm_90a), warp-specialised.
//
// A CTA of four warp groups takes one tile of kTileQueries = 128 query rows of one head:
//   warp groups 0 and 1, the producers (56 registers each after setmaxnreg): bulk-copy the raw bytes
//     of the visible pages into a ring of 3 to 6 raw stages (Sm90RawStages) and decode each page's K and V into a
//     ring of kStages bf16 tiles laid out as wgmma reads them (attention_sm90_pages.cuh);
//   warp groups 2 and 3, the consumers (200 registers), 64 query rows each: S = Q·Kᵀ (wgmma, Q and K
//     from shared memory), logits from S and the key table, masks and the online softmax in
//     registers, O += P·V (wgmma, P from registers, V from shared memory), then the epilogue of
//     attention_device.cuh (Rᵀ, +μ_v, bf16 store). With the deep ring a group issues S of the next
//     page and P·V of this one together and computes the next softmax under them, the two groups
//     taking turns to issue (kTurnBar), so that one's softmax runs under the other's MMAs.
// The tiles change hands through tile_full[s] (an mbarrier: every producer thread arrives, each consumer
// waits on its own) and the named barrier kEmptyBar + s (consumers arrive, producers wait); kTurnBar + c
// orders the consumer groups' MMA issues. Tile configuration: attention_sm90_tile.h; PTX wrappers:
// attention_sm90_ptx.cuh; the INT8 path's Q tile: attention_sm90_int8.cuh.
//
// The roles' loops stay in this one kernel function on purpose: a split into a producer function and
// a consumer struct (commit bcacd65, bit-identical outputs) measured 7–9% slower over INT4 and INT8
// pages in the same run, with the same SASS in both hot loops (bench/RESULTS.md, session 5); it went
// back to this form until the cause is known.
#include "kernels/cuda/attention_sm90.h"

#include <type_traits>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_int8.cuh"
#include "kernels/cuda/attention_sm90_pages.cuh"
#include "kernels/cuda/attention_sm90_ptx.cuh"
#include "kernels/cuda/attention_sm90_routed.cuh"
#include "kernels/cuda/attention_sm90_tile.h"
#include "kernels/cuda/cuda_status.h"

namespace kvpack::cuda {
namespace {

using namespace sm90;

template <int kDim, int kStages, bool kInt8Qk, bool kRouted>
__global__ void __launch_bounds__(Sm90Tile<kDim, kStages, kInt8Qk>::kThreads, 1) AttentionSm90Kernel(const AttentionParams p) {
  using T = Sm90Tile<kDim, kStages, kInt8Qk>;
  using SAcc = std::conditional_t<kInt8Qk, uint32_t, float>;  // S accumulator registers
  static_assert(T::kProducerThreads == kProducerThreads, "DecodePage's thread layout");
  constexpr int kUnitsPerRow = kDim / 8;  // 16-byte chunks per bf16 row
  constexpr int kONTiles = kDim / 8;      // 8-channel column groups of O
  extern __shared__ uint8_t smem_raw[];
  __shared__ QueryRuns runs;
  __shared__ VisibleScratch<T::kThreads, T::kWindow> scratch;
  __shared__ PageDesc raw_desc[T::kMaxRawStages], tile_desc[T::kStages];
  __shared__ uint64_t raw_full[T::kMaxRawStages];  // mbarriers: raw stage filled
  __shared__ uint64_t tile_full[T::kStages];    // mbarriers: decoded stage filled (every producer arrives)
  __shared__ uint32_t bf16_exponent;             // kBf16Exponent, see Int4CodesPlus128
  __shared__ float4 key_table[T::kStages][kPageTokens / 2];  // (a_j, b_j, a_j+1, b_j+1): DecodePage
  __shared__ Int8QueryRows<kInt8Qk> q_rows_int8;
  __shared__ RoutedState<kRouted, kStages> routed;
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  uint8_t* smem = smem_raw + ((T::kAlign - (SmemAddr(smem_raw) & (T::kAlign - 1))) & (T::kAlign - 1));
  uint8_t* raw = smem + T::kRawOffset;

  // ── Preconditions and prologue ──────────────────────────────────────────────────────────────
  const int tid = threadIdx.x, lane = tid & 31;
  const int group = tid >> 7;  // 0, 1: producers; 2, 3: consumers
  const int head = blockIdx.y;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTileQueries;  // first query of the tile
  const int n_rows = static_cast<int>(p.n_q - q0 < kTileQueries ? p.n_q - q0 : kTileQueries);
  const int64_t t0 = p.q_token_begin + q0;  // its token index (= position)
  const int n_pages = p.kv.n_pages;
  // Routed: the CTA's block (route.leads[blockIdx.x]) and its routing's slot.
  [[maybe_unused]] int slot = 0;

  if constexpr (kRouted) {  // consumer group c: page c of the block, its rows from its first query
    const int lead = p.route.leads[blockIdx.x];
    slot = lead - p.route.first_page;
    if (tid < 2) {
      const bool has = tid < QueryBlockPages(p.kv.pages, n_pages, lead);
      const PageDesc page = has ? p.kv.pages[lead + tid] : PageDesc{};
      routed.t0[tid] = page.token_begin;
      routed.q0[tid] = page.token_begin - p.q_token_begin;
      routed.rows[tid] = has ? page.n_valid : 0;
    }
    CountPooledSlices(p, slot, head, routed.n_synthetic);  // its barriers publish the blocks' rows too
    if constexpr (kInt8Qk) {
      QuantizeQueryTile<T>(p, routed.q0, routed.rows, head, smem, q_rows_int8);
    } else {
      for (int u = tid; u < kTileQueries * kUnitsPerRow; u += T::kThreads) {
        const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow, c = r / T::kGroupRows, rr = r % T::kGroupRows;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (rr < routed.rows[c]) v = *reinterpret_cast<const uint4*>(p.q + (routed.q0[c] + rr) * p.q_stride + head * kDim + c8 * 8);
        *reinterpret_cast<uint4*>(smem + c * (T::kQBytes / 2) + SwizzledOffset<T::kGroupRows>(rr, c8)) = v;
      }
    }
  } else if constexpr (kInt8Qk) {
    const int64_t group_q0[2] = {q0, q0 + T::kGroupRows};
    const int group_rows[2] = {n_rows < T::kGroupRows ? n_rows : T::kGroupRows,
                               n_rows > T::kGroupRows ? n_rows - T::kGroupRows : 0};
    QuantizeQueryTile<T>(p, group_q0, group_rows, head, smem, q_rows_int8);
  } else {
    for (int u = tid; u < kTileQueries * kUnitsPerRow; u += T::kThreads) {  // Q [2][64][d] → swizzled smem
      const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < n_rows) v = *reinterpret_cast<const uint4*>(p.q + (q0 + r) * p.q_stride + head * kDim + c8 * 8);
      *reinterpret_cast<uint4*>(smem + (r / T::kGroupRows) * (T::kQBytes / 2) + SwizzledOffset<T::kGroupRows>(r % T::kGroupRows, c8)) = v;
    }
  }
  if (tid == 0) {
    bf16_exponent = kBf16Exponent;
    for (int st = 0; st < T::kMaxRawStages; ++st) MbarInit(SmemAddr(&raw_full[st]), 1);
    for (int st = 0; st < T::kStages; ++st) MbarInit(SmemAddr(&tile_full[st]), T::kProducerThreads);
    MbarInitFence();
  }
  FenceProxyAsync();
  if constexpr (kRouted) {
    __syncthreads();  // Q and the mbarriers (the routed instance reads no query runs)
  } else {
    FindQueryRuns<T::kThreads>(p, t0, n_rows, runs);  // its barriers also publish Q and the mbarriers
  }

  // ── Main loop: windows of pages; in each, the producer/consumer pipeline over the visible pages ──
  // Each role runs its own copy of the window loop, so that the code after setmaxnreg belongs to one
  // role only (the register counts of the two differ). Both meet at the same CTA barriers.
  if (group < T::kProducerGroups) {
    SetMaxRegisters<T::kProducerRegisters, false>();
    uint32_t raw_phase = 0;  // bit st: the parity of raw stage st's next completion
    const uint32_t exponent = bf16_exponent;
    const int n_raw = Sm90RawStages<kDim, kStages, kInt8Qk>(p.max_page_bytes);  // the launch sized for these
    for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
      const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
      int n_visible;
      if constexpr (kRouted) {
        n_visible = CollectRoutedPages(p, slot, head, w0, wn, scratch);
      } else {
        n_visible = CollectVisiblePages(p, runs, w0, wn, scratch);
      }
      // Routed: the last window's pipeline goes on after its exact pages with the pooled slices.
      const int n_total = n_visible + (kRouted && w0 + T::kWindow >= n_pages ? SyntheticPages(routed) : 0);
      if (n_total > 0) {
        // Producers: raw page i+2 arrives while page i is decoded into tile stage i mod kStages. Thread 0
        // reads each page's source one page ahead, starts its bulk copies, and hands its descriptor on
        // through shared memory: raw_desc[raw stage] to the decode, tile_desc[stage] to the consumers.
        const int stage_bytes = 2 * p.max_page_bytes;
        PageSource source;
        auto issue = [&](int j) {  // thread 0: page j's copies, then the source of page j + 1
          const int st = j % n_raw;
          IssuePageCopy<kDim>(p.kv.pool, source, raw + st * stage_bytes, p.max_page_bytes, SmemAddr(&raw_full[st]));
          raw_desc[st] = source.desc;
          if (j + 1 < n_visible) source = FetchPageSource(p, head, w0 + scratch.visible[j + 1]);
        };
        if (tid == 0 && n_visible > 0) {
          source = FetchPageSource(p, head, w0 + scratch.visible[0]);
          for (int j = 0; j < n_raw - 1 && j < n_visible; ++j) issue(j);
        }
        [[maybe_unused]] int slice = -1;  // routed: the pooled slice of the last synthetic page
        for (int i = 0; i < n_total; ++i) {
          if constexpr (kRouted) {
            if (i >= n_visible) {  // a synthetic page: the next slice that the block pools, built into the tiles
              const PooledBits pooled(p, slot, head);
              slice = NextPooledSlice(pooled, n_pages, slice + 1);
              const int s = i % T::kStages;
              if (i >= T::kStages) BarSync(T::kEmptyBar + s, T::kThreads);
              BuildSyntheticPage<kDim, kStages, kInt8Qk>(p, head, pooled, slice, s, routed, tile_desc[s],
                                                         smem + T::kKOffset + s * T::kKTileBytes,
                                                         smem + T::kVOffset + s * T::kTileBytes,
                                                         reinterpret_cast<float2*>(key_table[s]), scale_log2, tid);
              FenceProxyAsync();
              MbarArrive(SmemAddr(&tile_full[s]));
              continue;
            }
          }
          BarSync(T::kProducerBar, T::kProducerThreads);  // everyone has decoded page i − 1: its stage is free
          const int next = i + n_raw - 1;
          if (tid == 0 && next < n_visible) issue(next);
          const int st = i % n_raw;
          MbarWait(SmemAddr(&raw_full[st]), (raw_phase >> st) & 1u);
          raw_phase ^= 1u << st;
          const int s = i % T::kStages;
          if (i >= T::kStages) BarSync(T::kEmptyBar + s, T::kThreads);  // consumers are done with page i − kStages
          const PageDesc page = raw_desc[st];
          uint8_t* k_tile = smem + T::kKOffset + s * T::kKTileBytes;
          uint8_t* v_tile = smem + T::kVOffset + s * T::kTileBytes;
          float2* keys = reinterpret_cast<float2*>(key_table[s]);
          if constexpr (kSm90Experiment == Sm90Experiment::kNoDecode) {  // timing only: the key table alone
            if (tid < kPageTokens) keys[tid] = make_float2(scale_log2, 0.0f);
          } else if constexpr (kInt8Qk) {
            DecodePageInt8Qk<kDim>(page, raw + st * stage_bytes, p.max_page_bytes, k_tile, v_tile, keys, scale_log2,
                                   exponent, tid);
          } else {
            DecodePage<kDim>(page, raw + st * stage_bytes, p.max_page_bytes, k_tile, v_tile, keys, scale_log2, exponent,
                             tid);
          }
          if (tid == 0) tile_desc[s] = page;
          FenceProxyAsync();
          MbarArrive(SmemAddr(&tile_full[s]));
        }
      }
      __syncthreads();  // the consumers are done with the tiles before the next window
    }
    return;
  }
  SetMaxRegisters<T::kConsumerRegisters, true>();
  // Consumer state: warp w of consumer group c owns rows c·64 + w·16 + (g, g + 8).
  const int warp_in_group = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
  const int consumer = group - T::kProducerGroups;
  const int row_base = consumer * T::kGroupRows + warp_in_group * 16;
  float o[kONTiles][4];  // O rows (g, g+8) × channels (n·8 + 2t, +1)
#pragma unroll
  for (int n = 0; n < kONTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  // Σ_c q_c of rows g and g + 8 (the key table's b_j term), from the bf16 Q the MMAs read: the four
  // threads of a row pair each add a quarter of the channels. On the INT8 path Σq̂ / s_q and s_q, by which
  // the exponent's argument is scaled (row_scale; 1 on the bf16 path), from QuantizeQueryTile.
  float q_sum[2], row_scale[2] = {1.0f, 1.0f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if constexpr (kInt8Qk) {
      const int row = row_base + g + 8 * r;
      q_sum[r] = q_rows_int8.sum_over_scale[row];
      row_scale[r] = q_rows_int8.scale[row];
      continue;
    }
    const uint8_t* q_rows = smem + consumer * (T::kQBytes / 2);
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
  uint32_t full_phase = 0;  // bit s: the parity of tile_full[s]'s next completion
  // The routed instance: this group's page of the block (its first token; its rows start at row_base's group).
  int64_t group_t0 = 0;
  if constexpr (kRouted) group_t0 = routed.t0[consumer];
  for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
    const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
    int n_visible;
    if constexpr (kRouted) {
      n_visible = CollectRoutedPages(p, slot, head, w0, wn, scratch);
      if (w0 + T::kWindow >= n_pages) n_visible += SyntheticPages(routed);  // the producers' n_total
    } else {
      n_visible = CollectVisiblePages(p, runs, w0, wn, scratch);
    }
    if (n_visible > 0) {
      // Consumers. Descriptors step by adding (byte offset >> 4) to their address field: shared
      // addresses stay below 2^18, so the 14-bit field never carries.
      const uint64_t q_desc = Desc(SmemAddr(smem + consumer * (T::kQBytes / 2)), 16, 1024);
      SAcc s_cur[8][4];  // S rows (g, g+8) × keys (n·8 + 2t, +1)
      uint32_t a[4][4];   // P as the A fragments of the four 16-key steps of P·V
      // S[64 × 64] = Q[64 × d] · Kᵀ[d × 64] of visible page i, once the producer has filled its stage;
      // k-step kc reads 32 bytes into a 128-byte swizzled row.
      // `wait` = false re-issues a page the group already holds (the last page's S(i+1): a wasted
      // 1/n_visible of the MMAs, so that no wgmma sits in a branch, which would serialise them all).
      // The INT8 path: k-step kc reads 32 int8 channels, the same 32 bytes into the row.
      // Waits for visible page i's fill (every group waits for every page, in order: the stage phases).
      auto wait_full = [&](int i) {
        const int s = i % T::kStages;
        MbarWait(SmemAddr(&tile_full[s]), (full_phase >> s) & 1u);
        full_phase ^= 1u << s;
      };
      // Hands page i's stage back, where the producer will wait for it (page i + kStages exists).
      auto release = [&](int i) {
        if (i + T::kStages < n_visible) BarArrive(T::kEmptyBar + i % T::kStages, T::kThreads);
      };
      auto issue_s = [&](SAcc (&sc)[8][4], int i, bool wait) {
        const uint64_t k_desc = Desc(SmemAddr(smem + T::kKOffset + (i % T::kStages) * T::kKTileBytes), 16, 1024);
        if (wait) wait_full(i);
        FenceRegs(sc);
        WgmmaFence();
        if constexpr (kInt8Qk) {
#pragma unroll
          for (int kc = 0; kc < kDim / 32; ++kc) WgmmaSS64Int8(sc, q_desc + kc * 2, k_desc + kc * 2, kc > 0);
        } else {
#pragma unroll
          for (int kc = 0; kc < kDim / 16; ++kc) {
            const uint32_t off = (kc >> 2) * (kPageTokens * 128) + (kc & 3) * 32;
            WgmmaSS64(sc, q_desc + (off >> 4), k_desc + (off >> 4), kc > 0);
          }
        }
        WgmmaCommit();
      };
      // The key table of page i (keys n·8 + 2t and + 1), read ahead of the S wait.
      auto load_keys = [&](float4 (&keys)[8], int i) {
#pragma unroll
        for (int n = 0; n < 8; ++n) keys[n] = key_table[i % T::kStages][n * 4 + t];
      };
      // Logits of page i from S and the key table (S holds Q·Kᵀ over the tile as stored), masks and the
      // online softmax (log2 domain, rows g and g + 8): sc becomes P, unrounded; corr rescales O.
      // On the INT8 path sc holds the logits divided by s_q (row_scale) until the exponent.
      auto softmax = [&](SAcc (&sc)[8][4], const float4 (&keys)[8], int i, float (&corr)[2]) {
        const PageDesc page = tile_desc[i % T::kStages];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float a_j = e & 1 ? keys[n].z : keys[n].x, b_j = e & 1 ? keys[n].w : keys[n].y;
            SetFloat(sc[n][e], fmaf(AccumulatorValue(sc[n][e]), a_j, q_sum[e >> 1] * b_j));
          }
        }
        // Masks: invalid slots, other sequences, future keys (causal).
        bool weighted = false;  // a synthetic page: key j stands for weight[j] tokens in the sum
        if constexpr (kRouted) {
          const int row_in_group = warp_in_group * 16 + g;
          if (page.reserved & kSyntheticPage) {
            weighted = true;
            const unsigned long long member = routed.member[i % T::kStages];
#pragma unroll
            for (int n = 0; n < 8; ++n) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                if (!(member >> (n * 8 + 2 * t + (e & 1)) & 1ull)) SetFloat(sc[n][e], -INFINITY);
              }
            }
          } else if (page.n_valid < kPageTokens || (p.visibility.causal && page.token_begin + page.n_valid - 1 > group_t0)) {
#pragma unroll
            for (int n = 0; n < 8; ++n) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int key = n * 8 + 2 * t + (e & 1);
                const bool ok = key < page.n_valid &&
                                (!p.visibility.causal || page.token_begin + key <= group_t0 + row_in_group + (e >> 1) * 8);
                if (!ok) SetFloat(sc[n][e], -INFINITY);
              }
            }
          }
        }
        const bool need_mask = !kRouted && (page.n_valid < kPageTokens || runs.n > 1 ||
                                            (p.visibility.causal && page.token_begin + page.n_valid - 1 > t0));
        if (need_mask) {
#pragma unroll
          for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = row_base + g + (e >> 1) * 8;
              const int key = n * 8 + 2 * t + (e & 1);
              const bool ok = key < page.n_valid && runs.q_seq[row] == page.seq_id &&
                              (!p.visibility.causal || page.token_begin + key <= t0 + row);
              if (!ok) SetFloat(sc[n][e], -INFINITY);
            }
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(AsFloat(sc[n][2 * r]), AsFloat(sc[n][2 * r + 1])));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
          const float m_new = fmaxf(row_max[r], mx * row_scale[r]);  // s_q > 0 keeps the order
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row so far
          corr[r] = Exp2Ftz(row_max[r] - m_use);
          row_max[r] = m_new;
          row_sum[r] *= corr[r];
#pragma unroll
          for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              const float arg = fmaf(AsFloat(sc[n][e]), row_scale[r], -m_use);
              const float w = kSm90Experiment == Sm90Experiment::kNoExp ? arg : Exp2Ftz(arg);  // noexp: timing only
              SetFloat(sc[n][e], w);
              row_sum[r] += w;
            }
          }
          if constexpr (kRouted) {
            if (weighted) {  // a synthetic page: key j stands for weight[j] tokens, one counted above
              const uint8_t* weight = routed.weight[i % T::kStages];
#pragma unroll
              for (int n = 0; n < 8; ++n) {
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                  row_sum[r] += AsFloat(sc[n][e]) * static_cast<float>(weight[n * 8 + 2 * t + (e & 1)] - 1);
                }
              }
            }
          }
        }
      };
      // O is rescaled only when some row of the warp has a new maximum (after the first pages almost
      // never; ×1 would change no bit).
      auto rescale_o = [&](const float (&corr)[2]) {
        if (__any_sync(kFullMask, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
          for (int n = 0; n < kONTiles; ++n) o[n][0] *= corr[0], o[n][1] *= corr[0], o[n][2] *= corr[1], o[n][3] *= corr[1];
        }
      };
      // P as bf16 A fragments: k-step kk of P·V takes keys kk·16 … +15 (two 8-key row groups).
      auto pack_p = [&](const SAcc (&sc)[8][4]) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          a[kk][0] = PackBf16(AsFloat(sc[2 * kk][0]), AsFloat(sc[2 * kk][1]));
          a[kk][1] = PackBf16(AsFloat(sc[2 * kk][2]), AsFloat(sc[2 * kk][3]));
          a[kk][2] = PackBf16(AsFloat(sc[2 * kk + 1][0]), AsFloat(sc[2 * kk + 1][1]));
          a[kk][3] = PackBf16(AsFloat(sc[2 * kk + 1][2]), AsFloat(sc[2 * kk + 1][3]));
        }
      };
      // O[64 × d] += P[64 × 64] · V[64 × d] of page i, one commit group.
      auto issue_pv = [&](int i) {
        const uint64_t v_desc = Desc(SmemAddr(smem + T::kVOffset + (i % T::kStages) * T::kTileBytes), kPageTokens * 128, 1024);
        FenceRegs(o);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) WgmmaRS(o, a[kk], v_desc + kk * (2048 >> 4));
        WgmmaCommit();
      };
      auto fence_p = [&] {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
          for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[kk][e])::"memory");
        }
      };

      if constexpr (T::kStages >= 3) {
        // Deep ring: at the top of step i, P(i) is in `a` and O is scaled to page i's row maxima. The
        // group issues S(i+1) and P(i)·V back to back, then computes the softmax of page i + 1 while
        // P(i)·V runs. The two consumer groups take turns to issue (kTurnBar), so that one group's
        // softmax runs while the other's MMAs occupy the tensor cores (FlashAttention-3's ping-pong).
        const int turn = T::kTurnBar + consumer, other_turn = T::kTurnBar + (consumer ^ 1);
        SAcc (&sc)[8][4] = s_cur;
        float corr[2];
        float4 keys[8];
        issue_s(sc, 0, true);
        load_keys(keys, 0);
        WgmmaWait<0>();
        FenceRegs(sc);
        softmax(sc, keys, 0, corr);
        rescale_o(corr);  // O from the windows before (zero in the first)
        pack_p(sc);
        if (T::kPingPong && consumer == 1) BarArrive(T::kTurnBar, 2 * 128);  // group 0 issues first
        for (int i = 0; i < n_visible; ++i) {
          const bool more = i + 1 < n_visible;
          if (T::kPingPong) BarSync(turn, 2 * 128);
          issue_s(sc, more ? i + 1 : i, more);
          issue_pv(i);
          if (T::kPingPong && (consumer == 0 || more)) BarArrive(other_turn, 2 * 128);
          load_keys(keys, more ? i + 1 : i);
          WgmmaWait<1>();
          FenceRegs(sc);
          if (more) softmax(sc, keys, i + 1, corr);
          WgmmaWait<0>();
          FenceRegs(o);
          fence_p();
          release(i);
          if (more) {
            rescale_o(corr);
            pack_p(sc);
          }
        }
      } else {
        // Two stages: the producer needs page i − 1's stage back before it can fill page i + 1's, so
        // every MMA is waited for first (which hands page i − 1 back), the softmax of page i runs while
        // the producer decodes page i + 1, and S(i+1) goes in behind P(i)·V. (A wait for all MMAs where
        // only P(i−1)·V is needed costs little: a group's MMAs run in order.)
        auto step = [&](int i, SAcc (&sc)[8][4], SAcc (&s_next)[8][4]) {
          float4 keys[8];
          load_keys(keys, i);
          WgmmaWait<0>();
          FenceRegs(o);
          FenceRegs(sc);
          fence_p();
          if (i > 0) release(i - 1);
          float corr[2];
          softmax(sc, keys, i, corr);
          rescale_o(corr);
          pack_p(sc);
          issue_pv(i);
          if (i + 1 < n_visible) issue_s(s_next, i + 1, true);
        };
        SAcc s_next[8][4];  // the two S tiles alternate (unrolled by two, so that they stay registers)
        issue_s(s_cur, 0, true);
        int i = 0;
        for (; i + 1 < n_visible; i += 2) {
          step(i, s_cur, s_next);
          step(i + 1, s_next, s_cur);
        }
        if (i < n_visible) step(i, s_cur, s_next);
      }
      WgmmaWait<0>();
      FenceRegs(o);
    }
    __syncthreads();  // matches the producer's, before the next window
  }

  // ── Epilogue: normalise, stage rows in shared memory, Rᵀ and +μ_v per row, bf16 out ──────────
  float* stage_rows = reinterpret_cast<float*>(smem) + row_base * T::kStagePitch;  // this warp's 16 rows
  float inv[2];
  InverseRowSums(row_sum, inv);
#pragma unroll
  for (int n = 0; n < kONTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) stage_rows[(g + (e >> 1) * 8) * T::kStagePitch + n * 8 + 2 * t + (e & 1)] = o[n][e] * inv[e >> 1];
  }
  __syncwarp();
  if constexpr (kRouted) {
    const int group_rows = routed.rows[consumer] - warp_in_group * 16;
    const int warp_rows = group_rows < 16 ? group_rows : 16;
    if (warp_rows > 0) {
      WriteOutputRows<kDim>(p, head, stage_rows, T::kStagePitch, warp_rows, routed.q0[consumer] + warp_in_group * 16, lane);
    }
  } else {
    const int warp_rows = n_rows - row_base < 16 ? n_rows - row_base : 16;
    if (warp_rows > 0) WriteOutputRows<kDim>(p, head, stage_rows, T::kStagePitch, warp_rows, q0 + row_base, lane);
  }
}

// The kernel instance that serves (head_dim, max_page_bytes, MMA path, routed): f(dim, stages, int8,
// routed), each as std::integral_constant, so that every entry point below makes the same choice. The
// INT8 path's entries hold no BF16 page, so it always takes four stages; routed launches take either
// path, as dense ones do.
template <int kValue>
using Int = std::integral_constant<int, kValue>;
template <bool kValue>
using Bool = std::integral_constant<bool, kValue>;
template <class F>
auto WithInstance(int head_dim, int max_page_bytes, MmaPath mma, bool routed, F&& f) {
  auto with_route = [&](auto route) {
    if (mma == MmaPath::kInt8) {
      return head_dim == 128 ? f(Int<128>{}, Int<kSm90DeepStages>{}, Bool<true>{}, route)
                             : f(Int<64>{}, Int<kSm90DeepStages>{}, Bool<true>{}, route);
    }
    if (head_dim == 128) {
      return Sm90Stages<128>(max_page_bytes) == kSm90DeepStages
                 ? f(Int<128>{}, Int<kSm90DeepStages>{}, Bool<false>{}, route)
                 : f(Int<128>{}, Int<2>{}, Bool<false>{}, route);
    }
    return f(Int<64>{}, Int<kSm90DeepStages>{}, Bool<false>{}, route);
  };
  return routed ? with_route(Bool<true>{}) : with_route(Bool<false>{});
}

// Raises the instance's dynamic shared-memory limit to what `max_page_bytes` needs; returns the bytes.
template <int kDim, int kStages, bool kInt8Qk, bool kRouted>
Error Prepare(int max_page_bytes, int* smem) {
  *smem = Sm90DynamicSmem<kDim, kStages, kInt8Qk>(max_page_bytes);
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(AttentionSm90Kernel<kDim, kStages, kInt8Qk, kRouted>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, *smem));
  return Error::Ok();
}

template <int kDim, int kStages, bool kInt8Qk, bool kRouted>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((Prepare<kDim, kStages, kInt8Qk, kRouted>(p.max_page_bytes, &smem)));
  // Routed: a CTA per block (route.leads).
  const dim3 grid = kRouted ? dim3(p.route.n_leads, p.kv.n_heads) : AttentionGrid(p);
  AttentionSm90Kernel<kDim, kStages, kInt8Qk, kRouted><<<grid, Sm90Tile<kDim, kStages, kInt8Qk>::kThreads, smem, stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention sm90 kernel");
  return Error::Ok();
}

template <int kDim, int kStages, bool kInt8Qk, bool kRouted>
Error CtasPerSm(const AttentionParams& p, int* ctas) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((Prepare<kDim, kStages, kInt8Qk, kRouted>(p.max_page_bytes, &smem)));
  KVPACK_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      ctas, AttentionSm90Kernel<kDim, kStages, kInt8Qk, kRouted>, Sm90Tile<kDim, kStages, kInt8Qk>::kThreads, smem));
  return Error::Ok();
}

}  // namespace

int AttentionSm90SharedBytes(int head_dim, int max_page_bytes) {  // the bf16 path's: the larger
  return WithInstance(head_dim, max_page_bytes, MmaPath::kBf16, false, [&](auto dim, auto stages, auto int8, auto) {
    return Sm90DynamicSmem<dim.value, stages.value, int8.value>(max_page_bytes);
  });
}

Error LaunchAttentionSm90(const AttentionParams& params, cudaStream_t stream) {
  return WithInstance(params.kv.head_dim, params.max_page_bytes, params.mma, params.route.n_blocks > 0,
                      [&](auto dim, auto stages, auto int8, auto route) {
                        return Launch<dim.value, stages.value, int8.value, route.value>(params, stream);
                      });
}

Error AttentionSm90CtasPerSm(const AttentionParams& params, int* ctas) {
  return WithInstance(params.kv.head_dim, params.max_page_bytes, params.mma, params.route.n_blocks > 0,
                      [&](auto dim, auto stages, auto int8, auto route) {
                        return CtasPerSm<dim.value, stages.value, int8.value, route.value>(params, ctas);
                      });
}

}  // namespace kvpack::cuda
