#include "kernels/cuda/attention.h"

#include <climits>
#include <numeric>
#include <string>
#include <type_traits>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_wgmma.h"

namespace kvpack::cuda {
namespace {

// ── Tile traits ─────────────────────────────────────────────────────────────────────────────────
// kWarps warps of kMTiles × 16 query rows each cover the kTileQueries = 128 rows of a CTA. Every warp
// reads the whole decoded K and V page from shared memory, so rows per warp set the shared-memory
// traffic per MMA: 2 m-tiles per warp reuse each K/V fragment twice (the layout FlashAttention-2
// uses for d = 128). kCtasPerSm CTAs share an SM so one CTA's decode and softmax overlap the other's
// MMAs.
template <int kDim, int kWarpsT, int kMTilesT>
struct AttentionTraits {
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
};
// ── PTX wrappers ────────────────────────────────────────────────────────────────────────────────
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
// ── Page decode: raw page bytes (shared) → bf16 tile [64][kPitch] (shared) ───────────────────────
// Each thread produces 8 channels (one 16-byte store) per step; slots ≥ n_valid become zeros.
template <typename T, int kDim>
__device__ __forceinline__ void DecodePage(const uint8_t* raw, PageFormat format, int n_valid, uint16_t* tile) {
  constexpr int kUnitsPerRow = kDim / 8;
  for (int u = threadIdx.x; u < kPageTokens * kUnitsPerRow; u += T::kThreads) {
    const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow;
    *reinterpret_cast<uint4*>(tile + r * T::kPitch + c8 * 8) = DecodeUnit<kDim>(raw, format, n_valid, r, c8);
  }
}

template <int kDim, int kWarps, int kMTiles>
__global__ void __launch_bounds__(32 * kWarps, (AttentionTraits<kDim, kWarps, kMTiles>::kCtasPerSm)) AttentionKernel(const AttentionParams p) {
  using T = AttentionTraits<kDim, kWarps, kMTiles>;
  constexpr int kKTiles = kDim / 16;   // k-steps of S = Q·Kᵀ
  constexpr int kONTiles = kDim / 8;   // n-tiles of O
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(smem);                       // [128][kPitch] bf16
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes);          // [64][kPitch] bf16
  uint16_t* v_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes + T::kTileBytes);
  uint8_t* raw = smem + T::kRawOffset;                                         // [2 stages][K | V]
  __shared__ QueryRuns runs;
  __shared__ VisibleScratch<T::kThreads, T::kWindow> scratch;

  // ── Preconditions and prologue ──────────────────────────────────────────────────────────────
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;  // MMA fragment row group and column pair
  const int head = blockIdx.y;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTileQueries;  // first query of the tile
  const int n_rows = static_cast<int>(p.n_q - q0 < kTileQueries ? p.n_q - q0 : kTileQueries);
  const int64_t t0 = p.q_token_begin + q0;  // its token index (= position)
  const int n_pages = p.kv.n_pages;
  const int row0 = warp * T::kRowsPerWarp;  // this warp's first row in the tile

  for (int u = tid; u < kTileQueries * (kDim / 8); u += T::kThreads) {  // Q tile [128][d] → smem
    const int r = u / (kDim / 8), c8 = u % (kDim / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < n_rows) v = *reinterpret_cast<const uint4*>(p.q + (q0 + r) * p.q_stride + head * kDim + c8 * 8);
    *reinterpret_cast<uint4*>(q_tile + r * T::kPitch + c8 * 8) = v;
  }
  FindQueryRuns<T::kThreads>(p, t0, n_rows, runs);

