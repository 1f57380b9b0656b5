#include "server/core/scheduler.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvpack::server {

Scheduler::Scheduler(SchedulerOptions options, Pool* pool, const Clock* clock)
    : options_(options), pool_(pool), clock_(clock) {}

absl::StatusOr<uint64_t> Scheduler::Submit(Job job) {
  if (job.peak_bytes > pool_->budget()) {
    return absl::ResourceExhaustedError(absl::StrCat("the request needs ", job.peak_bytes,
                                                     " bytes at its peak; the budget is ", pool_->budget()));
  }
  std::vector<Callback> callbacks;
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (waiting_.size() >= options_.max_queue) {
      return absl::UnavailableError(absl::StrCat("the queue is full (", options_.max_queue,
                                                 " requests wait); retry later"));
    }
    id = next_id_++;
    waiting_.push_back(Waiting{id, clock_->Now(), std::move(job)});
    PumpLocked(&callbacks);
  }
  for (Callback& c : callbacks) c();
  return id;
}

bool Scheduler::Cancel(uint64_t id) {
  std::function<void(absl::Status)> reject;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(waiting_.begin(), waiting_.end(), [id](const Waiting& w) { return w.id == id; });
    if (it == waiting_.end()) return false;
    reject = std::move(it->job.on_reject);
    waiting_.erase(it);
  }
  reject(absl::CancelledError("cancelled while waiting for memory"));
  return true;
}

void Scheduler::Pump() {
  std::vector<Callback> callbacks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    PumpLocked(&callbacks);
  }
  for (Callback& c : callbacks) c();
}

void Scheduler::RejectAll(const absl::Status& status) {
  std::vector<Waiting> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(waiting_);
  }
  for (Waiting& w : dropped) w.job.on_reject(status);
}

void Scheduler::PumpLocked(std::vector<Callback>* callbacks) {
  const absl::Time now = clock_->Now();
  // Deadlines first.
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (it->job.deadline <= now) {
      auto reject = std::make_shared<std::function<void(absl::Status)>>(std::move(it->job.on_reject));
      callbacks->push_back([reject] { (*reject)(absl::DeadlineExceededError("deadline passed while waiting for memory")); });
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  if (waiting_.empty()) return;

  // Rank: score desc, rank within tenant asc, arrival asc.
  struct Ranked {
    size_t index;
    int64_t score;
    int tenant_rank;
    uint64_t tenant_last_admit;
    uint64_t id;
  };
  std::vector<Ranked> ranked;
  ranked.reserve(waiting_.size());
  std::map<std::string, int> seen;
  for (size_t i = 0; i < waiting_.size(); ++i) {
    const Waiting& w = waiting_[i];
    const int64_t aged = options_.aging_step > absl::ZeroDuration()
                             ? static_cast<int64_t>(absl::FDivDuration(now - w.submitted, options_.aging_step))
                             : 0;
    auto last = last_admit_.find(w.job.tenant);
    ranked.push_back(Ranked{i, w.job.priority + aged, seen[w.job.tenant]++,
                            last == last_admit_.end() ? 0 : last->second, w.id});
  }
  std::sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.tenant_rank != b.tenant_rank) return a.tenant_rank < b.tenant_rank;
    if (a.tenant_last_admit != b.tenant_last_admit) return a.tenant_last_admit < b.tenant_last_admit;
    return a.id < b.id;
  });

  std::vector<size_t> admitted;
  for (const Ranked& r : ranked) {
    Waiting& w = waiting_[r.index];
    if (w.job.try_claim && !w.job.try_claim()) continue;  // over its tenant's quota for now
    absl::StatusOr<Pool::Reservation> reservation = pool_->Reserve(w.job.peak_bytes);
    if (reservation.ok()) {
      auto shared = std::make_shared<Pool::Reservation>(std::move(*reservation));
      auto admit = std::make_shared<std::function<void(Pool::Reservation)>>(std::move(w.job.on_admit));
      callbacks->push_back([admit, shared] { (*admit)(std::move(*shared)); });
      admitted.push_back(r.index);
      last_admit_[w.job.tenant] = ++admissions_;
      continue;
    }
    if (w.job.unclaim) w.job.unclaim();
    if (now - w.submitted >= options_.max_bypass) break;  // it starves: hold the line for it
  }
  std::sort(admitted.rbegin(), admitted.rend());
  for (size_t i : admitted) waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
}

size_t Scheduler::QueueDepth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_.size();
}

std::map<std::string, int> Scheduler::QueuedByTenant() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, int> out;
  for (const Waiting& w : waiting_) ++out[w.job.tenant];
  return out;
}

}  // namespace kvpack::server
