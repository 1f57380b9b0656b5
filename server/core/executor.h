// The daemon's own worker threads: layer work (CPU math or GPU launches) runs here, never on gRPC
// threads. FIFO; the scheduler decides what is posted and when.
//
// Thread safety: Post may be called from any thread. The destructor finishes every posted task.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvpack::server {

class Executor {
 public:
  explicit Executor(int n_threads);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void Post(std::function<void()> task);
  int Running() const;  // tasks being run now
  int Pending() const;  // tasks posted and not started

 private:
  void Loop();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int running_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kvpack::server
