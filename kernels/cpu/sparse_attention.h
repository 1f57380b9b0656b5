// Block-sparse attention over a packed entry, on the CPU: the exact reference of the sparse path
// (issue 13; Sol-style routing adapted to the stored domain). Same entry, same tiles, same page
// decode and online softmax as the dense path (attention.h's TileState hook).
//
// Page statistics, per (head, page), in the stored (rotated, smoothed, balanced) domain, from the
// DECODED rows (what the kernels read, so routing needs no other copy of K):
//   mean_k[h, p, :] = (1/n) Σ_j k̂_j     v_sum[h, p, :] = Σ_j v̂_j      n = PageDesc::n_valid
// Sums in double in slot order, rounded to float once, then stored as bf16 (round to nearest even,
// FloatToBf16): 4·d bytes per (page, head) (512 B at d = 128, 6% of an INT4 K+V page pair); the
// token count is the page descriptor's n_valid. bf16 halves the statistics, most of the GPU's
// routing region (H3: 68 MB instead of 136 MB), and loses nothing the GPU kept: its pooled tiles
// already rounded the float statistics to bf16 (RNE, the same values). The V SUM is stored, not the
// mean: the wgmma kernel's synthetic pages take V sums as their rows and FoldPooled adds e·v_sum,
// so both use it as stored; bf16 has float's exponent range (a sum of 64 rows cannot overflow where
// a row does not); and for a full page (n = 64, a power of two) bf16(sum) / 64 = bf16(mean) exactly,
// so the choice matters only for a range's last, partial page, where the mma.sync kernel's value
// bf16(v_sum / n) rounds twice.
//
// Query blocks: consecutive queries, cut at 128, where the sequence id changes and where the key page
// holding the query's position leaves the block's pages — the page holding its first query and, when
// that page leads a pair (visibility.h PairsWithNext: an even page and the next, of one range), its
// partner. In the layer (query t at position t) a block is exactly the queries of a page pair, or of
// one page where a range starts on an odd page or ends on an even one. (One routing per 128 queries
// rather than per 64: bench/query_block_study.py measured its error within ±2% at top-k 10–20%, and
// the wgmma kernel's two consumer groups then share one page list.) Per (block, head):
//   centroid c = mean of the block's stored queries q̂ (double, rounded to float)
//   score s_p  = scale · c · mean_k[p] (double dot over the bf16 mean key, rounded) for every page p
//                the block sees (Visibility::PageVisibleToRun with the block's last position)
//   exact      = top-k: the ceil(topk_ratio · V) best scores (at least 1; V visible pages), or
//                rel-tau: every page with s_p ≥ max s − rel_tau · std s (population std over V)
//              ∪ always: the diagonal pages (those holding the block's positions) and their ±1
//                neighbours in entry order, the first sink_pages visible pages, pages of ranges
//                marked always_attend, every visible page when the block's range attends densely,
//                and every page the block sees only in part (PageFullyVisibleToBlock false)
//              ∪ floor: the best remaining pages until min(min_exact_pages, V) are exact
//   pooled     = every other visible page (tail on); dropped (tail off)
// Ties in score go to the lower page index. A page seen only in part is scored +inf (it ranks first
// and takes a top-k place): its mean holds keys the block must not see, which must not move the
// routing of any other page (so keys hidden by causality or sequence never change a result). Exact pages are folded with FoldPage in ascending order,
// so with every page exact (topk_ratio 1) the result is bit-identical to AttendFloat. A pooled page
// adds, for query i, s = scale · q̂_i · mean_k[p] with weight n: ℓ += n·e^(s−m), acc += e^(s−m)·v_sum
// (= n tokens of logit s and value v_sum/n), so every visible token stays in the denominator.
// MMA paths (mma_path.h), resolved as the dense path's: on kInt8 the exact pages take FoldPage's INT8
// logits, and a pooled page's mean key is quantized as a query row is (QueryScaleOf / QueryCode over
// its bf16 values: codes k̂, scale s_k), s = scale · s_q,i · s_k · Σ q̂_codes·k̂ — what the kernels'
// synthetic pages hold on that path.
// The routed fraction of a call is Σ exact / Σ visible over its (block, head) pairs.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/layer.h"
#include "kernels/cpu/pack.h"
#include "kernels/layer_spec.h"
#include "kernels/sparse_plan.h"
#include "kernels/visibility.h"

