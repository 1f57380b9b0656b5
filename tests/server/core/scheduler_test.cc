#include "server/core/scheduler.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

namespace kvpack::server {
namespace {

constexpr uint64_t kKiB = 1024;

// Records what happened to each job; admitted jobs keep their reservation until Finish().
struct Recorder {
  std::vector<std::string> admitted;
  std::vector<std::pair<std::string, absl::StatusCode>> rejected;
  std::map<std::string, Pool::Reservation> held;

  Job Make(const std::string& name, uint64_t bytes, int priority = 0, const std::string& tenant = "t",
           absl::Time deadline = absl::InfiniteFuture()) {
    Job job;
    job.tenant = tenant;
    job.priority = priority;
    job.peak_bytes = bytes;
    job.deadline = deadline;
    job.on_admit = [this, name](Pool::Reservation r) {
      admitted.push_back(name);
      held[name] = std::move(r);
    };
    job.on_reject = [this, name](absl::Status s) { rejected.emplace_back(name, s.code()); };
    return job;
  }
  // The reservation is destroyed after the map is updated: its release pumps the scheduler, which
  // may admit (and insert) another job.
  void Finish(const std::string& name) {
    Pool::Reservation r = std::move(held[name]);
    held.erase(name);
  }
};

class SchedulerTest : public ::testing::Test {
 protected:
  SchedulerTest() : pool_(64 * kKiB, MakeHostArena()) {}
  void Start(SchedulerOptions options = {}) {
    scheduler_ = std::make_unique<Scheduler>(options, &pool_, &clock_);
    pool_.SetReleaseListener([this] { scheduler_->Pump(); });
  }
  ~SchedulerTest() override {
    pool_.SetReleaseListener(nullptr);
    rec_.held.clear();
  }
  ManualClock clock_;
  Pool pool_;
  Recorder rec_;
  std::unique_ptr<Scheduler> scheduler_;
};

TEST_F(SchedulerTest, WaitsForFreeBytesThenAdmits) {
  Start();
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("a", 40 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("b", 40 * kKiB)).ok());
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"a"}));
  EXPECT_EQ(scheduler_->QueueDepth(), 1u);
  rec_.Finish("a");  // its reservation returns; the pool's listener pumps
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"a", "b"}));
  EXPECT_EQ(scheduler_->QueueDepth(), 0u);
}

TEST_F(SchedulerTest, NeverFitsAndFullQueueAreClearErrors) {
  SchedulerOptions options;
  options.max_queue = 2;
  Start(options);
  absl::StatusOr<uint64_t> too_big = scheduler_->Submit(rec_.Make("huge", 65 * kKiB));
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("a", 64 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("b", 64 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("c", 64 * kKiB)).ok());
  absl::StatusOr<uint64_t> full = scheduler_->Submit(rec_.Make("d", 64 * kKiB));
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(full.status().message().find("queue is full"), std::string::npos);
}

TEST_F(SchedulerTest, PriorityThenTenantRoundRobin) {
  Start();
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("blocker", 64 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("a1", 64 * kKiB, 0, "a")).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("a2", 64 * kKiB, 0, "a")).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("b1", 64 * kKiB, 0, "b")).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("urgent", 64 * kKiB, 5, "a")).ok());
  for (const char* name : {"blocker", "urgent", "b1", "a1"}) rec_.Finish(name);
  // "urgent" (tenant a) was served last, so tenant b goes before a's older jobs.
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"blocker", "urgent", "b1", "a1", "a2"}));
}

TEST_F(SchedulerTest, SmallJobsBackfillUntilTheLargeOneHasWaitedTooLong) {
  SchedulerOptions options;
  options.aging_step = absl::InfiniteDuration();  // isolate the bypass rule
  options.max_bypass = absl::Seconds(2);
  Start(options);
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("running", 32 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("large", 48 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("small1", 16 * kKiB)).ok());
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"running", "small1"}));  // backfilled
  rec_.Finish("small1");
  clock_.Advance(absl::Seconds(3));  // "large" now starves
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("small2", 16 * kKiB)).ok());
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"running", "small1"}));  // held back for "large"
  rec_.Finish("running");
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"running", "small1", "large", "small2"}));
}

