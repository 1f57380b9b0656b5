#include "server/core/pool.h"

#include <gtest/gtest.h>

namespace kvpack::server {
namespace {

constexpr uint64_t kBudget = 1 << 20;

TEST(Pool, AccountsByStateFormatAndTenantAndFreesOnDestruction) {
  Pool pool(kBudget, MakeHostArena());
  {
    AllocationSpec kv{1000, PoolState::kKvActive, "a", {512, 0, 256}};
    absl::StatusOr<Pool::Lease> lease = pool.Allocate(kv);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->bytes(), 1024u);  // rounded to the granule
    absl::StatusOr<Pool::Lease> w = pool.Allocate({3001, PoolState::kWeights, "b", {}});
    ASSERT_TRUE(w.ok());
    const PoolSnapshot s = pool.Snapshot();
    EXPECT_EQ(s.allocated, 1024u + 3072u);
    EXPECT_EQ(s.by_state[static_cast<int>(PoolState::kKvActive)], 1024u);
    EXPECT_EQ(s.by_state[static_cast<int>(PoolState::kWeights)], 3072u);
    EXPECT_EQ(s.by_format[0], 512u);
    EXPECT_EQ(s.by_format[2], 256u);
    EXPECT_EQ(s.by_tenant.at("a"), 1024u);
    EXPECT_EQ(s.by_tenant.at("b"), 3072u);
    EXPECT_EQ(s.mapped, s.allocated);
    lease->SetState(PoolState::kKvKept);
    EXPECT_EQ(pool.Snapshot().by_state[static_cast<int>(PoolState::kKvKept)], 1024u);
    EXPECT_EQ(pool.Snapshot().by_state[static_cast<int>(PoolState::kKvActive)], 0u);
  }
  const PoolSnapshot s = pool.Snapshot();
  EXPECT_EQ(s.allocated, 0u);
  EXPECT_EQ(s.high_water, 4096u);
  EXPECT_TRUE(s.by_tenant.empty());
  EXPECT_EQ(s.by_format[0], 0u);
  EXPECT_EQ(s.mapped, 0u);
}

TEST(Pool, HardBudget) {
  Pool pool(kBudget, MakeHostArena());
  absl::StatusOr<Pool::Lease> a = pool.Allocate({kBudget - 512, PoolState::kWorkspace, "t", {}});
  ASSERT_TRUE(a.ok());
  absl::StatusOr<Pool::Lease> b = pool.Allocate({1024, PoolState::kWorkspace, "t", {}});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("512 of 1048576 free"), std::string::npos) << b.status();
}

TEST(Pool, ReservationsHoldBytesAndReturnTheRest) {
  Pool pool(kBudget, MakeHostArena());
  int released = 0;
  pool.SetReleaseListener([&] { ++released; });
  absl::StatusOr<Pool::Reservation> r = pool.Reserve(10000);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->remaining(), 10240u);
  EXPECT_EQ(pool.FreeBytes(), kBudget - 10240);
  EXPECT_FALSE(pool.Reserve(kBudget).ok());
  {
    absl::StatusOr<Pool::Lease> l = pool.Allocate({4096, PoolState::kKvActive, "t", {}}, &*r);
    ASSERT_TRUE(l.ok());
    EXPECT_EQ(r->remaining(), 10240u - 4096u);
    EXPECT_EQ(pool.Snapshot().reserved, 10240u - 4096u);
    EXPECT_EQ(pool.FreeBytes(), kBudget - 10240);
    EXPECT_FALSE(pool.Allocate({8192, PoolState::kWorkspace, "t", {}}, &*r).ok());  // over its reservation
  }
  EXPECT_EQ(released, 1);
  EXPECT_EQ(pool.FreeBytes(), kBudget - (10240 - 4096));
  r->Release();
  EXPECT_EQ(released, 2);
  EXPECT_EQ(pool.FreeBytes(), kBudget);
  EXPECT_EQ(pool.Snapshot().high_water, 4096u);
}

TEST(Pool, MovedLeaseFreesOnce) {
  Pool pool(kBudget, MakeHostArena());
  Pool::Lease outer;
  {
    absl::StatusOr<Pool::Lease> l = pool.Allocate({300, PoolState::kWeights, "t", {}});
    ASSERT_TRUE(l.ok());
    l->data()[0] = 7;
    outer = std::move(*l);
  }
  EXPECT_EQ(pool.Snapshot().allocated, 512u);
  EXPECT_EQ(outer.data()[0], 7);
  EXPECT_EQ(outer.data()[511], 0);  // zero-filled
  outer.Release();
  EXPECT_EQ(pool.Snapshot().allocated, 0u);
}

}  // namespace
}  // namespace kvpack::server
