// Registry: tenant scoping, leases on a manual clock (no sleeps), in-use entries survive, and
// unregistering a region waits for its users.
#include "server/runtime/registry.h"

#include <gtest/gtest.h>

namespace kvpack::server {
namespace {

std::shared_ptr<WeightsEntry> Weights(const std::string& tenant) {
  auto w = std::make_shared<WeightsEntry>();
  w->id = Registry::NewId("w-");
  w->tenant = tenant;
  return w;
}

std::shared_ptr<Region> FakeRegion(const std::string& tenant, int* unmapped) {
  static uint8_t bytes[64];
  return std::make_shared<Region>(Registry::NewId("r-"), tenant, RegionKind::kShm, "/fake", bytes, sizeof(bytes),
                                  [unmapped](uint8_t*, uint64_t) { ++*unmapped; });
}

TEST(Registry, IdsAreRandomAndTenantScoped) {
  ManualClock clock;
  Registry r(&clock, absl::Seconds(10));
  const std::string a = Registry::NewId("w-"), b = Registry::NewId("w-");
  EXPECT_EQ(a.size(), 34u);
  EXPECT_NE(a, b);
  auto w = Weights("alice");
  ASSERT_TRUE(r.AddWeights(w).ok());
  EXPECT_TRUE(r.GetWeights("alice", w->id, "h").ok());
  EXPECT_EQ(r.GetWeights("bob", w->id, "h").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.ReleaseWeights("bob", w->id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r.GetWeights("alice", "", "h").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.TenantCounts("alice").weights, 1);
  EXPECT_EQ(r.TenantCounts("bob").weights, 0);
}

TEST(Registry, LeasesExpireUnlessUsedOrRenewed) {
  ManualClock clock;
  Registry r(&clock, absl::Seconds(10));
  auto used = Weights("t"), renewed = Weights("t"), idle = Weights("t");
  const std::string used_id = used->id, renewed_id = renewed->id;
  ASSERT_TRUE(r.AddWeights(std::move(used)).ok());
  ASSERT_TRUE(r.AddWeights(std::move(renewed)).ok());
  ASSERT_TRUE(r.AddWeights(std::move(idle)).ok());
  clock.Advance(absl::Seconds(6));
  ASSERT_TRUE(r.GetWeights("t", used_id, "h").ok());  // use renews
  EXPECT_EQ(r.KeepAlive("t", {renewed_id, "w-unknown"}), 1);
  EXPECT_EQ(r.KeepAlive("other", {renewed_id}), 0);
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(r.Reap(), 1);  // only the idle one
  EXPECT_EQ(r.Counts().weights, 2);
  clock.Advance(absl::Seconds(10));
  EXPECT_EQ(r.Reap(), 2);
  EXPECT_EQ(r.Counts().weights, 0);
}

TEST(Registry, EntriesInUseAreNotReaped) {
  ManualClock clock;
  Registry r(&clock, absl::Seconds(1));
  auto w = Weights("t");
  ASSERT_TRUE(r.AddWeights(w).ok());  // `w` stands for a request holding it
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(r.Reap(), 0);
  w.reset();
  EXPECT_EQ(r.Reap(), 1);

  int unmapped = 0;
  auto region = FakeRegion("t", &unmapped);
  const std::string id = region->id();
  ASSERT_TRUE(r.AddRegion(std::move(region)).ok());
  {
    absl::StatusOr<RegionUse> use = r.UseRegion("t", id, "x");
    ASSERT_TRUE(use.ok());
    clock.Advance(absl::Seconds(5));
    EXPECT_EQ(r.Reap(), 0);
  }
  clock.Advance(absl::Seconds(5));
  EXPECT_EQ(r.Reap(), 1);
  EXPECT_EQ(unmapped, 1);
}

TEST(Registry, UnregisterWaitsForUsersAndSlicesAreBoundsChecked) {
  ManualClock clock;
  int unmapped = 0;
  Registry r(&clock, absl::Seconds(10));
  auto region = FakeRegion("t", &unmapped);
  const std::string id = region->id();
  ASSERT_TRUE(r.AddRegion(std::move(region)).ok());
  absl::StatusOr<RegionUse> use = r.UseRegion("t", id, "header.x.region");
  ASSERT_TRUE(use.ok());
  EXPECT_TRUE(use->get()->Slice(60, 4, "f").ok());
  absl::StatusOr<uint8_t*> bad = use->get()->Slice(61, 4, "header.x.region");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("header.x.region"), std::string::npos);
  EXPECT_FALSE(use->get()->Slice(~0ull - 2, 8, "f").ok());  // no overflow

  bool done = false;
  ASSERT_TRUE(r.UnregisterRegion("t", id, [&] { done = true; }).ok());
  EXPECT_FALSE(done);
  EXPECT_EQ(r.UseRegion("t", id, "x").status().code(), absl::StatusCode::kNotFound);  // gone for new users
  EXPECT_EQ(unmapped, 0);
  *use = RegionUse();  // the last user lets go
  EXPECT_TRUE(done);
  EXPECT_EQ(unmapped, 1);
}

TEST(Registry, RegionsAreBoundedPerTenantAndPerDaemon) {
  int unmapped = 0;  // outlives the registry, whose regions count into it when they go
  ManualClock clock;
  Registry r(&clock, absl::Seconds(10), RegistryLimits{/*max_regions=*/3, /*max_regions_per_tenant=*/2});
  ASSERT_TRUE(r.AddRegion(FakeRegion("a", &unmapped)).ok());
  auto second = FakeRegion("a", &unmapped);
  const std::string second_id = second->id();
  ASSERT_TRUE(r.AddRegion(second).ok());
  second.reset();
  absl::Status s = r.AddRegion(FakeRegion("a", &unmapped));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--max_regions_per_tenant"), std::string::npos) << s;
  EXPECT_EQ(unmapped, 1);  // the refused region is unmapped at once
  ASSERT_TRUE(r.AddRegion(FakeRegion("b", &unmapped)).ok());
  s = r.AddRegion(FakeRegion("c", &unmapped));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--max_regions"), std::string::npos) << s;
  // Unregistering gives the slot back.
  ASSERT_TRUE(r.UnregisterRegion("a", second_id, [] {}).ok());
  EXPECT_TRUE(r.AddRegion(FakeRegion("a", &unmapped)).ok());
  EXPECT_EQ(r.TenantCounts("a").shm, 2);
}

TEST(Registry, HandlesAreBoundedPerTenantAndPerDaemon) {
  ManualClock clock;
  RegistryLimits limits;
  limits.max_handles = 3;
  limits.max_handles_per_tenant = 2;
  Registry r(&clock, absl::Seconds(10), limits);
  auto w = Weights("a");
  ASSERT_TRUE(r.AddWeights(w).ok());
  auto kv = std::make_shared<KvEntry>();
  kv->id = Registry::NewId("kv-");
  kv->tenant = "a";
  ASSERT_TRUE(r.AddKv(kv).ok());
  EXPECT_EQ(r.CheckHandleRoom("a").code(), absl::StatusCode::kResourceExhausted);
  absl::Status s = r.AddWeights(Weights("a"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("--max_handles_per_tenant"), std::string::npos) << s;
  ASSERT_TRUE(r.AddWeights(Weights("b")).ok());
  s = r.AddWeights(Weights("c"));
  EXPECT_NE(s.message().find("--max_handles"), std::string::npos) << s;
  // Releasing and reaping give the room back.
  ASSERT_TRUE(r.ReleaseKv("a", kv->id).ok());
  EXPECT_TRUE(r.CheckHandleRoom("a").ok());
  ASSERT_TRUE(r.AddWeights(Weights("a")).ok());
  EXPECT_FALSE(r.CheckHandleRoom("a").ok());
  w.reset();
  clock.Advance(absl::Seconds(20));
  EXPECT_EQ(r.Reap(), 3);
  EXPECT_TRUE(r.CheckHandleRoom("a").ok());
  EXPECT_TRUE(r.CheckHandleRoom("c").ok());
}

TEST(Registry, ErrorsEchoAtMostABoundedPrefixOfClientStrings) {
  ManualClock clock;
  Registry r(&clock, absl::Seconds(10));
  const std::string huge(1 << 20, 'w');
  absl::Status s = r.GetWeights("t", huge, "header.weights_handle").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_LT(s.message().size(), 200u) << s.message().size();
  EXPECT_NE(s.message().find("\u2026"), std::string::npos);
  s = r.UseRegion("t", huge, "header.x.region").status();
  EXPECT_LT(s.message().size(), 200u);
  s = MapShmRegion("t", "/" + huge, 64).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(s.message().size(), 200u);
}

}  // namespace
}  // namespace kvpack::server
