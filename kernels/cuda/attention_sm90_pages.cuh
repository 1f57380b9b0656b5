// The producer side of the sm90 attention kernel (attention_sm90.cu): who decodes which part of a tile,
// the decode of a raw page into the swizzled bf16 K and V tiles
// that wgmma reads and the page's key table, and where a page's bytes are and their bulk copies (TMA on
// mbarriers) into a raw stage. INT8 and BF16 rows are read through the codecs (page_codec.cuh).
// Internal to kernels/cuda: include only from attention_sm90.cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_ptx.cuh"
#include "kernels/cuda/page_codec.cuh"

namespace kvpack::cuda::sm90 {

// ── The producer's decode ───────────────────────────────────────────────────────────────────────
// kThreads producer threads share a tile: thread ptid owns, in every 64-row tile, rows ptid/8 +
// (kThreads/8)·k and, in each of the kDim/64 column blocks, the 16-byte chunk ptid mod 8. Rows r and
// r + kThreads/8 share r mod 8, so every swizzled address is a per-thread base plus compile-time
// steps; the two chunks of a row at d = 128 share its metadata; a quarter warp stores one row's eight
// chunks of a block (conflict-free). INT4 and INT8 pages: all kProducerThreads threads decode both
// tiles (with one group on K and one on V, the V group, whose INT4 decode does the arithmetic,
// finished last on every page). BF16 pages, a copy: one group per tile (two-stage kernel at
// d = 128: 358 TFLOP/s against 347 with both groups on both tiles, bench/RESULTS.md runs 17–18).
inline constexpr int kProducerThreads = 256;
template <int kDimT, int kThreads = kProducerThreads>
struct ProducerUnits {
  static constexpr int kDim = kDimT;
  static constexpr int kBlocks = kDim / 64;                 // 64-channel column blocks of a tile
  static constexpr int kRowsPerStep = kThreads / 8;         // rows covered by one step of all threads
  static constexpr int kRowSteps = kPageTokens / kRowsPerStep;  // rows per thread per tile
  static constexpr int kRowStep = kRowsPerStep * 128;       // tile bytes between rows r and r + step
  static constexpr int kBlockStep = kPageTokens * 128;
  static_assert(kRowsPerStep % 8 == 0 && kPageTokens % kRowsPerStep == 0, "rows r, r + step share r mod 8");
  int row0, c8, tile_offset;
  __device__ explicit ProducerUnits(int ptid)
      : row0(ptid >> 3), c8(ptid & 7), tile_offset(SwizzledOffset<kPageTokens>(ptid >> 3, ptid & 7)) {}
  __device__ int Row(int k) const { return row0 + kRowsPerStep * k; }
  __device__ int TileOffset(int k, int b) const { return tile_offset + k * kRowStep + b * kBlockStep; }
};

// A thread's INT4 codes of one tile (rows Row(k), chunk c8 of each block), loaded before any store.
template <int kDim>
struct Int4Codes {
  uint32_t w[ProducerUnits<kDim>::kRowSteps][ProducerUnits<kDim>::kBlocks];
};
template <int kDim>
__device__ __forceinline__ Int4Codes<kDim> LoadInt4Codes(const uint8_t* src, const ProducerUnits<kDim>& u) {
  using U = ProducerUnits<kDim>;
  Int4Codes<kDim> c;
#pragma unroll
  for (int k = 0; k < U::kRowSteps; ++k) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) c.w[k][b] = *reinterpret_cast<const uint32_t*>(src + u.Row(k) * (kDim / 2) + (b * 8 + u.c8) * 4);
  }
  return c;
}

