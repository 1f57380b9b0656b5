// The pool: the daemon's one budget for everything it allocates (packed K/V, cached weights,
// workspaces), with exact accounting by state, format and tenant, and a high-water mark.
//
// Two kinds of claim:
//   * Reservation — bytes set aside for an admitted request's whole plan (its predicted peak), so a
//     request that was admitted can never fail for memory halfway. Allocations made against a
//     reservation draw it down; the unused rest returns to the free bytes when it is destroyed.
//   * Lease — one allocation, RAII: destroying it frees the bytes at once (cancellation frees a
//     request's memory by dropping its leases).
// Free bytes = budget − allocated − reserved-unused. The high-water mark tracks allocated bytes.
//
// Accounting is in units of kPoolGranule bytes (PoolBytes rounds up), so the planner can predict
// what the pool will count. Where the bytes live is the Arena's business: host memory on the CPU
// backend; on the GPU a VMM arena (server/backends/vmm_arena.h: reserved address space, 2 MiB
// physical chunks mapped on demand) behind the same interface.
//
// Thread safety: every method is thread-safe. Leases and reservations must not outlive their pool.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/format.h"

namespace kvpack::server {

inline constexpr uint64_t kPoolGranule = 256;
inline constexpr uint64_t PoolBytes(uint64_t bytes) { return (bytes + kPoolGranule - 1) / kPoolGranule * kPoolGranule; }

enum class PoolState : int { kKvActive = 0, kKvKept = 1, kWeights = 2, kWorkspace = 3 };
inline constexpr int kNumPoolStates = 4;
const char* PoolStateName(PoolState state);  // the metric label: "kv_active", ...
const char* FormatName(PageFormat format);   // "int4", "int8", "bf16"

// Where pool bytes physically live.
class Arena {
 public:
  virtual ~Arena() = default;
  // REQUIRES: bytes is a multiple of kPoolGranule. Returns null when the memory is not there.
  virtual void* Allocate(uint64_t bytes) = 0;
  virtual void Free(void* ptr, uint64_t bytes) = 0;
  // Physical bytes behind the arena (equals allocated bytes for host memory). Must not wait for
  // an Allocate in progress: Status and /metrics read it while layers allocate.
  virtual uint64_t MappedBytes() const = 0;
  // Returns idle physical memory kept mapped after Free (the VMM arena keeps it for the next
  // request) to the device, down to the arena's floor. Host arenas keep nothing.
  virtual void Trim() {}
};

// Host memory, 256-byte aligned, zero-filled.
std::unique_ptr<Arena> MakeHostArena();

// What one allocation is for. format_bytes splits packed-page bytes of a K/V block by format.
struct AllocationSpec {
  uint64_t bytes = 0;
  PoolState state = PoolState::kWorkspace;
  std::string tenant = "default";
  std::array<uint64_t, kNumPageFormats> format_bytes{};
};

struct PoolSnapshot {
  uint64_t budget = 0;
  uint64_t allocated = 0;
  uint64_t reserved = 0;  // reserved and not yet allocated
  uint64_t high_water = 0;
  uint64_t mapped = 0;
  std::array<uint64_t, kNumPoolStates> by_state{};
  std::array<uint64_t, kNumPageFormats> by_format{};
  std::map<std::string, uint64_t> by_tenant;  // allocated bytes; tenants with zero are dropped
  uint64_t free() const { return budget - allocated - reserved; }
};

class Pool {
 public:
  class Lease;
  class Reservation;

  Pool(uint64_t budget, std::unique_ptr<Arena> arena);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  uint64_t budget() const { return budget_; }
  // Arena::Trim: idle physical memory back to the device.
  void Trim() { arena_->Trim(); }

  // Sets aside `bytes` (rounded) of the free bytes. RESOURCE_EXHAUSTED when they are not free now.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes);

  // Allocates spec.bytes (rounded) from `from` when given (which must hold enough), else from the
  // free bytes. RESOURCE_EXHAUSTED (with the numbers) when they do not fit, or the arena fails.
  absl::StatusOr<Lease> Allocate(const AllocationSpec& spec, Reservation* from = nullptr);

  PoolSnapshot Snapshot() const;
  uint64_t FreeBytes() const;
  // Called (outside the pool's lock) whenever bytes return to the free bytes: the scheduler pumps.
  void SetReleaseListener(std::function<void()> listener);
  // Forgets the high-water mark (sets it to the current allocation).
  void ResetHighWater();

  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& other) noexcept { *this = std::move(other); }
    Reservation& operator=(Reservation&& other) noexcept;
    ~Reservation() { Release(); }
    uint64_t remaining() const { return remaining_; }
    void Release();

   private:
    friend class Pool;
    Pool* pool_ = nullptr;
    uint64_t remaining_ = 0;
  };

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    ~Lease() { Release(); }
    uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
    uint64_t bytes() const { return spec_.bytes; }
    PoolState state() const { return spec_.state; }
    const std::string& tenant() const { return spec_.tenant; }
    explicit operator bool() const { return pool_ != nullptr; }
    // Moves the bytes to another state (kv_active → kv_kept when a request keeps its K/V).
    void SetState(PoolState state);
    void Release();

   private:
    friend class Pool;
    Pool* pool_ = nullptr;
    void* ptr_ = nullptr;
    AllocationSpec spec_;
  };

 private:
  void Account(const AllocationSpec& spec, int sign);  // REQUIRES: mu_ held
  void FreeLease(Lease* lease);
  void ReturnReservation(uint64_t bytes);
  void NotifyRelease();

  const uint64_t budget_;
  std::unique_ptr<Arena> arena_;
  mutable std::mutex mu_;
  PoolSnapshot stats_;
  std::function<void()> listener_;
};

}  // namespace kvpack::server
