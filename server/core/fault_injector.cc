#include "server/core/fault_injector.h"

#include <utility>

namespace kvpack::server {

const char* FaultSiteName(FaultSite site) {
  switch (site) {
    case FaultSite::kHostAlloc: return "host_alloc";
    case FaultSite::kVmmMap: return "vmm_map";
    case FaultSite::kShmMap: return "shm_map";
    case FaultSite::kDeviceCall: return "device_call";
  }
  return "unknown";
}

void FaultInjector::FailNth(FaultSite site, uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  Counter& c = sites_[static_cast<int>(site)];
  c.fail_at = n == 0 ? 0 : c.calls + n;
}

bool FaultInjector::ShouldFail(FaultSite site) {
  std::lock_guard<std::mutex> lock(mu_);
  Counter& c = sites_[static_cast<int>(site)];
  ++c.calls;
  if (c.calls != c.fail_at) return false;
  c.fail_at = 0;
  ++c.injected;
  return true;
}

uint64_t FaultInjector::Calls(FaultSite site) const {
  std::lock_guard<std::mutex> lock(mu_);
  return sites_[static_cast<int>(site)].calls;
}

uint64_t FaultInjector::Injected(FaultSite site) const {
  std::lock_guard<std::mutex> lock(mu_);
  return sites_[static_cast<int>(site)].injected;
}

namespace {

class FaultyArena final : public Arena {
 public:
  FaultyArena(std::unique_ptr<Arena> arena, FaultInjector* faults, FaultSite site)
      : arena_(std::move(arena)), faults_(faults), site_(site) {}
  void* Allocate(uint64_t bytes) override { return faults_->ShouldFail(site_) ? nullptr : arena_->Allocate(bytes); }
  void Free(void* ptr, uint64_t bytes) override { arena_->Free(ptr, bytes); }
  uint64_t MappedBytes() const override { return arena_->MappedBytes(); }
  void Trim() override { arena_->Trim(); }

 private:
  std::unique_ptr<Arena> arena_;
  FaultInjector* const faults_;
  const FaultSite site_;
};

}  // namespace

std::unique_ptr<Arena> WithFaults(std::unique_ptr<Arena> arena, FaultInjector* faults, FaultSite site) {
  return std::make_unique<FaultyArena>(std::move(arena), faults, site);
}

}  // namespace kvpack::server
