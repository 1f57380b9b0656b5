// The CPU reference of a whole attention layer: the engine of the CPU backend and the reference the
// CUDA kernels are checked against. Same contract as kernels/cuda/layer.h, on host memory.
//
// Flow of RunLayer (= ProjectKv, then AttendLayer):
//   1. statistics pre-pass (unless config.stats): project the S = min(N, stats_sample_tokens)
//      tokens t_i = floor(i·N/S), apply bias / QK-norm / RoPE, compute μ_k, μ_v, λ, λ_v per (head,
//      channel) (stats.h); with transforms.choose_per_head, keep per head the transforms a small
//      attention on the sample estimates best (kernels/transform_choice.h; masks and sequence ids
//      are not applied in that estimate); write the tables, the per-head flags and estimates, the
//      page table and offsets into the K/V block (pack.h);
//   2. K/V projection in chunks of config.projection_chunk tokens: x[chunk] · W_kᵀ, W_vᵀ with fp32
//      accumulation in a fixed order, rounded to bf16 like a GEMM into a bf16 workspace
//      (projection.h); then per (token, head) the fp32 epilogue bias → QK-norm → RoPE → stored form
//      → quantized into the token's page (epilogue.h);
//   3. query chunks of config.query_chunk tokens: x[chunk] · W_qᵀ, epilogue (λ, R, bf16 round),
//      attention over the pages with online softmax, page by page (attention.h); acc/ℓ, Rᵀ, ⊙ λ_v,
//      + μ_v in the epilogue; bf16 out. With in_place, Q of chunk c is projected from x rows of chunk c
//      before the attention overwrites them (K/V were all projected in step 2).
// With config.projected (pre-projected Q, K, V in tensors.q/k/v): no GEMM; steps 1–3 read the
// caller's bf16 rows where they would read the projection workspace, and skip bias, QK-norm and
// RoPE (rejected by Supported). The rows are then the same values a GEMM would have written, so
// the result is bit-identical to the x + W path whose projection yields those rows.
// Query i has the sequence id of the range holding token i and position i (causal: key ≤ query).
// Results are bit-identical for every chunk size and thread count (each output element depends
// only on its own inputs, in a fixed arithmetic order).
//
// Memory: the caller passes the K/V block (KvBytes) and the scratch (WorkspaceBytes); nothing of
// size O(chunk) is allocated, and of size O(N) only the host page table of PlanKvLayout
// (16 + 16·H bytes per 64 tokens, the same bytes the block's tables hold). The workspace holds, at
// offset 0, one of (never two at once):
//   pre-pass    bf16 [S, 3·H·d]           Q, K and V of the sampled tokens (only without
//                                         ([S, 2·H·d] without            config.stats and with
//                                         choose_per_head)                smooth or balance on)
//   projection  bf16 [min(Tp, N), 2·H·d]  K then V columns of one chunk
//   queries     bf16 [min(Tq, N), H·d]    Q of one chunk in stored form (sparse: Tq + 63 rows,
//                                         then the statistics and routes, sparse_layer.h)
// WorkspaceBytes is the largest of the three, and that many bytes are written (tests hold it).
// With projected input only the queries are held there.
// Per-thread stack buffers are ~180 KiB at d = 256 (two decoded pages, a tile of queries, its
// accumulators and outputs): fine for 8 MiB default thread stacks.
//
// Errors: kvpack::Error values (never exceptions or aborts): Supported's message names the field;
// the gate's error when the ChunkGate (layer_spec.h), called before each chunk, returns one (kCancelled
// to cancel).
//
// Thread safety: functions are reentrant; each call uses up to CpuOptions::n_threads threads.
#pragma once

#include <cstdint>

#include "kernels/error.h"
#include "kernels/layer_spec.h"

