// Block-sparse attention over packed pages on the GPU (AttentionOptions::sparse): the CUDA twin of
// cpu/sparse_attention.h, which defines the algorithm (read its header first). Three kernels per layer:
//
//   LaunchPageStats   once per layer: per (head, page) mean_k = (1/n) Σ_j k̂_j and v_sum = Σ_j v̂_j of
//                     the decoded stored rows, double sums in slot order rounded to float, stored as
//                     bf16 — bit for bit the CPU's ComputePageStats (sparse_route.cu is built without
//                     FMA contraction; why bf16 and why the V sum: cpu/sparse_attention.h); on the
//                     INT8 MMA path also each mean key quantized as a query row is (int8 codes and
//                     s_k, the CPU's PooledKeyCodes), once per layer, for the pooled pass.
//   LaunchRoutePages  per query chunk: the centroid of each query block's stored queries (a block is
//                     the queries of a page pair, cpu/sparse_attention.h; its routing lives in the
//                     slot of its first page, the partner's slot is unused); centroid · mean_k of
//                     every (leading slot, page) per head, tiled 32 blocks × 64 pages through shared
//                     memory (double dots over the bf16 mean keys; partner slots take no work: they
//                     took half of it, 13.4 ms of routing's 20 in H3's 509 ms top-k 0.2 layer); then
//                     one CTA per (block, head): the visible pages, the forced pages, top-k or
//                     rel-tau, the floor — the CPU's RoutePages, bit for bit — written as two bitmasks
//                     per (block, head): exact and pooled pages.
//   LaunchSparseAttention  per query chunk. On the wgmma kernel's GPUs (sm_90a) its routed instance
//                     (attention_sm90.cu): a CTA per block, consumer group c the queries of its page c;
//                     both groups walk the block's one exact page list through the dense kernel's
//                     pipeline (deep ring, ping-pong), then the pooled pages as synthetic pages, one
//                     per slice of 64 pages that the block pools, whose rows are the stored mean keys
//                     (bf16, or their int8 codes on the INT8 MMA path) and V sums, copied, weighted by
//                     token count in the softmax sum. Either MMA path (mma_path.h), as dense launches;
//                     the pooled slices follow the exact pages in the last window's pipeline. H3
//                     top-k 0.2 on an H100, INT8 S: attention 389–392 ms (0.242× dense) where a CTA
//                     per page slot (the partner's returning at once) and row sums apart from the
//                     exponentials took 407–409, bf16 S 431–433, and one routing per 64 queries, each
//                     group walking its own list a page at a time, 509 (bench/RESULTS.md, sessions 8,
//                     13, 17–21, with what else was tried); at top-k 1.0 (the dense launch's pages,
//                     all exact) it takes 1.03× the dense kernel's time (1.11× before session 21).
//                     Elsewhere one CTA of 4 warps × 16 rows per (page of queries, head)
//                     (attention_sparse.cu, mma.sync, every arch), reading its block's routing: the
//                     exact pages in ascending order (raw copy, codec decode, S = Q·Kᵀ, masks, online
//                     softmax, O += P·V), then the pooled pages a slice of 64 at a time as one
//                     synthetic page of mean keys (bf16, or their int8 codes) with values
//                     bf16(v_sum / n) and a logit bias ln n (n tokens of logit s and value v_sum / n,
//                     the CPU's FoldPooled), then the dense path's epilogue (Rᵀ, ×λ_v, +μ_v, bf16).
// Results equal the CPU reference's routing exactly and its outputs to rounding (bf16 tiles, bf16 P,
// fold order); tests/kernels/cuda_sparse_test.cc holds both to that.
//
// Memory (PlanSparseRegion, part of the layer's workspace while it attends): the statistics
// bf16 [H, P, d] × 2, on the INT8 MMA path the mean keys' codes int8 [H, P, d] and s_k float [H, P],
// the range flags, the blocks' leading pages int32 [≤ P], exact and pooled bitmasks uint32 [blocks per chunk, H, ⌈P/32⌉]
// each, three uint64 tallies, the chunk's centroids float [blocks, H, d] and scores float [blocks, H, P]
// ("blocks": page slots, SparseBlocksPerChunk).
// H3 (N = 152,263: P = 2380, 56 heads × 128; Tq 4224: 69 slots): statistics 68.2 MB (136.5 as
// float), mean-key codes and scales 17.6 MB (INT8 path), scores 36.8 MB, bitmasks 2.3 MB, centroids
// 2.0 MB, block leads 4.8 KB — 126.9 MB (109.3 on the bf16 path); the layer in place peaks at 1.2901 GiB. The route kernel holds one
// (block, head)'s sort keys in shared memory: 8 bytes per page rounded up to a power of two (it selects
// the top k by radix select and sorts them only for the relative threshold or a floor that top-k does
// not meet), so entries have at most kMaxSparsePagesGpu pages.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/error.h"
#include "kernels/layer_spec.h"

namespace kvpack::cuda {

inline constexpr int kMaxSparsePagesGpu = 16384;  // 1,048,576 tokens; sort keys 128 KiB of shared memory

// Pieces of the sparse region of the workspace (byte offsets from its start).
struct SparseRegion {
  uint64_t mean_k = 0, v_sum = 0, mean_codes = 0, mean_scales = 0, flags = 0, leads = 0, exact_bits = 0, pooled_bits = 0;
  uint64_t tallies = 0;
  uint64_t centroids = 0, scores = 0, end = 0;
  int words = 0;  // uint32 per (block, head) bitmask: ⌈P/32⌉
  bool codes = false;  // the INT8 MMA path's mean-key codes and scales are planned (ConfigMmaPath)
};
SparseRegion PlanSparseRegion(const LayerConfig& config);
// OK when the CUDA layer can run config's sparse options (the entry's page count).
Error SparseSupported(const LayerConfig& config);

// What the route and attention kernels of one query chunk read. Device pointers.
struct SparseChunk {
  AttentionParams attention;       // q = the chunk's stored queries, q_token_begin = its first token,
                                   // out = its first output row; kv, scale, visibility as the dense path;
                                   // attention.route: the chunk's blocks, bitmasks and page statistics
  SparseOptions options;
  const uint8_t* range_flags = nullptr;  // per range: kSparseRangeAlwaysAttend | kSparseRangeAttendDensely
  int32_t* lead_table = nullptr;   // the layer's QueryBlockLeads (route.leads points into it per chunk)
  int n_ranges = 0;
  unsigned long long* tallies = nullptr;  // visible, exact, pooled pages (SparseReport), accumulated
  float* centroids = nullptr;      // scratch [n_blocks, H, d]
  float* scores = nullptr;         // scratch [n_blocks, H, pages]
};

// Points `chunk`'s statistics, range flags, bitmasks, tallies and scratch at their pieces of the
// region (`region` = its first byte on the device); n_ranges and the rest stay the caller's.
void BindSparseRegion(const SparseRegion& r, uint8_t* region, SparseChunk* chunk);

inline constexpr uint8_t kSparseRangeAlwaysAttend = 1;  // = cpu::kRangeAlwaysAttend
inline constexpr uint8_t kSparseRangeAttendDensely = 2; // = cpu::kRangeAttendDensely

// Writes route.mean_k and route.v_sum, and route.mean_codes / mean_scales where they are set.
Error LaunchPageStats(const KvEntryView& kv, const AttentionParams::Route& route, cudaStream_t stream);
Error LaunchRoutePages(const SparseChunk& chunk, cudaStream_t stream);
Error LaunchSparseAttention(const SparseChunk& chunk, cudaStream_t stream);

}  // namespace kvpack::cuda
