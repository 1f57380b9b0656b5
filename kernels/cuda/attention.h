// Dense attention over packed K/V pages (FlashAttention style), one kernel family, two kernels.
//
// A CTA takes one query tile (kTileQueries = 128 rows of one head) and streams the pages of that head
// that its queries may see through shared memory; each page is decoded (INT4 / INT8 / BF16, per page,
// by the format's codec: page_codec.cuh) to a bf16 tile in shared memory once; S = Q·Kᵀ and O += P·V
// run on the tensor cores (bf16 in, fp32 accumulate) with the online softmax in fp32 registers. The
// epilogue un-rotates each output row (Rᵀ, fast Walsh–Hadamard in registers), multiplies by λ_v, adds
// μ_v and writes bf16. Which keys a query sees is kernels/visibility.h's (slots past n_valid, other
// sequences, causal); pages that no query of the tile may see are skipped before they are loaded.
//   attention_sm90.cu (kWgmma, the default): Hopper's wgmma; two producer warp groups bulk-copy
//     pages and decode K and V into a ring of swizzled tiles, two consumer warp groups of 64 rows
//     multiply (FlashAttention-3's split: attention_sm90_*.cuh).
//   attention_sm80_mma.cu (kTall, kWide): mma.sync m16n8k16 from ldmatrix fragments (S in m16n8k32 s8
//     on the INT8 MMA path); every warp decodes.
// attention_device.cuh holds what both share (tile scheduler, visibility, the output rows).
//
// Queries are the chunk's tokens: query i of the launch is token q_token_begin + i, with that
// token's sequence id (looked up in the page table) and position (its token index).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/error.h"
#include "kernels/format.h"
#include "kernels/kernel_choice.h"
#include "kernels/layer_spec.h"
#include "kernels/mma_path.h"
#include "kernels/visibility.h"

namespace kvpack::cuda {

inline constexpr int kTileQueries = 128;

// Which kernel and warp layout run the 128 query rows of a CTA: kernels/kernel_choice.h, the one
// place that chooses (kAuto, kMmaSync) and checks a forced choice against the GPU (kTall, kWide,
// kWgmma). kTall: mma.sync, 4 warps × 32 rows, two CTAs per SM — every K/V fragment read from
// shared memory feeds two MMAs (H200, N = 32768, INT4: 293 TFLOP/s on the INT8 MMA path, 275 on
// bf16; session 10). kWide: mma.sync, 8 warps × 16 rows, one CTA per SM (215 TFLOP/s with BF16 pages,
// whose 64 KiB raw stages leave room for only one kTall CTA). kWgmma: Hopper's wgmma, two producer warp groups decoding pages
// and two consumer warp groups of 64 rows (attention_sm90.cu; bench/RESULTS.md runs 4–12: 358
// TFLOP/s over INT4), only on sm_90 in a binary built with 90a.
using ::kvpack::AttentionTilingChoice;

struct AttentionParams {
  const uint16_t* q = nullptr;   // bf16 [n_q, H·d], rotated and balanced (R·(q⊙λ))
  int64_t q_stride = 0;          // elements between query rows
  int64_t q_token_begin = 0;     // token index of query 0
  int64_t n_q = 0;
  uint16_t* out = nullptr;       // bf16 rows of n_q tokens, head h at columns h·d …
  int64_t out_stride = 0;
  KvEntryView kv;                // device view (pages, offsets, μ_v, λ_v, seed, rotate)
  float softmax_scale = 0.0f;    // already resolved (1/√d when the option is 0)
  Visibility visibility;         // which keys each query sees (kernels/visibility.h)
  int max_page_bytes = 0;        // largest page of the entry's formats (sizes the raw stages)
  AttentionTilingChoice tiling = AttentionTilingChoice::kAuto;
  // The resolved MMA path (ResolveMmaPath: kBf16 or kInt8). kInt8 (both kernels: wgmma and mma.sync
  // m16n8k32) REQUIRES that no page is BF16 (the caller's check: ResolveMmaPath).
  MmaPath mma = MmaPath::kBf16;
  // Block-sparse launches (sparse.h) only: the routing of the chunk's query blocks. A routed launch
  // takes page slots b = pages first_page + b (n_blocks of them; first_page leads a query block,
  // visibility.h LeadsQueryBlock) instead of n_q rows from q_token_begin; a block's routing sits in its
  // first page's slot. It attends the exact pages and pools the rest (either MMA path).
  struct Route {
    uint32_t* exact_bits = nullptr;   // [n_blocks, H, words] exact pages of each (block, head)
    uint32_t* pooled_bits = nullptr;  // [n_blocks, H, words] pooled pages (both written by the routing)
    int words = 0;                    // ⌈pages / 32⌉
    int first_page = 0;
    int n_blocks = 0;
    // The pages that lead the chunk's blocks, ascending (QueryBlockLeads; n_leads of them): the wgmma
    // routed instance runs a CTA per block from this list, none for a partner page's slot.
    const int32_t* leads = nullptr;
    int n_leads = 0;
    uint16_t* mean_k = nullptr;       // [H, pages, d] bf16 page statistics (written by LaunchPageStats)
    uint16_t* v_sum = nullptr;        // [H, pages, d] bf16
    // The INT8 MMA path's pooled keys: mean_k quantized as query rows are (mma_path.h), codes
    // [H, pages, d] and s_k [H, pages], written by LaunchPageStats; null on the bf16 path.
    int8_t* mean_codes = nullptr;
    float* mean_scales = nullptr;
  } route;
};

// OK for head_dim 64 / 128 and a non-empty entry.
Error AttentionSupported(const KvEntryView& kv);
// OK for an MMA path the GPU kernels run (kBf16, kInt8); `what` names the launch in the error (kAuto
// unresolved, kFp8 with no GPU kernel).
Error RequireKernelMmaPath(MmaPath mma, const char* what);
// Bytes of dynamic shared memory one CTA of `tiling` uses (part of Launch's answer to the planner;
// no global workspace is needed): kernels/attention_smem.h's figures. kAuto / kMmaSync: the largest
// of the choices they may become.
int AttentionSharedBytes(int head_dim, int max_page_bytes, AttentionTilingChoice tiling = AttentionTilingChoice::kAuto);
// What `requested` becomes on the current device for an entry whose largest page has max_page_bytes
// (ChooseAttentionKernel with the device's caps): kTall, kWide or kWgmma, or the error saying why
// the request cannot run on this GPU. The 3-argument form resolves kAuto.
Error ResolveAttentionTiling(int head_dim, int max_page_bytes, AttentionTilingChoice requested,
                             AttentionTilingChoice* resolved);
Error ResolveAttentionTiling(int head_dim, int max_page_bytes, AttentionTilingChoice* resolved);
Error LaunchAttention(const AttentionParams& params, cudaStream_t stream);

// Query rows whose launches fill whole waves of the GPU: a launch runs ⌈n_q / kTileQueries⌉ · heads
// CTAs, of which SMs × (CTAs per SM of the kernel `params` resolves to) run at once, so a multiple of
// these rows leaves no wave part-empty (H200, wgmma, 56 heads: 33 tiles = 4224 rows, 14 waves; 4096
// rows are 13.6 waves, the last 58% idle). Every CTA of a dense launch takes about equally long.
Error AttentionWaveRows(const AttentionParams& params, int64_t* rows);

}  // namespace kvpack::cuda
