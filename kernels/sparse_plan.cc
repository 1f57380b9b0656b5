#include "kernels/sparse_plan.h"

#include <algorithm>

#include "kernels/visibility.h"

namespace kvpack {

int64_t SparsePageCount(const LayerConfig& config) {
  int64_t pages = 0;
  for (const TokenRange& r : config.ranges) pages += (r.end - r.begin + kPageTokens - 1) / kPageTokens;
  return pages;
}

int64_t SparseQueryRows(const LayerConfig& config) {
  return std::min(config.shape.n_tokens, config.query_chunk + kSparseQueryBlock - 1);
}

int64_t SparseBlocksPerChunk(const LayerConfig& config) {
  const int64_t rows = SparseQueryRows(config);
  return std::min<int64_t>(SparsePageCount(config),
                           (rows + kPageTokens - 1) / kPageTokens + static_cast<int64_t>(config.ranges.size()));
}

int64_t SparseChunkEnd(const LayerConfig& config, const PageDesc* pages, int n_pages, int64_t begin) {
  const int64_t last = std::min(begin + config.query_chunk, config.shape.n_tokens) - 1;
  const PageDesc* it = std::upper_bound(pages, pages + n_pages, last, [](int64_t t, const PageDesc& page) {
    return t < static_cast<int64_t>(page.token_begin);
  });
  --it;  // pages tile [0, N) in ascending token_begin, so the page holding `last` precedes it
  const int at = static_cast<int>(it - pages);
  if (PairsWithNext(pages, n_pages, at)) ++it;  // the block's partner page
  return static_cast<int64_t>(it->token_begin) + it->n_valid;
}

std::vector<int32_t> QueryBlockLeads(const PageDesc* pages, int n_pages) {
  std::vector<int32_t> leads;
  for (int p = 0; p < n_pages; ++p) {
    if (LeadsQueryBlock(pages, n_pages, p)) leads.push_back(p);
  }
  return leads;
}

int SparseRouteSharedBytes(int64_t n_pages) {
  int64_t sort = 1;
  while (sort < n_pages) sort <<= 1;
  const int64_t bytes = sort * 8 + (n_pages + 15) / 16 * 16;
  return bytes > (int64_t{1} << 30) ? (1 << 30) : static_cast<int>(bytes);
}

}  // namespace kvpack
