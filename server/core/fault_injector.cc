#include "server/core/fault_injector.h"

#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

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

void FaultInjector::FailEvery(FaultSite site, uint64_t period) {
  std::lock_guard<std::mutex> lock(mu_);
  Counter& c = sites_[static_cast<int>(site)];
  c.period = period;
  c.period_from = c.calls;
}

bool FaultInjector::ShouldFail(FaultSite site) {
  std::lock_guard<std::mutex> lock(mu_);
  Counter& c = sites_[static_cast<int>(site)];
  ++c.calls;
  const bool nth = c.calls == c.fail_at;
  const bool periodic = c.period != 0 && (c.calls - c.period_from) % c.period == 0;
  if (!nth && !periodic) return false;
  if (nth) c.fail_at = 0;
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

absl::Status ApplyFaultEvery(const std::string& spec, FaultInjector* faults) {
  std::vector<std::pair<FaultSite, uint64_t>> parsed;
  for (absl::string_view part : absl::StrSplit(spec, ',')) {
    const std::vector<absl::string_view> kv = absl::StrSplit(part, absl::MaxSplits(':', 1));
    int site = 0;
    while (site < kNumFaultSites && (kv.size() != 2 || kv[0] != FaultSiteName(static_cast<FaultSite>(site)))) ++site;
    uint64_t period = 0;
    if (site == kNumFaultSites || !absl::SimpleAtoi(kv[1], &period) || period == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "\"", part.substr(0, 64), "\": expected SITE:N with SITE host_alloc, vmm_map, shm_map or device_call, N >= 1"));
    }
    parsed.emplace_back(static_cast<FaultSite>(site), period);
  }
  for (const auto& [site, period] : parsed) faults->FailEvery(site, period);
  return absl::OkStatus();
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
