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
template <int kDim>
struct AttentionTraits {
  static_assert(kDim == 64 || kDim == 128, "head_dim 64 or 128");
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerWarp = 16;                  // one m16 MMA row block per warp
  static_assert(kWarps * kRowsPerWarp == kTileQueries, "warps cover the query tile");
  static constexpr int kPitch = kDim + 8;                  // bf16 per smem row: +16 B keeps ldmatrix conflict-free
  static constexpr int kQBytes = kTileQueries * kPitch * 2;
  static constexpr int kTileBytes = kPageTokens * kPitch * 2;  // one decoded K or V page
  static constexpr int kRawOffset = kQBytes + 4 * kTileBytes;  // Q, then K0 V0 K1 V1 (two decoded pages)
  static constexpr int kStagePitch = kDim + 4;             // floats per row of the epilogue staging
  static_assert(kTileQueries * kStagePitch * 4 <= kRawOffset, "epilogue staging fits in the Q/K/V tiles");
  static_assert(kRawOffset % 128 == 0, "raw stages stay 128-byte aligned");
  static constexpr int kWindow = 2048;                     // pages examined per visibility pass
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
template <int kDim>
__device__ __forceinline__ void DecodePage(const uint8_t* raw, PageFormat format, int n_valid, uint16_t* tile) {
  using T = AttentionTraits<kDim>;
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
template <int kDim>
__device__ __forceinline__ void LoadPageAsync(const AttentionParams& p, int head, int page, uint8_t* stage) {
  using T = AttentionTraits<kDim>;
  const int bytes = PageBytes(static_cast<PageFormat>(p.kv.pages[page].format), kDim);
  const int64_t slot = static_cast<int64_t>(head) * p.kv.n_pages + page;
  const uint8_t* k_src = p.kv.pool + p.kv.k_offsets[slot];
  const uint8_t* v_src = p.kv.pool + p.kv.v_offsets[slot];
  for (int i = threadIdx.x * 16; i < bytes; i += T::kThreads * 16) {
    CpAsync16(stage + i, k_src + i);
    CpAsync16(stage + p.max_page_bytes + i, v_src + i);
  }
}

template <int kDim>
__global__ void __launch_bounds__(AttentionTraits<kDim>::kThreads, 1) AttentionKernel(const AttentionParams p) {
  using T = AttentionTraits<kDim>;
  constexpr int kKTiles = kDim / 16;   // k-steps of S = Q·Kᵀ
  constexpr int kONTiles = kDim / 8;   // n-tiles of O
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(smem);                       // [128][kPitch] bf16
  uint16_t* tiles = reinterpret_cast<uint16_t*>(smem + T::kQBytes);  // [2 pages][K | V][64][kPitch] bf16
  constexpr int kTileElems = T::kTileBytes / 2;
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

  for (int u = tid; u < kTileQueries * (kDim / 8); u += T::kThreads) {  // Q tile [128][d] → smem
    const int r = u / (kDim / 8), c8 = u % (kDim / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < n_rows) v = *reinterpret_cast<const uint4*>(p.q + (q0 + r) * p.q_stride + head * kDim + c8 * 8);
    *reinterpret_cast<uint4*>(q_tile + r * T::kPitch + c8 * 8) = v;
  }
  if (tid < kTileQueries) {
    const int r = tid < n_rows ? tid : n_rows - 1;  // padding rows copy the last real row (never written)
    q_seq[tid] = p.kv.pages[FindPage(p.kv.pages, n_pages, t0 + r)].seq_id;
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
  uint32_t q_frag[kKTiles][4];  // this warp's 16 rows of Q as MMA A fragments
#pragma unroll
  for (int kc = 0; kc < kKTiles; ++kc) {
    const int row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
    LdMatrixX4(q_frag[kc], q_tile + row * T::kPitch + kc * 16 + (lane >> 4) * 8);
  }
  __syncthreads();

  float o[kONTiles][4];  // O rows (g, g+8) × channels (n·8 + 2t, +1)
#pragma unroll
  for (int n = 0; n < kONTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
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
    bool mine[kPerThread];
    int count = 0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = tid * kPerThread + i;
      mine[i] = idx < wn && is_visible(p.kv.pages[w0 + idx]);
      count += mine[i];
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
      if (mine[i]) visible[pos++] = static_cast<uint16_t>(tid * kPerThread + i);
    }
    const int n_visible = n_vis;
    __syncthreads();
    if (n_visible == 0) continue;

    // Pipeline, one barrier per page: in iteration i the raw bytes of page i+2 are in flight, page i+1
    // is decoded into the other tile pair, and page i is multiplied; warps drift apart inside an
    // iteration, so one warp's decode overlaps another's MMAs.
    const int stage_bytes = 2 * p.max_page_bytes;
    LoadPageAsync<kDim>(p, head, w0 + visible[0], raw);
    CpAsyncCommit();
    if (n_visible > 1) LoadPageAsync<kDim>(p, head, w0 + visible[1], raw + stage_bytes);
    CpAsyncCommit();
    CpAsyncWaitOne();
    __syncthreads();
    {
      const PageDesc page = p.kv.pages[w0 + visible[0]];
      DecodePage<kDim>(raw, static_cast<PageFormat>(page.format), page.n_valid, tiles);
      DecodePage<kDim>(raw + p.max_page_bytes, static_cast<PageFormat>(page.format), page.n_valid, tiles + kTileElems);
    }
    for (int i = 0; i < n_visible; ++i) {
      CpAsyncWaitAll();  // page i+1's bytes
      __syncthreads();   // page i decoded; tile pair (i+1)&1 and raw stage i&1 are free
      if (i + 2 < n_visible) LoadPageAsync<kDim>(p, head, w0 + visible[i + 2], raw + (i & 1) * stage_bytes);
      CpAsyncCommit();
      if (i + 1 < n_visible) {
        const PageDesc next = p.kv.pages[w0 + visible[i + 1]];
        const uint8_t* stage = raw + ((i + 1) & 1) * stage_bytes;
        uint16_t* dst = tiles + ((i + 1) & 1) * 2 * kTileElems;
        DecodePage<kDim>(stage, static_cast<PageFormat>(next.format), next.n_valid, dst);
        DecodePage<kDim>(stage + p.max_page_bytes, static_cast<PageFormat>(next.format), next.n_valid, dst + kTileElems);
      }
      const PageDesc page = p.kv.pages[w0 + visible[i]];
      const uint16_t* k_tile = tiles + (i & 1) * 2 * kTileElems;
      const uint16_t* v_tile = k_tile + kTileElems;

      // S[16 × 64] = Q[16 × d] · Kᵀ[d × 64] for this warp's rows.
      float s[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kc = 0; kc < kKTiles; kc += 2) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          uint32_t b[4];  // keys n·8 …, channels kc·16 … kc·16 + 31
          LdMatrixX4(b, k_tile + (n * 8 + (lane & 7)) * T::kPitch + (kc + (lane >> 4)) * 16 + ((lane >> 3) & 1) * 8);
          Mma(s[n], q_frag[kc], b[0], b[1]);
          Mma(s[n], q_frag[kc + 1], b[2], b[3]);
        }
      }

      // Masks: invalid slots, other sequences, future keys (causal).
      const bool need_mask = page.n_valid < kPageTokens || entries > 1 ||
                             (p.causal && page.token_begin + page.n_valid - 1 > t0);
      if (need_mask) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = warp * 16 + g + (e >> 1) * 8;
            const int key = n * 8 + 2 * t + (e & 1);
            const bool ok = key < page.n_valid && q_seq[row] == page.seq_id &&
                            (!p.causal || page.token_begin + key <= t0 + row);
            if (!ok) s[n][e] = -INFINITY;
          }
        }
      }

      // Online softmax (log2 domain), rows g and g + 8.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const float m_new = fmaxf(row_max[r], mx * scale_log2);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row so far
        const float corr = exp2f(row_max[r] - m_use);
        row_max[r] = m_new;
        row_sum[r] *= corr;
