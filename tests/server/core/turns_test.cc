#include "server/core/turns.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvpack::server {
namespace {

// Spins (no sleeps) until `n` participants block in Acquire.
void AwaitWaiting(const TurnArbiter& turns, int n) {
  while (turns.Waiting() != n) std::this_thread::yield();
}

struct Worker {
  std::string name, tenant;
  int priority = 0;
  int turns = 1;  // chunks it runs
};

// Runs `workers`, each on its own thread taking `turns` turns (an Acquire per chunk, a Release at the
// end, as the engine does), and returns who held the turn in which order. A "main" participant holds
// the turn while the workers line up (in the listed order); each holder moves on only once every
// other unfinished worker waits, so every hand-over chooses among all of them and the order is
// deterministic. `between` runs with all workers
// waiting, before main lets go (tests advance the clock there).
std::vector<std::string> RunWorkers(TurnArbiter& turns, const std::vector<Worker>& workers,
                                    const std::function<void()>& between = nullptr) {
  const uint64_t main_id = turns.Join("main", 0);
  EXPECT_TRUE(turns.Acquire(main_id).ok());
  std::mutex mu;
  std::vector<std::string> order;
  std::atomic<int> active{static_cast<int>(workers.size())};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < workers.size(); ++i) {
    const Worker w = workers[i];
    threads.emplace_back([&, w] {
      const uint64_t id = turns.Join(w.tenant, w.priority);
      for (int k = 0; k < w.turns; ++k) {
        ASSERT_TRUE(turns.Acquire(id).ok());
        {
          std::lock_guard<std::mutex> lock(mu);
          order.push_back(w.name);
        }
        const bool last = k + 1 == w.turns;
        if (last) --active;
        AwaitWaiting(turns, active.load() - (last ? 0 : 1));
      }
      turns.Release(id);
      turns.Leave(id);
    });
    AwaitWaiting(turns, static_cast<int>(i) + 1);  // arrival in the listed order
  }
  if (between) between();
  turns.Release(main_id);
  turns.Leave(main_id);
  for (std::thread& t : threads) t.join();
  return order;
}

class TurnsTest : public ::testing::Test {
 protected:
  ManualClock clock_;
  TurnArbiter turns_{TurnOptions{}, &clock_};
};

TEST_F(TurnsTest, FreeTurnIsTakenAtOnceAndPassedOnRelease) {
  const uint64_t a = turns_.Join("t", 0);
  ASSERT_TRUE(turns_.Acquire(a).ok());
  EXPECT_TRUE(turns_.Held());
  turns_.Release(a);
  EXPECT_FALSE(turns_.Held());
  ASSERT_TRUE(turns_.Acquire(a).ok());
  ASSERT_TRUE(turns_.Acquire(a).ok());  // a yield with no one waiting: the same request goes on
  turns_.Leave(a);
  EXPECT_FALSE(turns_.Held()) << "leaving gives the turn back";
}

TEST_F(TurnsTest, HigherPriorityGoesFirst) {
  const std::vector<std::string> order =
      RunWorkers(turns_, {{"low", "a", 0, 1}, {"high", "b", 5, 1}, {"mid", "c", 2, 1}});
  EXPECT_EQ(order, std::vector<std::string>({"high", "mid", "low"}));
}

TEST_F(TurnsTest, HighPriorityChunksPassALongLowPriorityLayer) {
  // A long low-priority layer (4 chunks) is running when a short high-priority one (2 chunks)
  // arrives: the short one's chunks go next, back to back, not after the whole long layer.
  const std::vector<std::string> order = RunWorkers(turns_, {{"long", "a", 0, 4}, {"short", "b", 1, 2}});
  EXPECT_EQ(order, std::vector<std::string>({"short", "short", "long", "long", "long", "long"}));
}

TEST_F(TurnsTest, EqualPriorityAlternatesTenantsThenRequests) {
  // Tenant a runs two requests, tenant b one; each request has two chunks. Round robin across
  // tenants first (b gets every other turn), then across a's requests.
  const std::vector<std::string> order =
      RunWorkers(turns_, {{"a1", "a", 0, 2}, {"a2", "a", 0, 2}, {"b1", "b", 0, 2}});
  EXPECT_EQ(order, std::vector<std::string>({"a1", "b1", "a2", "b1", "a1", "a2"}));
}

TEST_F(TurnsTest, TwoRequestsOfEqualRankInterleaveChunkByChunk) {
  const std::vector<std::string> order = RunWorkers(turns_, {{"x", "a", 0, 3}, {"y", "b", 0, 3}});
  EXPECT_EQ(order, std::vector<std::string>({"x", "y", "x", "y", "x", "y"}));
}

