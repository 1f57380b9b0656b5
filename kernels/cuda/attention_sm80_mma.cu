// Attention over packed pages with mma.sync m16n8k16 (bf16 in, fp32 accumulate) from ldmatrix fragments:
// the portable kernel (every warp decodes; cp.async brings raw pages ahead of use). On Hopper it runs
// when a tiling other than kWgmma is asked for; it is the base of the consumer-GPU kernels (sm_80 …
// sm_120). Pages are decoded by the codecs (page_codec.cuh), visibility is kernels/visibility.h's.
#include "kernels/cuda/attention_sm80_mma.h"

#include <type_traits>

#include "kernels/attention_smem.h"
#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/page_codec.cuh"

namespace kvpack::cuda {
namespace {

// ── Tile traits ─────────────────────────────────────────────────────────────────────────────────
// kWarps warps of kMTiles × 16 query rows each cover the kTileQueries = 128 rows of a CTA. Every warp
// reads the whole decoded K and V page from shared memory, so rows per warp set the shared-memory
// traffic per MMA: 2 m-tiles per warp reuse each K/V fragment twice (the layout FlashAttention-2
// uses for d = 128). kCtasPerSm CTAs share an SM so one CTA's decode and softmax overlap the other's
// MMAs.
template <int kDimT, int kWarpsT, int kMTilesT>
struct AttentionTraits {
  static constexpr int kDim = kDimT;
  static_assert(kDim == 64 || kDim == 128, "head_dim 64 or 128");
  static constexpr int kWarps = kWarpsT;
  static constexpr int kMTiles = kMTilesT;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerWarp = 16 * kMTiles;
  static_assert(kWarps * kRowsPerWarp == kTileQueries, "warps cover the query tile");
  static constexpr int kCtasPerSm = 8 / kWarps;
  static constexpr int kPitch = kDim + 8;                  // bf16 per smem row: +16 B keeps ldmatrix conflict-free
  static constexpr int kQBytes = kTileQueries * kPitch * 2;
  static constexpr int kTileBytes = kPageTokens * kPitch * 2;  // one decoded K or V page
  static constexpr int kRawOffset = kQBytes + 2 * kTileBytes;  // Q [128][kPitch], K [64][kPitch], V [64][kPitch]
  static constexpr int kStagePitch = kDim + 4;             // floats per row of the epilogue staging
  static_assert(kTileQueries * kStagePitch * 4 <= kRawOffset, "epilogue staging fits in the Q/K/V tiles");
  static_assert(kRawOffset % 128 == 0, "raw stages stay 128-byte aligned");
  static constexpr int kWindow = 2048;                     // pages examined per visibility pass
  static_assert(kWindow % kThreads == 0, "window split evenly");
  static constexpr int kKTiles = kDim / 16;   // k-steps of S = Q·Kᵀ
  static constexpr int kONTiles = kDim / 8;   // n-tiles of O
  // The kernel choice (kernel_choice.h) sizes CTAs with attention_smem.h: the same layout.
  static_assert(kPitch == MmaSyncPitch(kDim) && kRawOffset == MmaSyncRawOffset(kDim) && kWindow == kMmaSyncWindow,
                "attention_smem.h's mma.sync layout");
  static_assert(kThreads == kMmaSyncTallThreads || kThreads == kMmaSyncWideThreads, "attention_smem.h's thread counts");
  static_assert((sizeof(QueryRuns) + sizeof(VisibleScratch<kThreads, kWindow>) + 127) / 128 * 128 ==
                    static_cast<size_t>(MmaSyncStaticSmem(kThreads)),
                "attention_smem.h's static shared memory");
};

// ── PTX wrappers ────────────────────────────────────────────────────────────────────────────────
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(smem)), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
// c[16×8] += a[16×16] · b[16×8], bf16 in, fp32 accumulate.
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ── Producer side: raw page copies and their decode ─────────────────────────────────────────────
// Starts the copy of one page's K and V bytes into a raw stage (K at 0, V at max_page_bytes); thread
// `tid` of kThreads copies every kThreads-th 16-byte piece.
template <int kThreads, int kDim>
__device__ __forceinline__ void LoadPageAsync(const AttentionParams& p, int head, int page, uint8_t* stage, int tid) {
  const int bytes = PageBytes(static_cast<PageFormat>(p.kv.pages[page].format), kDim);
  const int64_t slot = static_cast<int64_t>(head) * p.kv.n_pages + page;
  const uint8_t* k_src = p.kv.pool + p.kv.k_offsets[slot];
  const uint8_t* v_src = p.kv.pool + p.kv.v_offsets[slot];
  for (int i = tid * 16; i < bytes; i += kThreads * 16) {
    CpAsync16(stage + i, k_src + i);
    CpAsync16(stage + p.max_page_bytes + i, v_src + i);
  }
}
// Raw page bytes (shared) → bf16 tile [64][kPitch] (shared); each thread produces 8 channels (one
// 16-byte store) per step; slots ≥ n_valid become zeros.
template <typename T>
__device__ __forceinline__ void DecodePage(const uint8_t* raw, PageFormat format, int n_valid, uint16_t* tile) {
  constexpr int kUnitsPerRow = T::kDim / 8;
  for (int u = threadIdx.x; u < kPageTokens * kUnitsPerRow; u += T::kThreads) {
    const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow;
    *reinterpret_cast<uint4*>(tile + r * T::kPitch + c8 * 8) = DecodeUnit<T::kDim>(raw, format, n_valid, r, c8);
  }
}

// ── Consumer side: one warp's rows against one decoded page ─────────────────────────────────────
// A warp's fragments: row r of m-tile mt is row row0 + mt·16 + g + 8·(e / 2) of the tile, key or
// channel n·8 + 2t + (e mod 2).
template <class T>
struct WarpRows {
  float o[T::kMTiles][T::kONTiles][4];  // O rows (g, g+8) of each m-tile × channels (n·8 + 2t, +1)
  float row_max[T::kMTiles][2], row_sum[T::kMTiles][2];
  float s[T::kMTiles][8][4];            // S, then P, of the page in hand
};

// S[rows × 64] = Q[rows × d] · Kᵀ[d × 64] for this warp's kMTiles × 16 rows.
template <class T>
__device__ __forceinline__ void ScorePage(WarpRows<T>& w, const uint16_t* q_tile, const uint16_t* k_tile, int row0, int lane) {
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
    for (int n = 0; n < 8; ++n) w.s[mt][n][0] = w.s[mt][n][1] = w.s[mt][n][2] = w.s[mt][n][3] = 0.0f;
  }
#pragma unroll
  for (int kc = 0; kc < T::kKTiles; ++kc) {
    uint32_t a[T::kMTiles][4];  // Q rows of each m-tile, channels kc·16 … +15
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
      const int row = row0 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      LdMatrixX4(a[mt], q_tile + row * T::kPitch + kc * 16 + (lane >> 4) * 8);
    }
#pragma unroll
    for (int n = 0; n < 8; n += 2) {
      uint32_t b[4];  // keys n·8 … n·8 + 15, channels kc·16 … +15
      LdMatrixX4(b, k_tile + ((n + (lane >> 4)) * 8 + (lane & 7)) * T::kPitch + kc * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int mt = 0; mt < T::kMTiles; ++mt) {
        Mma(w.s[mt][n], a[mt], b[0], b[1]);
        Mma(w.s[mt][n + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Masks (where the page needs them), then the online softmax in the log2 domain: S becomes P.
template <class T>
__device__ __forceinline__ void SoftmaxPage(WarpRows<T>& w, const AttentionParams& p, const QueryRuns& runs,
                                            const PageDesc& page, int64_t t0, int row0, float scale_log2, int lane) {
  const int g = lane >> 2, t = lane & 3;
  if (p.visibility.PageNeedsMask(page, runs.n == 1, t0)) {
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + mt * 16 + g + (e >> 1) * 8;
          if (!p.visibility.KeyVisible(page, n * 8 + 2 * t + (e & 1), runs.q_seq[row], t0 + row)) w.s[mt][n][e] = -INFINITY;
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(w.s[mt][n][2 * r], w.s[mt][n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(w.row_max[mt][r], mx * scale_log2);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row so far
      const float corr = exp2f(w.row_max[mt][r] - m_use);
      w.row_max[mt][r] = m_new;
      w.row_sum[mt][r] *= corr;
#pragma unroll
      for (int n = 0; n < T::kONTiles; ++n) w.o[mt][n][2 * r] *= corr, w.o[mt][n][2 * r + 1] *= corr;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          w.s[mt][n][e] = exp2f(fmaf(w.s[mt][n][e], scale_log2, -m_use));
          w.row_sum[mt][r] += w.s[mt][n][e];
        }
      }
    }
  }
}

// O[rows × d] += P[rows × 64] · V[64 × d]; each V fragment serves every m-tile.
template <class T>
__device__ __forceinline__ void AccumulatePv(WarpRows<T>& w, const uint16_t* v_tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[T::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
      a[mt][0] = PackBf16(w.s[mt][2 * kk][0], w.s[mt][2 * kk][1]);
      a[mt][1] = PackBf16(w.s[mt][2 * kk][2], w.s[mt][2 * kk][3]);
      a[mt][2] = PackBf16(w.s[mt][2 * kk + 1][0], w.s[mt][2 * kk + 1][1]);
      a[mt][3] = PackBf16(w.s[mt][2 * kk + 1][2], w.s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int n = 0; n < T::kONTiles; n += 2) {
      uint32_t b[4];  // keys kk·16 … +15, channels n·8 … n·8 + 15
      LdMatrixX4Trans(b, v_tile + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * T::kPitch + (n + (lane >> 4)) * 8);
#pragma unroll
      for (int mt = 0; mt < T::kMTiles; ++mt) {
        Mma(w.o[mt][n], a[mt], b[0], b[1]);
        Mma(w.o[mt][n + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Normalise, stage rows in shared memory, Rᵀ, ×λ_v and +μ_v per row, bf16 out.
template <class T>
__device__ __forceinline__ void StoreWarpRows(const WarpRows<T>& w, const AttentionParams& p, uint8_t* smem,
                                              const QueryTileCoords& tile, int row0, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float* stage_rows = reinterpret_cast<float*>(smem) + row0 * T::kStagePitch;  // this warp's rows
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
    float inv[2];
    InverseRowSums(w.row_sum[mt], inv);
#pragma unroll
    for (int n = 0; n < T::kONTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        stage_rows[(mt * 16 + g + (e >> 1) * 8) * T::kStagePitch + n * 8 + 2 * t + (e & 1)] = w.o[mt][n][e] * inv[e >> 1];
      }
    }
  }
  __syncwarp();
  const int warp_rows = tile.n_rows - row0 < T::kRowsPerWarp ? tile.n_rows - row0 : T::kRowsPerWarp;
  if (warp_rows > 0) WriteOutputRows<T::kDim>(p, tile.head, stage_rows, T::kStagePitch, warp_rows, tile.q0 + row0, lane);
}

template <int kDim, int kWarps, int kMTiles>
__global__ void __launch_bounds__(32 * kWarps, (AttentionTraits<kDim, kWarps, kMTiles>::kCtasPerSm)) AttentionSm80Kernel(const AttentionParams p) {
  using T = AttentionTraits<kDim, kWarps, kMTiles>;
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(smem);                       // [128][kPitch] bf16
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes);          // [64][kPitch] bf16
  uint16_t* v_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes + T::kTileBytes);
  uint8_t* raw = smem + T::kRawOffset;                                         // [2 stages][K | V]
  __shared__ QueryRuns runs;
  __shared__ VisibleScratch<T::kThreads, T::kWindow> scratch;

  // ── Prologue: Q tile [128][d] → smem, the tile's query runs, O and the softmax state ────────────
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const QueryTileCoords tile = TileOfBlock(p);
  const int row0 = warp * T::kRowsPerWarp;  // this warp's first row in the tile
  for (int u = tid; u < kTileQueries * (kDim / 8); u += T::kThreads) {
    const int r = u / (kDim / 8), c8 = u % (kDim / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < tile.n_rows) v = *reinterpret_cast<const uint4*>(p.q + (tile.q0 + r) * p.q_stride + tile.head * kDim + c8 * 8);
    *reinterpret_cast<uint4*>(q_tile + r * T::kPitch + c8 * 8) = v;
  }
  FindQueryRuns<T::kThreads>(p, tile.t0, tile.n_rows, runs);
  WarpRows<T> w;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int n = 0; n < T::kONTiles; ++n) w.o[mt][n][0] = w.o[mt][n][1] = w.o[mt][n][2] = w.o[mt][n][3] = 0.0f;
    w.row_max[mt][0] = w.row_max[mt][1] = -INFINITY, w.row_sum[mt][0] = w.row_sum[mt][1] = 0.0f;
  }
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;

  // ── Main loop: windows of pages, visible pages streamed through two raw stages ─────────────────
  const int n_pages = p.kv.n_pages;
  for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
    const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
    const int n_visible = CollectVisiblePages(p, runs, w0, wn, scratch);
    if (n_visible == 0) continue;
    // Pipeline: page i+1's raw bytes are in flight while page i is decoded and multiplied.
    const int stage_bytes = 2 * p.max_page_bytes;
    LoadPageAsync<T::kThreads, kDim>(p, tile.head, w0 + scratch.visible[0], raw, tid);
    CpAsyncCommit();
    for (int i = 0; i < n_visible; ++i) {
      // Stage (i+1)&1 held page i−1, decoded before the previous iteration's second barrier.
      if (i + 1 < n_visible) LoadPageAsync<T::kThreads, kDim>(p, tile.head, w0 + scratch.visible[i + 1], raw + ((i + 1) & 1) * stage_bytes, tid);
      CpAsyncCommit();
      CpAsyncWait<1>();
      __syncthreads();  // page i's bytes are here; every warp is done with the previous tiles
      const PageDesc page = p.kv.pages[w0 + scratch.visible[i]];
      const uint8_t* stage = raw + (i & 1) * stage_bytes;
      DecodePage<T>(stage, static_cast<PageFormat>(page.format), page.n_valid, k_tile);
      DecodePage<T>(stage + p.max_page_bytes, static_cast<PageFormat>(page.format), page.n_valid, v_tile);
      __syncthreads();  // tiles decoded
      ScorePage(w, q_tile, k_tile, row0, lane);
      SoftmaxPage(w, p, runs, page, tile.t0, row0, scale_log2, lane);
      AccumulatePv(w, v_tile, lane);
    }
    __syncthreads();  // every warp is done with the tiles before the next window or the epilogue
  }

  // ── Epilogue ─────────────────────────────────────────────────────────────────────────────────
  StoreWarpRows(w, p, smem, tile, row0, lane);
}

template <int kDim, int kWarps, int kMTiles>
int DynamicSmem(int max_page_bytes) {
  static_assert(AttentionTraits<kDim, kWarps, kMTiles>::kRawOffset == MmaSyncRawOffset(kDim), "one layout");
  return MmaSyncDynamicSmem(kDim, max_page_bytes);  // + 2 raw stages × (K + V)
}

// Raises the kernel's dynamic shared-memory limit to what `max_page_bytes` needs and asks for the
// whole unified L1/shared array as shared memory (two kTall CTAs of ~93 KB must fit); returns the bytes.
template <int kDim, int kWarps, int kMTiles>
Error PrepareKernel(int max_page_bytes, int* smem) {
  auto kernel = AttentionSm80Kernel<kDim, kWarps, kMTiles>;
  *smem = DynamicSmem<kDim, kWarps, kMTiles>(max_page_bytes);
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *smem));
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  return Error::Ok();
}

template <int kDim, int kWarps, int kMTiles>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((PrepareKernel<kDim, kWarps, kMTiles>(p.max_page_bytes, &smem)));
  AttentionSm80Kernel<kDim, kWarps, kMTiles><<<AttentionGrid(p), AttentionTraits<kDim, kWarps, kMTiles>::kThreads, smem, stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention sm80 kernel");
  return Error::Ok();
}

