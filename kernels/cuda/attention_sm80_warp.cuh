// The mma.sync building blocks of the portable attention kernels (attention_sm80_mma.cu, the dense one,
// and attention_sparse.cu, the block-sparse one): PTX wrappers, a page's raw copy and decode into a
// bf16 tile, and one warp's rows against a decoded page (S = Q·Kᵀ, masks and online softmax, O += P·V,
// the epilogue), and the INT8 MMA path's pieces (mma_path.h: Q quantized per row, S = Q·Kᵀ as
// m16n8k32 s8 MMAs over K's integer codes read straight from the raw page). Templates over a tile
// traits type T with: kDim, kThreads, kMTiles (16-row m-tiles per warp), kRowsPerWarp (= 16·kMTiles),
// kPitch (bf16 per smem row), kKTiles (= kDim/16), kONTiles (= kDim/8), kStagePitch (floats per epilogue
// staging row).
#pragma once

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/page_codec.cuh"

namespace kvpack::cuda::sm80 {

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
// c[16×8] += a[16×32] · b[32×8], s8 in, s32 accumulate.
__device__ __forceinline__ void MmaInt8(uint32_t (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ── Producer side: raw page copies and their decode ─────────────────────────────────────────────
// Starts the copy of one page's K and V bytes into a raw stage (K at 0, V at max_page_bytes); thread
// `tid` of kThreads copies every kThreads-th 16-byte piece.
template <int kThreads, int kDim>
__device__ __forceinline__ void IssuePageCopy(const AttentionParams& p, const PageSource& src, uint8_t* stage, int tid) {
  const int bytes = PageBytes(static_cast<PageFormat>(src.desc.format), kDim);
  const uint8_t* k_src = p.kv.pool + src.k;
  const uint8_t* v_src = p.kv.pool + src.v;
  for (int i = tid * 16; i < bytes; i += kThreads * 16) {
    CpAsync16(stage + i, k_src + i);
    CpAsync16(stage + p.max_page_bytes + i, v_src + i);
  }
}
template <int kThreads, int kDim>
__device__ __forceinline__ void LoadPageAsync(const AttentionParams& p, int head, int page, uint8_t* stage, int tid) {
  IssuePageCopy<kThreads, kDim>(p, FetchPageSource(p, head, page), stage, tid);
}

// Raw page bytes (shared) → bf16 tile [64][kPitch] (shared); rows ≥ n_valid become zeros. The format
// is dispatched once per page, every loop below is unrolled with its loads ahead of its stores (a
// switch per 8-channel unit cost the loop its branches: Nsight Compute, session 10).
//   INT4: thread tid decodes kChunks 16-byte chunks (8 channels each) of row tid / kThreadsPerRow, so it
//     reads the row's metadata once and its codes in one pass; odd parts store their chunks from the
//     middle on, so that a quarter warp's stores (4 rows × 2 parts at kTall, d = 128) hit distinct
//     banks (a branch on the part instead ran both orders in every warp: twice the decode's
//     instructions, Nsight Compute, session 10). kV: the row in bf16x2 arithmetic (Int4Bf16Unit, as the wgmma kernel's V), not the exact
//     decode that K keeps (an error in K is a logit error, which softmax amplifies; page_codec.cuh).
//   INT8, BF16 (no metadata worth sharing): unit tid + kThreads·k, consecutive lanes on consecutive
//     chunks of a row, conflict-free loads and stores.
template <class T>
struct TileRowUnits {
  static constexpr int kThreadsPerRow = T::kThreads / kPageTokens;
  static constexpr int kChunks = T::kDim / 8 / kThreadsPerRow;  // per thread
  static_assert(T::kThreads % kPageTokens == 0 && (T::kDim / 8) % kThreadsPerRow == 0 && kChunks % 2 == 0,
                "threads split the rows evenly");
};
template <typename T, bool kV>
__device__ __forceinline__ void DecodeInt4Rows(const uint8_t* raw, int n_valid, uint16_t* tile) {
  using U = TileRowUnits<T>;
  constexpr PageFormat F = PageFormat::kInt4;
  constexpr int kHalf = U::kChunks / 2;
  const int r = threadIdx.x / U::kThreadsPerRow, part = threadIdx.x % U::kThreadsPerRow, c0 = part * U::kChunks;
  // Step k stores chunk k ^ kHalf on odd parts (without a branch: the parts of a row share a warp).
  const bool odd = part & 1;
  uint16_t* const row = tile + r * T::kPitch + c0 * 8;
  uint16_t* const lower = row + (odd ? kHalf * 8 : 0);  // steps k < kHalf
  uint16_t* const upper = row - (odd ? kHalf * 8 : 0);  // steps k ≥ kHalf
  if (r >= n_valid) {
#pragma unroll
    for (int k = 0; k < U::kChunks; ++k) *reinterpret_cast<uint4*>((k < kHalf ? lower : upper) + k * 8) = make_uint4(0, 0, 0, 0);
    return;
  }
  uint32_t codes[U::kChunks];
  const uint8_t* src = raw + r * (T::kDim / 2) + c0 * 4;
#pragma unroll
  for (int i = 0; i < U::kChunks / 2; ++i) {
    const uint2 w = *reinterpret_cast<const uint2*>(src + 8 * i);
    codes[2 * i] = w.x, codes[2 * i + 1] = w.y;
  }
  const uint32_t meta = *reinterpret_cast<const uint32_t*>(raw + MetaOffset(F, T::kDim) + r * 4);
  auto store = [&](auto&& convert) {
#pragma unroll
    for (int k = 0; k < U::kChunks; ++k) {
      *reinterpret_cast<uint4*>((k < kHalf ? lower : upper) + k * 8) = convert(odd ? codes[k ^ kHalf] : codes[k]);
    }
  };
  if constexpr (kV) {
    const Int4RowBf16 row_bf16 = Int4RowOf(meta);
    store([&](uint32_t c) { return Int4Bf16Unit(c, row_bf16, kBf16Exponent); });
  } else {
    store([&](uint32_t c) {
      RawUnit<F> u;
      u.bits = make_uint4(c, meta, 0, 0);
      return ConvertUnit<F>(u);
    });
  }
}
template <typename T, PageFormat F>
__device__ __forceinline__ void DecodeUnits(const uint8_t* raw, int n_valid, uint16_t* tile) {
  constexpr int kChunksPerRow = T::kDim / 8, kRowsPerStep = T::kThreads / kChunksPerRow;
  constexpr int kSteps = kPageTokens / kRowsPerStep;
  static_assert(T::kThreads % kChunksPerRow == 0 && kPageTokens % kRowsPerStep == 0, "threads cover the tile evenly");
  const int r0 = threadIdx.x / kChunksPerRow, c8 = threadIdx.x % kChunksPerRow;
  RawUnit<F> units[kSteps];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) units[k] = LoadUnit<F, T::kDim>(raw, r0 + k * kRowsPerStep, c8);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int r = r0 + k * kRowsPerStep;
    *reinterpret_cast<uint4*>(tile + r * T::kPitch + c8 * 8) = r < n_valid ? ConvertUnit<F>(units[k]) : make_uint4(0, 0, 0, 0);
  }
}
template <typename T, bool kV>
__device__ __forceinline__ void DecodePage(const uint8_t* raw, PageFormat format, int n_valid, uint16_t* tile) {
  DispatchFormat(format, [&](auto tag) {
    constexpr PageFormat F = decltype(tag)::kFormat;
    if constexpr (F == PageFormat::kInt4) {
      DecodeInt4Rows<T, kV>(raw, n_valid, tile);
    } else {
      DecodeUnits<T, F>(raw, n_valid, tile);
    }
  });
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

// Masks (where the page needs them), then the online softmax in the log2 domain: S becomes P. The
// exponent's argument is S·row_scale − max: row_scale is scale_log2 on the bf16 path (SoftmaxPage);
// on the INT8 path S holds each logit over its row's s_q (LogitsFromInt8Sums, whose key table carries
// scale_log2) and row_scale is s_q. O is rescaled only when some row of the warp has a new maximum
// (after the first pages almost never; ×1 would change no bit).
template <class T>
__device__ __forceinline__ void SoftmaxPageScaled(WarpRows<T>& w, const AttentionParams& p, const QueryRuns& runs,
                                                  const PageDesc& page, int64_t t0, int row0,
                                                  const float (&row_scale)[T::kMTiles][2], int lane) {
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
  bool rescale = false;
  float corr[T::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m8[8];  // the row's maximum as a tree (a chain of 15 dependent FMNMX stalled the warp)
#pragma unroll
      for (int n = 0; n < 8; ++n) m8[n] = fmaxf(w.s[mt][n][2 * r], w.s[mt][n][2 * r + 1]);
#pragma unroll
      for (int step = 4; step > 0; step >>= 1) {
#pragma unroll
        for (int n = 0; n < step; ++n) m8[n] = fmaxf(m8[n], m8[n + step]);
      }
      float mx = m8[0];
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(w.row_max[mt][r], mx * row_scale[mt][r]);  // row_scale > 0 keeps the order
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row so far
      corr[mt][r] = Exp2Ftz(w.row_max[mt][r] - m_use);
      rescale |= corr[mt][r] != 1.0f;
      w.row_max[mt][r] = m_new;
      w.row_sum[mt][r] *= corr[mt][r];
      float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the row's sum in four chains, not one of 16 adds
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          w.s[mt][n][e] = Exp2Ftz(fmaf(w.s[mt][n][e], row_scale[mt][r], -m_use));
          part[(n & 1) * 2 + (e & 1)] += w.s[mt][n][e];
        }
      }
      w.row_sum[mt][r] += (part[0] + part[1]) + (part[2] + part[3]);
    }
  }
  if (__any_sync(kFullMask, rescale)) {
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
      for (int n = 0; n < T::kONTiles; ++n) {
        w.o[mt][n][0] *= corr[mt][0], w.o[mt][n][1] *= corr[mt][0];
        w.o[mt][n][2] *= corr[mt][1], w.o[mt][n][3] *= corr[mt][1];
      }
    }
  }
}