TEST_F(TurnsTest, WaitingAgesPastNewerHigherPriority) {
  // "old" (priority 0) has waited 3 aging steps when "new" (priority 2) arrives: 0 + 3 > 2.
  const uint64_t main_id = turns_.Join("main", 0);
  ASSERT_TRUE(turns_.Acquire(main_id).ok());
  std::vector<std::string> order;
  std::mutex mu;
  const auto worker = [&](const std::string& name, int priority) {
    return std::thread([&, name, priority] {
      const uint64_t id = turns_.Join(name, priority);
      ASSERT_TRUE(turns_.Acquire(id).ok());
      {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(name);
      }
      turns_.Leave(id);
    });
  };
  std::thread old_one = worker("old", 0);
  AwaitWaiting(turns_, 1);
  clock_.Advance(absl::Seconds(3));
  std::thread new_one = worker("new", 2);
  AwaitWaiting(turns_, 2);
  turns_.Leave(main_id);
  old_one.join();
  new_one.join();
  EXPECT_EQ(order, std::vector<std::string>({"old", "new"}));
}

TEST_F(TurnsTest, WithoutWaitingLongerPriorityWins) {
  // The same arrival as above with 1 s waited: 0 + 1 < 2, so priority decides.
  std::vector<std::string> order = RunWorkers(turns_, {{"old", "a", 0, 1}, {"new", "b", 2, 1}},
                                              [&] { clock_.Advance(absl::Seconds(1)); });
  EXPECT_EQ(order, std::vector<std::string>({"new", "old"}));
}

TEST_F(TurnsTest, CancelEndsAWaitAtOnce) {
  const uint64_t holder = turns_.Join("a", 0);
  ASSERT_TRUE(turns_.Acquire(holder).ok());
  const uint64_t waiter = turns_.Join("b", 9);
  absl::Status status;
  std::thread t([&] { status = turns_.Acquire(waiter); });
  AwaitWaiting(turns_, 1);
  turns_.Cancel(waiter);
  t.join();  // returns while `holder` still holds the turn
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(turns_.Waiting(), 0);
  EXPECT_EQ(turns_.Acquire(waiter).code(), absl::StatusCode::kCancelled) << "later waits end at once too";
  turns_.Release(holder);
  EXPECT_FALSE(turns_.Held()) << "a cancelled request is never handed the turn";
  turns_.Leave(waiter);
  turns_.Leave(holder);
  EXPECT_EQ(turns_.Acquire(waiter).code(), absl::StatusCode::kCancelled) << "unknown id";
}

TEST_F(TurnsTest, LeavingWhileHoldingHandsTheTurnOn) {
  const uint64_t holder = turns_.Join("a", 0);
  ASSERT_TRUE(turns_.Acquire(holder).ok());
  const uint64_t waiter = turns_.Join("b", 0);
  absl::Status status = absl::UnknownError("not run");
  std::thread t([&] { status = turns_.Acquire(waiter); });
  AwaitWaiting(turns_, 1);
  turns_.Leave(holder);  // e.g. a chunk failed and the call ended holding the turn
  t.join();
  EXPECT_TRUE(status.ok());
  EXPECT_TRUE(turns_.Held());
  turns_.Release(holder);  // a stale release is ignored
  EXPECT_TRUE(turns_.Held());
  turns_.Leave(waiter);
}

TEST_F(TurnsTest, ParticipantsCountsJoinedCallsUntilTheyLeave) {
  EXPECT_EQ(turns_.Participants(), 0);
  const uint64_t a = turns_.Join("a", 0);
  EXPECT_EQ(turns_.Participants(), 1);  // alone: its chunks may queue ahead
  const uint64_t b = turns_.Join("b", 0);
  ASSERT_TRUE(turns_.Acquire(a).ok());
  EXPECT_EQ(turns_.Participants(), 2);  // b does not wait for the turn yet, but it may soon
  turns_.Cancel(b);
  EXPECT_EQ(turns_.Participants(), 2) << "a cancelled call counts until it leaves (its last chunk may run)";
  turns_.Leave(b);
  turns_.Leave(b);  // twice: ignored
  EXPECT_EQ(turns_.Participants(), 1);
  turns_.Release(a);
  turns_.Leave(a);
  EXPECT_EQ(turns_.Participants(), 0);
}

}  // namespace
}  // namespace kvpack::server
