// The CPU reference of a whole attention layer: the engine of the CPU backend and the reference the
// CUDA kernels are checked against. Same contract as kernels/cuda/layer.h, on host memory.
//
// Flow of RunLayer (= ProjectKv, then AttendLayer):
//   1. statistics pre-pass: project a strided sample of ~transforms.stats_sample_tokens tokens,
//      apply bias / QK-norm / RoPE, compute μ_k, μ_v, λ per (head, channel) (unless config.stats);
//   2. K/V projection in chunks of config.projection_chunk tokens: x[chunk] · W_kᵀ, W_vᵀ (fp32
//      accumulation, rounded to bf16 like a GEMM into a bf16 workspace), epilogue, pages;
//   3. query chunks of config.query_chunk tokens: x[chunk] · W_qᵀ, epilogue (λ, R), attention over the
//      pages with online softmax, page by page, Rᵀ and μ_v in the epilogue, bf16 out (may be x).
// Results are bit-identical for every chunk size. Memory: the caller passes the K/V block
// (KvBytes) and the scratch (WorkspaceBytes); nothing else of size O(N) is allocated.
//
// Thread safety: functions are reentrant; each call uses up to CpuOptions::n_threads threads.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels/error.h"
#include "kernels/layer_spec.h"

namespace kvpack::cpu {

struct CpuOptions {
  int n_threads = 0;  // 0: std::thread::hardware_concurrency()
};

// Polled between chunks; returning true stops the call with ErrorCode::kCancelled.
using CancelFn = std::function<bool()>;

// ── The three questions ─────────────────────────────────────────────────────────────────────────

// OK when the CPU backend can run `config`; otherwise the error names the field.
Error Supported(const LayerConfig& config);
// Bytes of the packed K/V block: PlanKvLayout(shape, ranges).total_bytes.
uint64_t KvBytes(const LayerConfig& config);
// Peak scratch bytes of ProjectKv, AttendLayer and RunLayer for `config` (the largest of them).
uint64_t WorkspaceBytes(const LayerConfig& config);

// ── Layer driver ────────────────────────────────────────────────────────────────────────────────

// Projects K and V of all N tokens into `kv` (KvBytes(config) bytes, laid out by PlanKvLayout, tables
// and statistics included). REQUIRES: Supported(config).ok(); workspace has WorkspaceBytes bytes.
Error ProjectKv(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
                const CpuOptions& options, const CancelFn& cancel);

// Projects Q chunk by chunk from tensors.x and attends to the entry `kv` (the same N tokens, so
// query i has the sequence id and position of token i). Writes tensors.out.
Error AttendLayer(const LayerConfig& config, const LayerTensors& tensors, const KvEntryView& kv,
                  uint8_t* workspace, const CpuOptions& options, const CancelFn& cancel);

// ProjectKv then AttendLayer; with config.in_place, tensors.out == tensors.x.
Error RunLayer(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
               const CpuOptions& options, const CancelFn& cancel);

// ── Pieces on float tensors (quality evaluation and tests) ──────────────────────────────────────

// μ_k, μ_v, λ from a strided sample of K and V, both [n_tokens, n_heads, head_dim] (after QK-norm
// and RoPE). With smoothing off μ = 0; with balancing off λ = 1.
KvStats ComputeStats(const float* k, const float* v, const LayerShape& shape, const TransformOptions& transforms);

// Packs float K and V ([N, H, d], after QK-norm and RoPE) into `kv` (KvBytes bytes).
Error PackKv(const float* k, const float* v, const LayerShape& shape, const std::vector<TokenRange>& ranges,
             const KvStats& stats, const TransformOptions& transforms, uint8_t* kv, const CpuOptions& options);

// Queries for AttendFloat: q is [n_q, H, d], un-transformed (λ and R are applied inside).
struct QueryBlock {
  const float* q = nullptr;
  int64_t n_q = 0;
  const int32_t* seq_ids = nullptr;    // [n_q]; null: every query has sequence id 0
  const int64_t* positions = nullptr;  // [n_q] token positions for causal masking; null: 0..n_q−1
};

// Attention of float queries over a packed entry; out is [n_q, H, d] float.
Error AttendFloat(const KvEntryView& kv, const QueryBlock& queries, const AttentionOptions& attention,
                  float* out, const CpuOptions& options);

// FP64 attention over unquantized K and V ([n_k, H, d]) — the accuracy reference. key_seq_ids may be
// null (all 0). out is [n_q, H, d].
void ReferenceAttention(const QueryBlock& queries, const float* k, const float* v, const int32_t* key_seq_ids,
                        int64_t n_k, int n_heads, int head_dim, const AttentionOptions& attention, double* out);

}  // namespace kvpack::cpu
