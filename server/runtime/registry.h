// Handles (weights, packed K/V) and memory regions, scoped to the tenant that created them.
//
// Ids are 128 random bits (from the OS's CSPRNG) in hex behind a kind prefix ("w-", "kv-", "r-"), so
// they cannot be guessed; another tenant's id answers NOT_FOUND, exactly like an unknown one.
//
// Ownership and leases (docs/daemon.md): every entry is leased for `lease` after its last use. Any
// RPC that names it renews it, and KeepAlive renews a list. Reap() releases expired entries that no
// request is using. So a client that dies loses its handles and regions one lease after its last
// call, and a live client keeps them by using them or calling KeepAlive.
//
// In use. Entries are shared_ptrs: a request holds the ones it uses, so releasing a handle while a
// request uses it frees its pool memory when that request ends. A region counts its users
// (RegionUse); unregistering removes it from the table at once (new requests get NOT_FOUND) and
// calls back when the last user is gone; the mapping goes with the last reference.
//
// Thread safety: every method is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/layer_spec.h"
#include "server/core/clock.h"
#include "server/core/fault_injector.h"
#include "server/core/pool.h"

namespace kvpack::server {

struct WeightsEntry {
  std::string id;
  std::string tenant;
  int hidden = 0;
  int n_heads = 0;
  int head_dim = 0;
  bool has_bias = false;
  int norm_len = 0;  // q/k norm weight length; 0 without QK-norm weights
  // One pool block: w_qkv bf16 [3·H·d, D] | bias f32 [3·H·d] | q_norm f32 | k_norm f32.
  Pool::Lease lease;
  uint64_t w_bytes() const { return 3ull * n_heads * head_dim * hidden * 2; }
  uint64_t bias_bytes() const { return has_bias ? 3ull * n_heads * head_dim * 4 : 0; }
  uint64_t norm_bytes() const { return static_cast<uint64_t>(norm_len) * 4; }
  uint64_t bias_offset() const { return w_bytes(); }
  uint64_t q_norm_offset() const { return w_bytes() + bias_bytes(); }
  uint64_t k_norm_offset() const { return q_norm_offset() + norm_bytes(); }
  uint64_t total_bytes() const { return k_norm_offset() + norm_bytes(); }
};

struct KvEntry {
  std::string id;
  std::string tenant;
  std::string weights_id;  // the weights it was projected with
  LayerConfig config;      // formats resolved; config.stats is null
  Pool::Lease lease;       // the packed block (state kv_kept)
};

enum class RegionKind { kShm, kCudaIpc };

class Region {
 public:
  // `fd` (shared-memory regions; owned, closed with the region) lets every use check the object's
  // current size, and the mapping is guarded against SIGBUS (shm_guard.h); -1 for CUDA IPC.
  Region(std::string id, std::string tenant, RegionKind kind, std::string name, uint8_t* base, uint64_t size,
         std::function<void(uint8_t*, uint64_t)> unmap, int fd = -1);
  ~Region();
  const std::string& id() const { return id_; }
  const std::string& tenant() const { return tenant_; }
  RegionKind kind() const { return kind_; }
  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  int users() const;
  // The bytes [offset, offset + bytes), bounds-checked against the registered size and, for a
  // shared-memory object, its size now (a frontend may have truncated it since: FAILED_PRECONDITION,
  // never a SIGBUS); `field` names the request field in errors.
  absl::StatusOr<uint8_t*> Slice(uint64_t offset, uint64_t bytes, const std::string& field) const;
  // FAILED_PRECONDITION once the object was truncated under an access (the guard replaced the
  // mapping with zero pages): a request that used the region must fail.
  absl::Status Intact() const;

 private:
  friend class RegionUse;
  friend class Registry;
  void AddUser();
  void RemoveUser();

  const std::string id_, tenant_;
  const RegionKind kind_;
  const std::string name_;
  uint8_t* const base_;
  const uint64_t size_;
  std::function<void(uint8_t*, uint64_t)> unmap_;
  const int fd_;
  int guard_ = -1;  // shm_guard slot
  mutable std::mutex mu_;
  int users_ = 0;
  std::vector<std::function<void()>> on_idle_;  // unregister waiters
};

// A request's claim on a region: the region stays mapped and registered-or-draining while it lives.
class RegionUse {
 public:
  RegionUse() = default;
  explicit RegionUse(std::shared_ptr<Region> region);
  RegionUse(RegionUse&&) noexcept = default;
  RegionUse& operator=(RegionUse&& other) noexcept;
  ~RegionUse();
  Region* get() const { return region_.get(); }

