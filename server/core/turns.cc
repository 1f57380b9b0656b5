#include "server/core/turns.h"

#include <tuple>

namespace kvpack::server {

TurnArbiter::TurnArbiter(TurnOptions options, const Clock* clock) : options_(options), clock_(clock) {}

uint64_t TurnArbiter::Join(const std::string& tenant, int priority) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  Participant& p = participants_[id];
  p.tenant = tenant;
  p.priority = priority;
  return id;
}

void TurnArbiter::Leave(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = participants_.find(id);
  if (it == participants_.end()) return;
  const bool waiting = it->second.waiting;
  participants_.erase(it);
  if (waiting) cv_.notify_all();  // its Acquire sees the id gone and returns CANCELLED
  if (holder_ == id) {
    holder_ = 0;
    GrantLocked();
  }
}

absl::Status TurnArbiter::Acquire(uint64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = participants_.find(id);
  if (it == participants_.end() || it->second.cancelled) return absl::CancelledError("cancelled waiting for a GPU turn");
  Participant& p = it->second;
  p.waiting = true;
  p.wait_start = clock_->Now();
  p.wait_seq = ++waits_;
  if (holder_ == id) holder_ = 0;  // a yield: it competes for its next chunk with the waiters
  if (holder_ == 0) GrantLocked();
  cv_.wait(lock, [&] {
    auto at = participants_.find(id);
    return holder_ == id || at == participants_.end() || at->second.cancelled;
  });
  if (holder_ == id) return absl::OkStatus();
  auto at = participants_.find(id);
  if (at != participants_.end()) at->second.waiting = false;
  return absl::CancelledError("cancelled waiting for a GPU turn");
}

void TurnArbiter::Release(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (holder_ != id || id == 0) return;
  holder_ = 0;
  GrantLocked();
}

void TurnArbiter::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = participants_.find(id);
  if (it == participants_.end()) return;
  it->second.cancelled = true;
  if (it->second.waiting) cv_.notify_all();
}

int TurnArbiter::Waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& [id, p] : participants_) n += p.waiting && !p.cancelled ? 1 : 0;
  return n;
}

int TurnArbiter::Participants() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(participants_.size());
}

bool TurnArbiter::Held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return holder_ != 0;
}

void TurnArbiter::GrantLocked() {
  const absl::Time now = clock_->Now();
  const auto score = [&](const Participant& p) {
    const int64_t aged = options_.aging_step > absl::ZeroDuration()
                             ? (now - p.wait_start) / options_.aging_step
                             : 0;
    return static_cast<int64_t>(p.priority) + aged;
  };
  const auto tenant_last = [&](const Participant& p) {
    auto it = tenant_last_turn_.find(p.tenant);
    return it == tenant_last_turn_.end() ? uint64_t{0} : it->second;
  };
  uint64_t best = 0;
  // Smaller key goes first: higher score, then the tenant and the participant that held it longest ago.
  std::tuple<int64_t, uint64_t, uint64_t, uint64_t> best_key{};
  for (const auto& [id, p] : participants_) {
    if (!p.waiting || p.cancelled) continue;
    const auto key = std::make_tuple(-score(p), tenant_last(p), p.last_turn, p.wait_seq);
    if (best == 0 || key < best_key) {
      best = id;
      best_key = key;
    }
  }
  if (best == 0) return;
  Participant& p = participants_[best];
  p.waiting = false;
  p.last_turn = ++grants_;
  tenant_last_turn_[p.tenant] = p.last_turn;
  holder_ = best;
  cv_.notify_all();
}

}  // namespace kvpack::server
