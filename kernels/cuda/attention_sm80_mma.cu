// Attention over packed pages with mma.sync m16n8k16 (bf16 in, fp32 accumulate) from ldmatrix fragments,
// and on the INT8 MMA path S = Q·Kᵀ with m16n8k32 (s8 in, s32 accumulate): the portable kernel. Every
// warp decodes V (and K on the bf16 path) into a bf16 tile; cp.async brings each page's raw bytes a page
// ahead of use. On Hopper it runs when a tiling other than kWgmma is asked for; it is the kernel of
// every other GPU (sm_80 … sm_120). Pages are decoded by the codecs (page_codec.cuh), visibility is
// kernels/visibility.h's. H200, N = 32768, 56×128 (bench/RESULTS.md, session 10): INT4 293 TFLOP/s on the
// INT8 path, 275 on bf16 (208 before the session); 299 at N = 152,263.
#include "kernels/cuda/attention_sm80_mma.h"

#include <type_traits>

#include "kernels/attention_smem.h"
#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm80_warp.cuh"
#include "kernels/cuda/cuda_status.h"

namespace kvpack::cuda {
namespace {

using namespace sm80;

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

// kInt8Qk: the INT8 MMA path (mma_path.h): S = Q·Kᵀ as m16n8k32 s8 MMAs of the tile's int8 query codes
// and K's integer codes read from the raw stage (ScorePageInt8: no K tile is decoded), logits from the
// int32 sums and a key table per page; P·V in bf16 as on the bf16 path. The same shared-memory bytes:
// the int8 Q tile takes the K tile's place, the rows' s_q and Σq / s_q and the key table the bf16 Q's.
template <int kDim, int kWarps, int kMTiles, bool kInt8Qk>
__global__ void __launch_bounds__(32 * kWarps, (AttentionTraits<kDim, kWarps, kMTiles>::kCtasPerSm)) AttentionSm80Kernel(const AttentionParams p) {
  using T = AttentionTraits<kDim, kWarps, kMTiles>;
  using L = Int8QkLayout<kDim>;
  static_assert(L::kQ8Bytes <= T::kTileBytes, "the int8 Q tile fits in the K tile's place");
  static_assert(2 * kTileQueries * 4 + kPageTokens * 8 <= T::kQBytes, "row data and key table fit in the bf16 Q's place");
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(smem);                       // [128][kPitch] bf16
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes);          // [64][kPitch] bf16
  uint16_t* v_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes + T::kTileBytes);
  uint8_t* raw = smem + T::kRawOffset;                                         // [2 stages][K | V]
  // The INT8 path's: s_q [128], Σq / s_q [128], the key table [64] (a_j, b_j), the int8 Q tile.
  float* q_scale = reinterpret_cast<float*>(smem);
  float* q_sum_over_scale = q_scale + kTileQueries;
  float2* key_table = reinterpret_cast<float2*>(q_sum_over_scale + kTileQueries);
  uint8_t* q8 = smem + T::kQBytes;
  __shared__ QueryRuns runs;
  __shared__ VisibleScratch<T::kThreads, T::kWindow> scratch;

  // ── Prologue: Q tile [128][d] → smem, the tile's query runs, O and the softmax state ────────────
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const QueryTileCoords tile = TileOfBlock(p);
  const int row0 = warp * T::kRowsPerWarp;  // this warp's first row in the tile
  if constexpr (kInt8Qk) {
    QuantizeQueryRows<T>(p, tile, q8, q_scale, q_sum_over_scale);
  } else {
    for (int u = tid; u < kTileQueries * (kDim / 8); u += T::kThreads) {
      const int r = u / (kDim / 8), c8 = u % (kDim / 8);
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < tile.n_rows) v = *reinterpret_cast<const uint4*>(p.q + (tile.q0 + r) * p.q_stride + tile.head * kDim + c8 * 8);
      *reinterpret_cast<uint4*>(q_tile + r * T::kPitch + c8 * 8) = v;
    }
  }
  FindQueryRuns<T::kThreads>(p, tile.t0, tile.n_rows, runs);  // its barriers publish Q too
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
    // Pipeline: page i+1's raw bytes are in flight while page i is decoded and multiplied. Its copy
    // starts after the first barrier of iteration i, when every warp is done with page i−1, whose raw
    // stage it overwrites (the INT8 path reads K from there until the end of an iteration).
    const int stage_bytes = 2 * p.max_page_bytes;
    // The descriptor and source of page i + 1 are read while page i's copy is in flight.
    PageSource next = FetchPageSource(p, tile.head, w0 + scratch.visible[0]);
    IssuePageCopy<T::kThreads, kDim>(p, next, raw, tid);
    CpAsyncCommit();
    PageDesc page = next.desc;  // the page in hand
    if (n_visible > 1) next = FetchPageSource(p, tile.head, w0 + scratch.visible[1]);
    for (int i = 0; i < n_visible; ++i) {
      CpAsyncWait<0>();
      __syncthreads();  // page i's bytes are here; every warp is done with page i − 1
      const PageDesc following = next.desc;
      if (i + 1 < n_visible) {
        IssuePageCopy<T::kThreads, kDim>(p, next, raw + ((i + 1) & 1) * stage_bytes, tid);
        CpAsyncCommit();
        if (i + 2 < n_visible) next = FetchPageSource(p, tile.head, w0 + scratch.visible[i + 2]);
      }
      const PageFormat format = static_cast<PageFormat>(page.format);
      const uint8_t* stage = raw + (i & 1) * stage_bytes;
      if constexpr (kInt8Qk) {
        WriteKeyTable<kDim>(stage, format, scale_log2, key_table);
      } else {
        DecodePage<T, false>(stage, format, page.n_valid, k_tile);
      }
      DecodePage<T, true>(stage + p.max_page_bytes, format, page.n_valid, v_tile);
      __syncthreads();  // tiles decoded
      if constexpr (kInt8Qk) {
        // Rows g, g + 8 of each m-tile: s_q and Σq / s_q, read per page (kept in registers across the
        // loop they pushed the kTall instance into spills).
        float row_scale[kMTiles][2], q_sums[kMTiles][2];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = row0 + mt * 16 + (lane >> 2) + 8 * r;
            row_scale[mt][r] = q_scale[row], q_sums[mt][r] = q_sum_over_scale[row];
          }
        }
        ScorePageInt8(w, q8, stage, format, key_table, q_sums, row0, lane);
        SoftmaxPageScaled(w, p, runs, page, tile.t0, row0, row_scale, lane);
      } else {
        ScorePage(w, q_tile, k_tile, row0, lane);
        SoftmaxPage(w, p, runs, page, tile.t0, row0, scale_log2, lane);
      }
      AccumulatePv(w, v_tile, lane);
      page = following;
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
template <int kDim, int kWarps, int kMTiles, bool kInt8Qk>
Error PrepareKernel(int max_page_bytes, int* smem) {
  auto kernel = AttentionSm80Kernel<kDim, kWarps, kMTiles, kInt8Qk>;
  *smem = DynamicSmem<kDim, kWarps, kMTiles>(max_page_bytes);
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *smem));
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  return Error::Ok();
}

