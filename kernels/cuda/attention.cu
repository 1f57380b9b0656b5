// The attention kernel family's entry points (attention.h): which kernel runs, its shared memory and
// occupancy, and the launch. The kernels: attention_sm90.cu (wgmma) and attention_sm80_mma.cu
// (mma.sync).
#include "kernels/cuda/attention.h"

#include <numeric>
#include <string>

#include "kernels/cuda/attention_sm80_mma.h"
#include "kernels/cuda/attention_sm90.h"
#include "kernels/cuda/cuda_status.h"

namespace kvpack::cuda {
namespace {

// kAuto: the wgmma kernel for every format and head_dim (one CTA of at most ~207 KB of shared
// memory, BF16 pages at d = 128, always fits an H200 SM); it is the fastest in every measured case.
AttentionTilingChoice Resolve(AttentionTilingChoice tiling) {
  return tiling == AttentionTilingChoice::kAuto ? AttentionTilingChoice::kWgmma : tiling;
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
  const int mma_sync = AttentionSm80SharedBytes(head_dim, max_page_bytes);
  const int wgmma = AttentionSm90SharedBytes(head_dim, max_page_bytes);
  switch (tiling) {
    case AttentionTilingChoice::kTall:
    case AttentionTilingChoice::kWide: return mma_sync;
    case AttentionTilingChoice::kWgmma: return wgmma;
    case AttentionTilingChoice::kAuto: break;
  }
  return mma_sync > wgmma ? mma_sync : wgmma;
}

Error ResolveAttentionTiling(int head_dim, int max_page_bytes, AttentionTilingChoice* resolved) {
  if (head_dim != 64 && head_dim != 128) return Unsupported("attention: head_dim = " + std::to_string(head_dim));
  (void)max_page_bytes;  // every page size fits the wgmma kernel's one CTA per SM
  *resolved = Resolve(AttentionTilingChoice::kAuto);
  return Error::Ok();
}

bool TilingHasInt8Mma(AttentionTilingChoice tiling) { return Resolve(tiling) == AttentionTilingChoice::kWgmma; }

Error LaunchAttention(const AttentionParams& params, cudaStream_t stream) {
  KVPACK_RETURN_IF_ERROR(AttentionSupported(params.kv));
  if (params.n_q == 0) return Error::Ok();
  const AttentionTilingChoice tiling = Resolve(params.tiling);
  if (params.mma != MmaPath::kBf16 && params.mma != MmaPath::kInt8) {
    return InvalidArgument("attention: mma path " + std::string(MmaPathName(params.mma)) + " is not resolved");
  }
  if (params.mma == MmaPath::kInt8 && !TilingHasInt8Mma(tiling)) {
    return Unsupported("attention: the INT8 MMA path runs on the wgmma kernel only");
  }
  if (tiling == AttentionTilingChoice::kWgmma) return LaunchAttentionSm90(params, stream);
  return LaunchAttentionSm80(params, tiling, stream);
}

Error AttentionWaveRows(const AttentionParams& params, int64_t* rows) {
  KVPACK_RETURN_IF_ERROR(AttentionSupported(params.kv));
  int device = 0, sms = 0, ctas = 0;
  KVPACK_CUDA_RETURN(cudaGetDevice(&device));
  KVPACK_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const AttentionTilingChoice tiling = Resolve(params.tiling);
  KVPACK_RETURN_IF_ERROR(tiling == AttentionTilingChoice::kWgmma ? AttentionSm90CtasPerSm(params, &ctas)
                                                                  : AttentionSm80CtasPerSm(params, tiling, &ctas));
  if (ctas <= 0) return Error(ErrorCode::kInternal, "attention: the kernel fits no CTA on an SM");
  const int64_t resident = static_cast<int64_t>(sms) * ctas;
  *rows = resident / std::gcd(resident, static_cast<int64_t>(params.kv.n_heads)) * kTileQueries;
  return Error::Ok();
}

}  // namespace kvpack::cuda
