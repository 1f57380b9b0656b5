// Writing a packed K/V block (KvLayout in layer_spec.h) on the host: where a token's row goes, the
// block's tables and statistics, and PackKv on float tensors.
//
// A block is self-contained once WriteBlockHeader has run and every token's K and V rows are
// encoded: MakeKvView over it gives the attention everything (pages, offsets, μ_k, μ_v, λ, λ_v).
// Invalid slots of a partial page stay zero (format.h): the page region is cleared first.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/layer.h"
#include "kernels/cpu/stats.h"
#include "kernels/layer_spec.h"

namespace kvpack::cpu {

// Maps a token to its page and slot: pages of range r start at first_page[r] (BuildPageLayout
// order). O(log ranges) per lookup; no allocation after construction (O(ranges) at construction).
class TokenPageMap {
 public:
  explicit TokenPageMap(const std::vector<TokenRange>& ranges);
  // Index of the range holding `token`. REQUIRES: 0 ≤ token < N.
  int RangeOf(int64_t token) const;
  void Locate(int64_t token, int* page, int* slot) const;

 private:
  const std::vector<TokenRange>& ranges_;
  std::vector<int> first_page_;
};

// Clears the page region, writes the page table and offsets (WriteKvTables) and the statistics at
// their KvLayout offsets. REQUIRES: each stats vector has H·d entries.
void WriteBlockHeader(const KvLayout& layout, const KvStats& stats, uint8_t* block);

// Writes the per-head flags and estimates (format v2) at their KvLayout offsets.
// REQUIRES: record sized for the layout's heads (stats.h TransformRecord).
void WriteTransformRecord(const KvLayout& layout, const TransformRecord& record, uint8_t* block);

// Encodes the stored forms of K and V of (token, head) into their pages. k and v are the epilogued
// rows (d floats each, after QK-norm and RoPE); they are used as scratch and clobbered. The head's
// rotation follows the flags already in the block (WriteTransformRecord; HeadRotatesK / V).
void PackRow(const KvLayout& layout, const LayerShape& shape, const TransformOptions& transforms,
             const KvStats& stats, int page, int slot, int head, float* k, float* v, uint8_t* block);

// The page statistics of block-sparse attention (sparse_attention.h, docs/format.md): per (head,
// page) the mean of the decoded stored K rows into mean_k and the sum of the decoded stored V rows
// into v_sum, [H, P, d] bf16 bits each (sums in double in slot order, rounded to float once, then
// to bf16 by FloatToBf16). Computed from the pages just packed, so the values are those a
// projection epilogue writing them in its own pass would produce. REQUIRES: head_dim ≤ kMaxHeadDimCpu.
void ComputePageStats(const KvEntryView& kv, uint16_t* mean_k, uint16_t* v_sum, const CpuOptions& options);

}  // namespace kvpack::cpu
