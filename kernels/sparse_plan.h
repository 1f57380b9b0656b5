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

}  // namespace kvpack
