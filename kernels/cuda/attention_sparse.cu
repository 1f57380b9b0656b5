// The exact stage and pooled tail of block-sparse attention (sparse.h), on mma.sync (every arch).
//
// A CTA of 4 warps × 16 rows takes the ≤ 64 queries of one page of one head; the routing is its query
// block's (one per (block, head), in the slot of the block's first page: the partner page of a pair
// reads the slot before its own), the same for all its rows:
//   1. the exact pages, ascending, from the block's exact bitmask: raw copy (cp.async, two stages, the
//      next page's bytes in flight), decode by the codec into bf16 tiles, S = Q·Kᵀ, masks, online
//      softmax, O += P·V — the dense portable kernel's steps (attention_sm80_warp.cuh);
//   2. the pooled pages, one synthetic page per slice of 64 pages (64·i … 64·i + 63) that holds any:
//      key j = mean_k of the slice's page j (stored bf16, copied), value j = bf16(v_sum / n_j) (exact
//      for a full page: n_j = 64), logit bias ln n_j — n_j tokens of logit s and value v_sum / n_j,
//      the CPU's FoldPooled — and −∞ for the slice's pages the block does not pool; no causal mask (a
//      pooled page is fully visible to the block: PageFullyVisibleToBlock). (Gathering the pooled
//      pages 64 at a time took one thread's serial scan of the bitmask per synthetic page.);
//   3. the dense path's epilogue: 1/ℓ, Rᵀ, ×λ_v, +μ_v, bf16 rows of the output.
#include <cuda_runtime.h>

#include "kernels/cuda/attention_device.cuh"
#include "kernels/cuda/attention_sm80_warp.cuh"
#include "kernels/cuda/attention_sm90.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/sparse.h"