#pragma unroll
        for (int n = 0; n < kONTiles; ++n) o[n][2 * r] *= corr, o[n][2 * r + 1] *= corr;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[n][e] = exp2f(fmaf(s[n][e], scale_log2, -m_use));
            row_sum[r] += s[n][e];
          }
        }
      }

      // O[16 × d] += P[16 × 64] · V[64 × d].
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t a[4] = {PackBf16x2(s[2 * kk][0], s[2 * kk][1]), PackBf16x2(s[2 * kk][2], s[2 * kk][3]),
                               PackBf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               PackBf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < kONTiles; n += 2) {
          uint32_t b[4];  // keys kk·16 … +15, channels n·8 … n·8 + 15
          LdMatrixX4Trans(b, v_tile + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * T::kPitch + (n + (lane >> 4)) * 8);
          Mma(o[n], a, b[0], b[1]);
          Mma(o[n + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with the tiles before the next window or the epilogue
  }

  // ── Epilogue: normalise, stage rows in shared memory, Rᵀ and +μ_v per row, bf16 out ──────────
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
  }
  float* stage = reinterpret_cast<float*>(smem) + warp * 16 * T::kStagePitch;  // this warp's 16 rows
#pragma unroll
  for (int n = 0; n < kONTiles; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) stage[(g + (e >> 1) * 8) * T::kStagePitch + n * 8 + 2 * t + (e & 1)] = o[n][e] * inv[e >> 1];
  }
  __syncwarp();
  constexpr int kPerLane = kDim / 32;
  const float* mu_v = p.kv.mu_v + head * kDim + lane * kPerLane;
  float sign[kPerLane];
  LaneSigns(sign, lane, p.kv.seed);
  for (int rr = 0; rr < 16; ++rr) {
    const int row = warp * 16 + rr;
    if (row >= n_rows) break;  // warp-uniform
    float x[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = stage[rr * T::kStagePitch + lane * kPerLane + i];
    if (p.kv.rotate) WarpRotateInverse(x, lane, sign);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] += mu_v[i];
    StoreBf16(p.out + (q0 + row) * p.out_stride + head * kDim + lane * kPerLane, x);
  }
}

template <int kDim>
Error Launch(const AttentionParams& p, cudaStream_t stream) {
  using T = AttentionTraits<kDim>;
  const int smem = AttentionSharedBytes(kDim, p.max_page_bytes);
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(AttentionKernel<kDim>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>((p.n_q + kTileQueries - 1) / kTileQueries), static_cast<unsigned>(p.kv.n_heads));
  AttentionKernel<kDim><<<grid, T::kThreads, smem, stream>>>(p);
  KVPACK_CUDA_RETURN_LAUNCH("attention kernel");
  return Error::Ok();
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
  const int raw = 2 * 2 * max_page_bytes;  // 2 stages × (K + V)
  return head_dim == 128 ? AttentionTraits<128>::kRawOffset + raw : AttentionTraits<64>::kRawOffset + raw;
}

Error LaunchAttention(const AttentionParams& params, cudaStream_t stream) {
  KVPACK_RETURN_IF_ERROR(AttentionSupported(params.kv));
  if (params.n_q == 0) return Error::Ok();
  return params.kv.head_dim == 128 ? Launch<128>(params, stream) : Launch<64>(params, stream);
}

}  // namespace kvpack::cuda
