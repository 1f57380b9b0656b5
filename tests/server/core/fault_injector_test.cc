#include "server/core/fault_injector.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace kvpack::server {
namespace {

TEST(FaultInjector, FailsExactlyTheNthCallOnce) {
  FaultInjector f;
  EXPECT_FALSE(f.ShouldFail(FaultSite::kHostAlloc));  // call 1, unarmed
  f.FailNth(FaultSite::kHostAlloc, 3);               // calls 2, 3, 4 from here: the 4th overall fails
  EXPECT_FALSE(f.ShouldFail(FaultSite::kHostAlloc));
  EXPECT_FALSE(f.ShouldFail(FaultSite::kHostAlloc));
  EXPECT_TRUE(f.ShouldFail(FaultSite::kHostAlloc));
  EXPECT_FALSE(f.ShouldFail(FaultSite::kHostAlloc));  // once
  EXPECT_EQ(f.Calls(FaultSite::kHostAlloc), 5u);
  EXPECT_EQ(f.Injected(FaultSite::kHostAlloc), 1u);
  EXPECT_EQ(f.Calls(FaultSite::kShmMap), 0u);  // sites count apart
}

TEST(FaultInjector, ZeroDisarms) {
  FaultInjector f;
  f.FailNth(FaultSite::kDeviceCall, 1);
  f.FailNth(FaultSite::kDeviceCall, 0);
  EXPECT_FALSE(f.ShouldFail(FaultSite::kDeviceCall));
  EXPECT_EQ(f.Injected(FaultSite::kDeviceCall), 0u);
}

TEST(FaultInjector, OneFailureAmongThreads) {
  FaultInjector f;
  f.FailNth(FaultSite::kVmmMap, 777);
  constexpr int kThreads = 4, kCallsEach = 1000;
  std::vector<std::thread> threads;
  std::atomic<int> failed{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kCallsEach; ++i) failed += f.ShouldFail(FaultSite::kVmmMap);
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed.load(), 1);
  EXPECT_EQ(f.Calls(FaultSite::kVmmMap), static_cast<uint64_t>(kThreads * kCallsEach));
}

TEST(FaultInjector, ArenaFailsAsWhenMemoryIsMissing) {
  FaultInjector f;
  Pool pool(1 << 20, WithFaults(MakeHostArena(), &f, FaultSite::kHostAlloc));
  f.FailNth(FaultSite::kHostAlloc, 2);
  absl::StatusOr<Pool::Lease> a = pool.Allocate({1000, PoolState::kWeights, "t", {}});
  ASSERT_TRUE(a.ok());
  absl::StatusOr<Pool::Lease> b = pool.Allocate({1000, PoolState::kWeights, "t", {}});
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.Snapshot().allocated, PoolBytes(1000));  // the failed one is not counted
  absl::StatusOr<Pool::Lease> c = pool.Allocate({1000, PoolState::kWeights, "t", {}});
  EXPECT_TRUE(c.ok());
}

TEST(FaultInjector, FailEveryRepeatsFromNowAndStopsAtZero) {
  FaultInjector f;
  EXPECT_FALSE(f.ShouldFail(FaultSite::kShmMap));  // counted before the period starts
  f.FailEvery(FaultSite::kShmMap, 3);
  std::vector<bool> got;
  for (int i = 0; i < 7; ++i) got.push_back(f.ShouldFail(FaultSite::kShmMap));
  EXPECT_EQ(got, (std::vector<bool>{false, false, true, false, false, true, false}));
  EXPECT_EQ(f.Injected(FaultSite::kShmMap), 2u);
  EXPECT_FALSE(f.ShouldFail(FaultSite::kHostAlloc));  // other sites untouched
  f.FailEvery(FaultSite::kShmMap, 0);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(f.ShouldFail(FaultSite::kShmMap));
}

TEST(FaultInjector, ApplyFaultEveryParsesSitesAndRefusesTheRest) {
  FaultInjector f;
  ASSERT_TRUE(ApplyFaultEvery("host_alloc:2,shm_map:1", &f).ok());
  EXPECT_FALSE(f.ShouldFail(FaultSite::kHostAlloc));
  EXPECT_TRUE(f.ShouldFail(FaultSite::kHostAlloc));
  EXPECT_TRUE(f.ShouldFail(FaultSite::kShmMap));
  EXPECT_FALSE(f.ShouldFail(FaultSite::kVmmMap));
  for (const char* bad : {"", "host_alloc", "host_alloc:0", "host_alloc:x", "disk:3", "vmm_map:2,", ":4"}) {
    FaultInjector g;
    const absl::Status s = ApplyFaultEvery(bad, &g);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_FALSE(g.ShouldFail(FaultSite::kVmmMap)) << "nothing applied on " << bad;
  }
}

TEST(FaultInjector, SiteNames) {
  EXPECT_STREQ(FaultSiteName(FaultSite::kHostAlloc), "host_alloc");
  EXPECT_STREQ(FaultSiteName(FaultSite::kVmmMap), "vmm_map");
  EXPECT_STREQ(FaultSiteName(FaultSite::kShmMap), "shm_map");
  EXPECT_STREQ(FaultSiteName(FaultSite::kDeviceCall), "device_call");
}

}  // namespace
}  // namespace kvpack::server
