// The CUDA engine of one attention layer: same contract as kernels/cpu/layer.h, on device memory.
//
// Flow of RunLayer (= ProjectKv, then AttendLayer), all on context.stream:
//   1. statistics pre-pass (unless config.stats): gather a strided sample of
//      min(N, transforms.stats_sample_tokens) tokens (token i·N/S), one cuBLASLt GEMM against W_k, W_v,
//      bias / QK-norm / RoPE, then μ_k, μ_v, λ, λ_v per (head, channel) into the entry's tables;
//      with transforms.choose_per_head, the per-head transform choice on the host from the same
//      sample, by the CPU layer's own function (head_choice.h: it synchronises the stream once), its
//      tables, per-head flags and estimates written into the entry;
//   2. K/V projection in chunks of config.projection_chunk tokens: one cuBLASLt GEMM x[chunk]·W_{k,v}ᵀ
//      into a bf16 workspace [Tp, 2·H·d] (fp32 accumulation), then ONE fused epilogue kernel (bias,
//      QK-norm, RoPE, −μ, ÷λ (K) or ÷λ_v (V), rotation, quantization) that writes the entry's pages;
//   3. query chunks of config.query_chunk tokens: GEMM x[chunk]·W_qᵀ into a bf16 workspace [Tq, H·d],
//      epilogue (bias, QK-norm, RoPE, ×λ, R) in place, attention over the pages (attention.h), whose
//      epilogue applies Rᵀ, ×λ_v and +μ_v and writes bf16 rows of tensors.out (which may be tensors.x).
// The full BF16 Q, K or V tensor never exists; nothing of size N×N is allocated.
// With config.projected the GEMMs (and the pre-pass gather) do not run: the epilogues read the
// caller's q, k, v rows in place (RowEpilogueParams::given), and the workspace holds no cuBLASLt
// scratch and no projection rows — only the stored-form Q chunk and the pre-pass floats.
//
// Memory: the caller passes the K/V block (KvBytes) and the scratch (WorkspaceBytes), both device
// memory; these functions allocate nothing on the device. Errors: kvpack::Error; a failing CUDA or
// cuBLASLt call gives ErrorCode::kInternal with the library's text. Kernels are launched
// asynchronously: a fault inside a kernel surfaces at the next synchronising call (RunLayer
// synchronises the stream before it returns, ProjectKv and AttendLayer do not — except ProjectKv
// once, after the pre-pass, when it chooses transforms per head).
//
// Chunks: `gate` (layer_spec.h) is called before the prologue (tables, statistics pre-pass) and before
// each projection and query chunk; its error stops the call. When it is called, the launches of the
// previous chunk are enqueued but may still run: a gate that needs them finished (to hand the GPU to
// another call) synchronises the stream itself.
//
// Thread safety: reentrant; one CudaContext (stream, and cuBLASLt workspace inside `workspace`) per
// concurrent call; the cuBLASLt handle may be shared.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/error.h"
#include "kernels/layer_spec.h"

namespace kvpack::cuda {

// Per-stage device time of the calls that filled it, in milliseconds (CUDA events around every
// launch). Timing adds event records between launches; leave it null outside benchmarks.
struct StageTimes {
  float stats_ms = 0;         // pre-pass: gather, GEMM, epilogue, reduction
  float kv_gemm_ms = 0;       // K/V projection GEMMs
  float kv_epilogue_ms = 0;   // fused K/V epilogue (quantization and packing)
  float q_gemm_ms = 0;        // Q projection GEMMs
  float q_epilogue_ms = 0;    // Q epilogue
  float attention_ms = 0;     // attention kernels
  float routing_ms = 0;       // block-sparse only: page statistics and routing kernels
};

struct CudaContext {
  cudaStream_t stream = nullptr;      // every launch and copy goes here
  cublasLtHandle_t blas = nullptr;    // REQUIRES: created by the caller (cublasLtCreate)
  StageTimes* times = nullptr;        // optional; filled (accumulated) when non-null, synchronises
  // Which attention kernel and warp layout (attention.h); every choice computes the same function.
  AttentionTilingChoice attention_tiling = AttentionTilingChoice::kAuto;
};

// ── The three questions ─────────────────────────────────────────────────────────────────────────

// OK when the CUDA engine can run `config`; otherwise the error names the field. Beyond the shared
// checks: head_dim 64 or 128, hidden a multiple of 8 (16-byte GEMM rows), positive chunk sizes.
Error Supported(const LayerConfig& config);
// Bytes of the packed K/V block: PlanKvLayout(shape, ranges).total_bytes.
uint64_t KvBytes(const LayerConfig& config);
// Peak scratch bytes of ProjectKv, AttendLayer and RunLayer (the largest of them): the cuBLASLt
// workspace plus the largest of the projection workspace [Tp, 2·H·d] bf16, the query workspace
// [Tq, H·d] bf16 and the pre-pass buffers (with the per-head choice, its sample: head_choice.h).
uint64_t WorkspaceBytes(const LayerConfig& config);
// Of that workspace, the block-sparse routing region (page statistics, bitmasks, centroids, scores:
// sparse.h SparseRegion); 0 with sparse off. Reported as PlanResult.routing_bytes.
uint64_t RoutingBytes(const LayerConfig& config);

// The kernel (kernel_choice.h, on the current device) and MMA path AttendLayer runs for `config` when
// asked for `requested` (every kernel runs every path: the path is ConfigMmaPath's); the error says
// why the request cannot run here.
Error ResolveLayerKernel(const LayerConfig& config, AttentionTilingChoice requested, AttentionTilingChoice* tiling,
                         MmaPath* mma);

// ── Layer driver (device pointers throughout: tensors, kv, workspace) ────────────────────────────

// Projects K and V of all N tokens into `kv` (KvBytes(config) bytes, laid out by PlanKvLayout, tables
// and statistics included). REQUIRES: Supported(config).ok(); workspace has WorkspaceBytes bytes.
Error ProjectKv(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
                const CudaContext& context, const ChunkGate& gate);

// Projects Q chunk by chunk from tensors.x and attends to the entry `kv` (a device view of the same
// N tokens: query i has the sequence id and position of token i). Writes tensors.out.
// With config.attention.sparse the block-sparse path runs (sparse.h) and adds its tallies to *report
// (when set; this synchronises the stream once at the end).
Error AttendLayer(const LayerConfig& config, const LayerTensors& tensors, const KvEntryView& kv,
                  uint8_t* workspace, const CudaContext& context, const ChunkGate& gate,
                  SparseReport* report = nullptr);

// ProjectKv then AttendLayer, then a stream synchronisation; with config.in_place,
// tensors.out == tensors.x.
Error RunLayer(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
               const CudaContext& context, const ChunkGate& gate, SparseReport* report = nullptr);

}  // namespace kvpack::cuda
