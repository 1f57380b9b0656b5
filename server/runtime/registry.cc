#include "server/runtime/registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/runtime/bounded.h"
#include "server/runtime/shm_guard.h"

namespace kvpack::server {

// ── Region ──

Region::Region(std::string id, std::string tenant, RegionKind kind, std::string name, uint8_t* base, uint64_t size,
               std::function<void(uint8_t*, uint64_t)> unmap, int fd)
    : id_(std::move(id)), tenant_(std::move(tenant)), kind_(kind), name_(std::move(name)), base_(base), size_(size),
      unmap_(std::move(unmap)), fd_(fd) {
  if (fd_ >= 0) guard_ = GuardRange(base_, size_);
}

Region::~Region() {
  UnguardRange(guard_);
  if (unmap_) unmap_(base_, size_);
  if (fd_ >= 0) close(fd_);
}

absl::Status Region::Intact() const {
  if (RangeFaulted(guard_)) {
    return absl::FailedPreconditionError(absl::StrCat("region ", id_, ": shared-memory object \"", Bounded(name_),
                                                      "\" was truncated while a request used it"));
  }
  return absl::OkStatus();
}

int Region::users() const {
  std::lock_guard<std::mutex> lock(mu_);
  return users_;
}

absl::StatusOr<uint8_t*> Region::Slice(uint64_t offset, uint64_t bytes, const std::string& field) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": bytes [", offset, ", ", offset, " + ", bytes,
                                                   ") are outside region ", id_, " of ", size_, " bytes"));
  }
  if (absl::Status s = Intact(); !s.ok()) return s;
  if (fd_ >= 0) {
    struct stat st {};
    if (fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) < offset + bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, ": shared-memory object \"", Bounded(name_), "\" is now ", static_cast<uint64_t>(st.st_size),
          " bytes; bytes [", offset, ", ", offset + bytes, ") pass its end (was it truncated after RegisterRegion?)"));
    }
  }
  return base_ + offset;
}

void Region::AddUser() {
  std::lock_guard<std::mutex> lock(mu_);
  ++users_;
}

void Region::RemoveUser() {
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--users_ == 0) waiters.swap(on_idle_);
  }
  for (auto& w : waiters) w();
}

RegionUse::RegionUse(std::shared_ptr<Region> region) : region_(std::move(region)) {
  if (region_) region_->AddUser();
}

RegionUse& RegionUse::operator=(RegionUse&& other) noexcept {
  if (this != &other) {
    if (region_) region_->RemoveUser();
    region_ = std::move(other.region_);
  }
  return *this;
}

RegionUse::~RegionUse() {
  if (region_) region_->RemoveUser();
}

// ── Registry ──

Registry::Registry(const Clock* clock, absl::Duration lease, RegistryLimits limits)
    : clock_(clock), lease_(lease), limits_(limits) {}

std::string Registry::NewId(const char* prefix) {
  static std::mutex mu;
  static std::random_device device;  // getrandom(2) on Linux
  std::lock_guard<std::mutex> lock(mu);
  char buf[33];
  for (int i = 0; i < 4; ++i) std::snprintf(buf + 8 * i, 9, "%08x", static_cast<unsigned>(device()));
  return absl::StrCat(prefix, buf);
}

absl::Status Registry::HandleRoomLocked(const std::string& tenant) const {
  auto it = handles_by_tenant_.find(tenant);
  if (it != handles_by_tenant_.end() && it->second >= limits_.max_handles_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat("this tenant holds ", limits_.max_handles_per_tenant,
                                                     " weights and K/V handles, its limit (--max_handles_per_tenant); "
                                                     "release some"));
  }
  if (weights_.size() + kv_.size() >= static_cast<size_t>(limits_.max_handles)) {
    return absl::ResourceExhaustedError(absl::StrCat("the daemon holds ", limits_.max_handles,
                                                     " weights and K/V handles, its limit (--max_handles); retry later"));
  }
  return absl::OkStatus();
}

absl::Status Registry::CheckHandleRoom(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  return HandleRoomLocked(tenant);
}

void Registry::ForgetHandleLocked(const std::string& tenant) {
  auto it = handles_by_tenant_.find(tenant);
  if (it != handles_by_tenant_.end() && --it->second <= 0) handles_by_tenant_.erase(it);
}

absl::Status Registry::AddWeights(std::shared_ptr<WeightsEntry> entry) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = HandleRoomLocked(entry->tenant); !s.ok()) return s;
  ++handles_by_tenant_[entry->tenant];
  const std::string id = entry->id;
  weights_[id] = Slot<WeightsEntry>{std::move(entry), clock_->Now()};
  return absl::OkStatus();
}

absl::Status Registry::AddKv(std::shared_ptr<KvEntry> entry) {
  std::lock_guard<std::mutex> lock(mu_);
  if (absl::Status s = HandleRoomLocked(entry->tenant); !s.ok()) return s;
  ++handles_by_tenant_[entry->tenant];
  const std::string id = entry->id;
  kv_[id] = Slot<KvEntry>{std::move(entry), clock_->Now()};
  return absl::OkStatus();
}

