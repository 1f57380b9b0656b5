// The mma.sync building blocks of the portable attention kernels (attention_sm80_mma.cu, the dense one,
// and attention_sparse.cu, the block-sparse one): PTX wrappers, a page's raw copy and decode into a
// bf16 tile, and one warp's rows against a decoded page (S = Q·Kᵀ, masks and online softmax, O += P·V,
// the epilogue). Templates over a tile traits type T with: kDim, kThreads, kMTiles (16-row m-tiles per
// warp), kRowsPerWarp (= 16·kMTiles), kPitch (bf16 per smem row), kKTiles (= kDim/16), kONTiles
// (= kDim/8), kStagePitch (floats per epilogue staging row).
#pragma once

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/page_codec.cuh"

namespace kvpack::cuda::sm80 {

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

}  // namespace kvpack::cuda::sm80
