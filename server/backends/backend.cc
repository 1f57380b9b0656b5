#include "server/backends/backend.h"

#include "server/backends/cpu_backend.h"
#if defined(KVPACK_HAVE_CUDA_BACKEND)
#include "server/backends/cuda_backend.h"
#endif

namespace kvpack::server {

DeviceIoLayout MakeDeviceIoLayout(const LayerConfig& config) {
  const auto align = [](uint64_t v) { return (v + 255) / 256 * 256; };
  const uint64_t n = static_cast<uint64_t>(config.shape.n_tokens);
  DeviceIoLayout io;
  io.x_bytes = n * static_cast<uint64_t>(config.shape.hidden) * 2;
  io.positions_offset = align(io.x_bytes);
  io.positions_bytes = config.rope.layout != RopeLayout::kNone ? n * static_cast<uint64_t>(config.rope.n_axes) * 4 : 0;
  io.out_bytes = n * static_cast<uint64_t>(config.shape.HeadCols()) * 2;
  io.out_offset = config.in_place ? io.x_offset : align(io.positions_offset + io.positions_bytes);
  io.total_bytes = config.in_place ? align(io.positions_offset + io.positions_bytes) : align(io.out_offset + io.out_bytes);
  return io;
}

absl::StatusOr<BackendKind> ParseBackendKind(const std::string& text) {
  if (text == "auto") return BackendKind::kAuto;
  if (text == "cpu") return BackendKind::kCpu;
  if (text == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError("--backend=" + text + ": expected auto, cpu or cuda");
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options, std::string* note) {
  if (options.kind != BackendKind::kCpu) {
#if defined(KVPACK_HAVE_CUDA_BACKEND)
    std::string why;
    std::unique_ptr<Backend> cuda = MakeCudaBackend(&why);
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
  return MakeCpuBackend(options.cpu_threads);
}

}  // namespace kvpack::server
