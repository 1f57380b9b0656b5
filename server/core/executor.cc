#include "server/core/executor.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <utility>

namespace kvpack::server {

Executor::Executor(int n_threads, int nice) {
  if (n_threads < 1) n_threads = 1;
  for (int i = 0; i < n_threads; ++i) threads_.emplace_back([this, nice] { Loop(nice); });
}

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

uint64_t Executor::Post(std::function<void()> task) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    tasks_.push_back(Task{id, std::move(task)});
  }
  cv_.notify_one();
  return id;
}

bool Executor::Withdraw(uint64_t id) {
  std::function<void()> dropped;  // destroyed after the lock is let go (it may own a pool reservation)
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = tasks_.begin(); it != tasks_.end(); ++it) {
    if (it->id != id) continue;
    dropped = std::move(it->run);
    tasks_.erase(it);
    return true;
  }
  return false;
}

int Executor::Running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

int Executor::Pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(tasks_.size());
}

void Executor::Loop(int nice) {
  // Raising one's own nice value needs no privilege; a failure leaves the default priority.
  if (nice > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice);
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and everything posted has run
      task = std::move(tasks_.front().run);
      tasks_.pop_front();
      ++running_;
    }
    task();
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
  }
}

}  // namespace kvpack::server
