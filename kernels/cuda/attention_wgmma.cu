// Attention over packed pages on Hopper's asynchronous warp-group MMA (wgmma, sm_90a), warp-specialised.
//
// A CTA of three warp groups takes one tile of kTileQueries = 128 query rows of one head:
//   warp group 0, the producer: cp.asyncs the raw bytes of the visible pages into a ring of kRawStages
//     stages and decodes each page (INT4 / INT8 / BF16) into a ring of kStages bf16 K and V tiles laid
//     out as wgmma reads them (128-byte swizzle);
//   warp groups 1 and 2, the consumers, 64 query rows each: S = Q·Kᵀ (wgmma, Q and K from shared
//     memory), masks and the online softmax in registers, O += P·V (wgmma, P from registers, V from
//     shared memory), then the epilogue of attention_device.cuh (Rᵀ, +μ_v, bf16 store).
// Named barriers hand the tiles over: kFullBar + s (producer arrives, consumers wait) and kEmptyBar + s
// (consumers arrive, producer waits). The producer decodes pages ahead while the consumers multiply,
// and the two consumer groups take turns on the tensor cores. Over INT4/INT8 pages the producer's
// decode is what limits speed (bench/RESULTS.md, runs 4–5: 270–280 TFLOP/s, 368 over BF16 pages).
#include "kernels/cuda/attention_wgmma.h"

#include <string>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/cuda_status.h"

namespace kvpack::cuda {
namespace {

// ── Tile traits ─────────────────────────────────────────────────────────────────────────────────
// Shared memory (dynamic, from a 1024-byte aligned base, as the 128-byte swizzle needs):
//   Q      [2 groups][64 rows][kDim]   bf16, swizzled     kQBytes
//   K      [kStages][64 keys][kDim]    bf16, swizzled     kStages · kTileBytes
//   V      [kStages][64 keys][kDim]    bf16, swizzled     kStages · kTileBytes
//   raw    [kRawStages][K page | V page]                  kRawStages · 2 · max_page_bytes
// The epilogue stages float rows [128][kDim + 4] over Q, K and V once every MMA is done.
template <int kDim, int kStagesT>
struct WgmmaTraits {
  static_assert(kDim == 64 || kDim == 128, "head_dim 64 or 128");
  static constexpr int kConsumerGroups = 2;
  static constexpr int kGroupRows = 64;  // wgmma M
  static_assert(kConsumerGroups * kGroupRows == kTileQueries, "consumer groups cover the query tile");
  static constexpr int kThreads = 128 * (1 + kConsumerGroups);
  static constexpr int kStages = kStagesT;  // decoded K/V tiles in flight: 3 where shared memory allows, else 2
  static constexpr int kRawStages = 3;  // raw pages in flight (one being decoded, two arriving)
  static constexpr int kTileBytes = kPageTokens * kDim * 2;
  static constexpr int kQBytes = kTileQueries * kDim * 2;
  static constexpr int kKOffset = kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kTileBytes;
  static constexpr int kRawOffset = kVOffset + kStages * kTileBytes;
  static constexpr int kAlign = 1024;  // the swizzle pattern repeats every 8 rows × 128 bytes
  static constexpr int kStagePitch = kDim + 4;
  static_assert(kTileQueries * kStagePitch * 4 <= kRawOffset, "epilogue staging fits over Q, K and V");
  static_assert(kTileBytes % kAlign == 0 && kQBytes % kAlign == 0, "tiles keep the swizzle alignment");
  static constexpr int kWindow = 3072;  // pages examined per visibility pass
  // Named barriers (0 is __syncthreads).
  static constexpr int kProducerBar = 1;
  static constexpr int kFullBar = 2;
  static constexpr int kEmptyBar = kFullBar + kStages;
  static_assert(kEmptyBar + kStages <= 16, "16 hardware barriers");
};

// Byte offset of channels c8·8 … +7 of row r in a [rows][kDim] bf16 tile with the 128-byte swizzle:
// 64-channel column blocks of rows·128 bytes each; inside one, row r's 128 bytes sit at r·128 and
// their 16-byte chunk j at (j ⊕ (r mod 8))·16, which spreads 8 consecutive rows' chunk j over all 32
// banks. This is the canonical K-major layout of wgmma (Q, K) and, read with keys as K and channels
// as N, its MN-major layout (V).
template <int kRows>
__device__ __forceinline__ int SwizzledOffset(int r, int c8) {
  return (c8 >> 3) * (kRows * 128) + r * 128 + (((c8 & 7) ^ (r & 7)) << 4);
}

// ── wgmma wrappers ──────────────────────────────────────────────────────────────────────────────
// Shared-memory matrix descriptor: start address, leading and stride byte offsets (in 16-byte
// units), 128-byte swizzle (layout type 1 in bits 62–63).
__device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaWaitAll() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous MMA.
template <int kN>
__device__ __forceinline__ void FenceRegs(float (&r)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(r[n][e])::"memory");
  }
}

