// Which keys a query sees: the one definition the CPU reference and every CUDA attention kernel share
// (host and device). Queries are tokens of the packed sequence; a query at position t (its token index)
// of sequence s sees key slot j of page P when
//   j < P.n_valid                       the slot holds a token
//   P.seq_id == s                       same sequence (block-diagonal attention, like varlen FlashAttention)
//   causal ⇒ P.token_begin + j ≤ t      not a future key
// Kernels work per (query tile, key page): a page is visited when some query of the tile sees one of its
// keys (PageVisibleToRun over the tile's runs of equal sequence id), and masked key by key (KeyVisible)
// only where PageNeedsMask says some key of it may be hidden from some query of the tile.
//
// The dense policy enumerates visible pages from these rules (cuda/attention_device.cuh
// CollectVisiblePages, cpu/attention.cc AttendTile). A routed (block-sparse) policy is another
// enumerator — a page list per query tile — over the same KeyVisible masks, not another copy of them.
// The routed policy (RoutedPages below; cpu/sparse_attention.h builds the lists on the host for now):
// per (query block, head) an exact list and a pooled list of pages, both in ascending entry order.
// Exact pages are visited and masked as in the dense policy; a pooled page enters as one term (its
// mean key, its summed V, weighted by its token count), which is only right when the block sees every
// key of it — PageFullyVisibleToBlock — so a page seen only in part is always exact.
// cpu/reference.cc keeps its own token-level rule on purpose: the FP64 reference the kernels are
// checked against must not share their definition.
#pragma once

#include <cstdint>

#include "kernels/format.h"

namespace kvpack {

struct Visibility {
  bool causal = false;

  // Key slot `slot` of `page` for a query of sequence q_seq at position q_pos.
  KVPACK_HD bool KeyVisible(const PageDesc& page, int slot, int32_t q_seq, int64_t q_pos) const {
    return slot < page.n_valid && page.seq_id == q_seq && (!causal || page.token_begin + slot <= q_pos);
  }
  // Some key of `page` for some query of sequence `seq` at a position ≤ last_pos (a run of the tile).
  KVPACK_HD bool PageVisibleToRun(const PageDesc& page, int32_t seq, int64_t last_pos) const {
    return page.seq_id == seq && (!causal || page.token_begin <= last_pos);
  }
  // False when every key of `page` is visible to every query of a tile that it is visible to at all:
  // a full page, a tile of one sequence, and (causal) no key after the tile's first query at first_pos.
  KVPACK_HD bool PageNeedsMask(const PageDesc& page, bool one_sequence, int64_t first_pos) const {
    return page.n_valid < kPageTokens || !one_sequence || (causal && page.token_begin + page.n_valid - 1 > first_pos);
  }
  // Every valid key of `page` is visible to every query of a block of sequence `seq` whose first
  // query is at first_pos (the condition for pooling the page for that block).
  KVPACK_HD bool PageFullyVisibleToBlock(const PageDesc& page, int32_t seq, int64_t first_pos) const {
    return page.seq_id == seq && (!causal || page.token_begin + page.n_valid - 1 <= first_pos);
  }
};

// Query blocks of the routed policy pair key pages: page p (of an entry's page array, entry order) leads
// a block unless it is the partner of p − 1; an even page pairs with the next when both belong to one
// range (so to one sequence). A block of the layer is the queries of its one or two pages (≤ 128), and
// shares one routing: on the wgmma GPUs both consumer groups of a CTA then walk one page list.
KVPACK_HD inline bool PairsWithNext(const PageDesc* pages, int n_pages, int p) {
  return (p & 1) == 0 && p + 1 < n_pages && pages[p + 1].range_index == pages[p].range_index &&
         pages[p + 1].seq_id == pages[p].seq_id;
}
KVPACK_HD inline bool LeadsQueryBlock(const PageDesc* pages, int n_pages, int p) {
  return p == 0 || !PairsWithNext(pages, n_pages, p - 1);
}
// The pages of the block led by p: 1 or 2.
KVPACK_HD inline int QueryBlockPages(const PageDesc* pages, int n_pages, int p) {
  return PairsWithNext(pages, n_pages, p) ? 2 : 1;
}
// The queries of the block led by p in the layer (query t at position t): its pages' valid slots,
// contiguous from pages[p].token_begin.
KVPACK_HD inline int QueryBlockRows(const PageDesc* pages, int n_pages, int p) {
  return pages[p].n_valid + (PairsWithNext(pages, n_pages, p) ? pages[p + 1].n_valid : 0);
}

// One (query block, head)'s routing: pages attended exactly and pages pooled, each ascending.
struct RoutedPages {
  const int32_t* exact = nullptr;
  int n_exact = 0;
  const int32_t* pooled = nullptr;  // empty with the tail off
  int n_pooled = 0;
};

}  // namespace kvpack
