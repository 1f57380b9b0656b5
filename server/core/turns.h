// The GPU turn arbiter: running layer calls take one turn per streamed chunk (a projection chunk or
// a query chunk of attention) so that the GPU work of several requests interleaves chunk by chunk
// instead of one whole layer after another. It decides who goes next; it runs nothing.
//
// One turn exists. A participant (one running request) calls Acquire() before launching each chunk
// and Release() when its call ends. An Acquire by the holder is a yield: its previous chunk is done
// (the caller's promise), and it competes for the next one with everyone waiting, so a
// high-priority request keeps the turn over a waiting low-priority one while equal ones alternate.
// Whenever the turn is free it passes straight to the best candidate (a hand-off under the lock),
// ranked by
//   1. score = priority + floor(waited for this turn / aging_step) — high priority first, and a
//      low-priority request waiting behind a stream of high-priority chunks climbs until it gets one
//      (no starvation);
//   2. how long ago its tenant last held the turn (round robin across tenants at equal score);
//   3. how long ago the participant itself last held it (round robin within a tenant);
//   4. arrival at the wait.
// Cancel(id) ends that participant's wait at once, and every later Acquire of it, with CANCELLED.
//
// Time comes from the injected clock, read only when a turn is handed over; tests drive it by hand.
// Thread safety: every method is thread-safe; Acquire blocks the calling thread (never a gRPC thread:
// the executor's).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/core/clock.h"

namespace kvpack::server {

struct TurnOptions {
  absl::Duration aging_step = absl::Seconds(1);  // +1 priority per step waited for one turn
};

class TurnArbiter {
 public:
  TurnArbiter(TurnOptions options, const Clock* clock);

  // Registers a running request; the id is never reused.
  uint64_t Join(const std::string& tenant, int priority);
  // Unregisters it, giving the turn back if it holds it. Unknown ids are ignored.
  void Leave(uint64_t id);

  // Blocks until `id` holds the turn (OK) or is cancelled (CANCELLED; also for unknown ids). When
  // `id` already holds it, first gives it back to the best of the waiters and `id` (a yield).
  absl::Status Acquire(uint64_t id);
  // Gives the turn back (to the best waiter). No-op when `id` does not hold it.
  void Release(uint64_t id);
  // Ends `id`'s wait, now and for every later Acquire, with CANCELLED. Unknown ids are ignored.
  void Cancel(uint64_t id);

  int Waiting() const;  // participants blocked in Acquire
  // Participants joined and not yet left (cancelled ones included: their last chunk may still run).
  // A backend whose chunks could queue ahead of the GPU (the CUDA backend's streams) may do so while
  // its call is the only participant: no other call can want the turn before it ends.
  int Participants() const;
  bool Held() const;

 private:
  struct Participant {
    std::string tenant;
    int priority = 0;
    bool waiting = false;
    bool cancelled = false;
    absl::Time wait_start;
    uint64_t wait_seq = 0;   // arrival order of the current wait
    uint64_t last_turn = 0;  // grant sequence of its last turn (0: never)
  };

  // Hands the free turn to the best waiter, if any. REQUIRES: mu_ held, no holder.
  void GrantLocked();

  const TurnOptions options_;
  const Clock* const clock_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Participant> participants_;
  std::map<std::string, uint64_t> tenant_last_turn_;  // tenant → grant sequence of its last turn
  uint64_t holder_ = 0;                               // 0: the turn is free
  uint64_t next_id_ = 1, grants_ = 0, waits_ = 0;
};

}  // namespace kvpack::server
