// Device pieces shared by the attention kernels (attention.cu: mma.sync tilings; attention_wgmma.cu:
// warp-specialised wgmma). Internal to kernels/cuda: include only from .cu files.
//
//   PTX wrappers          cp.async, shared-memory addresses, bf16 packing
//   DecodeUnit            8 channels of one page row (INT4 / INT8 / BF16) → 8 bf16 in one uint4
//   LoadPageAsync         a page's K and V bytes → a raw shared-memory stage (cp.async)
//   QueryRuns             sequence id of every query row and the runs of equal ids (visibility)
//   CollectVisiblePages   the pages of a window that some query of the tile may see, in page order
//   WriteOutputRows       the epilogue of one warp's rows: Rᵀ, ×λ_v, +μ_v, bf16 store
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/warp_row.cuh"
#include "kernels/format.h"

namespace kvpack::cuda {

// ── PTX wrappers ────────────────────────────────────────────────────────────────────────────────
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(smem)), "l"(gmem));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// ── Page decode ─────────────────────────────────────────────────────────────────────────────────
// Channels c8·8 … c8·8 + 7 of row r of a raw page (shared memory) in format F: LoadUnit reads the
// bytes, ConvertUnit makes 8 bf16 of them exactly as format.h's reference decodes (fp32: lo + code·
// scale with one rounding, or code·scale; then bf16 round to nearest even). Split so that a caller
// can issue several units' loads before their stores. Integer codes become floats through the
// exponent trick: the float with bits 0x4b000000 | c is 2^23 + c exactly (c < 2^23), so subtracting
// 2^23 gives c without an integer conversion (a quarter-rate instruction on sm_90).
template <PageFormat F>
struct RawUnit {
  uint4 bits;  // INT4: x = codes (8 nibbles), y = meta (scale | lo << 16); INT8: x, y = codes, z = scale; BF16: values
};

template <PageFormat F, int kDim>
__device__ __forceinline__ RawUnit<F> LoadUnit(const uint8_t* raw, int r, int c8) {
  RawUnit<F> u;
  if constexpr (F == PageFormat::kInt4) {
    u.bits.x = *reinterpret_cast<const uint32_t*>(raw + r * (kDim / 2) + c8 * 4);
    u.bits.y = *reinterpret_cast<const uint32_t*>(raw + MetaOffset(PageFormat::kInt4, kDim) + r * 4);
  } else if constexpr (F == PageFormat::kInt8) {
    const uint2 codes = *reinterpret_cast<const uint2*>(raw + r * kDim + c8 * 8);
    u.bits.x = codes.x, u.bits.y = codes.y;
    u.bits.z = *reinterpret_cast<const uint16_t*>(raw + MetaOffset(PageFormat::kInt8, kDim) + r * 2);
  } else {
    u.bits = *reinterpret_cast<const uint4*>(raw + r * kDim * 2 + c8 * 16);
  }
  return u;
}

template <PageFormat F>
__device__ __forceinline__ uint4 ConvertUnit(const RawUnit<F>& u) {
  if constexpr (F == PageFormat::kBf16) return u.bits;
  float v[8];
  if constexpr (F == PageFormat::kInt4) {
    const float scale = HalfBits(u.bits.y & 0xffffu), lo = HalfBits(u.bits.y >> 16);
    const uint32_t even = u.bits.x & 0x0f0f0f0fu, odd = (u.bits.x >> 4) & 0x0f0f0f0fu;  // byte k: channel 2k / 2k+1
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      // bytes (code, 0, 0, 0x4b): 2^23 + code
      v[2 * k] = fmaf(__uint_as_float(__byte_perm(even, 0x4b000000u, 0x7540 + k)) - 8388608.0f, scale, lo);
      v[2 * k + 1] = fmaf(__uint_as_float(__byte_perm(odd, 0x4b000000u, 0x7540 + k)) - 8388608.0f, scale, lo);
    }
  } else {
    const float scale = HalfBits(u.bits.z);
    const uint32_t x = u.bits.x ^ 0x80808080u, y = u.bits.y ^ 0x80808080u;  // each byte: code + 128
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = (__uint_as_float(__byte_perm(x, 0x4b000000u, 0x7540 + k)) - 8388736.0f) * scale;  // 2^23 + 128
      v[4 + k] = (__uint_as_float(__byte_perm(y, 0x4b000000u, 0x7540 + k)) - 8388736.0f) * scale;
    }
  }
  return make_uint4(PackBf16(v[0], v[1]), PackBf16(v[2], v[3]), PackBf16(v[4], v[5]), PackBf16(v[6], v[7]));
}

// One unit, zeros for rows at or past n_valid.
template <PageFormat F, int kDim>
__device__ __forceinline__ uint4 DecodeUnitOf(const uint8_t* raw, int n_valid, int r, int c8) {
  if (r >= n_valid) return make_uint4(0, 0, 0, 0);
  return ConvertUnit<F>(LoadUnit<F, kDim>(raw, r, c8));
}

template <int kDim>
__device__ __forceinline__ uint4 DecodeUnit(const uint8_t* raw, PageFormat format, int n_valid, int r, int c8) {
  switch (format) {
    case PageFormat::kInt4: return DecodeUnitOf<PageFormat::kInt4, kDim>(raw, n_valid, r, c8);
    case PageFormat::kInt8: return DecodeUnitOf<PageFormat::kInt8, kDim>(raw, n_valid, r, c8);
    default: return DecodeUnitOf<PageFormat::kBf16, kDim>(raw, n_valid, r, c8);
  }
}

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

