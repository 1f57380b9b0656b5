// The wgmma kernel's entry points in a build without sm_90a (KVPACK_CUDA_ARCHITECTURES lacks 90a,
// so attention_sm90.cu is not compiled): launches return an error that names the build. The kernel
// choice (kernels/kernel_choice.h) never picks kWgmma here (DeviceCaps::has_sm90a_code is false), so
// only an explicit request reaches these, and it is refused there first.
#include "kernels/attention_smem.h"
#include "kernels/cuda/attention_sm90.h"

namespace kvpack::cuda {
namespace {

Error BuiltWithoutSm90a() {
  return Unsupported("attention: the wgmma kernel needs sm_90a code; this binary was built without sm_90a "
                     "(KVPACK_CUDA_ARCHITECTURES)");
}

}  // namespace

int AttentionSm90SharedBytes(int head_dim, int max_page_bytes) { return WgmmaDynamicSmem(head_dim, max_page_bytes); }

Error LaunchAttentionSm90(const AttentionParams&, cudaStream_t) { return BuiltWithoutSm90a(); }

Error AttentionSm90CtasPerSm(const AttentionParams&, int*) { return BuiltWithoutSm90a(); }

}  // namespace kvpack::cuda
