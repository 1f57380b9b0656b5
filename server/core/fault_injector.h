// Fault injection for tests: fails the Nth call of a chosen kind (a host allocation, a shared-memory
// map, a VMM map, a device call) so that every error path of a request can be driven on purpose.
//
// Compiled in, off by default: it is an object a test creates and hands to the daemon's parts
// through their options (EngineOptions::faults); with none given (the daemon's only mode) every site
// skips the check. No global state.
//
// Sites (what "a call" is, and where the check sits):
//   kHostAlloc   the pool's host arena providing bytes (CPU backend: weights, K/V, workspaces)
//   kVmmMap      the pool's device arena mapping physical chunks (CUDA backend's VMM arena)
//   kShmMap      mapping a client's POSIX shared-memory region (RegisterRegion)
//   kDeviceCall  a backend call that runs device work or copies (ProjectKv, AttendLayer,
//                CopyToPool, CopyFromPool): the CUDA or cuBLASLt call inside it failing, as the
//                CUDA backend reports it (INTERNAL, sticky: health turns NOT_SERVING)
// The arena sites are decided by the backend (ReadsHostMemory: host, else VMM), see WithFaults.
//
// Thread safety: every method is thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "server/core/pool.h"

namespace kvpack::server {

enum class FaultSite : int { kHostAlloc = 0, kVmmMap = 1, kShmMap = 2, kDeviceCall = 3 };
inline constexpr int kNumFaultSites = 4;
const char* FaultSiteName(FaultSite site);  // "host_alloc", "vmm_map", "shm_map", "device_call"

class FaultInjector {
 public:
  // Makes the n-th call at `site` from now fail (n = 1: the next one), once; n = 0 disarms.
  void FailNth(FaultSite site, uint64_t n);
  // Makes every `period`-th call at `site` from now on fail (period = 0 stops it), as well as any
  // FailNth: kvpackd's --fault_every, for soaks and the GPU fault tests.
  void FailEvery(FaultSite site, uint64_t period);
  // Called by a site before its work: counts the call; true when this call must fail.
  bool ShouldFail(FaultSite site);
  // Calls counted at `site` since the start (a test counts a scenario's calls, then fails each).
  uint64_t Calls(FaultSite site) const;
  // Faults injected at `site` since the start.
  uint64_t Injected(FaultSite site) const;

 private:
  struct Counter {
    uint64_t calls = 0;
    uint64_t fail_at = 0;  // the call number that fails; 0: none
    uint64_t period = 0;   // every period-th call after period_from fails; 0: none
    uint64_t period_from = 0;
    uint64_t injected = 0;
  };
  mutable std::mutex mu_;
  std::array<Counter, kNumFaultSites> sites_{};
};

// Applies "SITE:N[,SITE:N...]" (SITE a FaultSiteName, N ≥ 1) as FailEvery(SITE, N) to `faults`;
// INVALID_ARGUMENT naming the bad part otherwise (nothing applied).
absl::Status ApplyFaultEvery(const std::string& spec, FaultInjector* faults);

// `arena` whose Allocate fails (returns null, as when the memory is not there) whenever `faults`
// says so at `site`. REQUIRES: faults outlives the arena.
std::unique_ptr<Arena> WithFaults(std::unique_ptr<Arena> arena, FaultInjector* faults, FaultSite site);

}  // namespace kvpack::server
