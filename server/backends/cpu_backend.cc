#include "server/backends/cpu_backend.h"

#include <cstring>

#include "kernels/cpu/layer.h"
#include "kernels/cpu/sparse_layer.h"
#include "server/core/error_status.h"

namespace kvpack::server {
namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int n_threads) { options_.n_threads = n_threads; }

  std::string name() const override { return "cpu"; }

  absl::Status Supported(const LayerConfig& config) const override { return ToStatus(cpu::Supported(config)); }
  uint64_t KvBytes(const LayerConfig& config) const override { return cpu::KvBytes(config); }
  uint64_t WorkspaceBytes(const LayerConfig& config) const override { return cpu::WorkspaceBytes(config); }
  uint64_t RoutingBytes(const LayerConfig& config) const override { return cpu::RoutingBytes(config); }
  uint64_t IoBytes(const LayerConfig&, const TensorResidency&) const override { return 0; }

  absl::Status ProjectKv(const LayerConfig& config, const LayerTensors& tensors, uint8_t* kv, uint8_t* workspace,
                         const ChunkGate& gate) override {
    return ToStatus(cpu::ProjectKv(config, tensors, kv, workspace, options_, gate));
  }

  absl::Status AttendLayer(const LayerConfig& config, const LayerTensors& tensors, const uint8_t* kv,
                           uint8_t* workspace, const ChunkGate& gate, SparseReport* sparse_report) override {
    const KvLayout layout = PlanKvLayout(config.shape, config.ranges);
    const KvEntryView view = MakeKvView(layout, config.shape, kv, config.transforms);
    return ToStatus(cpu::AttendLayer(config, tensors, view, workspace, options_, gate, sparse_report));
  }

  std::unique_ptr<Arena> CreateArena() override { return MakeHostArena(); }
  absl::Status CopyToPool(void* dst, const void* src, uint64_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyFromPool(void* dst, const void* src, uint64_t bytes) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  bool ReadsHostMemory() const override { return true; }

 private:
  cpu::CpuOptions options_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int n_threads) { return std::make_unique<CpuBackend>(n_threads); }

}  // namespace kvpack::server