#define KVPACK_F8(a, i) "+f"(a[i][0]), "+f"(a[i][1]), "+f"(a[i][2]), "+f"(a[i][3]), \
                        "+f"(a[i + 1][0]), "+f"(a[i + 1][1]), "+f"(a[i + 1][2]), "+f"(a[i + 1][3])

// s[64 × 64] (+)= A[64 × 16] · B[16 × 64]; A and B K-major in shared memory. scale_d = 0 overwrites.
__device__ __forceinline__ void WgmmaSS64(float (&s)[8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : KVPACK_F8(s, 0), KVPACK_F8(s, 2), KVPACK_F8(s, 4), KVPACK_F8(s, 6)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d)
      : "memory");
}

// o[64 × kN·8] += A[64 × 16] · B[16 × kN·8]; A in registers (the m16n8k16 A fragment of each warp's
// 16 rows), B MN-major in shared memory (transposed: imm-trans-b = 1).
__device__ __forceinline__ void WgmmaRS(float (&o)[8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"
      : KVPACK_F8(o, 0), KVPACK_F8(o, 2), KVPACK_F8(o, 4), KVPACK_F8(o, 6)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
      : "memory");
}
__device__ __forceinline__ void WgmmaRS(float (&o)[16][4], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : KVPACK_F8(o, 0), KVPACK_F8(o, 2), KVPACK_F8(o, 4), KVPACK_F8(o, 6),
        KVPACK_F8(o, 8), KVPACK_F8(o, 10), KVPACK_F8(o, 12), KVPACK_F8(o, 14)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1)
      : "memory");
}
#undef KVPACK_F8

// Named barriers: `count` threads (a multiple of 32) take part; arrive does not wait.
__device__ __forceinline__ void BarSync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void BarArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Orders this thread's ordinary shared-memory stores before later wgmma reads of them.
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The producer's decode of one page: raw K and V (K at `stage`, V at stage + v_offset) → the swizzled
// bf16 tiles, thread ptid of 128 taking every 128th 16-byte chunk (8 per tile at d = 128). All loads
// of a tile are issued before its first store (the compiler cannot reorder loads across stores to
// the same shared array), so their latencies overlap.
template <PageFormat F, int kDim>
__device__ __forceinline__ void DecodeTiles(const uint8_t* stage, int v_offset, int n_valid, uint8_t* k_tile,
                                            uint8_t* v_tile, int ptid) {
  constexpr int kUnitsPerRow = kDim / 8;
  constexpr int kSteps = kPageTokens * kUnitsPerRow / 128;
#pragma unroll
  for (int tile = 0; tile < 2; ++tile) {
    const uint8_t* src = tile == 0 ? stage : stage + v_offset;
    uint8_t* dst = tile == 0 ? k_tile : v_tile;
    RawUnit<F> units[kSteps];
#pragma unroll
    for (int it = 0; it < kSteps; ++it) {
      const int u = ptid + it * 128;
      units[it] = LoadUnit<F, kDim>(src, u / kUnitsPerRow, u % kUnitsPerRow);
    }
#pragma unroll
    for (int it = 0; it < kSteps; ++it) {
      const int u = ptid + it * 128;
      const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow;
      *reinterpret_cast<uint4*>(dst + SwizzledOffset<kPageTokens>(r, c8)) =
          r < n_valid ? ConvertUnit<F>(units[it]) : make_uint4(0, 0, 0, 0);
    }
  }
}

