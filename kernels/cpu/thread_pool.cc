#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <vector>

namespace kvpack::cpu {
namespace {

thread_local bool in_parallel_region = false;

void Drain(std::atomic<int64_t>* next, int64_t n_items, const std::function<void(int64_t)>& fn) {
  const bool was_inside = in_parallel_region;
  in_parallel_region = true;
  for (int64_t item = next->fetch_add(1); item < n_items; item = next->fetch_add(1)) fn(item);
  in_parallel_region = was_inside;
}

}  // namespace

int ResolveThreadCount(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

void ParallelFor(int n_threads, int64_t n_items, const std::function<void(int64_t item)>& fn) {
  if (n_items <= 0) return;
  const int64_t want = std::min<int64_t>(ResolveThreadCount(n_threads), n_items);
  std::atomic<int64_t> next{0};
  if (want <= 1 || in_parallel_region) {
    Drain(&next, n_items, fn);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(want - 1));
  for (int64_t i = 0; i + 1 < want; ++i) {
    try {
      workers.emplace_back(Drain, &next, n_items, std::cref(fn));
    } catch (const std::system_error&) {
      break;  // run with the threads we have
    }
  }
  Drain(&next, n_items, fn);
  for (std::thread& t : workers) t.join();
}

}  // namespace kvpack::cpu
