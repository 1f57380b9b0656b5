// Several concurrent clients of several tenants against a budget that fits two layers at a time:
// everything finishes, the pool never passes the budget, and it returns to zero.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

constexpr int kTenants = 3;
constexpr int kThreadsPerTenant = 2;
constexpr int kLayersPerThread = 3;

TEST(Concurrency, PoolStaysUnderBudgetAndReturnsToZero) {
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(21));
  const uint64_t weights = WeightsPoolBytes(L);
  const uint64_t peak = LayerPeakBytes(L);
  const uint64_t budget = kTenants * weights + peak * 5 / 2;  // two layers at a time
  DaemonProcess daemon({"--vram_budget=" + std::to_string(budget), "--threads=3"});
  ASSERT_TRUE(daemon.ok());

  std::atomic<bool> done{false};
  std::atomic<uint64_t> max_seen{0}, max_with_reserved{0};
  std::atomic<int> max_running{0};
  std::thread monitor([&] {
    auto c = daemon.Connect();
    while (!done) {
      absl::StatusOr<v1::StatusResponse> s = c->Status();
      if (s.ok()) {
        max_seen = std::max<uint64_t>(max_seen, s->pool_bytes());
        max_with_reserved = std::max<uint64_t>(max_with_reserved, s->pool_bytes() + s->reserved_bytes());
        max_running = std::max(max_running.load(), s->running());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });

  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  std::vector<std::string> handles;
  for (int t = 0; t < kTenants; ++t) {
    auto c = daemon.Connect("tenant" + std::to_string(t));
    absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
    ASSERT_TRUE(w.ok()) << w.status();
    handles.push_back(w->handle());
    for (int k = 0; k < kThreadsPerTenant; ++k) {
      threads.emplace_back([&, t, handle = w->handle()] {
        auto tc = daemon.Connect("tenant" + std::to_string(t));
        v1::LayerHeader h = L.header;
        h.set_weights_handle(handle);
        for (int i = 0; i < kLayersPerThread; ++i) {
          std::vector<uint16_t> out;
          absl::StatusOr<v1::LayerResult> r = tc->AttentionLayer(h, DataOf(L, &out));
          EXPECT_TRUE(r.ok()) << r.status();
          if (r.ok()) {
            EXPECT_EQ(r->peak_bytes(), peak);
            ++ok;
          }
        }
      });
    }
  }
  for (std::thread& t : threads) t.join();
  done = true;
  monitor.join();
  EXPECT_EQ(ok.load(), kTenants * kThreadsPerTenant * kLayersPerThread);

  for (int t = 0; t < kTenants; ++t) {
    EXPECT_TRUE(daemon.Connect("tenant" + std::to_string(t))->ReleaseWeights(handles[t]).ok());
  }
  auto c = daemon.Connect();
  const absl::StatusOr<v1::StatusResponse> s = c->Status();
  ASSERT_TRUE(s.ok());
  EXPECT_LE(max_seen.load(), budget);
  EXPECT_LE(max_with_reserved.load(), budget);
  EXPECT_LE(s->high_water_bytes(), budget);
  EXPECT_GE(s->high_water_bytes(), kTenants * weights + peak);
  EXPECT_EQ(s->pool_bytes(), 0u);
  EXPECT_EQ(s->reserved_bytes(), 0u);
  EXPECT_EQ(s->weights_handles(), 0);
  EXPECT_EQ(s->queue_depth(), 0);
  std::printf("budget %llu, layer peak %llu, max pool seen %llu, high-water %llu, max running %d\n",
              static_cast<unsigned long long>(budget), static_cast<unsigned long long>(peak),
              static_cast<unsigned long long>(max_seen.load()),
              static_cast<unsigned long long>(s->high_water_bytes()), max_running.load());
  EXPECT_GE(max_running.load(), 2);  // layers did run side by side
}

}  // namespace
}  // namespace kvpack::testing
