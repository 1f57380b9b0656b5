// The producer side of the sm90 attention kernel (load + decode): where a page's bytes are and their
// bulk copies (TMA on mbarriers) into a raw stage, and the decode of a raw page into the swizzled bf16
// K and V tiles that the consumers' wgmma reads, with the page's key table — per format, through the
// codecs (page_codec.cuh), exhaustively. Internal to kernels/cuda: include only from attention_sm90.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm90_ptx.cuh"
#include "kernels/cuda/attention_sm90_tile.h"
#include "kernels/cuda/page_codec.cuh"

namespace kvpack::cuda::sm90 {

// ── Who decodes what ────────────────────────────────────────────────────────────────────────────
// kThreads producer threads share a tile: thread ptid owns, in every 64-row tile, rows ptid/8 +
// (kThreads/8)·k and, in each of the kDim/64 column blocks, the 16-byte chunk ptid mod 8. Rows r and
// r + kThreads/8 share r mod 8, so every swizzled address is a per-thread base plus compile-time
// steps; the two chunks of a row at d = 128 share its metadata; a quarter warp stores one row's eight
// chunks of a block (conflict-free). INT4 and INT8 pages: all producer threads decode both tiles (with
// one group on K and one on V, the V group, whose INT4 decode does the arithmetic, finished last on
// every page). BF16 pages, a copy: one group per tile (two-stage kernel at d = 128: 358 TFLOP/s against
// 347 with both groups on both tiles, bench/RESULTS.md runs 17–18).
template <int kDimT, int kThreads>
struct ProducerUnits {
  static constexpr int kDim = kDimT;
  static constexpr int kBlocks = kDim / 64;                     // 64-channel column blocks of a tile
  static constexpr int kRowsPerStep = kThreads / 8;             // rows covered by one step of all threads
  static constexpr int kRowSteps = kPageTokens / kRowsPerStep;  // rows per thread per tile
  static constexpr int kRowStep = kRowsPerStep * 128;           // tile bytes between rows r and r + step
  static constexpr int kBlockStep = kPageTokens * 128;
  static_assert(kRowsPerStep % 8 == 0 && kPageTokens % kRowsPerStep == 0, "rows r, r + step share r mod 8");
  int row0, c8, tile_offset;
  __device__ explicit ProducerUnits(int ptid)
      : row0(ptid >> 3), c8(ptid & 7), tile_offset(SwizzledOffset<kPageTokens>(ptid >> 3, ptid & 7)) {}
  __device__ int Row(int k) const { return row0 + kRowsPerStep * k; }
  __device__ int TileOffset(int k, int b) const { return tile_offset + k * kRowStep + b * kBlockStep; }
};

// ── Per-format tile decode ──────────────────────────────────────────────────────────────────────
// INT4: K → the bf16 of 128 + code (its rows' scale and lo are in the key table), V → lo + code·scale in
// bf16x2 arithmetic (page_codec.cuh). Every load (K codes, V codes, V metadata) goes out before the
// first store, so a thread waits for shared memory once per page.
template <class U>
__device__ __forceinline__ void DecodeInt4Tiles(const uint8_t* k_src, const uint8_t* v_src, uint8_t* k_tile,
                                                uint8_t* v_tile, const U& u, uint32_t exponent) {
  constexpr int kDim = U::kDim;
  uint32_t k[U::kRowSteps][U::kBlocks], v[U::kRowSteps][U::kBlocks], v_meta[U::kRowSteps];
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      k[r][b] = *reinterpret_cast<const uint32_t*>(k_src + u.Row(r) * (kDim / 2) + (b * 8 + u.c8) * 4);
    }
  }
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      v[r][b] = *reinterpret_cast<const uint32_t*>(v_src + u.Row(r) * (kDim / 2) + (b * 8 + u.c8) * 4);
    }
  }
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
    v_meta[r] = *reinterpret_cast<const uint32_t*>(v_src + MetaOffset(PageFormat::kInt4, kDim) + u.Row(r) * 4);
  }
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(k_tile + u.TileOffset(r, b)) = Int4CodesPlus128(k[r][b], exponent);
  }
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
    const Int4RowBf16 row = Int4RowOf(v_meta[r]);
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(v_tile + u.TileOffset(r, b)) = Int4Bf16Unit(v[r][b], row, exponent);
  }
}

// The codec's exact decode of K and V (INT8: fp32 code·scale → bf16), K's and V's loads before the stores.
template <PageFormat F, class U>
__device__ __forceinline__ void DecodeTilesExact(const uint8_t* k_src, const uint8_t* v_src, uint8_t* k_tile,
                                                 uint8_t* v_tile, const U& u) {
  using Codec = DevicePageCodec<F>;
  typename Codec::Raw k[U::kRowSteps][U::kBlocks], v[U::kRowSteps][U::kBlocks];
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      k[r][b] = Codec::template Load<U::kDim>(k_src, u.Row(r), b * 8 + u.c8);
      v[r][b] = Codec::template Load<U::kDim>(v_src, u.Row(r), b * 8 + u.c8);
    }
  }
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      *reinterpret_cast<uint4*>(k_tile + u.TileOffset(r, b)) = Codec::Convert(k[r][b]);
      *reinterpret_cast<uint4*>(v_tile + u.TileOffset(r, b)) = Codec::Convert(v[r][b]);
    }
  }
}

