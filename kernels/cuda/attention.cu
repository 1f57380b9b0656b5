// The attention kernel family's entry points (attention.h): which kernel runs, its shared memory and
// occupancy, and the launch. The kernels: attention_sm90.cu (wgmma) and attention_sm80_mma.cu
// (mma.sync).
#include "kernels/cuda/attention.h"

#include <numeric>
#include <string>

#include "kernels/attention_smem.h"
#include "kernels/cuda/attention_sm80_mma.h"
#include "kernels/cuda/attention_sm90.h"
#include "kernels/cuda/attention_sm90_tile.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_caps.h"
#include "kernels/kernel_choice.h"
#include "kernels/page_codec.h"

namespace kvpack::cuda {
namespace {

// The choice (kernel_choice.h) reads attention_smem.h; the wgmma kernel sizes itself from
// attention_sm90_tile.h (which the lead's kernel work owns): both must give the same bytes.
static_assert(kAttentionTileQueries == kTileQueries, "attention_smem.h's tile");
static_assert(kWgmmaDynamicLimit == kSm90MaxDynamicSmem && kWgmmaDeepStages == kSm90DeepStages,
              "attention_smem.h's wgmma stage rule");
template <int kDim>
constexpr bool Sm90FiguresAgree(PageFormat f) {
  const int page = PageBytes(f, kDim);
  return WgmmaStagesFor(kDim, page) == Sm90Stages<kDim>(page) &&
         WgmmaDynamicSmemFor(kDim, kSm90DeepStages, page) == Sm90DynamicSmem<kDim, kSm90DeepStages>(page) &&
         WgmmaDynamicSmemFor(kDim, 2, page) == Sm90DynamicSmem<kDim, 2>(page);
}
static_assert(Sm90FiguresAgree<64>(PageFormat::kInt4) && Sm90FiguresAgree<64>(PageFormat::kInt8) &&
                  Sm90FiguresAgree<64>(PageFormat::kBf16) && Sm90FiguresAgree<128>(PageFormat::kInt4) &&
                  Sm90FiguresAgree<128>(PageFormat::kInt8) && Sm90FiguresAgree<128>(PageFormat::kBf16),
              "attention_smem.h's wgmma bytes = attention_sm90_tile.h's");

// What params.tiling becomes on this device: the one choice (kernel_choice.h), with its reason
// when the request cannot run here.
Error Resolve(const AttentionParams& params, AttentionTilingChoice* tiling) {
  return ResolveAttentionTiling(params.kv.head_dim, params.max_page_bytes, params.tiling, tiling);
}

}  // namespace

Error AttentionSupported(const KvEntryView& kv) {
  if (kv.head_dim != 64 && kv.head_dim != 128) {
    return Unsupported("attention: head_dim = " + std::to_string(kv.head_dim) + " (the GPU supports 64 and 128)");
  }
  if (kv.n_pages <= 0 || kv.n_heads <= 0) return InvalidArgument("attention: the K/V entry is empty");
  return Error::Ok();
}

int AttentionSharedBytes(int head_dim, int max_page_bytes, AttentionTilingChoice tiling) {
  const int mma_sync = MmaSyncDynamicSmem(head_dim, max_page_bytes);
  const int wgmma = WgmmaDynamicSmem(head_dim, max_page_bytes);
  switch (tiling) {
    case AttentionTilingChoice::kTall:
    case AttentionTilingChoice::kWide:
    case AttentionTilingChoice::kMmaSync: return mma_sync;
    case AttentionTilingChoice::kWgmma: return wgmma;
    case AttentionTilingChoice::kAuto: break;
  }
  return mma_sync > wgmma ? mma_sync : wgmma;
}

Error ResolveAttentionTiling(int head_dim, int max_page_bytes, AttentionTilingChoice requested,
                             AttentionTilingChoice* resolved) {
  DeviceCaps caps;
  KVPACK_RETURN_IF_ERROR(CurrentDeviceCaps(&caps));
  AttentionKernelChoice choice;
  KVPACK_RETURN_IF_ERROR(ChooseAttentionKernel(caps, head_dim, max_page_bytes, requested, &choice));
  *resolved = choice.tiling;
  return Error::Ok();
}

Error ResolveAttentionTiling(int head_dim, int max_page_bytes, AttentionTilingChoice* resolved) {
  return ResolveAttentionTiling(head_dim, max_page_bytes, AttentionTilingChoice::kAuto, resolved);
}

Error RequireKernelMmaPath(MmaPath mma, const char* what) {
  if (mma == MmaPath::kBf16 || mma == MmaPath::kInt8) return Error::Ok();
  return InvalidArgument(std::string(what) + ": mma path " + MmaPathName(mma) +
                         " has no GPU kernel (the launch takes a resolved bf16 or int8)");
}

Error LaunchAttention(const AttentionParams& params, cudaStream_t stream) {
  KVPACK_RETURN_IF_ERROR(AttentionSupported(params.kv));
  if (params.n_q == 0) return Error::Ok();
  AttentionTilingChoice tiling;
  KVPACK_RETURN_IF_ERROR(Resolve(params, &tiling));
  KVPACK_RETURN_IF_ERROR(RequireKernelMmaPath(params.mma, "attention"));
  if (tiling == AttentionTilingChoice::kWgmma) return LaunchAttentionSm90(params, stream);
  return LaunchAttentionSm80(params, tiling, stream);
}

Error AttentionWaveRows(const AttentionParams& params, int64_t* rows) {
  KVPACK_RETURN_IF_ERROR(AttentionSupported(params.kv));
  int device = 0, sms = 0, ctas = 0;
  KVPACK_CUDA_RETURN(cudaGetDevice(&device));
  KVPACK_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  AttentionTilingChoice tiling;
  KVPACK_RETURN_IF_ERROR(Resolve(params, &tiling));
  KVPACK_RETURN_IF_ERROR(tiling == AttentionTilingChoice::kWgmma ? AttentionSm90CtasPerSm(params, &ctas)
                                                                  : AttentionSm80CtasPerSm(params, tiling, &ctas));
  if (ctas <= 0) return Error(ErrorCode::kInternal, "attention: the kernel fits no CTA on an SM");
  const int64_t resident = static_cast<int64_t>(sms) * ctas;
  *rows = resident / std::gcd(resident, static_cast<int64_t>(params.kv.n_heads)) * kTileQueries;
  return Error::Ok();
}

}  // namespace kvpack::cuda