template <class T>
__device__ __forceinline__ void SoftmaxPage(WarpRows<T>& w, const AttentionParams& p, const QueryRuns& runs,
                                            const PageDesc& page, int64_t t0, int row0, float scale_log2, int lane) {
  float row_scale[T::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < T::kMTiles; ++mt) row_scale[mt][0] = row_scale[mt][1] = scale_log2;
  SoftmaxPageScaled(w, p, runs, page, t0, row0, row_scale, lane);
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

// ── The INT8 MMA path (mma_path.h) ─────────────────────────────────────────────────────────────
// Channel order of the int8 operands. In k-step kc of S = Q·Kᵀ (32 channels), the four threads of a
// quad (t = lane mod 4) take channels kDim/4·t + 8·kc + 0…7 of their rows and keys, the even ones in
// their first register of a pair (k = 4t … 4t+3 of the m16n8k32 fragment), the odd ones in the second
// (k = 16+4t …). An INT4 key's 8 channels are then one 32-bit word of nibbles (byte b: channel 2b low,
// 2b+1 high), split by two masks, and a thread reads its key's kDim/8 code bytes with one load. S is
// an exact int32 sum, so the order changes no bit of it.
//
// The int8 Q tile holds the fragments as the MMA takes them: for each 16-row m-tile and k-step, lane l's
// four registers (rows g and g + 8, even and odd channels: a0 … a3) in 16 consecutive bytes, so a
// fragment is one conflict-free 16-byte load into the four consecutive registers the MMA names.
template <int kDim>
struct Int8QkLayout {
  static constexpr int kKSteps = kDim / 32;  // m16n8k32 steps of S
  static constexpr int kQ8Bytes = kTileQueries / 16 * kKSteps * 32 * 16;
  // Byte of (row r of the tile, channel c) in the int8 Q tile.
  __device__ static int Offset(int r, int c) {
    const int rr = r & 15, t = c / (kDim / 4), within = c % (kDim / 4), kc = within >> 3, j = within & 7;
    const int lane = (rr & 7) * 4 + t, reg = (j & 1) * 2 + (rr >> 3);
    return (((r >> 4) * kKSteps + kc) * 32 + lane) * 16 + reg * 4 + (j >> 1);
  }
  __device__ static const uint4* Fragment(const uint8_t* q8, int m_tile, int kc, int lane) {
    return reinterpret_cast<const uint4*>(q8 + ((m_tile * kKSteps + kc) * 32 + lane) * 16);
  }
};

// Every warp quantizes rows warp, warp + kWarps, … of the tile from the bf16 stored-form Q (QueryScaleOf
// and QueryCode, the CPU reference's bits; lane l takes channels l·kDim/32 …) into q8, and lane 0
// writes the row's s_q and Σq / s_q (Σ over the bf16 values). Rows past n_rows get zero codes, s_q = 1.
template <class T>
__device__ __forceinline__ void QuantizeQueryRows(const AttentionParams& p, const QueryTileCoords& tile, uint8_t* q8,
                                                  float* q_scale, float* q_sum_over_scale) {
  constexpr int kPerLane = T::kDim / 32;
  constexpr int kWarps = T::kThreads / 32;
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < kTileQueries; r += kWarps) {
    float x[kPerLane] = {};
    if (r < tile.n_rows) UnpackBf16(LoadBf16Lanes<kPerLane>(p.q + (tile.q0 + r) * p.q_stride + tile.head * T::kDim + lane * kPerLane), x);
    float amax = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) amax = fmaxf(amax, fabsf(x[i])), sum += x[i];
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, m));
      sum += __shfl_xor_sync(kFullMask, sum, m);
    }
    const QueryScale qs = QueryScaleOf(amax);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      q8[Int8QkLayout<T::kDim>::Offset(r, lane * kPerLane + i)] = static_cast<uint8_t>(QueryCode(x[i], qs));
    }
    if (lane == 0) q_scale[r] = qs.scale, q_sum_over_scale[r] = sum / qs.scale;
  }
}