template <int kDim, int kStages>
__global__ void __launch_bounds__(WgmmaTraits<kDim, kStages>::kThreads, 1) AttentionWgmmaKernel(const AttentionParams p) {
  using T = WgmmaTraits<kDim, kStages>;
  constexpr int kUnitsPerRow = kDim / 8;  // 16-byte chunks per bf16 row
  constexpr int kONTiles = kDim / 8;      // 8-channel column groups of O
  extern __shared__ uint8_t smem_raw[];
  __shared__ QueryRuns runs;
  __shared__ VisibleScratch<T::kThreads, T::kWindow> scratch;
  uint8_t* smem = smem_raw + ((T::kAlign - (SmemAddr(smem_raw) & (T::kAlign - 1))) & (T::kAlign - 1));
  uint8_t* raw = smem + T::kRawOffset;

  // ── Preconditions and prologue ──────────────────────────────────────────────────────────────
  const int tid = threadIdx.x, lane = tid & 31;
  const int group = tid >> 7;  // 0: producer, 1..2: consumers
  const int head = blockIdx.y;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTileQueries;  // first query of the tile
  const int n_rows = static_cast<int>(p.n_q - q0 < kTileQueries ? p.n_q - q0 : kTileQueries);
  const int64_t t0 = p.q_token_begin + q0;  // its token index (= position)
  const int n_pages = p.kv.n_pages;

  for (int u = tid; u < kTileQueries * kUnitsPerRow; u += T::kThreads) {  // Q [2][64][d] → swizzled smem
    const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < n_rows) v = *reinterpret_cast<const uint4*>(p.q + (q0 + r) * p.q_stride + head * kDim + c8 * 8);
    *reinterpret_cast<uint4*>(smem + (r / T::kGroupRows) * (T::kQBytes / 2) + SwizzledOffset<T::kGroupRows>(r % T::kGroupRows, c8)) = v;
  }
  FenceProxyAsync();
  FindQueryRuns<T::kThreads>(p, t0, n_rows, runs);  // its barriers also publish Q

  // Consumer state: warp w of consumer group c owns rows c·64 + w·16 + (g, g + 8).
  const int warp_in_group = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
  const int row_base = (group - 1) * T::kGroupRows + warp_in_group * 16;
  float o[kONTiles][4];  // O rows (g, g+8) × channels (n·8 + 2t, +1)