template <int kDim, int kWarps, int kMTiles, bool kInt8Qk>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((PrepareKernel<kDim, kWarps, kMTiles, kInt8Qk>(p.max_page_bytes, &smem)));
  AttentionSm80Kernel<kDim, kWarps, kMTiles, kInt8Qk><<<AttentionGrid(p), AttentionTraits<kDim, kWarps, kMTiles>::kThreads, smem, stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention sm80 kernel");
  return Error::Ok();
}

template <int kDim, int kWarps, int kMTiles, bool kInt8Qk>
Error CtasPerSm(const AttentionParams& p, int* ctas) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((PrepareKernel<kDim, kWarps, kMTiles, kInt8Qk>(p.max_page_bytes, &smem)));
  KVPACK_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      ctas, AttentionSm80Kernel<kDim, kWarps, kMTiles, kInt8Qk>, AttentionTraits<kDim, kWarps, kMTiles>::kThreads, smem));
  return Error::Ok();
}

// The one place where the tiling and the MMA path become template arguments: f(dim, warps, m_tiles,
// int8_qk), each a std::integral_constant. kWide: 8 warps × 1 m-tile; otherwise kTall: 4 warps × 2
// m-tiles. int8_qk: the INT8 MMA path (params.mma == kInt8).
template <int kValue>
using Int = std::integral_constant<int, kValue>;
template <bool kValue>
using Bool = std::integral_constant<bool, kValue>;
template <class F>
Error WithTiling(int head_dim, AttentionTilingChoice tiling, MmaPath mma, F&& f) {
  const bool wide = tiling == AttentionTilingChoice::kWide;
  auto with_mma = [&](auto dim, auto warps, auto m_tiles) {
    return mma == MmaPath::kInt8 ? f(dim, warps, m_tiles, Bool<true>{}) : f(dim, warps, m_tiles, Bool<false>{});
  };
  if (head_dim == 128) return wide ? with_mma(Int<128>{}, Int<8>{}, Int<1>{}) : with_mma(Int<128>{}, Int<4>{}, Int<2>{});
  return wide ? with_mma(Int<64>{}, Int<8>{}, Int<1>{}) : with_mma(Int<64>{}, Int<4>{}, Int<2>{});
}

}  // namespace

int AttentionSm80SharedBytes(int head_dim, int max_page_bytes) {
  return MmaSyncDynamicSmem(head_dim, max_page_bytes);  // kTall and kWide share the layout
}

Error LaunchAttentionSm80(const AttentionParams& params, AttentionTilingChoice tiling, cudaStream_t stream) {
  return WithTiling(params.kv.head_dim, tiling, params.mma, [&](auto dim, auto warps, auto m_tiles, auto int8_qk) {
    return Launch<dim.value, warps.value, m_tiles.value, int8_qk.value>(params, stream);
  });
}

Error AttentionSm80CtasPerSm(const AttentionParams& params, AttentionTilingChoice tiling, int* ctas) {
  return WithTiling(params.kv.head_dim, tiling, params.mma, [&](auto dim, auto warps, auto m_tiles, auto int8_qk) {
    return CtasPerSm<dim.value, warps.value, m_tiles.value, int8_qk.value>(params, ctas);
  });
}

}  // namespace kvpack::cuda
