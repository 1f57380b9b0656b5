#include "kernels/cpu/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <vector>

namespace kvpack::cpu {
namespace {

TEST(ThreadPool, RunsEveryItemOnceForAnyThreadCount) {
  for (int threads : {0, 1, 2, 3, 8, 64}) {
    for (int64_t n : {0, 1, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      ParallelFor(threads, n, [&](int64_t i) { hits[i]++; });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "threads " << threads << " n " << n;
    }
  }
}

TEST(ThreadPool, NestedCallsRunOnTheirCaller) {
  std::atomic<int64_t> sum{0};
  ParallelFor(3, 5, [&](int64_t i) { ParallelFor(4, 10, [&](int64_t j) { sum += i * 10 + j; }); });
  EXPECT_EQ(sum.load(), 1225);  // Σ over i < 5, j < 10 of 10i + j
}

TEST(ThreadPool, ResolvesZeroToTheHardware) {
  EXPECT_GE(ResolveThreadCount(0), 1);
  EXPECT_EQ(ResolveThreadCount(5), 5);
}

}  // namespace
}  // namespace kvpack::cpu