// ── Visibility ──────────────────────────────────────────────────────────────────────────────────
// The query rows of a tile as runs of equal sequence id (rows are consecutive tokens, so a tile meets
// few sequences): a page is visible when its sequence is one of the runs' and (causal) it starts at or
// before the run's last token.
struct QueryRuns {
  int q_seq[kTileQueries];   // sequence id of each query row (padding rows repeat the last real row)
  int seq[kTileQueries];     // run i: sequence id …
  int last[kTileQueries];    // … and its last token
  int n;
};

// Fills `runs` for the tile of n_rows queries starting at token t0. Ends with a barrier.
template <int kThreads>
__device__ void FindQueryRuns(const AttentionParams& p, int64_t t0, int n_rows, QueryRuns& runs) {
  for (int r = threadIdx.x; r < kTileQueries; r += kThreads) {
    const int rr = r < n_rows ? r : n_rows - 1;
    runs.q_seq[r] = p.kv.pages[FindPage(p.kv.pages, p.kv.n_pages, t0 + rr)].seq_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int n = 0;
    for (int r = 0; r < n_rows; ++r) {
      if (n == 0 || runs.q_seq[r] != runs.seq[n - 1]) runs.seq[n++] = runs.q_seq[r];
      runs.last[n - 1] = static_cast<int>(t0 + r);
    }
    runs.n = n;
  }
  __syncthreads();
}

// Scratch of CollectVisiblePages: kWindow pages examined per pass, kThreads threads.
template <int kThreads, int kWindow>
struct VisibleScratch {
  static_assert(kWindow % kThreads == 0 && kWindow / kThreads <= 32, "window split evenly, ≤ 32 pages per thread");
  uint16_t visible[kWindow];  // offsets (from the window's first page) of the visible pages, in order
  int counts[kThreads];
  int n_visible;
};

// Writes the visible pages among [w0, w0 + wn) to scratch.visible and returns their number (the same
// in every thread). Starts and ends with barriers (so scratch may be reused right after the previous
// window's last use).
template <int kThreads, int kWindow>
__device__ int CollectVisiblePages(const AttentionParams& p, const QueryRuns& runs, int w0, int wn,
                                   VisibleScratch<kThreads, kWindow>& scratch) {
  constexpr int kPerThread = kWindow / kThreads;
  const int tid = threadIdx.x, entries = runs.n;
  uint32_t mine = 0;  // bit i: page tid·kPerThread + i is visible
  int count = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int idx = tid * kPerThread + i;
    if (idx >= wn) break;
    const PageDesc page = p.kv.pages[w0 + idx];
    bool visible = false;
    for (int e = 0; e < entries && !visible; ++e) {
      visible = page.seq_id == runs.seq[e] && (!p.causal || page.token_begin <= runs.last[e]);
    }
    if (visible) mine |= 1u << i, ++count;
  }
  scratch.counts[tid] = count;
  __syncthreads();
  if (tid == 0) {  // exclusive prefix sum, in page order
    int run = 0;
    for (int i = 0; i < kThreads; ++i) {
      const int c = scratch.counts[i];
      scratch.counts[i] = run;
      run += c;
    }
    scratch.n_visible = run;
  }
  __syncthreads();
  int pos = scratch.counts[tid];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (mine & (1u << i)) scratch.visible[pos++] = static_cast<uint16_t>(tid * kPerThread + i);
  }
  const int n_visible = scratch.n_visible;
  __syncthreads();
  return n_visible;
}

// ── Epilogue ────────────────────────────────────────────────────────────────────────────────────
// 1/ℓ of a thread's two rows (g, g + 8), whose softmax sums are spread over the quad of lanes 4g…4g+3;
// 0 for a row that saw no key.
__device__ __forceinline__ void InverseRowSums(const float (&row_sum)[2], float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
  }
}

// One warp writes n_rows output rows of `head`: rows[r·pitch + c] holds channel c of acc/ℓ (still
// rotated) for output row out_row0 + r. Each row: Rᵀ (fast Walsh–Hadamard across the warp), +μ_v,
// bf16 store. REQUIRES: the rows are visible to the calling warp (__syncwarp after writing them).
template <int kDim>
__device__ __forceinline__ void WriteOutputRows(const AttentionParams& p, int head, const float* rows, int pitch,
                                                int n_rows, int64_t out_row0, int lane) {
  constexpr int kPerLane = kDim / 32;
  const float* mu_v = p.kv.mu_v + head * kDim + lane * kPerLane;
  const float* lambda_v = p.kv.lambda_v + head * kDim + lane * kPerLane;
  float sign[kPerLane];
  LaneSigns(sign, lane, p.kv.seed);
  for (int r = 0; r < n_rows; ++r) {
    float x[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = rows[r * pitch + lane * kPerLane + i];
    if (p.kv.rotate) WarpRotateInverse(x, lane, sign);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = __fmul_rn(x[i], lambda_v[i]) + mu_v[i];  // no FMA: as the CPU rounds
    StoreBf16(p.out + (out_row0 + r) * p.out_stride + head * kDim + lane * kPerLane, x);
  }
}

}  // namespace kvpack::cuda