namespace kvpack::cpu {

inline constexpr int kQueryBlock = kSparseQueryBlock;  // the queries of a page pair

// Bytes of the page statistics of an entry (mean_k and v_sum, bf16 [H, P, d] each).
uint64_t PageStatsBytes(int n_heads, int head_dim, int n_pages);

// The page statistics of an entry, in caller memory: [H, P, d] bf16 bits each (ComputePageStats).
struct PageStatsView {
  const uint16_t* mean_k = nullptr;
  const uint16_t* v_sum = nullptr;
};

// The INT8 MMA path's pooled key: a bf16 mean key row (d ≤ kMaxHeadDimCpu values) quantized as a query
// row is (mma_path.h QuantizeQueryRow) into codes[d]; returns s_k. The GPU's LaunchPageStats writes
// the same bits.
float PooledKeyCodes(const uint16_t* mean_k, int d, int8_t* codes);

// Per-range flags the routing reads, indexed by PageDesc::range_index.
inline constexpr uint8_t kRangeAlwaysAttend = 1;
inline constexpr uint8_t kRangeAttendDensely = 2;
std::vector<uint8_t> RangeFlags(const std::vector<TokenRange>& ranges);

// Index one past the last query of the block starting at `first` (rules at the top of this file).
int64_t QueryBlockEnd(const KvEntryView& kv, const int32_t* seq_ids, const int64_t* positions, int64_t n_q,
                      int64_t first);

// Queries first..first+n−1 of head `head` of q ([n_q, H, d], un-transformed) in stored form into
// stored[n, d] (ToStoredQ, as AttendFloat does), and their mean (double sums, rounded) into centroid[d].
void StoredBlockQueries(const KvEntryView& kv, int head, const float* q, int64_t first, int n, float* stored,
                        float* centroid);

// Scratch of one RoutePages call: scores float[P], order int32[P], mark uint8[P].
struct RouteScratch {
  float* scores = nullptr;
  int32_t* order = nullptr;
  uint8_t* mark = nullptr;
};

// Routes one (block, head). `centroid` is the block's mean stored query (d floats); the block's
// queries are of sequence `seq` at positions first_pos..last_pos (first_pos its first query's).
// Writes the exact pages to exact[0..*n_exact) and the pooled ones to pooled[0..*n_pooled), each
// ascending (both buffers kv.n_pages long), and adds to *report.
void RoutePages(const KvEntryView& kv, const PageStatsView& stats, int head, const float* centroid, int32_t seq,
                int64_t first_pos, int64_t last_pos, const AttentionOptions& attention, float scale,
                const std::vector<uint8_t>& range_flags, const RouteScratch& scratch, int32_t* exact, int* n_exact,
                int32_t* pooled, int* n_pooled, SparseReport* report);

// Attention of a tile (all of one block) over a routing, on the resolved MMA path `mma`; out as
// AttendTile.
void AttendTileRouted(const KvEntryView& kv, const PageStatsView& stats, int head, const QueryTile& tile, bool causal,
                      float scale, MmaPath mma, const RoutedPages& routed, float* out);

// AttendFloat with attention.sparse (which must be enabled and valid): statistics, routing and the
// exact stage; `ranges` give the per-range flags (may be empty: none set). *report may be null.
Error SparseAttendFloat(const KvEntryView& kv, const QueryBlock& queries, const AttentionOptions& attention,
                        const std::vector<TokenRange>& ranges, float* out, const CpuOptions& options,
                        SparseReport* report);

}  // namespace kvpack::cpu
