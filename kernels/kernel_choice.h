// The one place that chooses the attention kernel and its tiling for a GPU: pure C++ (no CUDA
// headers), so every arch's limits are unit-tested on any machine (tests/kernels/kernel_choice_test).
// kernels/cuda/attention.cu asks it before every launch, with the DeviceCaps read once per device
// (cuda/device_caps.h); the daemon asks it at startup to report and check --attention_kernel.
//
// The kernels (kernels/cuda/attention.h):
//   kWgmma  Hopper's warp-group MMA (attention_sm90.cu): sm_90 GPUs only, and only in a binary that
//           holds sm_90a code; one CTA per SM of up to ~226 KB of shared memory. The fastest where
//           it runs, so kAuto takes it there.
//   kTall   mma.sync (attention_sm80_mma.cu), 4 warps × 32 rows: every K/V fragment feeds two MMAs;
//           good when two CTAs fit on an SM (one CTA's decode and softmax under the other's MMAs).
//   kWide   the same kernel, 8 warps × 16 rows: one CTA per SM fills the SM with warps; taken when
//           only one CTA fits (H200, BF16 pages, d = 128: 200 TFLOP/s vs kTall's 148).
// Shared memory per CTA is attention_smem.h's, the figure the kernels allocate.
//
// Where nothing fits, the error says what was needed and what the GPU has. With today's mma.sync
// kernel (two raw stages) that is: on GPUs of 99 KB per block (sm_86, sm_89, sm_120), INT8 and
// BF16 pages at head_dim 128 (INT4 at 128 and every format at 64 fit).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/error.h"

namespace kvpack {

// Which kernel and warp layout run a CTA's 128 query rows. Requests: kAuto (the best that fits),
// kMmaSync (the portable kernel, its tiling chosen from shared memory), or one tiling exactly.
// Resolved choices are kTall, kWide or kWgmma. Stable values (they travel in CudaContext and tests).
enum class AttentionTilingChoice : uint8_t { kAuto = 0, kTall = 1, kWide = 2, kWgmma = 3, kMmaSync = 4 };

// What the choice needs to know about a GPU and the binary (cudaGetDeviceProperties, once per device).
struct DeviceCaps {
  int cc_major = 0;                     // compute capability, e.g. 8.6 → 8, 6
  int cc_minor = 0;
  int smem_per_block_optin = 0;         // bytes one CTA may use after cudaFuncSetAttribute (static + dynamic)
  int smem_per_sm = 0;                  // bytes of shared memory on one SM
  int smem_reserved_per_block = 1024;   // what the system keeps per resident CTA (1 KiB on sm_80 … sm_120)
  int sm_count = 0;
  bool has_sm90a_code = false;          // the binary holds the wgmma kernel (90a in KVPACK_CUDA_ARCHITECTURES)
};

// "sm_86", "sm_90" (the GPU's compute capability; the binary's arch-specific sm_90a is separate).
std::string ComputeCapabilityName(const DeviceCaps& caps);

struct AttentionKernelChoice {
  AttentionTilingChoice tiling = AttentionTilingChoice::kAuto;  // kTall, kWide or kWgmma
  int smem_bytes = 0;   // shared memory of one CTA, static and dynamic
  int ctas_per_sm = 0;  // CTAs that fit on one SM by shared memory
};

// The kernel that runs attention at `head_dim` over pages of at most max_page_bytes on `caps`.
// Errors: kInvalidArgument for head_dim / max_page_bytes out of range or a request not listed
// above, kUnsupported naming why where the request cannot run here (e.g. "wgmma needs sm_90a; this
// GPU is sm_86") or nothing fits the GPU's shared memory.
Error ChooseAttentionKernel(const DeviceCaps& caps, int head_dim, int max_page_bytes, AttentionTilingChoice request,
                            AttentionKernelChoice* choice);

// OK when code in `archs_built` ("sm_80,sm_90a,compute_120": cuda/device_caps.h CudaArchsBuilt)
// runs on the GPU: SASS sm_XY on compute capability X.Z with Z ≥ Y (sm_XYa: X.Y only), or PTX
// compute_XY of a capability ≤ the GPU's. Otherwise kUnsupported naming both (every kernel launch
// would fail with "no kernel image").
Error BinaryRunsOn(const std::string& archs_built, const DeviceCaps& caps);

// The daemon's --attention_kernel names: "auto" → kAuto, "wgmma" → kWgmma, "mma_sync" → kMmaSync.
Error ParseAttentionKernel(const std::string& name, AttentionTilingChoice* request);
// "wgmma" for kWgmma, "mma_sync" for kTall / kWide / kMmaSync, "auto" for kAuto (the family Status reports).
const char* AttentionKernelName(AttentionTilingChoice tiling);

}  // namespace kvpack