  float o[kMTiles][kONTiles][4];  // O rows (g, g+8) of each m-tile × channels (n·8 + 2t, +1)
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int n = 0; n < kONTiles; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
  }
  float row_max[kMTiles][2], row_sum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) row_max[mt][0] = row_max[mt][1] = -INFINITY, row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;
  const int entries = runs.n;

  // ── Main loop: windows of pages, visible pages streamed through two raw stages ─────────────────
  for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
    const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
    const int n_visible = CollectVisiblePages(p, runs, w0, wn, scratch);
    if (n_visible == 0) continue;

    // Pipeline: page i+1's raw bytes are in flight while page i is decoded and multiplied.
    const int stage_bytes = 2 * p.max_page_bytes;
    LoadPageAsync<T::kThreads, kDim>(p, head, w0 + scratch.visible[0], raw, tid);
    CpAsyncCommit();
    for (int i = 0; i < n_visible; ++i) {
      // Stage (i+1)&1 held page i−1, decoded before the previous iteration's second barrier.
      if (i + 1 < n_visible) LoadPageAsync<T::kThreads, kDim>(p, head, w0 + scratch.visible[i + 1], raw + ((i + 1) & 1) * stage_bytes, tid);
      CpAsyncCommit();
      CpAsyncWait<1>();
      __syncthreads();  // page i's bytes are here; every warp is done with the previous tiles
      const PageDesc page = p.kv.pages[w0 + scratch.visible[i]];
      const uint8_t* stage = raw + (i & 1) * stage_bytes;
      DecodePage<T, kDim>(stage, static_cast<PageFormat>(page.format), page.n_valid, k_tile);
      DecodePage<T, kDim>(stage + p.max_page_bytes, static_cast<PageFormat>(page.format), page.n_valid, v_tile);
      __syncthreads();  // tiles decoded

      // S[rows × 64] = Q[rows × d] · Kᵀ[d × 64] for this warp's kMTiles × 16 rows.
      float s[kMTiles][8][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int n = 0; n < 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
      }
#pragma unroll
      for (int kc = 0; kc < kKTiles; ++kc) {
        uint32_t a[kMTiles][4];  // Q rows of each m-tile, channels kc·16 … +15
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          const int row = row0 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
          LdMatrixX4(a[mt], q_tile + row * T::kPitch + kc * 16 + (lane >> 4) * 8);
        }
#pragma unroll
        for (int n = 0; n < 8; n += 2) {
          uint32_t b[4];  // keys n·8 … n·8 + 15, channels kc·16 … +15
          LdMatrixX4(b, k_tile + ((n + (lane >> 4)) * 8 + (lane & 7)) * T::kPitch + kc * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma(s[mt][n], a[mt], b[0], b[1]);
            Mma(s[mt][n + 1], a[mt], b[2], b[3]);
          }
        }
      }

      // Masks: invalid slots, other sequences, future keys (causal).
      const bool need_mask = page.n_valid < kPageTokens || entries > 1 ||
                             (p.causal && page.token_begin + page.n_valid - 1 > t0);
      if (need_mask) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = row0 + mt * 16 + g + (e >> 1) * 8;
              const int key = n * 8 + 2 * t + (e & 1);
              const bool ok = key < page.n_valid && runs.q_seq[row] == page.seq_id &&
                              (!p.causal || page.token_begin + key <= t0 + row);
              if (!ok) s[mt][n][e] = -INFINITY;
            }
          }
        }
      }

      // Online softmax (log2 domain), rows g and g + 8 of each m-tile.
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
          const float m_new = fmaxf(row_max[mt][r], mx * scale_log2);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row so far
          const float corr = exp2f(row_max[mt][r] - m_use);
          row_max[mt][r] = m_new;
          row_sum[mt][r] *= corr;
#pragma unroll
          for (int n = 0; n < kONTiles; ++n) o[mt][n][2 * r] *= corr, o[mt][n][2 * r + 1] *= corr;
