#include "kernels/cuda/attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <string>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/warp_row.cuh"

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
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
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
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(smem)), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void CpAsyncWaitOne() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float HalfBits(uint32_t bits) { return __half2float(__ushort_as_half(static_cast<unsigned short>(bits))); }

// ── Page decode: raw page bytes (shared) → bf16 tile [64][kPitch] (shared) ───────────────────────
// Each thread produces 8 channels (one 16-byte store) per step; slots ≥ n_valid become zeros.
template <typename T, int kDim>
__device__ __forceinline__ void DecodePage(const uint8_t* raw, PageFormat format, int n_valid, uint16_t* tile) {
  constexpr int kUnitsPerRow = kDim / 8;
  for (int u = threadIdx.x; u < kPageTokens * kUnitsPerRow; u += T::kThreads) {
    const int r = u / kUnitsPerRow, c8 = u % kUnitsPerRow;
    uint4 out = make_uint4(0, 0, 0, 0);
    if (r < n_valid) {
      if (format == PageFormat::kInt4) {
        const uint32_t codes = *reinterpret_cast<const uint32_t*>(raw + r * (kDim / 2) + c8 * 4);
        const uint32_t meta = *reinterpret_cast<const uint32_t*>(raw + MetaOffset(PageFormat::kInt4, kDim) + r * 4);
        const float scale = HalfBits(meta & 0xffffu), lo = HalfBits(meta >> 16);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = fmaf(static_cast<float>((codes >> (4 * i)) & 0xfu), scale, lo);
        out = make_uint4(PackBf16x2(v[0], v[1]), PackBf16x2(v[2], v[3]), PackBf16x2(v[4], v[5]), PackBf16x2(v[6], v[7]));
      } else if (format == PageFormat::kInt8) {
        const uint2 codes = *reinterpret_cast<const uint2*>(raw + r * kDim + c8 * 8);
        const float scale = HalfBits(*reinterpret_cast<const uint16_t*>(raw + MetaOffset(PageFormat::kInt8, kDim) + r * 2));
        float v[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          v[i] = static_cast<float>(static_cast<int8_t>(codes.x >> (8 * i))) * scale;
          v[4 + i] = static_cast<float>(static_cast<int8_t>(codes.y >> (8 * i))) * scale;
        }
        out = make_uint4(PackBf16x2(v[0], v[1]), PackBf16x2(v[2], v[3]), PackBf16x2(v[4], v[5]), PackBf16x2(v[6], v[7]));
      } else {
        out = *reinterpret_cast<const uint4*>(raw + r * kDim * 2 + c8 * 16);
      }
    }
    *reinterpret_cast<uint4*>(tile + r * T::kPitch + c8 * 8) = out;
  }
}

// Starts the copy of one page's K and V bytes into a raw stage (K at 0, V at max_page_bytes).
template <typename T, int kDim>
__device__ __forceinline__ void LoadPageAsync(const AttentionParams& p, int head, int page, uint8_t* stage) {
  const int bytes = PageBytes(static_cast<PageFormat>(p.kv.pages[page].format), kDim);
  const int64_t slot = static_cast<int64_t>(head) * p.kv.n_pages + page;
  const uint8_t* k_src = p.kv.pool + p.kv.k_offsets[slot];
  const uint8_t* v_src = p.kv.pool + p.kv.v_offsets[slot];
  for (int i = threadIdx.x * 16; i < bytes; i += T::kThreads * 16) {
    CpAsync16(stage + i, k_src + i);
    CpAsync16(stage + p.max_page_bytes + i, v_src + i);
  }
}