// One tile of a BF16 page, a copy by one group's units.
template <class U>
__device__ __forceinline__ void CopyBf16Tile(const uint8_t* src, uint8_t* tile, const U& u) {
  using Codec = DevicePageCodec<PageFormat::kBf16>;
  Codec::Raw raw[U::kRowSteps][U::kBlocks];
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) raw[r][b] = Codec::Load<U::kDim>(src, u.Row(r), b * 8 + u.c8);
  }
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(tile + u.TileOffset(r, b)) = Codec::Convert(raw[r][b]);
  }
}

// Zeroes a thread's rows at or past n_valid of a tile (their bytes may decode to anything finite or not).
template <class U>
__device__ __forceinline__ void ZeroRowsPast(int n_valid, uint8_t* tile, const U& u) {
#pragma unroll
  for (int r = 0; r < U::kRowSteps; ++r) {
    if (u.Row(r) < n_valid) continue;
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(tile + u.TileOffset(r, b)) = make_uint4(0, 0, 0, 0);
  }
}

// A page of format F: raw K and V → the K and V tiles, by the kThreads producer threads (ptid).
template <PageFormat F, int kDim, int kThreads>
__device__ __forceinline__ void DecodeTiles(const uint8_t* k_src, const uint8_t* v_src, int n_valid, uint8_t* k_tile,
                                            uint8_t* v_tile, uint32_t exponent, int ptid) {
  using U = ProducerUnits<kDim, kThreads>;
  if constexpr (F == PageFormat::kBf16) {
    using Half = ProducerUnits<kDim, kThreads / 2>;
    const bool is_k = ptid < kThreads / 2;
    const Half half(ptid % (kThreads / 2));
    uint8_t* tile = is_k ? k_tile : v_tile;
    CopyBf16Tile(is_k ? k_src : v_src, tile, half);
    if (n_valid < kPageTokens) ZeroRowsPast(n_valid, tile, half);
    return;
  } else if constexpr (F == PageFormat::kInt4) {
    static_assert(DevicePageCodec<F>::kKeyTileHoldsCodes, "INT4 K tiles hold codes + 128");
    DecodeInt4Tiles(k_src, v_src, k_tile, v_tile, U(ptid), exponent);
  } else if constexpr (F == PageFormat::kInt8) {
    DecodeTilesExact<F>(k_src, v_src, k_tile, v_tile, U(ptid));
  } else {
    static_assert(kUnhandledFormat<F>, "the sm90 producer has no decode for this format");
  }
  const U u(ptid);
  if (n_valid < kPageTokens) ZeroRowsPast(n_valid, k_tile, u), ZeroRowsPast(n_valid, v_tile, u);
}

// One page: raw K and V (K at `stage`, V at stage + v_offset) → the swizzled bf16 K and V tiles and the
// key table. The key table: logit(q_i, key j)·log2(e)·softmax_scale = a_j·S'_ij + b_j·Σq_i, where S' =
// Q·Kᵀ over the K tile as held (DevicePageCodec<F>::KeyFactors); threads 0…63 write one key each.
template <int kDim, int kThreads>
__device__ __forceinline__ void DecodePage(const PageDesc& page, const uint8_t* stage, int v_offset, uint8_t* k_tile,
                                           uint8_t* v_tile, float2* keys, float scale_log2, uint32_t exponent,
                                           int ptid) {
  const PageFormat format = static_cast<PageFormat>(page.format);
  if (ptid < kPageTokens) {
    keys[ptid] = DispatchFormat(format, [&](auto tag) {
      return DevicePageCodec<decltype(tag)::kFormat>::template KeyFactors<kDim>(stage, ptid, scale_log2);
    });
  }
  if constexpr (kSm90Experiment == Sm90Experiment::kNoDecode) return;  // timing only: stale tiles
  DispatchFormat(format, [&](auto tag) {
    DecodeTiles<decltype(tag)::kFormat, kDim, kThreads>(stage, stage + v_offset, page.n_valid, k_tile, v_tile,
                                                        exponent, ptid);
  });
}

// ── Copies ──────────────────────────────────────────────────────────────────────────────────────
// Where one page's bytes are, read from global memory one page before its copy is issued so that the
// reads' latency hides behind a decode. Offsets, not pointers: an add right after the loads would wait
// for them there.
struct PageSource {
  PageDesc desc;
  uint64_t k, v;  // byte offsets into the pool
};
__device__ __forceinline__ PageSource FetchPageSource(const AttentionParams& p, int head, int page) {
  const int64_t slot = static_cast<int64_t>(head) * p.kv.n_pages + page;
  return {p.kv.pages[page], p.kv.k_offsets[slot], p.kv.v_offsets[slot]};
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
