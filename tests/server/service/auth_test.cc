// Bearer tokens, tenants bound to tokens, tenant isolation of handles, quotas, TLS, and the refusal
// to listen beyond loopback without tokens.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

constexpr char kAliceToken[] = "alice-token-0123456789abcdef";
constexpr char kAnyToken[] = "service-token-0123456789abcdef";

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "kvpack_auth_" + std::to_string(getpid()) + "_" + name;
}

std::string WriteTokenFile() {
  const std::string path = TempPath("tokens");
  std::ofstream out(path);
  out << "# kvpackd tokens\n" << kAliceToken << " alice\n" << kAnyToken << "   # any tenant\n";
  return path;
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.ok()); }
  DaemonProcess daemon_{{"--vram_budget=64Mi", "--auth_token_file=" + WriteTokenFile(), "--tenant_quota=1Mi"}};
};

TEST_F(AuthTest, TokensAndTenants) {
  EXPECT_EQ(daemon_.Connect()->Status().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(daemon_.Connect("", "wrong-token-0123456789")->Status().status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(daemon_.Connect("bob", kAliceToken)->Status().status().code(), absl::StatusCode::kPermissionDenied);
  // The token is checked first: a caller without a valid one learns nothing about its other headers.
  EXPECT_EQ(daemon_.Connect("bad tenant!")->Status().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(daemon_.Connect("bad tenant!", "wrong-token-0123456789")->Status().status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(daemon_.Connect("bad tenant!", kAnyToken)->Status().status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<v1::StatusResponse> s = daemon_.Connect("", kAliceToken)->Status();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tenant().tenant(), "alice");
  EXPECT_EQ(s->tenant().quota_bytes(), 1u << 20);
  s = daemon_.Connect("bob", kAnyToken)->Status();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tenant().tenant(), "bob");

  // Health needs no token (probes).
  EXPECT_TRUE(*daemon_.Connect()->Health());
}

TEST_F(AuthTest, HandlesAreTenantScoped) {
  auto alice = daemon_.Connect("", kAliceToken);
  auto bob = daemon_.Connect("bob", kAnyToken);
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(17));
  absl::StatusOr<v1::WeightsResponse> w = alice->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->handle().size(), 2u + 32u);  // "w-" + 128 random bits in hex

  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  std::vector<uint16_t> out;
  EXPECT_EQ(bob->AttentionLayer(h, DataOf(L, &out)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(bob->ReleaseWeights(w->handle()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*bob->KeepAlive({w->handle()}), 0);
  EXPECT_EQ(bob->Status()->tenant().pool_bytes(), 0u);
  EXPECT_EQ(alice->Status()->tenant().pool_bytes(), w->pool_bytes());
  EXPECT_EQ(alice->Status()->tenant().weights_handles(), 1);
  absl::StatusOr<v1::LayerResult> r = alice->AttentionLayer(h, DataOf(L, &out));
  EXPECT_TRUE(r.ok()) << r.status();

  // Regions too.
  auto shm = client::SharedMemory::Create(4096);
  ASSERT_TRUE(shm.ok());
  absl::StatusOr<std::string> region = alice->RegisterShmRegion((*shm)->name(), 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(bob->UnregisterRegion(*region).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(bob->RegionStatus()->regions_size(), 0);
  EXPECT_TRUE(alice->UnregisterRegion(*region).ok());
  EXPECT_TRUE(alice->ReleaseWeights(w->handle()).ok());
}

TEST_F(AuthTest, QuotaBoundsATenantsPoolBytes) {
  auto alice = daemon_.Connect("", kAliceToken);
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(19));  // ~100 KB of weights
  std::vector<std::string> handles;
  absl::Status last;
  for (int i = 0; i < 20 && last.ok(); ++i) {
    absl::StatusOr<v1::WeightsResponse> w = alice->RegisterWeights(WeightsOf(L));
    if (w.ok()) handles.push_back(w->handle());
    last = w.status();
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_NE(last.message().find("quota"), std::string::npos) << last;
  EXPECT_LE(alice->Status()->tenant().pool_bytes(), 1u << 20);
  // Another tenant is not affected.
  EXPECT_TRUE(daemon_.Connect("carol", kAnyToken)->RegisterWeights(WeightsOf(L)).ok());
  for (const std::string& h : handles) EXPECT_TRUE(alice->ReleaseWeights(h).ok());
}

TEST(AuthStartup, RefusesNonLoopbackWithoutTokens) {
  DaemonProcess d({"--listen=0.0.0.0:0"});
  EXPECT_FALSE(d.ok());
  EXPECT_EQ(d.Stop(), 2);
}

TEST(AuthStartup, Tls) {
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) GTEST_SKIP() << "openssl not installed";
  const std::string key = TempPath("key.pem"), cert = TempPath("cert.pem");
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost -addext "
                          "subjectAltName=DNS:localhost -days 1 -keyout " + key + " -out " + cert + " 2>/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  DaemonProcess d({"--tls_cert_file=" + cert, "--tls_key_file=" + key});
  ASSERT_TRUE(d.ok());
  client::ClientOptions o;
  o.address = "localhost:" + std::to_string(d.port());
  o.tls_ca_file = cert;
  auto c = client::Client::Connect(o);
  ASSERT_TRUE(c.ok());
  absl::StatusOr<v1::StatusResponse> s = (*c)->Status();
  EXPECT_TRUE(s.ok()) << s.status();
  // Plaintext against the TLS port fails.
  EXPECT_FALSE(d.Connect("", "", absl::Seconds(2))->Status().ok());
}

}  // namespace
}  // namespace kvpack::testing
