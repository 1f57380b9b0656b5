// The daemon's own worker threads: layer work (CPU math or GPU launches) runs here, never on gRPC
// threads. FIFO; the scheduler decides what is posted and when. A posted task that has not started
// can be withdrawn (a cancelled request gives its place and memory back at once).
//
// Thread safety: Post may be called from any thread. The destructor finishes every posted task.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvpack::server {

class Executor {
 public:
  // `nice` > 0 lowers the threads' CPU priority (Linux: per-thread nice; the threads a task starts
  // inherit it), so the daemon's RPC threads — Status, Plan, uploads — are not starved by CPU
  // layer work on a small host.
  explicit Executor(int n_threads, int nice = 0);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Returns the task's id (never 0).
  uint64_t Post(std::function<void()> task);
  // Removes task `id` if it has not started, destroying it on the calling thread (outside the
  // executor's lock); false when it started, ran or is unknown.
  bool Withdraw(uint64_t id);
  int Running() const;  // tasks being run now
  int Pending() const;  // tasks posted and not started

 private:
  void Loop(int nice);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Task {
    uint64_t id;
    std::function<void()> run;
  };
  std::deque<Task> tasks_;
  uint64_t next_id_ = 1;
  int running_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvpack::server