// The key table of a page on the INT8 path: key j's (a_j, b_j) = (scale_j, lo_j)·scale_log2 from its
// row metadata (IntegerRowAffine; INT8 pages have lo = 0), so that logit_ij·scale_log2 =
// s_q,i·(a_j·S_ij + b_j·Σq_i / s_q,i). Threads 0 … 63, one key each. REQUIRES: an INT4 or INT8 page
// (ResolveMmaPath keeps entries with BF16 pages on the bf16 path).
template <int kDim>
__device__ __forceinline__ void WriteKeyTable(const uint8_t* k_raw, PageFormat format, float scale_log2, float2* table) {
  static_assert(kNumPageFormats == 3, "the INT8 path's key table handles INT4 and INT8 (BF16 never comes)");
  const int j = threadIdx.x;
  if (j >= kPageTokens) return;
  const float2 affine = format == PageFormat::kInt4 ? IntegerRowAffine<PageFormat::kInt4, kDim>(k_raw, j)
                                                    : IntegerRowAffine<PageFormat::kInt8, kDim>(k_raw, j);
  table[j] = make_float2(affine.x * scale_log2, affine.y * scale_log2);
}

// S[rows × 64] = Q̂[rows × d] · codesᵀ[d × 64] in int32 for this warp's rows, K's codes read from the
// raw page (no decoded K tile), then the logits over s_q into w.s: a_j·S + b_j·(Σq / s_q) (the key
// table of WriteKeyTable; |S| < 2^22, so S converts to fp32 exactly). Keys past n_valid give finite
// sums that the masks hide.
template <class T>
__device__ __forceinline__ void ScorePageInt8(WarpRows<T>& w, const uint8_t* q8, const uint8_t* k_raw, PageFormat format,
                                              const float2* table, const float (&q_sum_over_scale)[T::kMTiles][2],
                                              int row0, int lane) {
  using L = Int8QkLayout<T::kDim>;
  const int g = lane >> 2, t = lane & 3;
  uint32_t acc[T::kMTiles][8][4] = {};
  // The k-steps in passes of two (two passes at d = 128, one at 64), each with its Q fragments in
  // registers (all four at once spilled at kTall: 32 of them beside S's 64 and O's 128).
  constexpr int kPartSteps = 2, kParts = L::kKSteps / kPartSteps;
#pragma unroll
  for (int part = 0; part < kParts; ++part) {
    uint32_t a[T::kMTiles][kPartSteps][4];
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
      for (int i = 0; i < kPartSteps; ++i) {
        const uint4 f = *L::Fragment(q8, row0 / 16 + mt, part * kPartSteps + i, lane);
        a[mt][i][0] = f.x, a[mt][i][1] = f.y, a[mt][i][2] = f.z, a[mt][i][3] = f.w;
      }
    }
    if (format == PageFormat::kInt4) {
      // Keys n·8 + g in groups of four 8-key tiles: kDim/8 bytes of nibbles from byte kDim/8·t, 4 per
      // k-step; k-step outside the tiles, so that an accumulator's next MMA is 4·kMTiles MMAs away.
      constexpr int kGroup = 4;
#pragma unroll
      for (int n0 = 0; n0 < 8; n0 += kGroup) {
        uint32_t words[kGroup][kPartSteps];
#pragma unroll
        for (int j = 0; j < kGroup; ++j) {
          const uint8_t* key = k_raw + ((n0 + j) * 8 + g) * (T::kDim / 2) + (T::kDim / 8) * t + 4 * kPartSteps * part;
          const uint2 v = *reinterpret_cast<const uint2*>(key);
          words[j][0] = v.x, words[j][1] = v.y;
        }
#pragma unroll
        for (int i = 0; i < kPartSteps; ++i) {
#pragma unroll
          for (int j = 0; j < kGroup; ++j) {
            const uint32_t even = words[j][i] & 0x0f0f0f0fu, odd = (words[j][i] >> 4) & 0x0f0f0f0fu;
#pragma unroll
            for (int mt = 0; mt < T::kMTiles; ++mt) MmaInt8(acc[mt][n0 + j], a[mt][i], even, odd);
          }
        }
      }
    } else {  // INT8 codes: kDim/4 bytes from byte kDim/4·t, 8 per k-step (a word pair)
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const uint4 v = *reinterpret_cast<const uint4*>(k_raw + (n * 8 + g) * T::kDim + (T::kDim / 4) * t + 8 * kPartSteps * part);
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < kPartSteps; ++i) {
          const uint32_t even = __byte_perm(words[2 * i], words[2 * i + 1], 0x6420);
          const uint32_t odd = __byte_perm(words[2 * i], words[2 * i + 1], 0x7531);
#pragma unroll
          for (int mt = 0; mt < T::kMTiles; ++mt) MmaInt8(acc[mt][n], a[mt][i], even, odd);
        }
      }
    }
  }
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float4 k = reinterpret_cast<const float4*>(table)[n * 4 + t];  // keys n·8 + 2t, + 1
#pragma unroll
    for (int mt = 0; mt < T::kMTiles; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float sum = static_cast<float>(static_cast<int32_t>(acc[mt][n][e]));  // exact: |S| < 2^22
        w.s[mt][n][e] = fmaf(sum, e & 1 ? k.z : k.x, q_sum_over_scale[mt][e >> 1] * (e & 1 ? k.w : k.y));
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
