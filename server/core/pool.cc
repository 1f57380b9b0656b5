#include "server/core/pool.h"

#include <sys/mman.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvpack::server {

const char* PoolStateName(PoolState state) {
  switch (state) {
    case PoolState::kKvActive: return "kv_active";
    case PoolState::kKvKept: return "kv_kept";
    case PoolState::kWeights: return "weights";
    case PoolState::kWorkspace: return "workspace";
  }
  return "unknown";
}

const char* FormatName(PageFormat format) {
  switch (format) {
    case PageFormat::kInt4: return "int4";
    case PageFormat::kInt8: return "int8";
    case PageFormat::kBf16: return "bf16";
  }
  return "unknown";
}

namespace {

// Host memory, zero-filled (unused page slots must read as zero, format.h). Blocks of 1 MiB and more
// are anonymous mappings: page-aligned, zeroed and populated by the kernel in one pass (far cheaper
// than a page fault per 4 KiB while an upload streams in), and
// returned to the system at once on free, so a 256 MiB upload is not preceded by a 256 MiB memset.
class HostArena final : public Arena {
 public:
  static constexpr uint64_t kMapThreshold = 1ull << 20;

  void* Allocate(uint64_t bytes) override {
    void* p = nullptr;
    if (bytes >= kMapThreshold) {
      p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
      if (p == MAP_FAILED) return nullptr;
    } else {
      p = std::aligned_alloc(kPoolGranule, bytes);
      if (p == nullptr) return nullptr;
      std::memset(p, 0, bytes);
    }
    mapped_ += bytes;
    return p;
  }
  void Free(void* ptr, uint64_t bytes) override {
    if (bytes >= kMapThreshold) {
      munmap(ptr, bytes);
    } else {
      std::free(ptr);
    }
    mapped_ -= bytes;
  }
  uint64_t MappedBytes() const override { return mapped_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> mapped_{0};
};

}  // namespace

std::unique_ptr<Arena> MakeHostArena() { return std::make_unique<HostArena>(); }

Pool::Pool(uint64_t budget, std::unique_ptr<Arena> arena) : budget_(budget), arena_(std::move(arena)) {
  stats_.budget = budget;
}

Pool::~Pool() = default;

absl::StatusOr<Pool::Reservation> Pool::Reserve(uint64_t bytes) {
  bytes = PoolBytes(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > stats_.free()) {
    return absl::ResourceExhaustedError(absl::StrCat("pool: cannot reserve ", bytes, " bytes; ", stats_.free(),
                                                     " of ", budget_, " free"));
  }
  stats_.reserved += bytes;
  Reservation r;
  r.pool_ = this;
  r.remaining_ = bytes;
  return r;
}

absl::StatusOr<Pool::Lease> Pool::Allocate(const AllocationSpec& spec_in, Reservation* from) {
  AllocationSpec spec = spec_in;
  spec.bytes = PoolBytes(spec.bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (from != nullptr) {
      if (from->pool_ != this || from->remaining_ < spec.bytes) {
        return absl::ResourceExhaustedError(absl::StrCat("pool: allocation of ", spec.bytes, " bytes (",
                                                         PoolStateName(spec.state), ") exceeds its reservation of ",
                                                         from->remaining_, " bytes"));
      }
      from->remaining_ -= spec.bytes;
      stats_.reserved -= spec.bytes;
    } else if (spec.bytes > stats_.free()) {
      return absl::ResourceExhaustedError(absl::StrCat("pool: cannot allocate ", spec.bytes, " bytes (",
                                                       PoolStateName(spec.state), "); ", stats_.free(), " of ",
                                                       budget_, " free"));
    }
    Account(spec, +1);
  }
  void* ptr = spec.bytes > 0 ? arena_->Allocate(spec.bytes) : nullptr;
  if (spec.bytes > 0 && ptr == nullptr) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      Account(spec, -1);
    }
    NotifyRelease();
    return absl::ResourceExhaustedError(absl::StrCat("pool: the arena could not provide ", spec.bytes, " bytes"));
  }
  Lease lease;
  lease.pool_ = this;
  lease.ptr_ = ptr;
  lease.spec_ = std::move(spec);
  return lease;
}

void Pool::Account(const AllocationSpec& spec, int sign) {
  const auto apply = [sign](uint64_t& v, uint64_t d) { v = sign > 0 ? v + d : v - d; };
  apply(stats_.allocated, spec.bytes);
  apply(stats_.by_state[static_cast<int>(spec.state)], spec.bytes);
  for (int f = 0; f < kNumPageFormats; ++f) apply(stats_.by_format[f], spec.format_bytes[f]);
  uint64_t& tenant = stats_.by_tenant[spec.tenant];
  apply(tenant, spec.bytes);
  if (tenant == 0) stats_.by_tenant.erase(spec.tenant);
  if (stats_.allocated > stats_.high_water) stats_.high_water = stats_.allocated;
}

void Pool::FreeLease(Lease* lease) {
  if (lease->ptr_ != nullptr) arena_->Free(lease->ptr_, lease->spec_.bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Account(lease->spec_, -1);
  }
  NotifyRelease();
}

void Pool::ReturnReservation(uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.reserved -= bytes;
  }
  NotifyRelease();
}

void Pool::NotifyRelease() {
  std::function<void()> listener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    listener = listener_;
  }
  if (listener) listener();
}

PoolSnapshot Pool::Snapshot() const {
  // The arena is asked outside the pool's lock: an arena may be slow to answer while it maps memory
  // for an allocation, and Status must not wait for layer work (nor hold up the pool meanwhile).
  const uint64_t mapped = arena_->MappedBytes();
  std::lock_guard<std::mutex> lock(mu_);
  PoolSnapshot s = stats_;
  s.mapped = mapped;
  return s;
}

uint64_t Pool::FreeBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_.free();
}

void Pool::SetReleaseListener(std::function<void()> listener) {
  std::lock_guard<std::mutex> lock(mu_);
  listener_ = std::move(listener);
}

void Pool::ResetHighWater() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.high_water = stats_.allocated;
}

Pool::Reservation& Pool::Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    remaining_ = std::exchange(other.remaining_, 0);
  }
  return *this;
}

void Pool::Reservation::Release() {
  if (pool_ != nullptr) {
    Pool* pool = std::exchange(pool_, nullptr);
    const uint64_t bytes = std::exchange(remaining_, 0);
    pool->ReturnReservation(bytes);
  }
}

Pool::Lease& Pool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    spec_ = std::move(other.spec_);
  }
  return *this;
}

void Pool::Lease::SetState(PoolState state) {
  if (pool_ == nullptr || state == spec_.state) return;
  std::lock_guard<std::mutex> lock(pool_->mu_);
  pool_->stats_.by_state[static_cast<int>(spec_.state)] -= spec_.bytes;
  pool_->stats_.by_state[static_cast<int>(state)] += spec_.bytes;
  spec_.state = state;
}

void Pool::Lease::Release() {
  if (pool_ != nullptr) {
    Pool* pool = std::exchange(pool_, nullptr);
    pool->FreeLease(this);
    ptr_ = nullptr;
  }
}

}  // namespace kvpack::server