namespace kvpack::cuda {
namespace {

using namespace sm80;

// Tile traits of one query block: Q [64][kPitch], K and V tiles [64][kPitch] (bf16), then two raw stages.
template <int kDimT>
struct SparseTile {
  static constexpr int kDim = kDimT;
  static constexpr int kWarps = 4;
  static constexpr int kMTiles = 1;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerWarp = 16;
  static constexpr int kRows = kWarps * kRowsPerWarp;
  static_assert(kRows == kPageTokens, "a CTA holds one query block");
  static constexpr int kPitch = kDim + 8;
  static constexpr int kTileBytes = kPageTokens * kPitch * 2;
  static constexpr int kQBytes = kRows * kPitch * 2;
  static constexpr int kRawOffset = kQBytes + 2 * kTileBytes;
  static constexpr int kStagePitch = kDim + 4;
  static_assert(kRows * kStagePitch * 4 <= kRawOffset, "epilogue staging fits in the Q/K/V tiles");
  static constexpr int kKTiles = kDim / 16;
  static constexpr int kONTiles = kDim / 8;
};

// The first set bit at or after `from` of bits[0 … words), or −1. Every thread of the CTA calls it
// with the same arguments (uniform control flow).
__device__ __forceinline__ int NextBit(const uint32_t* bits, int words, int from) {
  int w = from >> 5;
  if (w >= words) return -1;
  uint32_t m = bits[w] & (~0u << (from & 31));
  while (m == 0) {
    if (++w >= words) return -1;
    m = bits[w];
  }
  return (w << 5) + __ffs(m) - 1;
}

// kInt8Qk: the INT8 MMA path (mma_path.h), as the dense portable kernel runs it: the block's int8 query
// codes in the K tile's place, their s_q and Σq / s_q, the key table and (pooled pass) the synthetic
// page's int8 mean-key codes (AttentionParams::Route::mean_codes) in the bf16 Q tile's place; S from
// the raw page's integer codes (ScorePageInt8), so no K tile is decoded.
template <int kDim, bool kInt8Qk>
__global__ void __launch_bounds__(SparseTile<kDim>::kThreads) SparseAttentionKernel(const SparseChunk chunk) {
  using T = SparseTile<kDim>;
  using L = Int8QkLayout<kDim>;
  static_assert(L::kQ8Bytes <= T::kTileBytes, "the int8 Q tile fits in the K tile's place");
  static_assert(2 * kTileQueries * 4 + kPageTokens * 8 + kPageTokens * kDim <= T::kQBytes,
                "row data, key table and synthetic codes fit in the bf16 Q's place");
  extern __shared__ __align__(128) uint8_t smem[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(smem);
  uint16_t* k_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes);
  uint16_t* v_tile = reinterpret_cast<uint16_t*>(smem + T::kQBytes + T::kTileBytes);
  uint8_t* raw = smem + T::kRawOffset;
  // The INT8 path's: s_q [128], Σq / s_q [128], the key table [64] (a_j, b_j), the synthetic page's
  // codes [64][d] (an INT8 page's K layout); the int8 Q tile.
  float* q_scale = reinterpret_cast<float*>(smem);
  float* q_sum_over_scale = q_scale + kTileQueries;
  float2* key_table = reinterpret_cast<float2*>(q_sum_over_scale + kTileQueries);
  uint8_t* synthetic_codes = reinterpret_cast<uint8_t*>(key_table + kPageTokens);
  uint8_t* q8 = smem + T::kQBytes;
  __shared__ QueryRuns runs;
  __shared__ float bias[kPageTokens];    // the synthetic page's ln n_j, in S units (÷ scale·log2 e)
  const AttentionParams& p = chunk.attention;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int head = blockIdx.y;
  const PageDesc block = p.kv.pages[chunk.attention.route.first_page + blockIdx.x];
  const int n_rows = block.n_valid;
  const int64_t t0 = block.token_begin;
  const int64_t q0 = t0 - p.q_token_begin;  // launch row of the block's first query
  const int row0 = warp * T::kRowsPerWarp;
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;

  // ── Prologue: the block's stored queries [64][d] → smem; one run (one sequence) ────────────────
  if constexpr (kInt8Qk) {
    QuantizeQueryRows<T>(p, QueryTileCoords{head, q0, n_rows, t0}, q8, q_scale, q_sum_over_scale);
  } else {
    for (int u = tid; u < T::kRows * (kDim / 8); u += T::kThreads) {
      const int r = u / (kDim / 8), c8 = u % (kDim / 8);
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < n_rows) v = *reinterpret_cast<const uint4*>(p.q + (q0 + r) * p.q_stride + head * kDim + c8 * 8);
      *reinterpret_cast<uint4*>(q_tile + r * T::kPitch + c8 * 8) = v;
    }
  }
  for (int r = tid; r < kTileQueries; r += T::kThreads) runs.q_seq[r] = block.seq_id;
  if (tid == 0) runs.n = 1, runs.seq[0] = block.seq_id, runs.last[0] = static_cast<int>(t0 + n_rows - 1);
  WarpRows<T> w;
#pragma unroll
  for (int n = 0; n < T::kONTiles; ++n) w.o[0][n][0] = w.o[0][n][1] = w.o[0][n][2] = w.o[0][n][3] = 0.0f;
  w.row_max[0][0] = w.row_max[0][1] = -INFINITY, w.row_sum[0][0] = w.row_sum[0][1] = 0.0f;
  // The block's routing (a chunk starts with a block's first page: slot 0 leads).
  const int slot = LeadsQueryBlock(p.kv.pages, p.kv.n_pages, chunk.attention.route.first_page + blockIdx.x)
                       ? blockIdx.x : blockIdx.x - 1;
  const int64_t route = (static_cast<int64_t>(slot) * p.kv.n_heads + head) * chunk.attention.route.words;
  const uint32_t* exact = chunk.attention.route.exact_bits + route;
  const uint32_t* pooled = chunk.attention.route.pooled_bits + route;
  __syncthreads();
  // The INT8 path's rows g, g + 8 of this warp: s_q and Σq / s_q (the softmax's row scale on that
  // path; scale_log2 on the bf16 path).
  float row_scale[1][2] = {{scale_log2, scale_log2}}, q_sums[1][2] = {{0.0f, 0.0f}};
  if constexpr (kInt8Qk) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + (lane >> 2) + 8 * r;
      row_scale[0][r] = q_scale[row], q_sums[0][r] = q_sum_over_scale[row];
    }
  }
  // S of a page whose K is in k_tile (bf16) or, on the INT8 path, its integer codes at `codes`.
  auto score = [&](const uint8_t* codes, PageFormat format) {
    if constexpr (kInt8Qk) {
      ScorePageInt8(w, q8, codes, format, key_table, q_sums, row0, lane);
    } else {
      ScorePage(w, q_tile, k_tile, row0, lane);
    }
  };

  // ── 1. Exact pages ───────────────────────────────────────────────────────────────────────────
  // Page i + 1's copy starts once every warp is done with page i − 1, whose raw stage it overwrites
  // (the INT8 path reads K's codes from there through the MMAs).
  const int stage_bytes = 2 * p.max_page_bytes;
  int page_index = NextBit(exact, chunk.attention.route.words, 0);
  if (page_index >= 0) LoadPageAsync<T::kThreads, kDim>(p, head, page_index, raw, tid);
  CpAsyncCommit();
  for (int i = 0; page_index >= 0; ++i) {
    const int next = NextBit(exact, chunk.attention.route.words, page_index + 1);
    CpAsyncWait<0>();
    __syncthreads();  // page i's bytes are here; every warp is done with the previous page
    if (next >= 0) LoadPageAsync<T::kThreads, kDim>(p, head, next, raw + ((i + 1) & 1) * stage_bytes, tid);
    CpAsyncCommit();
    const PageDesc page = p.kv.pages[page_index];
    const PageFormat format = static_cast<PageFormat>(page.format);
    const uint8_t* stage = raw + (i & 1) * stage_bytes;
    if constexpr (kInt8Qk) {
      WriteKeyTable<kDim>(stage, format, scale_log2, key_table);
    } else {
      DecodePage<T, false>(stage, format, page.n_valid, k_tile);
    }
    DecodePage<T, true>(stage + p.max_page_bytes, format, page.n_valid, v_tile);
    __syncthreads();  // tiles decoded
    score(stage, format);
    SoftmaxPageScaled(w, p, runs, page, t0, row0, row_scale, lane);
    AccumulatePv(w, v_tile, lane);
    page_index = next;
  }

  // ── 2. Pooled pages, one synthetic page per slice of 64 pages that holds any ─────────────────
  AttentionParams pooled_params = p;
  pooled_params.visibility.causal = false;  // pooled pages are wholly visible to the block
  const uint16_t* mean_k = chunk.attention.route.mean_k + static_cast<int64_t>(head) * p.kv.n_pages * kDim;
  const uint16_t* v_sum = chunk.attention.route.v_sum + static_cast<int64_t>(head) * p.kv.n_pages * kDim;
  const int words = chunk.attention.route.words;
  for (int first = 0; first < p.kv.n_pages; first += kPageTokens) {
    const int word = first >> 5;  // the slice's bits: words word, word + 1
    const unsigned long long member =
        pooled[word] | (word + 1 < words ? static_cast<unsigned long long>(pooled[word + 1]) << 32 : 0ull);
    if (member == 0) continue;  // the same for every thread
    const int count = p.kv.n_pages - first < kPageTokens ? p.kv.n_pages - first : kPageTokens;
    __syncthreads();  // every warp is done with the tiles
    for (int u = tid; u < kPageTokens * (kDim / 8); u += T::kThreads) {
      const int j = u / (kDim / 8), c8 = u % (kDim / 8);
      uint4 k8 = make_uint4(0, 0, 0, 0), v8 = make_uint4(0, 0, 0, 0);
      if (member >> j & 1ull) {
        const int64_t at = static_cast<int64_t>(first + j) * kDim + c8 * 8;
        const float inv_n = 1.0f / static_cast<float>(p.kv.pages[first + j].n_valid);
        if constexpr (!kInt8Qk) k8 = *reinterpret_cast<const uint4*>(mean_k + at);  // 8 bf16 mean keys, as stored
        const uint4 vs = *reinterpret_cast<const uint4*>(v_sum + at);  // 8 bf16 V sums
        auto mean2 = [&](uint32_t two) { return PackBf16(Bf16Lo(two) * inv_n, Bf16Hi(two) * inv_n); };
        v8 = make_uint4(mean2(vs.x), mean2(vs.y), mean2(vs.z), mean2(vs.w));
      }
      if constexpr (!kInt8Qk) *reinterpret_cast<uint4*>(k_tile + j * T::kPitch + c8 * 8) = k8;
      *reinterpret_cast<uint4*>(v_tile + j * T::kPitch + c8 * 8) = v8;
    }
    if constexpr (kInt8Qk) {  // the pooled pages' mean-key codes (LaunchPageStats) and their s_k
      const int8_t* codes = chunk.attention.route.mean_codes + (static_cast<int64_t>(head) * p.kv.n_pages + first) * kDim;
      for (int u = tid; u < kPageTokens * (kDim / 16); u += T::kThreads) {
        const int j = u / (kDim / 16), c16 = u % (kDim / 16);
        const uint4 v = member >> j & 1ull ? *reinterpret_cast<const uint4*>(codes + j * kDim + c16 * 16) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(synthetic_codes + j * kDim + c16 * 16) = v;
      }
      const float* s_k = chunk.attention.route.mean_scales + static_cast<int64_t>(head) * p.kv.n_pages + first;
      for (int j = tid; j < kPageTokens; j += T::kThreads) {
        key_table[j] = make_float2((member >> j & 1ull ? s_k[j] : 1.0f) * scale_log2, 0.0f);
      }
    }
    for (int j = tid; j < kPageTokens; j += T::kThreads) {  // pages of the slice the block does not pool: −∞
      bias[j] = member >> j & 1ull ? log2f(static_cast<float>(p.kv.pages[first + j].n_valid)) / scale_log2 : -INFINITY;
    }
    __syncthreads();
    PageDesc synthetic{};
    synthetic.token_begin = 0;
    synthetic.seq_id = block.seq_id;
    synthetic.n_valid = static_cast<uint16_t>(count);
    score(synthetic_codes, PageFormat::kInt8);
    // The bias in S units: ÷ scale·log2 e on the bf16 path, ÷ s_q (the row scale) on the INT8 path.
    const int t = lane & 3;
    const float to_s[2] = {scale_log2 / row_scale[0][0], scale_log2 / row_scale[0][1]};
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float b = bias[n * 8 + 2 * t + (e & 1)];
        w.s[0][n][e] += kInt8Qk ? b * to_s[e >> 1] : b;
      }
    }
    SoftmaxPageScaled(w, pooled_params, runs, synthetic, t0, row0, row_scale, lane);
    AccumulatePv(w, v_tile, lane);
  }

  // ── 3. Epilogue ──────────────────────────────────────────────────────────────────────────────
  const QueryTileCoords tile{head, q0, n_rows, t0};
  StoreWarpRows(w, p, smem, tile, row0, lane);
}