template <int kDim, int kWarps, int kMTiles>
__global__ void __launch_bounds__(32 * kWarps, 8 / kWarps) AttentionKernel(const AttentionParams p) {
  using T = AttentionTraits<kDim, kWarps, kMTiles>;
  constexpr int kKTiles = kDim / 16;   // k-steps of S = Q·Kᵀ
  constexpr int kONTiles = kDim / 8;   // n-tiles of O
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(smem);                       // [128][kPitch] bf16
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes);          // [64][kPitch] bf16
  uint16_t* v_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes + T::kTileBytes);
  uint8_t* raw = smem + T::kRawOffset;                                         // [2 stages][K | V]
  __shared__ int q_seq[kTileQueries];        // sequence id of each query row
  __shared__ int ent_seq[kTileQueries];      // runs of equal sequence id among the rows …
  __shared__ int ent_last[kTileQueries];     // … and the last token position of each run
  __shared__ int n_ent;
  __shared__ int n_vis;                      // visible pages in the current window
  __shared__ uint16_t visible[T::kWindow];   // visible pages of the current window (offsets)
  __shared__ int counts[T::kThreads];

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
  for (int r = tid; r < kTileQueries; r += T::kThreads) {
    const int rr = r < n_rows ? r : n_rows - 1;  // padding rows copy the last real row (never written)
    q_seq[r] = p.kv.pages[FindPage(p.kv.pages, n_pages, t0 + rr)].seq_id;
  }
  __syncthreads();
  if (tid == 0) {
    int n = 0;
    for (int r = 0; r < n_rows; ++r) {
      if (n == 0 || q_seq[r] != ent_seq[n - 1]) ent_seq[n++] = q_seq[r];
      ent_last[n - 1] = static_cast<int>(t0 + r);
    }
    n_ent = n;
  }
  __syncthreads();

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
  const int entries = n_ent;

  auto is_visible = [&](const PageDesc& page) {
    for (int e = 0; e < entries; ++e) {
      if (page.seq_id == ent_seq[e] && (!p.causal || page.token_begin <= ent_last[e])) return true;
    }
    return false;
  };

  // ── Main loop: windows of pages, visible pages streamed through two raw stages ─────────────────
  for (int w0 = 0; w0 < n_pages; w0 += T::kWindow) {
    const int wn = n_pages - w0 < T::kWindow ? n_pages - w0 : T::kWindow;
    constexpr int kPerThread = T::kWindow / T::kThreads;
    uint32_t mine = 0;  // bit i: page tid·kPerThread + i is visible
    int count = 0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = tid * kPerThread + i;
      if (idx < wn && is_visible(p.kv.pages[w0 + idx])) mine |= 1u << i, ++count;
    }
    counts[tid] = count;
    __syncthreads();
    if (tid == 0) {  // exclusive prefix sum, in page order
      int run = 0;
      for (int i = 0; i < T::kThreads; ++i) {
        const int c = counts[i];
        counts[i] = run;
        run += c;
      }
      n_vis = run;
    }
    __syncthreads();
    int pos = counts[tid];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (mine & (1u << i)) visible[pos++] = static_cast<uint16_t>(tid * kPerThread + i);
    }
    const int n_visible = n_vis;
    __syncthreads();
    if (n_visible == 0) continue;

    // Pipeline: page i+1's raw bytes are in flight while page i is decoded and multiplied.
    const int stage_bytes = 2 * p.max_page_bytes;
    LoadPageAsync<T, kDim>(p, head, w0 + visible[0], raw);
    CpAsyncCommit();
    for (int i = 0; i < n_visible; ++i) {
      // Stage (i+1)&1 held page i−1, decoded before the previous iteration's second barrier.
      if (i + 1 < n_visible) LoadPageAsync<T, kDim>(p, head, w0 + visible[i + 1], raw + ((i + 1) & 1) * stage_bytes);
      CpAsyncCommit();
      CpAsyncWaitOne();
      __syncthreads();  // page i's bytes are here; every warp is done with the previous tiles
      const PageDesc page = p.kv.pages[w0 + visible[i]];
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
              const bool ok = key < page.n_valid && q_seq[row] == page.seq_id &&
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
          a[mt][0] = PackBf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = PackBf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = PackBf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = PackBf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
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
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      l += __shfl_xor_sync(kFullMask, l, 1);
      l += __shfl_xor_sync(kFullMask, l, 2);
      inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
    }
#pragma unroll
    for (int n = 0; n < kONTiles; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        stage_rows[(mt * 16 + g + (e >> 1) * 8) * T::kStagePitch + n * 8 + 2 * t + (e & 1)] = o[mt][n][e] * inv[e >> 1];
      }
    }
  }
  __syncwarp();
  constexpr int kPerLane = kDim / 32;
  const float* mu_v = p.kv.mu_v + head * kDim + lane * kPerLane;
  const float* lambda_v = p.kv.lambda_v + head * kDim + lane * kPerLane;
  float sign[kPerLane];
  LaneSigns(sign, lane, p.kv.seed);
  for (int rr = 0; rr < T::kRowsPerWarp; ++rr) {
    const int row = row0 + rr;
    if (row >= n_rows) break;  // warp-uniform
    float x[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = stage_rows[rr * T::kStagePitch + lane * kPerLane + i];
    if (p.kv.rotate) WarpRotateInverse(x, lane, sign);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = __fmul_rn(x[i], lambda_v[i]) + mu_v[i];  // no FMA: as the CPU rounds
    StoreBf16(p.out + (q0 + row) * p.out_stride + head * kDim + lane * kPerLane, x);
  }
}

