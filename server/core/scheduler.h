// The scheduler: admission by memory, priorities, per-tenant fairness, aging, deadlines,
// cancellation, and a bounded queue. It decides; it does not run anything — an admitted job's
// on_admit callback receives the job's pool reservation and hands the work to an executor.
//
// Order. Waiting jobs are ranked by score = priority + floor(waited / aging_step) (so a job that
// waits climbs past newer, higher-priority ones), then by the job's rank among its own tenant's
// waiting jobs, then by how long ago its tenant was last served (round robin across tenants at equal
// score), then by arrival.
// Admission. In rank order, each job tries to reserve its predicted peak in the pool. A job that
// does not fit is skipped (smaller jobs behind it may go first), unless it has waited at least
// max_bypass: then nothing behind it is admitted until it fits, so large jobs never starve.
// Deadlines. Pump() rejects waiting jobs whose deadline has passed with DEADLINE_EXCEEDED.
// Bounds. Submit fails with UNAVAILABLE when max_queue jobs wait, and with RESOURCE_EXHAUSTED when
// the job's peak exceeds the whole budget (it could never run).
//
// Callbacks run on the thread that calls Submit/Pump/Cancel, never under the scheduler's lock, and
// must not block. Thread safety: every method is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/core/clock.h"
#include "server/core/pool.h"

namespace kvpack::server {

struct SchedulerOptions {
  size_t max_queue = 64;
  absl::Duration aging_step = absl::Seconds(1);  // +1 priority per step waited
  absl::Duration max_bypass = absl::Seconds(2);  // after this, a waiting job blocks those behind it
};

struct Job {
  std::string tenant = "default";
  int priority = 0;
  uint64_t peak_bytes = 0;
  absl::Time deadline = absl::InfiniteFuture();
  // Optional: claims the job's share of a per-tenant limit (quota) just before its memory is
  // reserved; false skips the job for now (without holding back other tenants' jobs). When the
  // memory then cannot be reserved, `unclaim` undoes the claim. Both run under the scheduler's lock
  // and must not call back into it.
  std::function<bool()> try_claim;
  std::function<void()> unclaim;
  // Exactly one of the two is called, once.
  std::function<void(Pool::Reservation)> on_admit;
  std::function<void(absl::Status)> on_reject;
};

class Scheduler {
 public:
  Scheduler(SchedulerOptions options, Pool* pool, const Clock* clock);

  // Queues the job and pumps. Returns its id; fails without calling back when the queue is full
  // or the job can never fit.
  absl::StatusOr<uint64_t> Submit(Job job);
  // Removes a waiting job and rejects it with CANCELLED. False when it is no longer waiting.
  bool Cancel(uint64_t id);
  // Expires deadlines and admits what fits.
  void Pump();
  // Rejects every waiting job with `status` (shutdown).
  void RejectAll(const absl::Status& status);

  size_t QueueDepth() const;
  std::map<std::string, int> QueuedByTenant() const;
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Waiting {
    uint64_t id;
    absl::Time submitted;
    Job job;
  };
  using Callback = std::function<void()>;
  void PumpLocked(std::vector<Callback>* callbacks);

  const SchedulerOptions options_;
  Pool* const pool_;
  const Clock* const clock_;
  mutable std::mutex mu_;
  std::vector<Waiting> waiting_;  // arrival order
  std::map<std::string, uint64_t> last_admit_;  // tenant → sequence number of its last admission
  uint64_t admissions_ = 0;
  uint64_t next_id_ = 1;
};

}  // namespace kvpack::server
