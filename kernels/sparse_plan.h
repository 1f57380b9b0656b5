// Sizes and query chunks of the block-sparse path (AttentionOptions::sparse), shared by the CPU layer
// (cpu/sparse_layer.h) and the CUDA layer (cuda/sparse.h), so that both plan the same memory.
//
// A query block is the queries of a page pair (visibility.h PairsWithNext; query t sits at position t in
// a layer), or of one page where a range starts on an odd page or ends on an even one, so query chunks
// end on block ends: the chunk that starts at `begin` (a block start) ends with the page holding token
// min(begin + query_chunk, N) − 1, or with its partner when that page leads a pair — at most
// query_chunk + 127 rows. Routing memory is kept per page slot of the chunk (the partner's slot unused):
// at most ceil(rows / 64) + (number of ranges) slots (each range may end in a partial page).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/format.h"
#include "kernels/layer_spec.h"

namespace kvpack {

inline constexpr int kSparseQueryBlock = 2 * kPageTokens;  // the queries of a page pair

// Pages of the entry of `config` (every range rounded up to whole pages).
int64_t SparsePageCount(const LayerConfig& config);
// Rows of the largest query chunk of a sparse layer: min(N, query_chunk + kSparseQueryBlock − 1).
int64_t SparseQueryRows(const LayerConfig& config);
// Page slots (routing slots: one per page of queries, used by the pages that lead a block) of the
// largest chunk, at most the entry's pages.
int64_t SparseBlocksPerChunk(const LayerConfig& config);
// End (one past the last token) of the chunk that starts at `begin`, a block start; pages[0, n_pages)
// is BuildPageLayout(config.ranges) (or an entry's page array, the same pages).
int64_t SparseChunkEnd(const LayerConfig& config, const PageDesc* pages, int n_pages, int64_t begin);
// The first page of every query block of the entry (visibility.h LeadsQueryBlock), ascending: block k of
// the layer is the queries of page result[k] and its partner. At most n_pages entries.
std::vector<int32_t> QueryBlockLeads(const PageDesc* pages, int n_pages);

// The GPU routing kernel (cuda/sparse_route.cu) keys (and may sort) one (block, head)'s page scores in shared memory:
// 8 bytes per page rounded up to a power of two, plus a byte per page of marks rounded to 16. Pure, so
// that the backend can check a GPU's per-block limit before anything is reserved: on GPUs of 99 KB per
// block (sm_86, sm_89, sm_120) entries of more than 8192 pages (524,288 tokens) do not route.
int SparseRouteSharedBytes(int64_t n_pages);

}  // namespace kvpack