#pragma unroll
  for (int n = 0; n < kONTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;

  // ── Main loop: windows of pages; in each, the producer/consumer pipeline over the visible pages ──
  for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
    const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
    const int n_visible = CollectVisiblePages(p, runs, w0, wn, scratch);
    if (n_visible == 0) continue;

    if (group == 0) {
      // Producer: raw page i+2 arrives while page i is decoded into tile stage i mod kStages.
      const int ptid = tid;
      const int stage_bytes = 2 * p.max_page_bytes;
#pragma unroll
      for (int j = 0; j < T::kRawStages - 1; ++j) {
        if (j < n_visible) LoadPageAsync<128, kDim>(p, head, w0 + scratch.visible[j], raw + j * stage_bytes, ptid);
        CpAsyncCommit();
      }
      for (int i = 0; i < n_visible; ++i) {
        CpAsyncWait<T::kRawStages - 2>();  // this thread's copies of page i are done
        BarSync(T::kProducerBar, 128);     // everyone's are, and everyone has decoded page i − 1
        const int next = i + T::kRawStages - 1;
        if (next < n_visible) {
          LoadPageAsync<128, kDim>(p, head, w0 + scratch.visible[next], raw + (next % T::kRawStages) * stage_bytes, ptid);
        }
        CpAsyncCommit();
        const int s = i % T::kStages;
        if (i >= T::kStages) BarSync(T::kEmptyBar + s, T::kThreads);  // consumers are done with page i − kStages
        const PageDesc page = p.kv.pages[w0 + scratch.visible[i]];
        const PageFormat format = static_cast<PageFormat>(page.format);
        const uint8_t* stage = raw + (i % T::kRawStages) * stage_bytes;
        uint8_t* k_tile = smem + T::kKOffset + s * T::kTileBytes;
        uint8_t* v_tile = smem + T::kVOffset + s * T::kTileBytes;
        switch (format) {
          case PageFormat::kInt4: DecodeTiles<PageFormat::kInt4, kDim>(stage, p.max_page_bytes, page.n_valid, k_tile, v_tile, ptid); break;
          case PageFormat::kInt8: DecodeTiles<PageFormat::kInt8, kDim>(stage, p.max_page_bytes, page.n_valid, k_tile, v_tile, ptid); break;
          default: DecodeTiles<PageFormat::kBf16, kDim>(stage, p.max_page_bytes, page.n_valid, k_tile, v_tile, ptid); break;
        }
        FenceProxyAsync();
        BarArrive(T::kFullBar + s, T::kThreads);
      }
      CpAsyncWait<0>();
    } else {
      // Consumers: S(i+1) is issued right behind P(i)·V so that the tensor cores run both while this
      // group waits (224.5 → 230.6 TFLOP/s at N = 32768 INT4 against completing each before the next).
      const uint32_t q_addr = SmemAddr(smem + (group - 1) * (T::kQBytes / 2));
      float sc[8][4];   // S rows (g, g+8) × keys (n·8 + 2t, +1)
      uint32_t a[4][4];  // P as the A fragments of the four 16-key steps of P·V
      // S[64 × 64] = Q[64 × d] · Kᵀ[d × 64] of visible page i, once the producer has filled its stage;
      // k-step kc reads 32 bytes into a 128-byte swizzled row.
      auto issue_s = [&](int i) {
        const uint32_t k_addr = SmemAddr(smem + T::kKOffset + (i % T::kStages) * T::kTileBytes);
        BarSync(T::kFullBar + i % T::kStages, T::kThreads);
        WgmmaFence();
#pragma unroll
        for (int kc = 0; kc < kDim / 16; ++kc) {
          const uint32_t off = (kc >> 2) * (kPageTokens * 128) + (kc & 3) * 32;
          WgmmaSS64(sc, Desc(q_addr + off, 16, 1024), Desc(k_addr + off, 16, 1024), kc > 0);
        }
        WgmmaCommit();
      };
      issue_s(0);
      for (int i = 0; i < n_visible; ++i) {
        const int s = i % T::kStages;
        WgmmaWaitAll();  // S(i) and P(i−1)·V
        FenceRegs(sc);
        FenceRegs(o);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
          for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[kk][e])::"memory");  // P(i−1) read until here
        }
        if (i > 0 && i - 1 + T::kStages < n_visible) BarArrive(T::kEmptyBar + (i - 1) % T::kStages, T::kThreads);
        const PageDesc page = p.kv.pages[w0 + scratch.visible[i]];

        // Masks: invalid slots, other sequences, future keys (causal).
        const bool need_mask = page.n_valid < kPageTokens || runs.n > 1 ||
                               (p.causal && page.token_begin + page.n_valid - 1 > t0);
        if (need_mask) {
#pragma unroll
          for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = row_base + g + (e >> 1) * 8;
              const int key = n * 8 + 2 * t + (e & 1);
              const bool ok = key < page.n_valid && runs.q_seq[row] == page.seq_id &&
                              (!p.causal || page.token_begin + key <= t0 + row);
              if (!ok) sc[n][e] = -INFINITY;
            }
          }
        }

        // Online softmax (log2 domain), rows g and g + 8. O is rescaled only when some row of the warp
        // has a new maximum (after the first pages almost never; ×1 would change no bit).
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
          const float m_new = fmaxf(row_max[r], mx * scale_log2);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row so far
          corr[r] = exp2f(row_max[r] - m_use);
          row_max[r] = m_new;
          row_sum[r] *= corr[r];