absl::Status Registry::AddRegion(std::shared_ptr<Region> region) {
  std::lock_guard<std::mutex> lock(mu_);
  int& tenant_regions = regions_by_tenant_[region->tenant()];
  if (tenant_regions >= limits_.max_regions_per_tenant) {
    if (tenant_regions == 0) regions_by_tenant_.erase(region->tenant());
    return absl::ResourceExhaustedError(absl::StrCat("this tenant holds ", limits_.max_regions_per_tenant,
                                                     " regions, its limit (--max_regions_per_tenant); unregister some"));
  }
  if (regions_.size() >= static_cast<size_t>(limits_.max_regions)) {
    if (tenant_regions == 0) regions_by_tenant_.erase(region->tenant());
    return absl::ResourceExhaustedError(absl::StrCat("the daemon holds ", limits_.max_regions,
                                                     " regions, its limit (--max_regions); retry later"));
  }
  ++tenant_regions;
  const std::string id = region->id();
  regions_[id] = Slot<Region>{std::move(region), clock_->Now()};
  return absl::OkStatus();
}

namespace {

template <typename Table>
absl::Status Lookup(Table& table, const std::string& tenant, const std::string& id, const std::string& field,
                    typename Table::iterator* out) {
  if (id.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": required"));
  auto it = table.find(id);
  if (it == table.end() || it->second.entry->tenant != tenant) {
    return absl::NotFoundError(absl::StrCat(field, " = \"", Bounded(id), "\": no such handle for this tenant"));
  }
  *out = it;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<WeightsEntry>> Registry::GetWeights(const std::string& tenant, const std::string& id,
                                                                   const char* field) {
  std::lock_guard<std::mutex> lock(mu_);
  decltype(weights_)::iterator it;
  if (absl::Status s = Lookup(weights_, tenant, id, field, &it); !s.ok()) return s;
  it->second.last_used = clock_->Now();
  return it->second.entry;
}

absl::Status Registry::ReleaseWeights(const std::string& tenant, const std::string& id) {
  std::shared_ptr<WeightsEntry> dropped;  // freed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  decltype(weights_)::iterator it;
  if (absl::Status s = Lookup(weights_, tenant, id, "handle", &it); !s.ok()) return s;
  dropped = std::move(it->second.entry);
  weights_.erase(it);
  ForgetHandleLocked(tenant);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<KvEntry>> Registry::GetKv(const std::string& tenant, const std::string& id,
                                                         const char* field) {
  std::lock_guard<std::mutex> lock(mu_);
  decltype(kv_)::iterator it;
  if (absl::Status s = Lookup(kv_, tenant, id, field, &it); !s.ok()) return s;
  it->second.last_used = clock_->Now();
  return it->second.entry;
}

absl::Status Registry::ReleaseKv(const std::string& tenant, const std::string& id) {
  std::shared_ptr<KvEntry> dropped;
  std::lock_guard<std::mutex> lock(mu_);
  decltype(kv_)::iterator it;
  if (absl::Status s = Lookup(kv_, tenant, id, "handle", &it); !s.ok()) return s;
  dropped = std::move(it->second.entry);
  kv_.erase(it);
  ForgetHandleLocked(tenant);
  return absl::OkStatus();
}

absl::StatusOr<RegionUse> Registry::UseRegion(const std::string& tenant, const std::string& id,
                                              const std::string& field) {
  if (id.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ".region_id: required"));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end() || it->second.entry->tenant() != tenant) {
    return absl::NotFoundError(absl::StrCat(field, ".region_id = \"", Bounded(id), "\": no such region for this tenant"));
  }
  it->second.last_used = clock_->Now();
  return RegionUse(it->second.entry);
}

absl::Status Registry::UnregisterRegion(const std::string& tenant, const std::string& id, std::function<void()> done) {
  std::shared_ptr<Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (id.empty()) return absl::InvalidArgumentError("region_id: required");
    if (it == regions_.end() || it->second.entry->tenant() != tenant) {
      return absl::NotFoundError(absl::StrCat("region_id = \"", Bounded(id), "\": no such region for this tenant"));
    }
    region = std::move(it->second.entry);
    regions_.erase(it);
    ForgetRegionLocked(tenant);
  }
  bool now = false;
  {
    std::lock_guard<std::mutex> lock(region->mu_);
    if (region->users_ == 0) {
      now = true;
    } else {
      region->on_idle_.push_back(std::move(done));
    }
  }
  if (now) done();
  return absl::OkStatus();
}

std::vector<std::shared_ptr<Region>> Registry::Regions(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Region>> out;
  for (const auto& [id, slot] : regions_) {
    if (slot.entry->tenant() == tenant) out.push_back(slot.entry);
  }
  return out;
}

