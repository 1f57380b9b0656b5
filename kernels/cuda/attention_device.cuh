// Device pieces shared by the attention kernels (attention_sm80_mma.cu: mma.sync; attention_sm90.cu:
// warp-specialised wgmma). Internal to kernels/cuda: include only from .cu files.
//
//   SmemAddr              a shared-memory address for PTX
//   CpAsync16             16-byte asynchronous copies global → shared (LDGSTS) and their groups
//   Exp2Ftz               2^x in one MUFU.EX2 (denormal results flushed)
//   QueryTileCoords       the tile scheduler: which query tile and head a CTA takes
//   QueryRuns             sequence id of every query row and the runs of equal ids (visibility)
//   CollectVisiblePages   the pages of a window that some query of the tile may see, in page order
//                         (the dense policy of kernels/visibility.h)
//   PageSource            a page's descriptor and pool offsets, fetched a page ahead of its copy
//   WriteOutputRows       the epilogue of one warp's rows: Rᵀ, ×λ_v, +μ_v, bf16 store
// Page decode is the codecs' (page_codec.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/warp_row.cuh"
#include "kernels/format.h"
#include "kernels/transform_choice.h"
#include "kernels/visibility.h"

namespace kvpack::cuda {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global → shared without a register (LDGSTS); complete after CpAsyncWait (and, before a wgmma
// reads them, FenceProxyAsync). CpAsync16Fill copies `bytes` < 16 and fills the rest with zeros (0:
// zeros only, nothing read).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SmemAddr(smem)), "l"(gmem));
}
__device__ __forceinline__ void CpAsync16Fill(void* smem, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(smem)), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

// ── Math ────────────────────────────────────────────────────────────────────────────────────────
// ex2.approx with denormals flushed: one MUFU.EX2 (exp2f adds a range check and two multiplies to
// keep denormal results, which an attention weight below 2^-126 does not need). ex2(−inf) = +0.
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ── Tile scheduler ──────────────────────────────────────────────────────────────────────────────
// One CTA per (query tile, head): blockIdx.x the tile of kTileQueries rows, blockIdx.y the head. Every
// CTA of a dense launch takes about equally long, so the hardware's launch order is the schedule
// (AttentionWaveRows sizes query chunks to whole waves).
struct QueryTileCoords {
  int head;
  int64_t q0;      // first query of the tile (launch row)
  int n_rows;      // its valid rows, 1 … kTileQueries
  int64_t t0;      // token index (= position) of its first query
};
__device__ __forceinline__ QueryTileCoords TileOfBlock(const AttentionParams& p) {
  QueryTileCoords c;
  c.head = blockIdx.y;
  c.q0 = static_cast<int64_t>(blockIdx.x) * kTileQueries;
  c.n_rows = static_cast<int>(p.n_q - c.q0 < kTileQueries ? p.n_q - c.q0 : kTileQueries);
  c.t0 = p.q_token_begin + c.q0;
  return c;
}
inline dim3 AttentionGrid(const AttentionParams& p) {
  return dim3(static_cast<unsigned>((p.n_q + kTileQueries - 1) / kTileQueries), static_cast<unsigned>(p.kv.n_heads));
}

// ── Visibility ──────────────────────────────────────────────────────────────────────────────────
// The query rows of a tile as runs of equal sequence id (rows are consecutive tokens, so a tile meets
// few sequences): a page is visible when it is visible to one of the runs (Visibility::PageVisibleToRun).
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

// Thread tid's first slot in scratch.visible when each thread of the CTA adds `count` entries, in
// thread (= page) order: an exclusive prefix sum over scratch.counts; scratch.n_visible gets the total.
// Every thread calls it (two barriers).
template <int kThreads, int kWindow>
__device__ __forceinline__ int VisibleSlot(VisibleScratch<kThreads, kWindow>& scratch, int tid, int count) {
  scratch.counts[tid] = count;
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int i = 0; i < kThreads; ++i) {
      const int c = scratch.counts[i];
      scratch.counts[i] = run;
      run += c;
    }
    scratch.n_visible = run;
  }
  __syncthreads();
  return scratch.counts[tid];
}

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
      // Visibility::PageVisibleToRun, spelled out with the run's last token as an int: through the
      // member function (an int64 comparison) the sm90 kernel measured 5–8% slower over INT4/INT8
      // pages in the same run, with identical outputs (bench/RESULTS.md, session 5).
      visible = page.seq_id == runs.seq[e] && (!p.visibility.causal || page.token_begin <= runs.last[e]);
    }
    if (visible) mine |= 1u << i, ++count;
  }
  int pos = VisibleSlot(scratch, tid, count);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (mine & (1u << i)) scratch.visible[pos++] = static_cast<uint16_t>(tid * kPerThread + i);
  }
  const int n_visible = scratch.n_visible;
  __syncthreads();
  return n_visible;
}

// ── Page sources ────────────────────────────────────────────────────────────────────────────────
// Where one page's bytes are, read from global memory a page before its copy is issued so that the
// reads' latency hides behind a page's work (both kernels; issued just before the copy, they stalled
// every warp of the mma.sync kernel: Nsight Compute, session 10).
// Offsets, not pointers: an add right after the loads would wait for them there.
struct PageSource {
  PageDesc desc;
  uint64_t k, v;  // byte offsets into the pool
};
__device__ __forceinline__ PageSource FetchPageSource(const AttentionParams& p, int head, int page) {
  const int64_t slot = static_cast<int64_t>(head) * p.kv.n_pages + page;
  return {p.kv.pages[page], p.kv.k_offsets[slot], p.kv.v_offsets[slot]};
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
  const bool rotate = HeadRotatesV(p.kv.rotate, p.kv.head_flags, head);
  for (int r = 0; r < n_rows; ++r) {
    float x[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = rows[r * pitch + lane * kPerLane + i];
    if (rotate) WarpRotateInverse(x, lane, sign);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = __fmul_rn(x[i], lambda_v[i]) + mu_v[i];  // no FMA: as the CPU rounds
    StoreBf16(p.out + (out_row0 + r) * p.out_stride + head * kDim + lane * kPerLane, x);
  }
}

}  // namespace kvpack::cuda