TEST_F(SchedulerTest, AgingLiftsOldJobsAboveNewerHigherPriorityOnes) {
  SchedulerOptions options;
  options.aging_step = absl::Seconds(1);
  options.max_bypass = absl::InfiniteDuration();
  Start(options);
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("blocker", 64 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("old", 64 * kKiB, 0)).ok());
  clock_.Advance(absl::Seconds(10));
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("new", 64 * kKiB, 3)).ok());
  rec_.Finish("blocker");
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"blocker", "old"}));
}

TEST_F(SchedulerTest, DeadlinesAndCancellation) {
  Start();
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("blocker", 64 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("late", 8 * kKiB, 0, "t", clock_.Now() + absl::Seconds(1))).ok());
  absl::StatusOr<uint64_t> gone = scheduler_->Submit(rec_.Make("gone", 8 * kKiB));
  ASSERT_TRUE(gone.ok());
  EXPECT_TRUE(scheduler_->Cancel(*gone));
  EXPECT_FALSE(scheduler_->Cancel(*gone));
  clock_.Advance(absl::Seconds(2));
  scheduler_->Pump();
  ASSERT_EQ(rec_.rejected.size(), 2u);
  EXPECT_EQ(rec_.rejected[0], std::make_pair(std::string("gone"), absl::StatusCode::kCancelled));
  EXPECT_EQ(rec_.rejected[1], std::make_pair(std::string("late"), absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(scheduler_->QueueDepth(), 0u);
  EXPECT_EQ(pool_.Snapshot().reserved, 64 * kKiB);  // only the blocker holds memory
}

TEST_F(SchedulerTest, ClaimsGateAdmissionWithoutBlockingOthers) {
  SchedulerOptions options;
  options.max_bypass = absl::ZeroDuration();  // a job that does not fit would hold the line at once
  Start(options);
  int quota_left = 1;  // tenant "q" may run one job at a time
  auto gated = [&](const std::string& name) {
    Job job = rec_.Make(name, 8 * kKiB, 0, "q");
    job.try_claim = [&] { return quota_left > 0 ? (--quota_left, true) : false; };
    job.unclaim = [&] { ++quota_left; };
    return job;
  };
  ASSERT_TRUE(scheduler_->Submit(gated("q1")).ok());
  ASSERT_TRUE(scheduler_->Submit(gated("q2")).ok());               // over quota: skipped, not blocking
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("other", 8 * kKiB)).ok());
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"q1", "other"}));
  ++quota_left;  // q1 finished and gave back its share
  rec_.Finish("q1");
  EXPECT_EQ(rec_.admitted, std::vector<std::string>({"q1", "other", "q2"}));
  // A claim is undone when the memory is not there.
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("big", 40 * kKiB)).ok());
  quota_left = 1;
  Job huge = gated("q3");
  huge.peak_bytes = 60 * kKiB;
  ASSERT_TRUE(scheduler_->Submit(std::move(huge)).ok());
  EXPECT_EQ(quota_left, 1);
}

TEST_F(SchedulerTest, RejectAllOnShutdown) {
  Start();
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("blocker", 64 * kKiB)).ok());
  ASSERT_TRUE(scheduler_->Submit(rec_.Make("w", 8 * kKiB, 0, "x")).ok());
  EXPECT_EQ(scheduler_->QueuedByTenant().at("x"), 1);
  scheduler_->RejectAll(absl::UnavailableError("shutting down"));
  ASSERT_EQ(rec_.rejected.size(), 1u);
  EXPECT_EQ(rec_.rejected[0].second, absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvpack::server
