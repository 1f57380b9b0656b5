// The wgmma attention kernel's pages (attention_wgmma.cu): the swizzled bf16 tile layout wgmma reads,
// the bulk copies (TMA on mbarriers) that bring raw pages into shared memory, and the producers' decode
// of a raw page into K and V tiles and the key table. Internal to kernels/cuda: include only from .cu
// files, after attention_device.cuh.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/attention_device.cuh"

namespace kvpack::cuda {

// Byte offset of channels c8·8 … +7 of row r in a [rows][kDim] bf16 tile with the 128-byte swizzle:
// 64-channel column blocks of rows·128 bytes each; inside one, row r's 128 bytes sit at r·128 and
// their 16-byte chunk j at (j ⊕ (r mod 8))·16, which spreads 8 consecutive rows' chunk j over all 32
// banks. This is the canonical K-major layout of wgmma (Q, K) and, read with keys as K and channels
// as N, its MN-major layout (V).
template <int kRows>
__device__ __forceinline__ int SwizzledOffset(int r, int c8) {
  return (c8 >> 3) * (kRows * 128) + r * 128 + (((c8 & 7) ^ (r & 7)) << 4);
}

// The raw stages fill by bulk copies (TMA) that complete on an mbarrier: one thread starts a page's
// two copies with the byte count expected, every producer thread waits for the phase.
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarExpectBytes(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void BulkCopy(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// ── The producer's decode ───────────────────────────────────────────────────────────────────────
// Producer thread ptid owns, in every 64-row tile, rows ptid/8 + 16·k (k = 0…3) and, in each of the
// kDim/64 column blocks, the 16-byte chunk ptid mod 8. Rows r and r + 16 share r mod 8, so every
// swizzled address is a per-thread base plus compile-time steps; the two chunks of a row at d = 128
// share its metadata; a quarter warp stores one row's eight chunks of a block (conflict-free).
template <int kDim>
struct ProducerUnits {
  static constexpr int kBlocks = kDim / 64;           // 64-channel column blocks of a tile
  static constexpr int kRowSteps = kPageTokens / 16;  // rows per thread per tile
  static constexpr int kRowStep = 16 * 128;           // tile bytes between rows r and r + 16
  static constexpr int kBlockStep = kPageTokens * 128;
  int row0, c8, tile_offset;
  __device__ explicit ProducerUnits(int ptid)
      : row0(ptid >> 3), c8(ptid & 7), tile_offset(SwizzledOffset<kPageTokens>(ptid >> 3, ptid & 7)) {}
  __device__ int Row(int k) const { return row0 + 16 * k; }
  __device__ int TileOffset(int k, int b) const { return tile_offset + k * kRowStep + b * kBlockStep; }
};

// 8 INT4 V codes (one 32-bit word, channel 2j in the low nibble of byte j) → 8 bf16 lo + code·scale,
// in bf16x2 arithmetic: (0x4300 | code) is the bf16 of 128 + code, so one byte permute and one mask
// make a channel pair and an exact subtraction gives the codes. scale and lo are each split into a
// bf16 high part and a bf16 rest (exact to 2^-17); code·scale_high + lo_high rounds once near the
// value, code·scale_rest + lo_rest is small, and their sum rounds again: about 1.3× the error of
// format.h's fp32 decode on centred rows (an emulation over random rows; more where |lo| ≫ the
// step, i.e. without smoothing). Only V pages take this path: an error in V reaches the output
// linearly, averaged over keys, while K's error is a logit error that softmax amplifies — rounding
// a K row's scale to bf16 took cuda_layer_test's INT4 case from rel L2 0.004 to 0.017 — so K
// pages keep the exact fp32 decode.
struct Int4RowBf16 {
  __nv_bfloat162 scale_high, scale_rest, lo_high, lo_rest;
};
__device__ __forceinline__ Int4RowBf16 Int4RowOf(uint32_t meta) {
  const float scale = HalfBits(meta & 0xffffu), lo = HalfBits(meta >> 16);
  const uint32_t scale_high = PackBf16(scale, scale), lo_high = PackBf16(lo, lo);
  const uint32_t rests = PackBf16(scale - __uint_as_float(scale_high << 16), lo - __uint_as_float(lo_high << 16));
  const uint32_t scale_rest = __byte_perm(rests, 0, 0x1010), lo_rest = __byte_perm(rests, 0, 0x3232);
  Int4RowBf16 row;
  row.scale_high = *reinterpret_cast<const __nv_bfloat162*>(&scale_high);
  row.scale_rest = *reinterpret_cast<const __nv_bfloat162*>(&scale_rest);
  row.lo_high = *reinterpret_cast<const __nv_bfloat162*>(&lo_high);
  row.lo_rest = *reinterpret_cast<const __nv_bfloat162*>(&lo_rest);
  return row;
}
// 8 INT4 codes → the bf16 of 128 + code, channel pairs (2j, 2j + 1) in word j.
// `exponent` is 0x43004300 read from shared memory (kBf16Exponent), so that mask-and-or is one LOP3
// (it takes one immediate; a constant ptxas can see becomes a second LOP3).
inline constexpr uint32_t kBf16Exponent = 0x43004300u;
__device__ __forceinline__ uint4 Int4CodesPlus128(uint32_t codes, uint32_t exponent) {
  const uint32_t high = codes >> 4;  // byte j of `high` has channel 2j + 1 in its low nibble
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = (__byte_perm(codes, high, 0x4400 + 0x1111 * j) & 0x000f000fu) | exponent;
  return make_uint4(out[0], out[1], out[2], out[3]);
}
__device__ __forceinline__ uint4 Int4Bf16Unit(uint32_t codes, const Int4RowBf16& row, uint32_t exponent) {
  const uint4 plus128 = Int4CodesPlus128(codes, exponent);
  const uint32_t pairs[4] = {plus128.x, plus128.y, plus128.z, plus128.w};
  const __nv_bfloat162 bias = __floats2bfloat162_rn(128.0f, 128.0f);
  uint32_t out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 code = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&pairs[j]), bias);
    const __nv_bfloat162 v =
        __hadd2(__hfma2(code, row.scale_high, row.lo_high), __hfma2(code, row.scale_rest, row.lo_rest));
    out[j] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

template <int kDim>
__device__ __forceinline__ void DecodeInt4VTile(const uint8_t* src, uint8_t* dst, const ProducerUnits<kDim>& u,
                                                uint32_t exponent) {
  using U = ProducerUnits<kDim>;
  uint32_t codes[U::kRowSteps][U::kBlocks], meta[U::kRowSteps];
#pragma unroll
  for (int k = 0; k < U::kRowSteps; ++k) {  // every load before the first store
    meta[k] = *reinterpret_cast<const uint32_t*>(src + MetaOffset(PageFormat::kInt4, kDim) + u.Row(k) * 4);
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      codes[k][b] = *reinterpret_cast<const uint32_t*>(src + u.Row(k) * (kDim / 2) + (b * 8 + u.c8) * 4);
    }
  }
#pragma unroll
  for (int k = 0; k < U::kRowSteps; ++k) {
    const Int4RowBf16 row = Int4RowOf(meta[k]);
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(dst + u.TileOffset(k, b)) = Int4Bf16Unit(codes[k][b], row, exponent);
  }
}

// An INT4 K page → the bf16 of 128 + code; its rows' scale and lo go to the key table instead.
template <int kDim>
__device__ __forceinline__ void Int4KCodesTile(const uint8_t* src, uint8_t* dst, const ProducerUnits<kDim>& u,
                                               uint32_t exponent) {
  using U = ProducerUnits<kDim>;
  uint32_t codes[U::kRowSteps][U::kBlocks];
#pragma unroll
  for (int k = 0; k < U::kRowSteps; ++k) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) {
      codes[k][b] = *reinterpret_cast<const uint32_t*>(src + u.Row(k) * (kDim / 2) + (b * 8 + u.c8) * 4);
    }
  }