#pragma unroll
          for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              sc[n][e] = exp2f(fmaf(sc[n][e], scale_log2, -m_use));
              row_sum[r] += sc[n][e];
            }
          }
        }
        if (__any_sync(kFullMask, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
          for (int n = 0; n < kONTiles; ++n) o[n][0] *= corr[0], o[n][1] *= corr[0], o[n][2] *= corr[1], o[n][3] *= corr[1];
        }

        // O[64 × d] += P[64 × 64] · V[64 × d]: k-step kk takes keys kk·16 … +15 (two 8-key row groups).
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          a[kk][0] = PackBf16x2(sc[2 * kk][0], sc[2 * kk][1]);
          a[kk][1] = PackBf16x2(sc[2 * kk][2], sc[2 * kk][3]);
          a[kk][2] = PackBf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
          a[kk][3] = PackBf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        }
        const uint32_t v_addr = SmemAddr(smem + T::kVOffset + s * T::kTileBytes);
        FenceRegs(o);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) WgmmaRS(o, a[kk], Desc(v_addr + kk * 2048, kPageTokens * 128, 1024));
        WgmmaCommit();
        if (i + 1 < n_visible) issue_s(i + 1);
      }
      WgmmaWaitAll();
      FenceRegs(o);
    }
    __syncthreads();  // every group is done with the tiles before the next window or the epilogue
  }

  // ── Epilogue: normalise, stage rows in shared memory, Rᵀ and +μ_v per row, bf16 out ──────────
  if (group == 0) return;
  float* stage_rows = reinterpret_cast<float*>(smem) + row_base * T::kStagePitch;  // this warp's 16 rows
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
  }
#pragma unroll
  for (int n = 0; n < kONTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) stage_rows[(g + (e >> 1) * 8) * T::kStagePitch + n * 8 + 2 * t + (e & 1)] = o[n][e] * inv[e >> 1];
  }
  __syncwarp();
  const int warp_rows = n_rows - row_base < 16 ? n_rows - row_base : 16;
  if (warp_rows > 0) WriteOutputRows<kDim>(p, head, stage_rows, T::kStagePitch, warp_rows, q0 + row_base, lane);
}

template <int kDim, int kStages>
int DynamicSmem(int max_page_bytes) {
  using T = WgmmaTraits<kDim, kStages>;
  return T::kAlign + T::kRawOffset + T::kRawStages * 2 * max_page_bytes;
}

// Three decoded stages where they fit beside the static shared memory (~9 KB) in the 227 KB of an
// SM: every format at d = 64, INT4 and INT8 at d = 128; BF16 pages at d = 128 take two.
inline constexpr int kMaxDynamicSmem = 216 * 1024;
template <int kDim>
int Stages(int max_page_bytes) {
  return DynamicSmem<kDim, 3>(max_page_bytes) <= kMaxDynamicSmem ? 3 : 2;
}

template <int kDim, int kStages>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  using T = WgmmaTraits<kDim, kStages>;
  const int smem = DynamicSmem<kDim, kStages>(p.max_page_bytes);
  auto kernel = AttentionWgmmaKernel<kDim, kStages>;
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>((p.n_q + kTileQueries - 1) / kTileQueries), static_cast<unsigned>(p.kv.n_heads));
  kernel<<<grid, T::kThreads, smem, stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention wgmma kernel");
  return Error::Ok();
}

template <int kDim>
Error LaunchForDim(const AttentionParams& p, cudaStream_t stream) {
  return Stages<kDim>(p.max_page_bytes) == 3 ? Launch<kDim, 3>(p, stream) : Launch<kDim, 2>(p, stream);
}

}  // namespace

int AttentionWgmmaSharedBytes(int head_dim, int max_page_bytes) {
  if (head_dim == 128) {
    return Stages<128>(max_page_bytes) == 3 ? DynamicSmem<128, 3>(max_page_bytes) : DynamicSmem<128, 2>(max_page_bytes);
  }
  return Stages<64>(max_page_bytes) == 3 ? DynamicSmem<64, 3>(max_page_bytes) : DynamicSmem<64, 2>(max_page_bytes);
}

Error LaunchAttentionWgmma(const AttentionParams& params, cudaStream_t stream) {
  return params.kv.head_dim == 128 ? LaunchForDim<128>(params, stream) : LaunchForDim<64>(params, stream);
}

}  // namespace kvpack::cuda
