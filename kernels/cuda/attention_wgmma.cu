// Attention over packed pages on Hopper's asynchronous warp-group MMA (wgmma, sm_90a), warp-specialised.
//
// A CTA of four warp groups takes one tile of kTileQueries = 128 query rows of one head:
//   warp groups 0 and 1, the producers (56 registers each after setmaxnreg): bulk-copy the raw bytes
//     of the visible pages into a ring of kRawStages stages and decode each page's K and V into a
//     ring of kStages bf16 tiles laid out as wgmma reads them (128-byte swizzle): INT4 K as the codes
//     + 128 with each key's scale and lo in a key table, INT4 V in bf16x2 arithmetic, INT8 and BF16
//     exactly (wgmma_pages.cuh);
//   warp groups 2 and 3, the consumers (200 registers), 64 query rows each: S = Q·Kᵀ (wgmma, Q and K
//     from shared memory), logits from S and the key table, masks and the online softmax in
//     registers, O += P·V (wgmma, P from registers, V from shared memory), then the epilogue of
//     attention_device.cuh (Rᵀ, +μ_v, bf16 store). With the deep ring a group issues S of the next
//     page and P·V of this one together and computes the next softmax under them, the two groups
//     taking turns to issue (kTurnBar), so that one's softmax runs under the other's MMAs.
// The tiles change hands through tile_full[s] (an mbarrier: every producer thread arrives, each consumer
// waits on its own, so the consumer groups never wait for each other) and the named barrier
// kEmptyBar + s (consumers arrive, producers wait); kTurnBar + c orders the consumer groups' MMA issues.
// bench/RESULTS.md has the measurements behind each choice.
#include "kernels/cuda/attention_wgmma.h"

#include <string>
#include <type_traits>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/wgmma_pages.cuh"
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
  // Two producer groups, so a scheduler holds two producer warps whose latencies hide each other's
  // (with one, the producer limited the kernel); both decode half of each tile (DecodePage).
  static constexpr int kProducerGroups = 2;
  static constexpr int kProducerThreads = 128 * kProducerGroups;
  static_assert(kProducerThreads == cuda::kProducerThreads, "DecodePage's thread layout");
  static constexpr int kThreads = kProducerThreads + 128 * kConsumerGroups;
  // Registers per thread after setmaxnreg: the decode needs few, the consumers' S tiles, O and P
  // many: 256·56 + 256·200 = 65536, the register file (the launch's 512·128).
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 200;
  static_assert(kProducerThreads * kProducerRegisters + 128 * kConsumerGroups * kConsumerRegisters <= 65536,
                "register file");
  static constexpr int kStages = kStagesT;  // decoded K/V tiles in flight: 4 where shared memory allows, else 2
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
  static constexpr int kEmptyBar = 2;
  static constexpr int kTurnBar = kEmptyBar + kStages;  // + c: consumer group c may issue its MMAs
  static_assert(kTurnBar + kConsumerGroups <= 16, "16 hardware barriers");
};

// ── wgmma wrappers ──────────────────────────────────────────────────────────────────────────────
// Shared-memory matrix descriptor: start address, leading and stride byte offsets (in 16-byte
// units), 128-byte swizzle (layout type 1 in bits 62–63).
__device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3ffffu) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending of this warp group's committed wgmma groups are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory"); }
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

// Moves this warp group's register allocation to kCount per thread (a multiple of 8 in 24…256);
// every warp of the group executes it.
template <int kCount, bool kIncrease>
__device__ __forceinline__ void SetMaxRegisters() {
  if constexpr (kIncrease) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount));
  }
}