namespace kvpack::cpu {

struct TransformRecord;  // stats.h

struct CpuOptions {
  int n_threads = 0;  // 0: std::thread::hardware_concurrency()
};

// ── The three questions ─────────────────────────────────────────────────────────────────────────

// OK when the CPU backend can run `config`; otherwise the error names the field.
Error Supported(const LayerConfig& config);
// Bytes of the packed K/V block: PlanKvLayout(shape, ranges).total_bytes (0 when !Supported).
uint64_t KvBytes(const LayerConfig& config);
// Peak scratch bytes of ProjectKv, AttendLayer and RunLayer for `config` (the largest of them; what
// the workspace holds is listed at the top of this file). 0 when !Supported.
uint64_t WorkspaceBytes(const LayerConfig& config);

// ── Layer driver ────────────────────────────────────────────────────────────────────────────────

// Projects K and V of all N tokens into `kv` (KvBytes(config) bytes, laid out by PlanKvLayout, tables
// and statistics included). REQUIRES: Supported(config).ok(); workspace has WorkspaceBytes bytes.
Error ProjectKv(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
                const CpuOptions& options, const ChunkGate& gate);

// Projects Q chunk by chunk from tensors.x and attends to the entry `kv` (the same N tokens, so
// query i has the sequence id and position of token i). Writes tensors.out.
// With config.attention.sparse the block-sparse path runs (sparse_layer.h) and, when
// sparse_report is set, its tallies are added to it.
Error AttendLayer(const LayerConfig& config, const LayerTensors& tensors, const KvEntryView& kv,
                  uint8_t* workspace, const CpuOptions& options, const ChunkGate& gate,
                  SparseReport* sparse_report = nullptr);

// ProjectKv then AttendLayer; with config.in_place, tensors.out == tensors.x.
Error RunLayer(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
               const CpuOptions& options, const ChunkGate& gate, SparseReport* sparse_report = nullptr);

// ── Pieces on float tensors (quality evaluation and tests) ──────────────────────────────────────

// μ_k, μ_v, λ, λ_v from a strided sample of K and V, both [n_tokens, n_heads, head_dim] (after QK-norm
// and RoPE); the same sample and formulas as the layer's pre-pass (stats.h). With smoothing off
// μ = 0; with balancing off λ = λ_v = 1.
KvStats ComputeStats(const float* k, const float* v, const LayerShape& shape, const TransformOptions& transforms);

// Packs float K and V ([N, H, d], after QK-norm and RoPE) into `kv` (PlanKvLayout(shape,
// ranges).total_bytes): page table, offsets, stats and pages, as ProjectKv would from the same rows.
// `record` (may be null: flags and estimates zero) is written before the rows: its flags decide which
// heads store q·k or V without R (transform_choice.h kHeadPlainK / V).
Error PackKv(const float* k, const float* v, const LayerShape& shape, const std::vector<TokenRange>& ranges,
             const KvStats& stats, const TransformOptions& transforms, uint8_t* kv, const CpuOptions& options,
             const TransformRecord* record = nullptr);

// Queries for AttendFloat: q is [n_q, H, d], un-transformed: λ and R are applied inside and the
// result rounded to bf16, exactly as the layer does (epilogue.h ToStoredQ).
struct QueryBlock {
  const float* q = nullptr;
  int64_t n_q = 0;
  const int32_t* seq_ids = nullptr;    // [n_q]; null: every query has sequence id 0
  const int64_t* positions = nullptr;  // [n_q] token positions for causal masking; null: 0..n_q−1
};

// Attention of float queries over a packed entry; out is [n_q, H, d] float (acc/ℓ, Rᵀ, ⊙ λ_v, + μ_v, not
// rounded). Key token index j is page.token_begin + slot; a query sees key j when the sequence ids
// match and, with attention.causal, j ≤ its position. A query that sees no key gets zeros.
Error AttendFloat(const KvEntryView& kv, const QueryBlock& queries, const AttentionOptions& attention,
                  float* out, const CpuOptions& options);

// FP64 attention over unquantized K and V ([n_k, H, d]) — the accuracy reference. key_seq_ids may be
// null (all 0). out is [n_q, H, d]. No transforms, no rounding; masks as in AttendFloat.
void ReferenceAttention(const QueryBlock& queries, const float* k, const float* v, const int32_t* key_seq_ids,
                        int64_t n_k, int n_heads, int head_dim, const AttentionOptions& attention, double* out);

}  // namespace kvpack::cpu