int Registry::KeepAlive(const std::string& tenant, const std::vector<std::string>& ids) {
  const absl::Time now = clock_->Now();
  std::lock_guard<std::mutex> lock(mu_);
  int renewed = 0;
  for (const std::string& id : ids) {
    if (auto it = weights_.find(id); it != weights_.end() && it->second.entry->tenant == tenant) {
      it->second.last_used = now;
      ++renewed;
    } else if (auto it = kv_.find(id); it != kv_.end() && it->second.entry->tenant == tenant) {
      it->second.last_used = now;
      ++renewed;
    } else if (auto it = regions_.find(id); it != regions_.end() && it->second.entry->tenant() == tenant) {
      it->second.last_used = now;
      ++renewed;
    }
  }
  return renewed;
}

int Registry::Reap() {
  const absl::Time now = clock_->Now();
  std::vector<std::shared_ptr<void>> dropped;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  const auto expired = [&](absl::Time last) { return now - last >= lease_; };
  for (auto it = weights_.begin(); it != weights_.end();) {
    if (expired(it->second.last_used) && it->second.entry.use_count() == 1) {
      ForgetHandleLocked(it->second.entry->tenant);
      dropped.push_back(std::move(it->second.entry));
      it = weights_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = kv_.begin(); it != kv_.end();) {
    if (expired(it->second.last_used) && it->second.entry.use_count() == 1) {
      ForgetHandleLocked(it->second.entry->tenant);
      dropped.push_back(std::move(it->second.entry));
      it = kv_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = regions_.begin(); it != regions_.end();) {
    if (expired(it->second.last_used) && it->second.entry->users() == 0) {
      ForgetRegionLocked(it->second.entry->tenant());
      dropped.push_back(std::move(it->second.entry));
      it = regions_.erase(it);
    } else {
      ++it;
    }
  }
  return static_cast<int>(dropped.size());
}

void Registry::Clear() {
  std::map<std::string, Slot<WeightsEntry>> w;
  std::map<std::string, Slot<KvEntry>> k;
  std::map<std::string, Slot<Region>> r;
  std::lock_guard<std::mutex> lock(mu_);
  w.swap(weights_);
  k.swap(kv_);
  r.swap(regions_);
  regions_by_tenant_.clear();
  handles_by_tenant_.clear();
}

void Registry::ForgetRegionLocked(const std::string& tenant) {
  auto it = regions_by_tenant_.find(tenant);
  if (it != regions_by_tenant_.end() && --it->second <= 0) regions_by_tenant_.erase(it);
}

RegistryCounts Registry::Counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  RegistryCounts c;
  c.weights = static_cast<int>(weights_.size());
  c.kv = static_cast<int>(kv_.size());
  for (const auto& [id, slot] : regions_) (slot.entry->kind() == RegionKind::kShm ? c.shm : c.cuda_ipc)++;
  return c;
}

RegistryCounts Registry::TenantCounts(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  RegistryCounts c;
  for (const auto& [id, slot] : weights_) c.weights += slot.entry->tenant == tenant;
  for (const auto& [id, slot] : kv_) c.kv += slot.entry->tenant == tenant;
  for (const auto& [id, slot] : regions_) {
    if (slot.entry->tenant() == tenant) (slot.entry->kind() == RegionKind::kShm ? c.shm : c.cuda_ipc)++;
  }
  return c;
}

absl::StatusOr<std::shared_ptr<Region>> MapShmRegion(const std::string& tenant, const std::string& name,
                                                     uint64_t size, FaultInjector* faults) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_name = \"", Bounded(name), "\": expected \"/name\" (one leading slash, no other, ≤ 255 chars)"));
  }
  if (size == 0) return absl::InvalidArgumentError("size_bytes: must be positive");
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      return absl::ResourceExhaustedError(absl::StrCat("shm_name: the daemon has no file descriptor left (",
                                                       std::strerror(err), "); unregister regions"));
    }
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("shm_name = \"", Bounded(name), "\": no such object"));
    return absl::PermissionDeniedError(absl::StrCat("shm_name = \"", Bounded(name), "\": ", std::strerror(err)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("size_bytes = ", size, " exceeds the object's size (",
                                                   static_cast<uint64_t>(st.st_size), " bytes)"));
  }
  void* base = MAP_FAILED;
  if (faults != nullptr && faults->ShouldFail(FaultSite::kShmMap)) {
    errno = ENOMEM;  // what the kernel answers when the address space or mapping count runs out
  } else {
    base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("mmap of ", size, " bytes failed: ", std::strerror(err)));
  }
  // The fd stays open: every use fstat()s it (the object may shrink after this check).
  return std::make_shared<Region>(Registry::NewId("r-"), tenant, RegionKind::kShm, name, static_cast<uint8_t*>(base),
                                  size, [](uint8_t* p, uint64_t n) { munmap(p, n); }, fd);
}

}  // namespace kvpack::server