#pragma unroll
          for (int n = 0; n < 8; ++n) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              s[mt][n][e] = exp2f(fmaf(s[mt][n][e], scale_log2, -m_use));
              row_sum[mt][r] += s[mt][n][e];
            }
          }
        }
      }

      // O[rows × d] += P[rows × 64] · V[64 × d]; each V fragment serves every m-tile.
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          a[mt][0] = PackBf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = PackBf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = PackBf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = PackBf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < kONTiles; n += 2) {
          uint32_t b[4];  // keys kk·16 … +15, channels n·8 … n·8 + 15
          LdMatrixX4Trans(b, v_tile + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * T::kPitch + (n + (lane >> 4)) * 8);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            Mma(o[mt][n], a[mt], b[0], b[1]);
            Mma(o[mt][n + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with the tiles before the next window or the epilogue
  }

  // ── Epilogue: normalise, stage rows in shared memory, Rᵀ, ×λ_v and +μ_v per row, bf16 out ─────
  float* stage_rows = reinterpret_cast<float*>(smem) + row0 * T::kStagePitch;  // this warp's rows
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    float inv[2];
    InverseRowSums(row_sum[mt], inv);
#pragma unroll
    for (int n = 0; n < kONTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        stage_rows[(mt * 16 + g + (e >> 1) * 8) * T::kStagePitch + n * 8 + 2 * t + (e & 1)] = o[mt][n][e] * inv[e >> 1];
      }
    }
  }
  __syncwarp();
  const int warp_rows = n_rows - row0 < T::kRowsPerWarp ? n_rows - row0 : T::kRowsPerWarp;
  if (warp_rows > 0) WriteOutputRows<kDim>(p, head, stage_rows, T::kStagePitch, warp_rows, q0 + row0, lane);
}

template <int kDim, int kWarps, int kMTiles>
int DynamicSmem(int max_page_bytes) {
  return AttentionTraits<kDim, kWarps, kMTiles>::kRawOffset + 4 * max_page_bytes;  // + 2 raw stages × (K + V)
}

// Raises the kernel's dynamic shared-memory limit to what `max_page_bytes` needs and asks for the
// whole unified L1/shared array as shared memory (two kTall CTAs of ~93 KB must fit); returns the bytes.
template <int kDim, int kWarps, int kMTiles>
Error PrepareKernel(int max_page_bytes, int* smem) {
  auto kernel = AttentionKernel<kDim, kWarps, kMTiles>;
  *smem = DynamicSmem<kDim, kWarps, kMTiles>(max_page_bytes);
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, *smem));
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  return Error::Ok();
}

template <int kDim, int kWarps, int kMTiles>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  using T = AttentionTraits<kDim, kWarps, kMTiles>;
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((PrepareKernel<kDim, kWarps, kMTiles>(p.max_page_bytes, &smem)));
  const dim3 grid(static_cast<unsigned>((p.n_q + kTileQueries - 1) / kTileQueries), static_cast<unsigned>(p.kv.n_heads));
  AttentionKernel<kDim, kWarps, kMTiles><<<grid, T::kThreads, smem, stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention kernel");
  return Error::Ok();
}

template <int kDim, int kWarps, int kMTiles>
Error CtasPerSm(const AttentionParams& p, int* ctas) {
  int smem = 0;
  KVPACK_RETURN_IF_ERROR((PrepareKernel<kDim, kWarps, kMTiles>(p.max_page_bytes, &smem)));
  KVPACK_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      ctas, AttentionKernel<kDim, kWarps, kMTiles>, AttentionTraits<kDim, kWarps, kMTiles>::kThreads, smem));
  return Error::Ok();
}

// kAuto: the wgmma kernel for every format and head_dim (one CTA of at most ~207 KB of shared
// memory, BF16 pages at d = 128, always fits an H200 SM); it is the fastest in every measured case.
AttentionTilingChoice Resolve() { return AttentionTilingChoice::kWgmma; }