template <int kDim, bool kInt8Qk>
Error Launch(const SparseChunk& chunk, cudaStream_t stream) {
  using T = SparseTile<kDim>;
  const int smem = T::kRawOffset + 2 * 2 * chunk.attention.max_page_bytes;
  auto kernel = SparseAttentionKernel<kDim, kInt8Qk>;
  KVPACK_CUDA_RETURN(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<dim3(chunk.attention.route.n_blocks, chunk.attention.kv.n_heads), T::kThreads, smem, stream>>>(chunk);
  KVPACK_CUDA_RETURN_LAUNCH("sparse attention");
  return Error::Ok();
}

}  // namespace

Error LaunchSparseAttention(const SparseChunk& chunk, cudaStream_t stream) {
  if (chunk.attention.route.n_blocks <= 0) return Error::Ok();
  KVPACK_RETURN_IF_ERROR(RequireKernelMmaPath(chunk.attention.mma, "sparse attention"));
  if (chunk.attention.tiling == AttentionTilingChoice::kWgmma) {
    if (chunk.attention.route.leads == nullptr || chunk.attention.route.n_leads <= 0) {
      return InvalidArgument("sparse attention: route.leads (the chunk's blocks) must be set");
    }
    return LaunchAttentionSm90(chunk.attention, stream);
  }
  const bool int8 = chunk.attention.mma == MmaPath::kInt8;
  switch (chunk.attention.kv.head_dim) {
    case 64:
      return int8 ? Launch<64, true>(chunk, stream) : Launch<64, false>(chunk, stream);
    case 128:
      return int8 ? Launch<128, true>(chunk, stream) : Launch<128, false>(chunk, stream);
    default:
      return Unsupported("sparse attention: head_dim must be 64 or 128");
  }
}

}  // namespace kvpack::cuda