template <int kDim, int kWarps, int kMTiles>
int DynamicSmem(int max_page_bytes) {
  return AttentionTraits<kDim, kWarps, kMTiles>::kRawOffset + 4 * max_page_bytes;  // + 2 raw stages × (K + V)
}

// Raises the kernel's dynamic shared-memory limit to what `max_page_bytes` needs and asks for the
// whole unified L1/shared array as shared memory (two kTall CTAs of ~93 KB must fit).
template <int kDim, int kWarps, int kMTiles>
Error PrepareKernel(int max_page_bytes) {
  auto kernel = AttentionKernel<kDim, kWarps, kMTiles>;
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          DynamicSmem<kDim, kWarps, kMTiles>(max_page_bytes)));
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  return Error::Ok();
}

template <int kDim, int kWarps, int kMTiles>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  using T = AttentionTraits<kDim, kWarps, kMTiles>;
  KVPACK_RETURN_IF_ERROR((PrepareKernel<kDim, kWarps, kMTiles>(p.max_page_bytes)));
  const dim3 grid(static_cast<unsigned>((p.n_q + kTileQueries - 1) / kTileQueries), static_cast<unsigned>(p.kv.n_heads));
  AttentionKernel<kDim, kWarps, kMTiles><<<grid, T::kThreads, DynamicSmem<kDim, kWarps, kMTiles>(p.max_page_bytes), stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention kernel");
  return Error::Ok();
}

// kTall when two of its CTAs fit on an SM with this entry's raw stages (INT4/INT8 pages), else kWide
// (BF16 pages make the raw stages 64 KiB at d = 128: one kTall CTA of 4 warps would idle the SM).
template <int kDim>
Error Resolve(int max_page_bytes, AttentionTilingChoice* resolved) {
  KVPACK_RETURN_IF_ERROR((PrepareKernel<kDim, 4, 2>(max_page_bytes)));
  int blocks = 0;
  KVPACK_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &blocks, AttentionKernel<kDim, 4, 2>, AttentionTraits<kDim, 4, 2>::kThreads, DynamicSmem<kDim, 4, 2>(max_page_bytes)));
  *resolved = blocks >= 2 ? AttentionTilingChoice::kTall : AttentionTilingChoice::kWide;
  return Error::Ok();
}

// The one place where runtime choices become template arguments.
template <int kDim>
Error LaunchForDim(const AttentionParams& p, cudaStream_t stream) {
  AttentionTilingChoice tiling = p.tiling;
  if (tiling == AttentionTilingChoice::kAuto) KVPACK_RETURN_IF_ERROR(Resolve<kDim>(p.max_page_bytes, &tiling));
  return tiling == AttentionTilingChoice::kWide ? Launch<kDim, 8, 1>(p, stream) : Launch<kDim, 4, 2>(p, stream);
}

}  // namespace

Error AttentionSupported(const KvEntryView& kv) {
  if (kv.head_dim != 64 && kv.head_dim != 128) {
    return Unsupported("attention: head_dim = " + std::to_string(kv.head_dim) + " (the GPU supports 64 and 128)");
  }
  if (kv.n_pages <= 0 || kv.n_heads <= 0) return InvalidArgument("attention: the K/V entry is empty");
  return Error::Ok();
}

int AttentionSharedBytes(int head_dim, int max_page_bytes) {
  const int raw = 2 * 2 * max_page_bytes;  // 2 stages × (K + V); both tilings share the layout
  return head_dim == 128 ? AttentionTraits<128, 4, 2>::kRawOffset + raw : AttentionTraits<64, 4, 2>::kRawOffset + raw;
}

Error ResolveAttentionTiling(int head_dim, int max_page_bytes, AttentionTilingChoice* resolved) {
  if (head_dim == 128) return Resolve<128>(max_page_bytes, resolved);
  if (head_dim == 64) return Resolve<64>(max_page_bytes, resolved);
  return Unsupported("attention: head_dim = " + std::to_string(head_dim));
}

Error LaunchAttention(const AttentionParams& params, cudaStream_t stream) {
  KVPACK_RETURN_IF_ERROR(AttentionSupported(params.kv));
  if (params.n_q == 0) return Error::Ok();
  return params.kv.head_dim == 128 ? LaunchForDim<128>(params, stream) : LaunchForDim<64>(params, stream);
}

}  // namespace kvpack::cuda
