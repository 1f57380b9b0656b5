// Time source of the scheduler and the lease reaper, injected so tests advance time by hand.
//
// Thread safety: Now() may be called from any thread.
#pragma once

#include <atomic>
#include <mutex>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvpack::server {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

class SystemClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

// A clock that moves only when told; for tests.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(absl::Time start = absl::UnixEpoch() + absl::Hours(1)) : now_(start) {}
  absl::Time Now() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    std::lock_guard<std::mutex> lock(mu_);
    now_ += d;
  }

 private:
  mutable std::mutex mu_;
  absl::Time now_;
};

}  // namespace kvpack::server