#pragma unroll
  for (int k = 0; k < U::kRowSteps; ++k) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(dst + u.TileOffset(k, b)) = Int4CodesPlus128(codes[k][b], exponent);
  }
}

// INT8 / BF16 pages: format.h's exact fp32 decode (attention_device.cuh), in the same
// thread layout.
template <PageFormat F, int kDim>
__device__ __forceinline__ void DecodeTile(const uint8_t* src, uint8_t* dst, const ProducerUnits<kDim>& u) {
  using U = ProducerUnits<kDim>;
  RawUnit<F> units[U::kRowSteps][U::kBlocks];
#pragma unroll
  for (int k = 0; k < U::kRowSteps; ++k) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) units[k][b] = LoadUnit<F, kDim>(src, u.Row(k), b * 8 + u.c8);
  }
#pragma unroll
  for (int k = 0; k < U::kRowSteps; ++k) {
#pragma unroll
    for (int b = 0; b < U::kBlocks; ++b) *reinterpret_cast<uint4*>(dst + u.TileOffset(k, b)) = ConvertUnit<F>(units[k][b]);
  }
}

// One page: raw K and V (K at `stage`, V at stage + v_offset) → the swizzled bf16 K and V tiles.
// Producer thread ptid of 256: threads 0…127 decode K (and write the key table), 128…255 V. Rows at
// or past n_valid are zeroed afterwards (their bytes may decode to anything finite or not).
//
// The key table: logit(q_i, key j)·log2(e)·softmax_scale = a_j·S'_ij + b_j·Σq_i, where S' = Q·Kᵀ over the
// K tile as stored. INT4 K tiles hold 128 + code, so with k̂ = lo + code·scale (exact, no rounding):
// a_j = scale_j·c, b_j = (lo_j − 128·scale_j)·c, c = log2(e)·softmax_scale. Other tiles hold k̂ itself:
// a_j = c, b_j = 0. Threads 0…63 write one key each.
template <int kDim>
__device__ __forceinline__ void DecodePage(const PageDesc& page, const uint8_t* stage, int v_offset, uint8_t* k_tile,
                                           uint8_t* v_tile, float2* keys, float scale_log2, uint32_t exponent,
                                           int ptid) {
  const PageFormat format = static_cast<PageFormat>(page.format);
  const bool is_k = ptid < 128;
  const ProducerUnits<kDim> u(ptid & 127);
  uint8_t* tile = is_k ? k_tile : v_tile;
  if (is_k) {
    if (ptid < kPageTokens) {
      float2 key = make_float2(scale_log2, 0.0f);
      if (format == PageFormat::kInt4) {
        const uint32_t meta = *reinterpret_cast<const uint32_t*>(stage + MetaOffset(PageFormat::kInt4, kDim) + ptid * 4);
        const float scale = HalfBits(meta & 0xffffu), lo = HalfBits(meta >> 16);
        key = make_float2(scale * scale_log2, fmaf(-128.0f, scale, lo) * scale_log2);
      }
      keys[ptid] = key;
    }
    switch (format) {
      case PageFormat::kInt4: Int4KCodesTile<kDim>(stage, tile, u, exponent); break;
      case PageFormat::kInt8: DecodeTile<PageFormat::kInt8, kDim>(stage, tile, u); break;
      default: DecodeTile<PageFormat::kBf16, kDim>(stage, tile, u); break;
    }
  } else {
    switch (format) {
      case PageFormat::kInt4: DecodeInt4VTile<kDim>(stage + v_offset, tile, u, exponent); break;
      case PageFormat::kInt8: DecodeTile<PageFormat::kInt8, kDim>(stage + v_offset, tile, u); break;
      default: DecodeTile<PageFormat::kBf16, kDim>(stage + v_offset, tile, u); break;
    }
  }
  if (page.n_valid < kPageTokens) {
#pragma unroll
    for (int k = 0; k < ProducerUnits<kDim>::kRowSteps; ++k) {
      if (u.Row(k) < page.n_valid) continue;
#pragma unroll
      for (int b = 0; b < ProducerUnits<kDim>::kBlocks; ++b) *reinterpret_cast<uint4*>(tile + u.TileOffset(k, b)) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Where one page's bytes are, read from global memory one page before its copy is issued so that the
// reads' latency hides behind a decode.
// Offsets, not pointers: an add right after the loads would wait for them there.
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

}  // namespace kvpack::cuda