// The one place where runtime choices become template arguments: mma_sync(dim, warps, m_tiles), each
// a std::integral_constant, for the mma.sync tilings; wgmma() for the wgmma kernel, which picks its
// own instance (attention_wgmma.cu).
template <int kValue>
using Int = std::integral_constant<int, kValue>;
template <class MmaSync, class Wgmma>
Error WithTiling(const AttentionParams& p, MmaSync&& mma_sync, Wgmma&& wgmma) {
  const AttentionTilingChoice tiling = p.tiling == AttentionTilingChoice::kAuto ? Resolve() : p.tiling;
  if (tiling == AttentionTilingChoice::kWgmma) return wgmma();
  const bool wide = tiling == AttentionTilingChoice::kWide;
  if (p.kv.head_dim == 128) {
    return wide ? mma_sync(Int<128>{}, Int<8>{}, Int<1>{}) : mma_sync(Int<128>{}, Int<4>{}, Int<2>{});
  }
  return wide ? mma_sync(Int<64>{}, Int<8>{}, Int<1>{}) : mma_sync(Int<64>{}, Int<4>{}, Int<2>{});
}

}  // namespace

Error AttentionSupported(const KvEntryView& kv) {
  if (kv.head_dim != 64 && kv.head_dim != 128) {
    return Unsupported("attention: head_dim = " + std::to_string(kv.head_dim) + " (the GPU supports 64 and 128)");
  }
  if (kv.n_pages <= 0 || kv.n_heads <= 0) return InvalidArgument("attention: the K/V entry is empty");
  return Error::Ok();
}

int AttentionSharedBytes(int head_dim, int max_page_bytes, AttentionTilingChoice tiling) {
  const int raw = 2 * 2 * max_page_bytes;  // 2 stages × (K + V); kTall and kWide share the layout
  const int mma_sync = head_dim == 128 ? AttentionTraits<128, 4, 2>::kRawOffset + raw : AttentionTraits<64, 4, 2>::kRawOffset + raw;
  const int wgmma = AttentionWgmmaSharedBytes(head_dim, max_page_bytes);
  switch (tiling) {
    case AttentionTilingChoice::kTall:
    case AttentionTilingChoice::kWide: return mma_sync;
    case AttentionTilingChoice::kWgmma: return wgmma;
    default: return mma_sync > wgmma ? mma_sync : wgmma;
  }
}

Error ResolveAttentionTiling(int head_dim, int max_page_bytes, AttentionTilingChoice* resolved) {
  if (head_dim != 64 && head_dim != 128) return Unsupported("attention: head_dim = " + std::to_string(head_dim));
  (void)max_page_bytes;  // every page size fits the wgmma kernel's one CTA per SM
  *resolved = Resolve();
  return Error::Ok();
}

Error LaunchAttention(const AttentionParams& params, cudaStream_t stream) {
  KVPACK_RETURN_IF_ERROR(AttentionSupported(params.kv));
  if (params.n_q == 0) return Error::Ok();
  return WithTiling(
      params, [&](auto dim, auto warps, auto m_tiles) { return Launch<dim.value, warps.value, m_tiles.value>(params, stream); },
      [&] { return LaunchAttentionWgmma(params, stream); });
}

Error AttentionWaveRows(const AttentionParams& params, int64_t* rows) {
  KVPACK_RETURN_IF_ERROR(AttentionSupported(params.kv));
  int device = 0, sms = 0, ctas = 0;
  KVPACK_CUDA_RETURN(cudaGetDevice(&device));
  KVPACK_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KVPACK_RETURN_IF_ERROR(WithTiling(
      params, [&](auto dim, auto warps, auto m_tiles) { return CtasPerSm<dim.value, warps.value, m_tiles.value>(params, &ctas); },
      [&] { return AttentionWgmmaCtasPerSm(params, &ctas); }));
  if (ctas <= 0) return Error(ErrorCode::kInternal, "attention: the kernel fits no CTA on an SM");
  const int64_t resident = static_cast<int64_t>(sms) * ctas;
  *rows = resident / std::gcd(resident, static_cast<int64_t>(params.kv.n_heads)) * kTileQueries;
  return Error::Ok();
}

}  // namespace kvpack::cuda
