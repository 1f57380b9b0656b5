// The host-bytes budget of inline tensors in flight (--max_inline_bytes_in_flight).
//
// Inline inputs (x, positions, pre-projected q, k, v) and inline outputs are received into or sent
// from host buffers that a call owns, outside the pool. Each call's bytes are bounded by
// --max_inline_bytes; this bounds them across calls, so stalled uploads cannot pile up host memory
// that no metric shows. A call takes a Lease for its inline bytes before it allocates them (or
// fails with RESOURCE_EXHAUSTED); the lease goes with the call's buffers, on every exit path.
//
// Thread safety: every method is thread-safe; a Lease is owned by one call.
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/status/statusor.h"

namespace kvpack::server {

class InlineBudget {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept : budget_(other.budget_), bytes_(other.bytes_) { other.budget_ = nullptr; }
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { Release(); }
    uint64_t bytes() const { return budget_ != nullptr ? bytes_ : 0; }
    void Release();

   private:
    friend class InlineBudget;
    Lease(InlineBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
    InlineBudget* budget_ = nullptr;
    uint64_t bytes_ = 0;
  };

  explicit InlineBudget(uint64_t max_bytes) : max_(max_bytes) {}

  // Claims `bytes` (RESOURCE_EXHAUSTED with the numbers when they would pass the budget).
  absl::StatusOr<Lease> Acquire(uint64_t bytes);
  uint64_t held() const { return held_.load(std::memory_order_relaxed); }
  uint64_t max() const { return max_; }

 private:
  const uint64_t max_;
  std::atomic<uint64_t> held_{0};
};

}  // namespace kvpack::server