// A thread's part of an INT4 V tile: codes and row metadata, loaded before any store; then lo +
// code·scale in bf16x2 arithmetic.
template <int kDim>
struct Int4VRows {
  Int4Codes<kDim> codes;
  uint32_t meta[ProducerUnits<kDim>::kRowSteps];
};
template <int kDim>
__device__ __forceinline__ Int4VRows<kDim> LoadInt4V(const uint8_t* v_src, const ProducerUnits<kDim>& u) {
  Int4VRows<kDim> v;
  v.codes = LoadInt4Codes(v_src, u);
#pragma unroll
  for (int r = 0; r < ProducerUnits<kDim>::kRowSteps; ++r) {
    v.meta[r] = *reinterpret_cast<const uint32_t*>(v_src + MetaOffset(PageFormat::kInt4, kDim) + u.Row(r) * 4);
  }
  return v;
}
template <int kDim>
__device__ __forceinline__ void StoreInt4V(const Int4VRows<kDim>& v, uint8_t* v_tile, const ProducerUnits<kDim>& u,
                                           uint32_t exponent) {
  using U = ProducerUnits<kDim>;
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
    const Int4RowBf16 row = Int4RowOf(v.meta[r]);
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(v_tile + u.TileOffset(r, b)) = Int4Bf16Unit(v.codes.w[r][b], row, exponent);
  }
}

// An INT4 page pair: K → the bf16 of 128 + code (its rows' scale and lo go to the key table), V → lo +
// code·scale in bf16x2 arithmetic. Every load (K codes, V codes, V metadata) goes out before the first
// store, so a thread waits for shared memory once per page.
template <int kDim>
__device__ __forceinline__ void DecodeInt4Tiles(const uint8_t* k_src, const uint8_t* v_src, uint8_t* k_tile,
                                                uint8_t* v_tile, const ProducerUnits<kDim>& u, uint32_t exponent) {
  using U = ProducerUnits<kDim>;
  const Int4Codes<kDim> k = LoadInt4Codes(k_src, u);
  const Int4VRows<kDim> v = LoadInt4V(v_src, u);
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(k_tile + u.TileOffset(r, b)) = Int4CodesPlus128(k.w[r][b], exponent);
  }
  StoreInt4V(v, v_tile, u, exponent);
}

// INT8 page pairs: the codec's exact fp32 decode (page_codec.cuh LoadUnit / ConvertUnit), K's and V's
// loads before the stores.
template <PageFormat F, int kDim>
__device__ __forceinline__ void DecodeTiles(const uint8_t* k_src, const uint8_t* v_src, uint8_t* k_tile, uint8_t* v_tile,
                                            const ProducerUnits<kDim>& u) {
  using U = ProducerUnits<kDim>;
  RawUnit<F> k[U::kRowSteps][U::kBlocks], v[U::kRowSteps][U::kBlocks];
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      k[r][b] = LoadUnit<F, kDim>(k_src, u.Row(r), b * 8 + u.c8);
      v[r][b] = LoadUnit<F, kDim>(v_src, u.Row(r), b * 8 + u.c8);
    }
  }
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      *reinterpret_cast<uint4*>(k_tile + u.TileOffset(r, b)) = ConvertUnit<F>(k[r][b]);
      *reinterpret_cast<uint4*>(v_tile + u.TileOffset(r, b)) = ConvertUnit<F>(v[r][b]);
    }
  }
}

// One tile of a BF16 page, by one group's units.
template <class U>
__device__ __forceinline__ void CopyBf16Tile(const uint8_t* src, uint8_t* tile, const U& u) {
  RawUnit<PageFormat::kBf16> raw[U::kRowSteps][U::kBlocks];
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) raw[r][b] = LoadUnit<PageFormat::kBf16, U::kDim>(src, u.Row(r), b * 8 + u.c8);
  }
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(tile + u.TileOffset(r, b)) = ConvertUnit<PageFormat::kBf16>(raw[r][b]);
  }
}

// Zeroes a thread's rows at or past n_valid of a tile.
template <class U>
__device__ __forceinline__ void ZeroRowsPast(int n_valid, uint8_t* tile, const U& u) {
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
    if (u.Row(r) < n_valid) continue;
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(tile + u.TileOffset(r, b)) = make_uint4(0, 0, 0, 0);
  }
}

