// The block-sparse path inside the CPU layer (layer.h AttendLayer with config.attention.sparse):
// where its memory sits in the workspace and how one query chunk is attended.
//
// Workspace with sparse on, after the queries' region (layer.h) — RoutingBytes in all:
//   page statistics   bf16 [H, P, d] mean_k, then v_sum             PageStatsBytes (4·d per page·head)
//   routes            per (page slot of the chunk, head): exact and pooled page lists int32[P]
//                     each, scores float[P], order int32[P], marks uint8[P], a SparseReport — used
//                     by the slots whose page leads a query block (visibility.h LeadsQueryBlock)
// The routes region is bounded by the query chunk: a chunk holds at most
// min(P, ceil((Tq + 127)/64) + ranges) page slots. Query chunks end on block ends (a block is the
// queries of a page pair, whose centroid needs all of them: sparse_plan.h), so a chunk has up to
// Tq + 127 rows.
// The statistics are computed from the pages when AttendLayer starts (one read of K and V); the
// GPU's projection epilogue would write the same values in its pass (they are functions of the
// decoded rows only).
#pragma once

#include <cstdint>

#include "kernels/cpu/sparse_attention.h"
#include "kernels/layer_spec.h"
#include "kernels/sparse_plan.h"

namespace kvpack::cpu {

// Bytes of the statistics and routes regions (0 with sparse off).
uint64_t RoutingBytes(const LayerConfig& config);
// Upper bound on the routed fraction (SparseReport) of the layer, from the options and the ranges
// alone: per block of b pages min(V, max(ceil(topk_ratio·V) + b + 2 + sink_pages, min_exact_pages))
// over V, the pages it sees (1 with rel_tau, always-attend or dense ranges, which the options cannot bound).
double RoutedFractionBound(const LayerConfig& config);

// Attends rows [begin, end) whose stored bf16 queries are in q_ws ([end − begin, H·d]); writes
// tensors.out rows (bf16). `routing` is the workspace region RoutingBytes long whose statistics were
// filled by ComputePageStats. Adds to *report.
void AttendChunkSparse(const LayerConfig& config, const KvEntryView& kv, const uint16_t* q_ws, int64_t begin,
                       int64_t end, uint8_t* routing, int threads, uint16_t* out, SparseReport* report);

}  // namespace kvpack::cpu