template <int kDim, int kWarps, int kMTiles>
Error CtasPerSm(const AttentionParams& p, int* ctas) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((PrepareKernel<kDim, kWarps, kMTiles>(p.max_page_bytes, &smem)));
  KVPACK_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      ctas, AttentionSm80Kernel<kDim, kWarps, kMTiles>, AttentionTraits<kDim, kWarps, kMTiles>::kThreads, smem));
  return Error::Ok();
}

// The one place where the tiling becomes template arguments: f(dim, warps, m_tiles), each a
// std::integral_constant. kWide: 8 warps × 1 m-tile; otherwise kTall: 4 warps × 2 m-tiles.
template <int kValue>
using Int = std::integral_constant<int, kValue>;
template <class F>
Error WithTiling(int head_dim, AttentionTilingChoice tiling, F&& f) {
  const bool wide = tiling == AttentionTilingChoice::kWide;
  if (head_dim == 128) return wide ? f(Int<128>{}, Int<8>{}, Int<1>{}) : f(Int<128>{}, Int<4>{}, Int<2>{});
  return wide ? f(Int<64>{}, Int<8>{}, Int<1>{}) : f(Int<64>{}, Int<4>{}, Int<2>{});
}

}  // namespace

int AttentionSm80SharedBytes(int head_dim, int max_page_bytes) {
  return MmaSyncDynamicSmem(head_dim, max_page_bytes);  // kTall and kWide share the layout
}

Error LaunchAttentionSm80(const AttentionParams& params, AttentionTilingChoice tiling, cudaStream_t stream) {
  return WithTiling(params.kv.head_dim, tiling, [&](auto dim, auto warps, auto m_tiles) {
    return Launch<dim.value, warps.value, m_tiles.value>(params, stream);
  });
}

Error AttentionSm80CtasPerSm(const AttentionParams& params, AttentionTilingChoice tiling, int* ctas) {
  return WithTiling(params.kv.head_dim, tiling, [&](auto dim, auto warps, auto m_tiles) {
    return CtasPerSm<dim.value, warps.value, m_tiles.value>(params, ctas);
  });
}

}  // namespace kvpack::cuda