// Named barriers: `count` threads (a multiple of 32) take part; arrive does not wait.
__device__ __forceinline__ void BarSync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void BarArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Orders this thread's ordinary shared-memory stores before later wgmma reads of them.
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ex2.approx with denormals flushed: one MUFU.EX2 (exp2f adds a range check and two multiplies to
// keep denormal results, which an attention weight below 2^-126 does not need). ex2(−inf) = +0.
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <int kDim, int kStages>
__global__ void __launch_bounds__(WgmmaTraits<kDim, kStages>::kThreads, 1) AttentionWgmmaKernel(const AttentionParams p) {
  using T = WgmmaTraits<kDim, kStages>;
  constexpr int kUnitsPerRow = kDim / 8;  // 16-byte chunks per bf16 row
  constexpr int kONTiles = kDim / 8;      // 8-channel column groups of O
  extern __shared__ uint8_t smem_raw[];
  __shared__ QueryRuns runs;
  __shared__ VisibleScratch<T::kThreads, T::kWindow> scratch;
  __shared__ PageDesc raw_desc[T::kRawStages], tile_desc[T::kStages];
  __shared__ uint64_t raw_full[T::kRawStages];  // mbarriers: raw stage filled
  __shared__ uint64_t tile_full[T::kStages];    // mbarriers: decoded stage filled (every producer arrives)
  __shared__ uint32_t bf16_exponent;             // kBf16Exponent, see Int4CodesPlus128
  __shared__ float4 key_table[T::kStages][kPageTokens / 2];  // (a_j, b_j, a_j+1, b_j+1): DecodePage
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

  for (int u = tid; u < kTileQueries * kUnitsPerRow; u += T::kThreads) {  // Q [2][64][d] → swizzled smem
    const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < n_rows) v = *reinterpret_cast<const uint4*>(p.q + (q0 + r) * p.q_stride + head * kDim + c8 * 8);
    *reinterpret_cast<uint4*>(smem + (r / T::kGroupRows) * (T::kQBytes / 2) + SwizzledOffset<T::kGroupRows>(r % T::kGroupRows, c8)) = v;
  }
  if (tid == 0) {
    bf16_exponent = kBf16Exponent;
    for (int st = 0; st < T::kRawStages; ++st) MbarInit(SmemAddr(&raw_full[st]), 1);
    for (int st = 0; st < T::kStages; ++st) MbarInit(SmemAddr(&tile_full[st]), T::kProducerThreads);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  FenceProxyAsync();
  FindQueryRuns<T::kThreads>(p, t0, n_rows, runs);  // its barriers also publish Q and the mbarriers

  // ── Main loop: windows of pages; in each, the producer/consumer pipeline over the visible pages ──
  // Each role runs its own copy of the window loop, so that the code after setmaxnreg belongs to one
  // role only (the register counts of the two differ). Both meet at the same CTA barriers.
  if (group < T::kProducerGroups) {
    SetMaxRegisters<T::kProducerRegisters, false>();
    uint32_t raw_phase = 0;  // bit st: the parity of raw stage st's next completion
    const uint32_t exponent = bf16_exponent;
    for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
      const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
      const int n_visible = CollectVisiblePages(p, runs, w0, wn, scratch);
      if (n_visible > 0) {
        // Producers: raw page i+2 arrives while page i is decoded into tile stage i mod kStages. Thread 0
        // reads each page's source one page ahead, starts its bulk copies, and hands its descriptor on
        // through shared memory: raw_desc[raw stage] to the decode, tile_desc[stage] to the consumers.
        const int stage_bytes = 2 * p.max_page_bytes;
        PageSource source;
        auto issue = [&](int j) {  // thread 0: page j's copies, then the source of page j + 1
          const int st = j % T::kRawStages;
          IssuePageCopy<kDim>(p.kv.pool, source, raw + st * stage_bytes, p.max_page_bytes, SmemAddr(&raw_full[st]));
          raw_desc[st] = source.desc;
          if (j + 1 < n_visible) source = FetchPageSource(p, head, w0 + scratch.visible[j + 1]);
        };
        if (tid == 0) {
          source = FetchPageSource(p, head, w0 + scratch.visible[0]);
          for (int j = 0; j < T::kRawStages - 1 && j < n_visible; ++j) issue(j);
        }
        for (int i = 0; i < n_visible; ++i) {
          BarSync(T::kProducerBar, T::kProducerThreads);  // everyone has decoded page i − 1: its stage is free
          const int next = i + T::kRawStages - 1;
          if (tid == 0 && next < n_visible) issue(next);
          const int st = i % T::kRawStages;
          MbarWait(SmemAddr(&raw_full[st]), (raw_phase >> st) & 1u);
          raw_phase ^= 1u << st;
          const int s = i % T::kStages;
          if (i >= T::kStages) BarSync(T::kEmptyBar + s, T::kThreads);  // consumers are done with page i − kStages
          const PageDesc page = raw_desc[st];
          DecodePage<kDim>(page, raw + st * stage_bytes, p.max_page_bytes,
                           smem + T::kKOffset + s * T::kTileBytes, smem + T::kVOffset + s * T::kTileBytes,
                           reinterpret_cast<float2*>(key_table[s]), scale_log2, exponent, tid);
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
  // threads of a row pair each add a quarter of the channels.
  float q_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
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
  for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
    const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
    const int n_visible = CollectVisiblePages(p, runs, w0, wn, scratch);
    if (n_visible > 0) {
      // Consumers. Descriptors step by adding (byte offset >> 4) to their address field: shared
      // addresses stay below 2^18, so the 14-bit field never carries.
      const uint64_t q_desc = Desc(SmemAddr(smem + consumer * (T::kQBytes / 2)), 16, 1024);
      float s_cur[8][4];  // S rows (g, g+8) × keys (n·8 + 2t, +1)
      uint32_t a[4][4];   // P as the A fragments of the four 16-key steps of P·V
      // S[64 × 64] = Q[64 × d] · Kᵀ[d × 64] of visible page i, once the producer has filled its stage;
      // k-step kc reads 32 bytes into a 128-byte swizzled row.
      // `wait` = false re-issues a page the group already holds (the last page's S(i+1): a wasted
      // 1/n_visible of the MMAs, so that no wgmma sits in a branch, which would serialise them all).
      auto issue_s = [&](float (&sc)[8][4], int i, bool wait) {
        const uint64_t k_desc = Desc(SmemAddr(smem + T::kKOffset + (i % T::kStages) * T::kTileBytes), 16, 1024);
        if (wait) {
          const int s = i % T::kStages;
          MbarWait(SmemAddr(&tile_full[s]), (full_phase >> s) & 1u);
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
      };
      // The key table of page i (keys n·8 + 2t and + 1), read ahead of the S wait.
      auto load_keys = [&](float4 (&keys)[8], int i) {
#pragma unroll
        for (int n = 0; n < 8; ++n) keys[n] = key_table[i % T::kStages][n * 4 + t];
      };
      // Logits of page i from S and the key table (S holds Q·Kᵀ over the tile as stored), masks and the
      // online softmax (log2 domain, rows g and g + 8): sc becomes P, unrounded; corr rescales O.
      auto softmax = [&](float (&sc)[8][4], const float4 (&keys)[8], int i, float (&corr)[2]) {
        const PageDesc page = tile_desc[i % T::kStages];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float a_j = e & 1 ? keys[n].z : keys[n].x, b_j = e & 1 ? keys[n].w : keys[n].y;
            sc[n][e] = fmaf(sc[n][e], a_j, q_sum[e >> 1] * b_j);
          }
        }
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
              sc[n][e] = Exp2Ftz(sc[n][e] - m_use);
              row_sum[r] += sc[n][e];
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
      auto pack_p = [&](const float (&sc)[8][4]) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          a[kk][0] = PackBf16(sc[2 * kk][0], sc[2 * kk][1]);
          a[kk][1] = PackBf16(sc[2 * kk][2], sc[2 * kk][3]);
          a[kk][2] = PackBf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
          a[kk][3] = PackBf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
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
        float (&sc)[8][4] = s_cur;
        float corr[2];
        float4 keys[8];
        issue_s(sc, 0, true);
        load_keys(keys, 0);
        WgmmaWait<0>();
        FenceRegs(sc);
        softmax(sc, keys, 0, corr);
        pack_p(sc);
        if (consumer == 1) BarArrive(T::kTurnBar, 2 * 128);  // group 0 issues first
        for (int i = 0; i < n_visible; ++i) {
          const bool more = i + 1 < n_visible;
          BarSync(turn, 2 * 128);
          issue_s(sc, more ? i + 1 : i, more);
          issue_pv(i);
          if (consumer == 0 || more) BarArrive(other_turn, 2 * 128);
          load_keys(keys, more ? i + 1 : i);
          WgmmaWait<1>();
          FenceRegs(sc);
          if (more) softmax(sc, keys, i + 1, corr);
          WgmmaWait<0>();
          FenceRegs(o);
          fence_p();
          if (i + T::kStages < n_visible) BarArrive(T::kEmptyBar + i % T::kStages, T::kThreads);
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
        auto step = [&](int i, float (&sc)[8][4], float (&s_next)[8][4]) {
          float4 keys[8];
          load_keys(keys, i);
          WgmmaWait<0>();
          FenceRegs(o);
          FenceRegs(sc);
          fence_p();
          if (i > 0 && i - 1 + T::kStages < n_visible) BarArrive(T::kEmptyBar + (i - 1) % T::kStages, T::kThreads);
          float corr[2];
          softmax(sc, keys, i, corr);
          rescale_o(corr);
          pack_p(sc);
          issue_pv(i);
          if (i + 1 < n_visible) issue_s(s_next, i + 1, true);
        };
        float s_next[8][4];  // the two S tiles alternate (unrolled by two, so that they stay registers)
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
  const int warp_rows = n_rows - row_base < 16 ? n_rows - row_base : 16;
  if (warp_rows > 0) WriteOutputRows<kDim>(p, head, stage_rows, T::kStagePitch, warp_rows, q0 + row_base, lane);
}

template <int kDim, int kStages>
constexpr int DynamicSmem(int max_page_bytes) {
  using T = WgmmaTraits<kDim, kStages>;
  return T::kAlign + T::kRawOffset + T::kRawStages * 2 * max_page_bytes;
}

// Four decoded stages where they fit beside the static shared memory (~9 KB) in the 227 KB of an
// SM: every format at d = 64, INT4 and INT8 at d = 128; BF16 pages at d = 128 take two. (The
// consumers hold two pages — S(i+1) runs while page i is in P·V — and hand a page back mid-way
// through the next, so with three stages the producer had half a page's time to decode each.)
inline constexpr int kMaxDynamicSmem = 216 * 1024;
inline constexpr int kDeepStages = 4;
template <int kDim>
int Stages(int max_page_bytes) {
  return DynamicSmem<kDim, kDeepStages>(max_page_bytes) <= kMaxDynamicSmem ? kDeepStages : 2;
}
static_assert(DynamicSmem<64, kDeepStages>(PageBytes(PageFormat::kBf16, 64)) <= kMaxDynamicSmem,
              "d = 64 takes four stages with any page (so it has no two-stage instance)");

// The kernel instance that serves (head_dim, max_page_bytes): f(dim, stages), both as
// std::integral_constant, so that every entry point below makes the same choice.
template <int kValue>
using Int = std::integral_constant<int, kValue>;
template <class F>
auto WithInstance(int head_dim, int max_page_bytes, F&& f) {
  if (head_dim == 128) {
    return Stages<128>(max_page_bytes) == kDeepStages ? f(Int<128>{}, Int<kDeepStages>{}) : f(Int<128>{}, Int<2>{});
  }
  return f(Int<64>{}, Int<kDeepStages>{});
}

// Raises the instance's dynamic shared-memory limit to what `max_page_bytes` needs; returns the bytes.
template <int kDim, int kStages>
Error Prepare(int max_page_bytes, int* smem) {
  *smem = DynamicSmem<kDim, kStages>(max_page_bytes);
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(AttentionWgmmaKernel<kDim, kStages>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, *smem));
  return Error::Ok();
}

template <int kDim, int kStages>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  using T = WgmmaTraits<kDim, kStages>;
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((Prepare<kDim, kStages>(p.max_page_bytes, &smem)));
  const dim3 grid(static_cast<unsigned>((p.n_q + kTileQueries - 1) / kTileQueries), static_cast<unsigned>(p.kv.n_heads));
  AttentionWgmmaKernel<kDim, kStages><<<grid, T::kThreads, smem, stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention wgmma kernel");
  return Error::Ok();
}

template <int kDim, int kStages>
Error CtasPerSm(const AttentionParams& p, int* ctas) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((Prepare<kDim, kStages>(p.max_page_bytes, &smem)));
  KVPACK_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, AttentionWgmmaKernel<kDim, kStages>,
                                                                   WgmmaTraits<kDim, kStages>::kThreads, smem));
  return Error::Ok();
}

}  // namespace

int AttentionWgmmaSharedBytes(int head_dim, int max_page_bytes) {
  return WithInstance(head_dim, max_page_bytes,
                      [&](auto dim, auto stages) { return DynamicSmem<dim.value, stages.value>(max_page_bytes); });
}

Error LaunchAttentionWgmma(const AttentionParams& params, cudaStream_t stream) {
  return WithInstance(params.kv.head_dim, params.max_page_bytes,
                      [&](auto dim, auto stages) { return Launch<dim.value, stages.value>(params, stream); });
}

Error AttentionWgmmaCtasPerSm(const AttentionParams& params, int* ctas) {
  return WithInstance(params.kv.head_dim, params.max_page_bytes,
                      [&](auto dim, auto stages) { return CtasPerSm<dim.value, stages.value>(params, ctas); });
}

}  // namespace kvpack::cuda