// One page: raw K and V (K at `stage`, V at stage + v_offset) → the swizzled bf16 K and V tiles, by
// the kProducerThreads producer threads (ptid). Rows at or past n_valid are zeroed afterwards (their
// bytes may decode to anything finite or not).
//
// The key table: logit(q_i, key j)·log2(e)·softmax_scale = a_j·S'_ij + b_j·Σq_i, where S' = Q·Kᵀ over the
// K tile as stored. INT4 K tiles hold 128 + code, so with k̂ = lo + code·scale (exact, no rounding):
// a_j = scale_j·c, b_j = (lo_j − 128·scale_j)·c, c = log2(e)·softmax_scale. Other tiles hold k̂ itself:
// a_j = c, b_j = 0. Threads 0…63 write one key each.
template <int kDim>
__device__ __forceinline__ void DecodePage(const PageDesc& page, const uint8_t* stage, int v_offset, uint8_t* k_tile,
                                           uint8_t* v_tile, float2* keys, float scale_log2, uint32_t exponent,
                                           int ptid) {
  // INT4 (K codes + key table, V in bf16x2), BF16 (a copy), INT8 (the codec's exact decode): a new
  // format needs its branch here; DecodeTiles' chain and the codecs fail to compile without one.
  static_assert(kNumPageFormats == 3, "the sm90 producer's DecodePage handles INT4, INT8 and BF16");
  const PageFormat format = static_cast<PageFormat>(page.format);
  const ProducerUnits<kDim> u(ptid);
  if (ptid < kPageTokens) {
    float2 key = make_float2(scale_log2, 0.0f);
    if (format == PageFormat::kInt4) {
      const uint32_t meta = *reinterpret_cast<const uint32_t*>(stage + MetaOffset(PageFormat::kInt4, kDim) + ptid * 4);
      const float scale = HalfBits(meta & 0xffffu), lo = HalfBits(meta >> 16);
      key = make_float2(scale * scale_log2, fmaf(-128.0f, scale, lo) * scale_log2);
    }
    keys[ptid] = key;
  }
  if (format == PageFormat::kBf16) {
    using Half = ProducerUnits<kDim, kProducerThreads / 2>;
    const bool is_k = ptid < kProducerThreads / 2;
    const Half half(ptid % (kProducerThreads / 2));
    uint8_t* tile = is_k ? k_tile : v_tile;
    CopyBf16Tile(is_k ? stage : stage + v_offset, tile, half);
    if (page.n_valid < kPageTokens) ZeroRowsPast(page.n_valid, tile, half);
    return;
  }
  if (format == PageFormat::kInt4) {
    DecodeInt4Tiles<kDim>(stage, stage + v_offset, k_tile, v_tile, u, exponent);
  } else {
    DecodeTiles<PageFormat::kInt8, kDim>(stage, stage + v_offset, k_tile, v_tile, u);
  }
  if (page.n_valid < kPageTokens) ZeroRowsPast(page.n_valid, k_tile, u), ZeroRowsPast(page.n_valid, v_tile, u);
}

// ── The INT8 MMA path (mma_path.h): K as int8 codes ─────────────────────────────────────────────
// The K tile is [64 keys][128 bytes] of int8 codes, swizzled as the bf16 tiles are (16-byte chunk c of
// row r at r·128 + (c ⊕ (r mod 8))·16; at d = 64 chunks 0…3 only). Thread ptid owns chunk ptid mod
// kChunks of rows ptid / kChunks + kRowsPerStep·k; a quarter warp stores one row's eight chunks at d =
// 128 (conflict-free), two rows' four at d = 64 (two-way).
template <int kDim, int kThreads = kProducerThreads>
struct Int8KUnits {
  static constexpr int kChunks = kDim / 16;
  static constexpr int kRowsPerStep = kThreads / kChunks;
  static constexpr int kRowSteps = kPageTokens / kRowsPerStep;
  static_assert(kRowSteps >= 1 && kPageTokens % kRowsPerStep == 0, "the threads cover the tile's rows evenly");
  int row0, chunk;
  __device__ explicit Int8KUnits(int ptid) : row0(ptid / kChunks), chunk(ptid % kChunks) {}
  __device__ int Row(int k) const { return row0 + kRowsPerStep * k; }
  __device__ int TileOffset(int k) const { return Row(k) * 128 + ((chunk ^ (Row(k) & 7)) << 4); }
};