 private:
  std::shared_ptr<Region> region_;
};

struct RegistryCounts {
  int weights = 0;
  int kv = 0;
  int shm = 0;
  int cuda_ipc = 0;
};

// Bounds on what clients may register (RESOURCE_EXHAUSTED beyond them). Each shm region holds a
// mapping and an open file descriptor; without a bound one tenant registering the same 4 KiB object
// ~65k times exhausted the daemon's memory (std::bad_alloc) and file descriptors.
// Handles are bounded too: each costs at least one 256-byte pool granule, but also host memory
// for its entry, so a large budget alone would let tiny weights pile up millions of entries.
struct RegistryLimits {
  int max_regions = 4096;             // all tenants (--max_regions)
  int max_regions_per_tenant = 1024;  // --max_regions_per_tenant
  int max_handles = 65536;            // weights and K/V handles, all tenants (--max_handles)
  int max_handles_per_tenant = 4096;  // --max_handles_per_tenant
};

class Registry {
 public:
  Registry(const Clock* clock, absl::Duration lease, RegistryLimits limits = {});

  static std::string NewId(const char* prefix);
  absl::Duration lease() const { return lease_; }

  // RESOURCE_EXHAUSTED when one more handle of `tenant` would pass a handle limit (a fail-fast
  // check before work; AddWeights/AddKv check again).
  absl::Status CheckHandleRoom(const std::string& tenant) const;
  // RESOURCE_EXHAUSTED (the entry dropped, its memory freed) beyond the handle limits.
  absl::Status AddWeights(std::shared_ptr<WeightsEntry> entry);
  absl::StatusOr<std::shared_ptr<WeightsEntry>> GetWeights(const std::string& tenant, const std::string& id,
                                                           const char* field);
  absl::Status ReleaseWeights(const std::string& tenant, const std::string& id);

  absl::Status AddKv(std::shared_ptr<KvEntry> entry);
  absl::StatusOr<std::shared_ptr<KvEntry>> GetKv(const std::string& tenant, const std::string& id, const char* field);
  absl::Status ReleaseKv(const std::string& tenant, const std::string& id);

  // RESOURCE_EXHAUSTED (and the region unmapped) when the tenant or the daemon holds its limit.
  absl::Status AddRegion(std::shared_ptr<Region> region);
  const RegistryLimits& limits() const { return limits_; }
  absl::StatusOr<RegionUse> UseRegion(const std::string& tenant, const std::string& id, const std::string& field);
  // Removes the region now; `done` runs when no request uses it any more (maybe at once).
  absl::Status UnregisterRegion(const std::string& tenant, const std::string& id, std::function<void()> done);
  std::vector<std::shared_ptr<Region>> Regions(const std::string& tenant) const;

  int KeepAlive(const std::string& tenant, const std::vector<std::string>& ids);
  // Releases expired entries nobody uses; returns how many.
  int Reap();
  // Drops everything (shutdown).
  void Clear();

  RegistryCounts Counts() const;
  RegistryCounts TenantCounts(const std::string& tenant) const;

 private:
  void ForgetRegionLocked(const std::string& tenant);  // REQUIRES: mu_ held
  absl::Status HandleRoomLocked(const std::string& tenant) const;  // REQUIRES: mu_ held
  void ForgetHandleLocked(const std::string& tenant);  // REQUIRES: mu_ held
  template <typename T>
  struct Slot {
    std::shared_ptr<T> entry;
    absl::Time last_used;
  };
  const Clock* const clock_;
  const absl::Duration lease_;
  const RegistryLimits limits_;
  mutable std::mutex mu_;
  std::map<std::string, Slot<WeightsEntry>> weights_;
  std::map<std::string, Slot<KvEntry>> kv_;
  std::map<std::string, Slot<Region>> regions_;
  std::map<std::string, int> regions_by_tenant_;  // kept with regions_
  std::map<std::string, int> handles_by_tenant_;  // kept with weights_ and kv_
};

// Maps the POSIX shared-memory object `name` ("/name", shm_open rules) for `size` bytes. `faults`
// (tests) can fail the map as mmap does when memory runs out (RESOURCE_EXHAUSTED).
absl::StatusOr<std::shared_ptr<Region>> MapShmRegion(const std::string& tenant, const std::string& name,
                                                     uint64_t size,
                                                     FaultInjector* faults = nullptr);

}  // namespace kvpack::server
