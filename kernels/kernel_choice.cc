#include "kernels/kernel_choice.h"

#include <algorithm>

#include "kernels/attention_smem.h"
#include "kernels/page_codec.h"

namespace kvpack {
namespace {

// CTAs of `smem_bytes` (static + dynamic) that one SM holds, by shared memory alone.
int CtasBySharedMemory(const DeviceCaps& caps, int smem_bytes) {
  if (smem_bytes > caps.smem_per_block_optin) return 0;
  return caps.smem_per_sm / (smem_bytes + caps.smem_reserved_per_block);
}

std::string Geometry(int head_dim, int max_page_bytes) {
  return "head_dim " + std::to_string(head_dim) + " with pages of up to " + std::to_string(max_page_bytes) + " bytes";
}

Error TooLarge(const DeviceCaps& caps, const char* kernel, int smem_bytes, int head_dim, int max_page_bytes) {
  return Unsupported(std::string("attention: the ") + kernel + " kernel needs " + std::to_string(smem_bytes) +
                     " bytes of shared memory per CTA at " + Geometry(head_dim, max_page_bytes) + "; this GPU (" +
                     ComputeCapabilityName(caps) + ") allows " + std::to_string(caps.smem_per_block_optin) +
                     " per block (INT4 pages fit every GPU at head_dim 64 and 128)");
}

Error ChooseWgmma(const DeviceCaps& caps, int head_dim, int max_page_bytes, AttentionKernelChoice* choice) {
  if (caps.cc_major != 9 || caps.cc_minor != 0) {
    return Unsupported("attention: the wgmma kernel needs sm_90a; this GPU is " + ComputeCapabilityName(caps));
  }
  if (!caps.has_sm90a_code) {
    return Unsupported("attention: the wgmma kernel needs sm_90a code; this binary was built without sm_90a "
                       "(KVPACK_CUDA_ARCHITECTURES)");
  }
  const int stages = WgmmaStagesFor(head_dim, max_page_bytes);
  const int smem = WgmmaDynamicSmemFor(head_dim, stages, max_page_bytes) + WgmmaStaticSmemBound(stages);
  const int ctas = CtasBySharedMemory(caps, smem);
  if (ctas < 1) return TooLarge(caps, "wgmma", smem, head_dim, max_page_bytes);
  *choice = {AttentionTilingChoice::kWgmma, smem, 1};  // __launch_bounds__(512, 1)
  return Error::Ok();
}

// kMmaSync: kTall where two CTAs share an SM, else kWide (one CTA of 8 warps fills the SM better
// than one of 4). kTall / kWide: that tiling wherever one CTA fits.
Error ChooseMmaSync(const DeviceCaps& caps, int head_dim, int max_page_bytes, AttentionTilingChoice request,
                    AttentionKernelChoice* choice) {
  const int dynamic = MmaSyncDynamicSmem(head_dim, max_page_bytes);
  const int tall = dynamic + MmaSyncStaticSmem(kMmaSyncTallThreads);
  const int wide = dynamic + MmaSyncStaticSmem(kMmaSyncWideThreads);
  const int tall_ctas = std::min(CtasBySharedMemory(caps, tall), 2);  // __launch_bounds__(128, 2)
  const int wide_ctas = std::min(CtasBySharedMemory(caps, wide), 1);  // __launch_bounds__(256, 1)
  const bool take_tall = request == AttentionTilingChoice::kTall ||
                         (request == AttentionTilingChoice::kMmaSync && tall_ctas >= 2);
  if (take_tall) {
    if (tall_ctas < 1) return TooLarge(caps, "mma_sync", tall, head_dim, max_page_bytes);
    *choice = {AttentionTilingChoice::kTall, tall, tall_ctas};
    return Error::Ok();
  }
  if (wide_ctas < 1) return TooLarge(caps, "mma_sync", wide, head_dim, max_page_bytes);
  *choice = {AttentionTilingChoice::kWide, wide, wide_ctas};
  return Error::Ok();
}

}  // namespace

std::string ComputeCapabilityName(const DeviceCaps& caps) {
  return "sm_" + std::to_string(caps.cc_major) + std::to_string(caps.cc_minor);
}

Error ChooseAttentionKernel(const DeviceCaps& caps, int head_dim, int max_page_bytes, AttentionTilingChoice request,
                            AttentionKernelChoice* choice) {
  if (head_dim != 64 && head_dim != 128) {
    return Unsupported("attention: head_dim = " + std::to_string(head_dim) + " (the GPU supports 64 and 128)");
  }
  const int largest = PageBytes(PageFormat::kBf16, head_dim);
  if (max_page_bytes <= 0 || max_page_bytes > largest) {
    return InvalidArgument("attention: max_page_bytes = " + std::to_string(max_page_bytes) + " (1 … " +
                           std::to_string(largest) + " at head_dim " + std::to_string(head_dim) + ")");
  }
  switch (request) {
    case AttentionTilingChoice::kWgmma: return ChooseWgmma(caps, head_dim, max_page_bytes, choice);
    case AttentionTilingChoice::kTall:
    case AttentionTilingChoice::kWide:
    case AttentionTilingChoice::kMmaSync: return ChooseMmaSync(caps, head_dim, max_page_bytes, request, choice);
    case AttentionTilingChoice::kAuto:
      // The wgmma kernel wherever it runs (the fastest in every measured case), else mma.sync.
      if (ChooseWgmma(caps, head_dim, max_page_bytes, choice).ok()) return Error::Ok();
      return ChooseMmaSync(caps, head_dim, max_page_bytes, AttentionTilingChoice::kMmaSync, choice);
  }
  return InvalidArgument("attention: kernel request " + std::to_string(static_cast<int>(request)) +
                         " (auto, tall, wide, wgmma or mma_sync)");
}

Error BinaryRunsOn(const std::string& archs_built, const DeviceCaps& caps) {
  const int gpu = caps.cc_major * 10 + caps.cc_minor;
  size_t begin = 0;
  while (begin < archs_built.size()) {
    size_t end = archs_built.find(',', begin);
    if (end == std::string::npos) end = archs_built.size();
    const std::string arch = archs_built.substr(begin, end - begin);
    begin = end + 1;
    const bool sass = arch.rfind("sm_", 0) == 0, ptx = arch.rfind("compute_", 0) == 0;
    if (!sass && !ptx) continue;
    const std::string digits = arch.substr(sass ? 3 : 8);
    size_t used = 0;
    int number = 0;
    while (used < digits.size() && digits[used] >= '0' && digits[used] <= '9') {
      number = number * 10 + (digits[used++] - '0');
      if (number > 1000) break;  // no such arch; keeps the arithmetic bounded
    }
    if (used == 0) continue;
    const bool arch_specific = used < digits.size();  // sm_90a, sm_100f: that capability only
    if (ptx && !arch_specific && number <= gpu) return Error::Ok();
    if (sass && (arch_specific ? number == gpu : number / 10 == gpu / 10 && number <= gpu)) return Error::Ok();
  }
  return Unsupported("this binary holds " + archs_built + " (KVPACK_CUDA_ARCHITECTURES); none runs on " +
                     ComputeCapabilityName(caps));
}

Error ParseAttentionKernel(const std::string& name, AttentionTilingChoice* request) {
  if (name == "auto") *request = AttentionTilingChoice::kAuto;
  else if (name == "wgmma") *request = AttentionTilingChoice::kWgmma;
  else if (name == "mma_sync") *request = AttentionTilingChoice::kMmaSync;
  else return InvalidArgument("attention_kernel: '" + name + "' (auto, wgmma or mma_sync)");
  return Error::Ok();
}

const char* AttentionKernelName(AttentionTilingChoice tiling) {
  switch (tiling) {
    case AttentionTilingChoice::kWgmma: return "wgmma";
    case AttentionTilingChoice::kTall:
    case AttentionTilingChoice::kWide:
    case AttentionTilingChoice::kMmaSync: return "mma_sync";
    case AttentionTilingChoice::kAuto: break;
  }
  return "auto";
}

}  // namespace kvpack
