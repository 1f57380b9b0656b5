// A client process that dies holding a region, weights and a kept K/V entry: its leases run out
// (--lease_seconds) and the daemon releases everything.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

TEST(DeadClient, ResourcesAreReleasedWhenLeasesExpire) {
  DaemonProcess daemon({"--vram_budget=64Mi", "--lease_seconds=1"});
  ASSERT_TRUE(daemon.ok());
  auto shm = client::SharedMemory::Create(1 << 16);
  ASSERT_TRUE(shm.ok());

  // The child is forked before this process makes any gRPC channel.
  const pid_t child = fork();
  if (child == 0) {
    auto c = daemon.Connect("ghost");
    const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(23));
    absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
    absl::StatusOr<std::string> region = c->RegisterShmRegion((*shm)->name(), (*shm)->size());
    if (!w.ok() || !region.ok()) _exit(1);
    v1::LayerHeader h = L.header;
    h.set_weights_handle(w->handle());
    h.set_keep_kv(true);
    std::vector<uint16_t> out;
    absl::StatusOr<v1::LayerResult> r = c->AttentionLayer(h, DataOf(L, &out));
    _exit(r.ok() && !r->kv_handle().empty() ? 0 : 1);  // dies without releasing anything
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  auto c = daemon.Connect("ghost");
  absl::StatusOr<v1::StatusResponse> s = c->Status();
  ASSERT_TRUE(s.ok());
  const auto held = [](const v1::StatusResponse& st) {
    return st.pool_bytes() > 0 || st.weights_handles() > 0 || st.kv_handles() > 0 || st.shm_regions() > 0;
  };
  EXPECT_TRUE(held(*s)) << "the dead client's resources should still be there within their lease";
  EXPECT_TRUE(WaitFor([&] {
    absl::StatusOr<v1::StatusResponse> now = c->Status();
    return now.ok() && !held(*now);
  }, std::chrono::milliseconds(5000)));
  const std::string m = daemon.Metrics();
  EXPECT_EQ(Sample(m, "kvpack_handles{kind=\"weights\"}"), 0.0);
  EXPECT_EQ(Sample(m, "kvpack_handles{kind=\"kv\"}"), 0.0);
  EXPECT_EQ(Sample(m, "kvpack_regions{kind=\"shm\"}"), 0.0);
  EXPECT_EQ(Sample(m, "kvpack_pool_bytes{state=\"kv_kept\"}"), 0.0);
}

TEST(DeadClient, KeepAliveHoldsResources) {
  DaemonProcess daemon({"--vram_budget=64Mi", "--lease_seconds=1"});
  ASSERT_TRUE(daemon.ok());
  auto c = daemon.Connect();
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(29));
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok());
  for (int i = 0; i < 8; ++i) {  // 2 s of renewals every 250 ms
    ASSERT_EQ(*c->KeepAlive({w->handle()}), 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  EXPECT_EQ(c->Status()->weights_handles(), 1);
  EXPECT_TRUE(c->ReleaseWeights(w->handle()).ok());
}

}  // namespace
}  // namespace kvpack::testing
