// Executor: FIFO on its threads; a posted task that has not started can be withdrawn, and is then
// destroyed (with what it owns) by the caller, never run.
#include "server/core/executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>

namespace kvpack::server {
namespace {

TEST(Executor, WithdrawsOnlyTasksThatHaveNotStarted) {
  Executor executor(1);
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<bool> first_started{false};
  const uint64_t first = executor.Post([&] {
    first_started = true;
    gate.wait();
  });
  auto owned = std::make_shared<int>(7);  // stands for a pool reservation the task owns
  std::weak_ptr<int> watch = owned;
  std::atomic<int> ran{0};
  const uint64_t second = executor.Post([owned = std::move(owned), &ran] { ran += *owned; });
  const uint64_t third = executor.Post([&ran] { ran += 100; });
  EXPECT_NE(first, 0u);
  EXPECT_NE(second, first);
  while (!first_started) std::this_thread::yield();
  EXPECT_EQ(executor.Pending(), 2);

  EXPECT_FALSE(executor.Withdraw(first));   // running
  EXPECT_TRUE(executor.Withdraw(second));   // waiting: removed and destroyed now
  EXPECT_TRUE(watch.expired());
  EXPECT_FALSE(executor.Withdraw(second));  // only once
  EXPECT_FALSE(executor.Withdraw(12345));   // unknown
  EXPECT_EQ(executor.Pending(), 1);
  release.set_value();
  while (executor.Pending() > 0 || executor.Running() > 0) std::this_thread::yield();
  EXPECT_EQ(ran, 100);  // the third ran, the withdrawn second did not
  EXPECT_FALSE(executor.Withdraw(third));  // done
}

}  // namespace
}  // namespace kvpack::server
