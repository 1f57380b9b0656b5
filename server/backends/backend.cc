#include "server/backends/backend.h"

#include "server/backends/cpu_backend.h"
#if defined(KVPACK_HAVE_CUDA_BACKEND)
#include "server/backends/cuda_backend.h"
#endif

namespace kvpack::server {

MmaPath Backend::ResolvedMma(const LayerConfig& config) const { return ConfigMmaPath(config); }

uint64_t HostStagingBytes(const LayerConfig& config, const TensorResidency& resident) {
  const LayerShape& s = config.shape;
  uint64_t bytes = 0;
  if (config.projected.enabled) {
    const uint64_t span = 2ull * static_cast<uint64_t>(config.projected.SpanElements(s));
    for (bool resident_input : {resident.q, resident.k, resident.v}) bytes += resident_input ? 0 : PoolBytes(span);
  } else if (!resident.x) {
    bytes += PoolBytes(2ull * s.n_tokens * s.hidden);
  }
  if (config.rope.layout != RopeLayout::kNone && !resident.positions) {
    bytes += PoolBytes(4ull * s.n_tokens * config.rope.n_axes);
  }
  if (!config.in_place && !resident.out) bytes += PoolBytes(2ull * s.n_tokens * s.HeadCols());
  return bytes;
}

absl::StatusOr<BackendKind> ParseBackendKind(const std::string& text) {
  if (text == "auto") return BackendKind::kAuto;
  if (text == "cpu") return BackendKind::kCpu;
  if (text == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError("--backend=" + text + ": expected auto, cpu or cuda");
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options, std::string* note) {
  const bool forced_kernel = options.attention_kernel != AttentionTilingChoice::kAuto;
  if (options.kind != BackendKind::kCpu) {
#if defined(KVPACK_HAVE_CUDA_BACKEND)
    std::string why;
    absl::Status refused;
    CudaBackendOptions cuda_options;
    cuda_options.attention_kernel = options.attention_kernel;
    std::unique_ptr<Backend> cuda = MakeCudaBackend(cuda_options, &why, &refused);
    if (!refused.ok()) return refused;  // a GPU answered but cannot run the forced kernel
    if (cuda != nullptr) {
      *note = "CUDA backend";
      return cuda;
    }
    *note = "no CUDA device answered (" + why + "); serving on the CPU backend";
#else
    *note = "this build has no CUDA backend; serving on the CPU backend";
#endif
  } else {
    *note = "CPU backend (--backend=cpu)";
  }
  if (forced_kernel) {
    return absl::FailedPreconditionError(std::string("--attention_kernel=") +
                                         AttentionKernelName(options.attention_kernel) +
                                         " needs the CUDA backend; " + *note);
  }
  return MakeCpuBackend(options.cpu_threads);
}

}  // namespace kvpack::server
