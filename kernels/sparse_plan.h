// Sizes and query chunks of the block-sparse path (AttentionOptions::sparse), shared by the CPU layer
// (cpu/sparse_layer.h) and the CUDA layer (cuda/sparse.h), so that both plan the same memory.
//
// A query block is the queries of one key page (query t sits at position t in a layer), so query chunks
// end on page ends: the chunk that starts at `begin` (a page start) ends with the page holding token
// min(begin + query_chunk, N) − 1, which gives at most query_chunk + 63 rows and at most
// ceil(rows / 64) + (number of ranges) blocks (each range may end in a partial page).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/format.h"
#include "kernels/layer_spec.h"

namespace kvpack {

inline constexpr int kSparseQueryBlock = kPageTokens;

// Pages of the entry of `config` (every range rounded up to whole pages).
int64_t SparsePageCount(const LayerConfig& config);
// Rows of the largest query chunk of a sparse layer: min(N, query_chunk + kSparseQueryBlock − 1).
int64_t SparseQueryRows(const LayerConfig& config);
// Query blocks (pages of queries) of the largest chunk, at most the entry's pages.
int64_t SparseBlocksPerChunk(const LayerConfig& config);
// End (one past the last token) of the chunk that starts at `begin`, a page start; `pages` is
// BuildPageLayout(config.ranges).
int64_t SparseChunkEnd(const LayerConfig& config, const std::vector<PageDesc>& pages, int64_t begin);

// The GPU routing kernel (cuda/sparse_route.cu) keys (and may sort) one (block, head)'s page scores in shared memory:
// 8 bytes per page rounded up to a power of two, plus a byte per page of marks rounded to 16. Pure, so
// that the backend can check a GPU's per-block limit before anything is reserved: on GPUs of 99 KB per
// block (sm_86, sm_89, sm_120) entries of more than 8192 pages (524,288 tokens) do not route.
int SparseRouteSharedBytes(int64_t n_pages);

}  // namespace kvpack
