#include "server/backends/faulty_backend.h"

#include <atomic>
#include <string>
#include <utility>

namespace kvpack::server {
namespace {

class FaultyBackend final : public Backend {
 public:
  FaultyBackend(std::unique_ptr<Backend> backend, FaultInjector* faults) : b_(std::move(backend)), faults_(faults) {}

  std::string name() const override { return b_->name(); }
  absl::Status Supported(const LayerConfig& c) const override { return b_->Supported(c); }
  uint64_t KvBytes(const LayerConfig& c) const override { return b_->KvBytes(c); }
  uint64_t WorkspaceBytes(const LayerConfig& c) const override { return b_->WorkspaceBytes(c); }
  uint64_t RoutingBytes(const LayerConfig& c) const override { return b_->RoutingBytes(c); }
  uint64_t IoBytes(const LayerConfig& c, const TensorResidency& r) const override { return b_->IoBytes(c, r); }
  absl::Status ProjectKv(const LayerConfig& c, const LayerTensors& t, uint8_t* kv, uint8_t* ws,
                         const ChunkGate& gate) override {
    if (absl::Status s = Injected("ProjectKv"); !s.ok()) return s;
    return b_->ProjectKv(c, t, kv, ws, gate);
  }
  absl::Status AttendLayer(const LayerConfig& c, const LayerTensors& t, const uint8_t* kv, uint8_t* ws,
                           const ChunkGate& gate, SparseReport* sparse_report) override {
    if (absl::Status s = Injected("AttendLayer"); !s.ok()) return s;
    return b_->AttendLayer(c, t, kv, ws, gate, sparse_report);
  }
  bool TakesTurns() const override { return b_->TakesTurns(); }
  void SetRunsAlone(std::function<bool()> runs_alone) override { b_->SetRunsAlone(std::move(runs_alone)); }
  std::unique_ptr<Arena> CreateArena() override { return b_->CreateArena(); }
  absl::Status CopyToPool(void* dst, const void* src, uint64_t bytes) override {
    if (absl::Status s = Injected("CopyToPool"); !s.ok()) return s;
    return b_->CopyToPool(dst, src, bytes);
  }
  absl::Status CopyFromPool(void* dst, const void* src, uint64_t bytes) override {
    if (absl::Status s = Injected("CopyFromPool"); !s.ok()) return s;
    return b_->CopyFromPool(dst, src, bytes);
  }
  DeviceMemory QueryDeviceMemory() const override { return b_->QueryDeviceMemory(); }
  DeviceIdentity Identity() const override { return b_->Identity(); }
  KernelInfo Kernel() const override { return b_->Kernel(); }
  bool ReadsHostMemory() const override { return b_->ReadsHostMemory(); }
  absl::StatusOr<IpcMapping> OpenIpcRegion(const std::string& handle, int device, uint64_t size) override {
    return b_->OpenIpcRegion(handle, device, size);
  }
  bool Healthy() const override { return healthy_.load() && b_->Healthy(); }

 private:
  absl::Status Injected(const char* call) {
    if (!faults_->ShouldFail(FaultSite::kDeviceCall)) return absl::OkStatus();
    healthy_ = false;
    return absl::InternalError(std::string(call) + ": injected device call failure (fault injection)");
  }

  std::unique_ptr<Backend> b_;
  FaultInjector* const faults_;
  std::atomic<bool> healthy_{true};
};

}  // namespace

std::unique_ptr<Backend> WithDeviceFaults(std::unique_ptr<Backend> backend, FaultInjector* faults) {
  return std::make_unique<FaultyBackend>(std::move(backend), faults);
}

}  // namespace kvpack::server