// A page pair in format F (INT4 or INT8): K's integer codes (IntegerCodesUnit) into the int8 tile, V
// decoded to bf16 as on the bf16 path; every load before the first store.
template <PageFormat F, int kDim>
__device__ __forceinline__ void DecodeInt8QkTiles(const uint8_t* k_src, const uint8_t* v_src, uint8_t* k_tile,
                                                  uint8_t* v_tile, const ProducerUnits<kDim>& u,
                                                  const Int8KUnits<kDim>& ku, uint32_t exponent) {
  using U = ProducerUnits<kDim>;
  using KU = Int8KUnits<kDim>;
  uint4 k[KU::kRowSteps];
#pragma unroll
  for (int r = 0; r < KU::kRowSteps; ++r) k[r] = IntegerCodesUnit<F, kDim>(k_src, ku.Row(r), ku.chunk);
  if constexpr (F == PageFormat::kInt4) {
    const Int4VRows<kDim> v = LoadInt4V(v_src, u);
#pragma unroll
    for (int r = 0; r < KU::kRowSteps; ++r) *reinterpret_cast<uint4*>(k_tile + ku.TileOffset(r)) = k[r];
    StoreInt4V(v, v_tile, u, exponent);
  } else {
    RawUnit<F> v[U::kRowSteps][U::kBlocks];
#pragma unroll
    for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
      for (int b = 0; b < U::kBlocks; ++b) v[r][b] = LoadUnit<F, kDim>(v_src, u.Row(r), b * 8 + u.c8);
    }
#pragma unroll
    for (int r = 0; r < KU::kRowSteps; ++r) *reinterpret_cast<uint4*>(k_tile + ku.TileOffset(r)) = k[r];
#pragma unroll
    for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
      for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(v_tile + u.TileOffset(r, b)) = ConvertUnit<F>(v[r][b]);
    }
  }
}

// One page on the INT8 MMA path. The key table: logit(q_i, key j)·log2(e)·softmax_scale = s_q,i ·
// (a_j·S_ij + b_j·Σq_i / s_q,i) with S = the int32 Q codes · K codes, a_j = scale_j·c, b_j = lo_j·c, c =
// log2(e)·softmax_scale (mma_path.h). Only V rows at or past n_valid are zeroed: K codes are finite
// integers whose logits the consumers mask. REQUIRES: the page is INT4 or INT8 (ResolveMmaPath keeps
// entries with BF16 pages on the bf16 path).
template <int kDim>
__device__ __forceinline__ void DecodePageInt8Qk(const PageDesc& page, const uint8_t* stage, int v_offset,
                                                 uint8_t* k_tile, uint8_t* v_tile, float2* keys, float scale_log2,
                                                 uint32_t exponent, int ptid) {
  static_assert(kNumPageFormats == 3, "the INT8 MMA path's DecodePageInt8Qk handles INT4 and INT8 (BF16 never comes)");
  const ProducerUnits<kDim> u(ptid);
  const Int8KUnits<kDim> ku(ptid);
  auto decode = [&](auto tag) {
    constexpr PageFormat F = decltype(tag)::kFormat;
    if (ptid < kPageTokens) {
      const float2 affine = IntegerRowAffine<F, kDim>(stage, ptid);
      keys[ptid] = make_float2(affine.x * scale_log2, affine.y * scale_log2);
    }
    DecodeInt8QkTiles<F, kDim>(stage, stage + v_offset, k_tile, v_tile, u, ku, exponent);
  };
  if (static_cast<PageFormat>(page.format) == PageFormat::kInt4) {
    decode(FormatTag<PageFormat::kInt4>{});
  } else {
    decode(FormatTag<PageFormat::kInt8>{});
  }
  if (page.n_valid < kPageTokens) ZeroRowsPast(page.n_valid, v_tile, u);
}

// Starts the bulk copies of a page's K and V bytes into a raw stage (K at 0, V at v_offset), completing
// on `bar`. One thread.
template <int kDim>
__device__ __forceinline__ void IssuePageCopy(const uint8_t* pool, const PageSource& src, uint8_t* stage, int v_offset,
                                              uint32_t bar) {
  const int bytes = PageBytes(static_cast<PageFormat>(src.desc.format), kDim);
  MbarExpectBytes(bar, 2 * bytes);
  BulkCopy(SmemAddr(stage), pool + src.k, bytes, bar);
  BulkCopy(SmemAddr(stage + v_offset), pool + src.v, bytes, bar);
}

}  // namespace kvpack::cuda::sm90
