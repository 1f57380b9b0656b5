// Attention of a tile of stored-form queries over one head of a packed entry, on the CPU.
//
// Tile: up to kQueryTile queries × one page of kPageTokens keys at a time. For each page the K rows
// are decoded into a per-call stack buffer [64, d], scores s = scale · q̂·k̂ computed for the tile,
// masked, and folded into an online softmax (fp32):
//   m' = max(m, max_j s_j);  α = exp(m − m');  ℓ ← α·ℓ + Σ_j exp(s_j − m');  acc ← α·acc + Σ_j exp(s_j − m')·v̂_j
// with V rows decoded into a second stack buffer [64, d]. Pages are visited in entry order and slots
// in order, so a query's result depends only on that query (bit-identical for any tiling or thread
// count). No dequantized copy of K or V beyond one page per call ever exists.
//
// Masks: slot j ≥ n_valid; page.seq_id ≠ the query's sequence id; causal and key token index
// (page.token_begin + j) > the query's position. A query that sees no key gets zeros.
// Epilogue per query: o = acc / ℓ, then Rᵀ·o when the entry is rotated, then ⊙ λ_v, then + μ_v
// (two separate fp32 roundings, no fused multiply-add, so the CUDA epilogue can mirror it).
//
// Dot products q̂·k̂ and the accumulation use the same 8-lane fixed order as projection.h.
#pragma once

#include <cstdint>

#include "kernels/layer_spec.h"
#include "kernels/mma_path.h"
#include "kernels/visibility.h"

namespace kvpack::cpu {

inline constexpr int kQueryTile = 16;

// A tile of queries already in stored form (λ applied, rotated, bf16-rounded; epilogue.h ToStoredQ).
struct QueryTile {
  const float* q = nullptr;           // [n, d], row stride d
  const int32_t* seq_ids = nullptr;   // [n]
  const int64_t* positions = nullptr; // [n]
  int n = 0;                          // 1..kQueryTile
};

// Softmax scale actually used: attention.softmax_scale, or 1/sqrt(d) when it is 0.
float EffectiveScale(const AttentionOptions& attention, int head_dim);

// The online-softmax state of one tile, and the three steps AttendTile is made of. This is the hook the
// block-sparse path (sparse_attention.h) shares: it folds its routed pages with FoldPage, its pooled
// terms into the same m, ℓ and acc, and finishes with FinishTile, so a page it attends exactly is
// attended by the very code of the dense path.
struct TileState {
  float m[kQueryTile];                      // running max per query
  float l[kQueryTile];                      // running denominator per query
  float acc[kQueryTile * kMaxHeadDimCpu];   // [n, d] running numerator (stored V domain)
  // The MMA path's logits (mma_path.h): kInt8 (and kFp8) takes the INT4/INT8 pages' logits from the queries'
  // int8 codes (q_codes [n, d], their s_q and Σq̂) and the K codes, as the GPU's INT8 path does.
  MmaPath mma = MmaPath::kBf16;
  int8_t q_codes[kQueryTile * kMaxHeadDimCpu];
  float q_scale[kQueryTile];
  float q_sum[kQueryTile];
  // kFp8: Σ_j p_j·(lo_j + 8·s_j) of the INT4 pages per query (mma_path.h), rescaled with acc and
  // added to every channel of acc at the end; 0 on the other paths.
  float v_off[kQueryTile];
};
// `mma` is the resolved path (ResolveMmaPath).
void BeginTile(const QueryTile& tile, int d, MmaPath mma, TileState* state);
// Folds page `page` of head `head` into the state of `tile` (skipped when no query of the tile sees it).
void FoldPage(const KvEntryView& kv, int head, const QueryTile& tile, const Visibility& visibility, float scale,
              int page, TileState* state);
// acc/ℓ, Rᵀ, ⊙ λ_v, + μ_v into out[n, d]; zeros for a query that saw no key.
void FinishTile(const KvEntryView& kv, int head, int n, const TileState& state, float* out);

// Σ a_i·b_i of int8 codes, exact in int32 as the INT8 MMAs accumulate (|sum| < 2^22 for d ≤ 256).
int32_t IntDot(const int8_t* a, const int8_t* b, int n);

// Whether any page of the entry is BF16 (which keeps a layer on bf16 MMAs: ResolveMmaPath).
bool HasBf16Pages(const KvEntryView& kv);

// out[i·d + c] = attention output of query i for head `head`, channel c (fp32, final form), on the
// resolved MMA path `mma`.
void AttendTile(const KvEntryView& kv, int head, const QueryTile& tile, bool causal, float scale, MmaPath mma,
                float* out);

}  // namespace kvpack::cpu
