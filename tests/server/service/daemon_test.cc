// Every RPC of kvpack.v1 against the real kvpackd (CPU backend) on loopback.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>
#include <thread>

#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.ok()) << daemon_.why(); }
  DaemonProcess daemon_{{"--vram_budget=256Mi"}};
};

TEST_F(DaemonTest, HealthStatusAndPlan) {
  auto c = daemon_.Connect();
  absl::StatusOr<bool> serving = c->Health();
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(*serving);

  absl::StatusOr<v1::StatusResponse> s = c->Status();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->backend(), "cpu");
  EXPECT_EQ(s->attention_kernel(), "cpu");  // the GPU fields stay empty on the CPU backend
  EXPECT_EQ(s->compute_capability(), "");
  EXPECT_EQ(s->cuda_archs_built(), "");
  EXPECT_EQ(s->sm_count(), 0);
  EXPECT_EQ(s->budget_bytes(), 256u << 20);
  EXPECT_EQ(s->pool_bytes(), 0u);
  EXPECT_TRUE(s->serving());
  EXPECT_EQ(s->tenant().tenant(), "default");

  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec());
  v1::PlanRequest req;
  *req.mutable_header() = L.header;
  req.set_has_bias(true);
  req.mutable_header()->mutable_options()->mutable_qk_norm()->set_weight_len(64);
  absl::StatusOr<v1::PlanResponse> p = c->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->fits());
  ASSERT_EQ(p->plan().ranges_size(), 3);
  EXPECT_EQ(p->plan().ranges(0).format(), v1::FORMAT_BF16);
  EXPECT_EQ(p->plan().ranges(1).format(), v1::FORMAT_INT8);
  EXPECT_EQ(p->plan().projection_chunk(), 300);
  EXPECT_EQ(p->plan().predicted_peak_bytes(), p->plan().kv_bytes() + p->plan().workspace_bytes());
  EXPECT_EQ(p->plan().mma(), "bf16");  // a BF16 range keeps the layer on bf16 MMAs
  {  // INT4/INT8 ranges only: INT8 S asked for, and what auto resolves to at this head_dim (64: bf16)
    v1::PlanRequest int8 = req;
    for (int i = 0; i < int8.header().ranges_size(); ++i) {
      int8.mutable_header()->mutable_ranges(i)->clear_allowed_formats();
      int8.mutable_header()->mutable_ranges(i)->add_allowed_formats(v1::FORMAT_INT4);
    }
    absl::StatusOr<v1::PlanResponse> a = c->Plan(int8);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->plan().mma(), "bf16");  // auto at head_dim 64
    int8.mutable_header()->mutable_options()->mutable_attention()->set_mma(v1::AttentionOptions::MMA_INT8);
    a = c->Plan(int8);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->plan().mma(), "int8");
  }

  // Too small a budget for the floor: fits = false with the numbers, not an error.
  req.mutable_header()->mutable_shape()->set_n_tokens(3000000);
  req.mutable_header()->mutable_ranges(2)->set_end(3000000);
  p = c->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->fits());
  EXPECT_NE(p->reason().find("bytes are available"), std::string::npos) << p->reason();
}

TEST_F(DaemonTest, AttentionLayerMatchesTheLocalReferenceAndThePredictedPeak) {
  auto c = daemon_.Connect();
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec());
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok()) << w.status();
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> r = c->AttentionLayer(h, DataOf(L, &out));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->output_bytes(), L.out_bytes());
  EXPECT_EQ(r->peak_bytes(), r->plan().predicted_peak_bytes());
  absl::StatusOr<std::vector<uint16_t>> ref = client::ReferenceOutput(L, r->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_TRUE(out == *ref) << "max |err| " << client::Compare(out, *ref).max_abs;

  // The pool's high-water mark is the weights plus the layer's predicted peak.
  absl::StatusOr<v1::StatusResponse> s = c->Status();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->high_water_bytes(), w->pool_bytes() + r->plan().predicted_peak_bytes());
  EXPECT_EQ(s->pool_bytes(), w->pool_bytes());
  EXPECT_EQ(s->weights_handles(), 1);
  ASSERT_TRUE(c->ReleaseWeights(w->handle()).ok());
  EXPECT_EQ(c->ReleaseWeights(w->handle()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->Status()->pool_bytes(), 0u);
}

TEST_F(DaemonTest, ErrorEstimatesReportedAndErrorBudgetsResolved) {
  auto c = daemon_.Connect();
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(21));
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok()) << w.status();
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> r = c->AttentionLayer(h, DataOf(L, &out));
  ASSERT_TRUE(r.ok()) << r.status();
  // The run's estimate (its own pre-pass), per format and per range in the range's format.
  const v1::ErrorEstimate& e = r->estimated_rel_error();
  EXPECT_GT(e.int4(), e.int8());
  EXPECT_GT(e.int8(), e.bf16());
  EXPECT_GT(e.bf16(), 0.0);
  EXPECT_EQ(r->plan().ranges(0).estimated_rel_error(), e.bf16());
  EXPECT_EQ(r->plan().ranges(1).estimated_rel_error(), e.int8());
  EXPECT_EQ(r->plan().ranges(2).estimated_rel_error(), e.int4());

  // That estimate resolves error budgets: the cheapest format that meets each.
  v1::PlanRequest req;
  *req.mutable_header() = h;
  *req.mutable_header()->mutable_estimated_rel_error() = e;
  const double budgets[] = {e.bf16() * 0.5, e.int8() * 1.01, e.int4() * 1.01};
  for (int i = 0; i < 3; ++i) {
    req.mutable_header()->mutable_ranges(i)->clear_allowed_formats();
    req.mutable_header()->mutable_ranges(i)->set_max_rel_error(budgets[i]);
  }
  absl::StatusOr<v1::PlanResponse> p = c->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->plan().ranges(0).format(), v1::FORMAT_BF16);  // nothing meets half BF16's estimate
  EXPECT_EQ(p->plan().ranges(1).format(), v1::FORMAT_INT8);
  EXPECT_EQ(p->plan().ranges(2).format(), v1::FORMAT_INT4);
  EXPECT_EQ(p->plan().estimated_rel_error().int8(), e.int8());

  // Or a sample sent with Plan: float32 [n, H, d] Q, K and V.
  req.mutable_header()->clear_estimated_rel_error();
  const int64_t n = 100, values = n * 2 * 64;
  std::vector<float> q(values), k(values), v(values);
  for (int64_t i = 0; i < values; ++i) {
    q[i] = static_cast<float>(std::sin(0.37 * i) + 0.1 * (i % 7));
    k[i] = static_cast<float>(std::cos(0.11 * i) + 0.5 * (i % 64 == 3));
    v[i] = static_cast<float>(std::sin(0.23 * i + 1.0) + 0.2);
  }
  v1::QkvSample* sample = req.mutable_sample();
  sample->set_n_tokens(n);
  sample->set_q(std::string(reinterpret_cast<const char*>(q.data()), q.size() * 4));
  sample->set_k(std::string(reinterpret_cast<const char*>(k.data()), k.size() * 4));
  sample->set_v(std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4));
  p = c->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GT(p->plan().estimated_rel_error().int4(), p->plan().estimated_rel_error().bf16());
  EXPECT_GT(p->plan().ranges(2).estimated_rel_error(), 0.0);
  sample->set_k("short");
  EXPECT_EQ(c->Plan(req).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c->Plan(req).status().message().find("sample.k"), std::string::npos);
  req.clear_sample();
  p = c->Plan(req);  // a budget without any estimate
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("max_rel_error needs an error estimate"), std::string::npos);
  ASSERT_TRUE(c->ReleaseWeights(w->handle()).ok());
}

TEST(DaemonPolicies, FromTheFileAndTheApiResolveByBlockTimestepAndRole) {
  const std::string path = ::testing::TempDir() + "/kvpack_policies.yaml";
  std::ofstream(path) << "policies:\n"
                         "  - name: dit\n"
                         "    rules:\n"
                         "      - blocks: [0, 1]\n"
                         "        formats: [bf16]\n"
                         "      - roles: text\n"
                         "        timesteps: [500, 1000]\n"
                         "        formats: [int8, int4]\n"
                         "      - formats: [int4]\n";
  DaemonProcess daemon({"--vram_budget=256Mi", "--policy_file=" + path});
  ASSERT_TRUE(daemon.ok());
  auto c = daemon.Connect();
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec());
  v1::PlanRequest req;
  *req.mutable_header() = L.header;
  req.set_has_bias(true);
  req.mutable_header()->mutable_options()->mutable_qk_norm()->set_weight_len(64);
  const char* roles[] = {"text", "generated", "text"};
  for (int i = 0; i < 3; ++i) {
    req.mutable_header()->mutable_ranges(i)->set_role(roles[i]);
    if (i < 2) req.mutable_header()->mutable_ranges(i)->clear_allowed_formats();  // range 2 keeps its own
  }
  req.mutable_header()->set_policy("dit");
  req.mutable_header()->set_block_index(5);
  req.mutable_header()->set_timestep(700);
  absl::StatusOr<v1::PlanResponse> p = c->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->plan().ranges(0).format(), v1::FORMAT_INT8);  // the text rule
  EXPECT_EQ(p->plan().ranges(1).format(), v1::FORMAT_INT4);  // the catch-all
  EXPECT_EQ(p->plan().ranges(2).format(), v1::FORMAT_INT4);  // its own list ([INT4])
  req.mutable_header()->set_block_index(1);
  p = c->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->plan().ranges(0).format(), v1::FORMAT_BF16);  // the block rule comes first
  EXPECT_EQ(p->plan().ranges(1).format(), v1::FORMAT_BF16);

  // Registered over the API, then used; a bad text names its line; unknown names are NOT_FOUND.
  grpc::ClientContext ctx;
  c->Prepare(&ctx);
  v1::RegisterPoliciesRequest reg;
  reg.set_text("policies:\n  - name: all-int8\n    rules:\n      - formats: int8\n");
  v1::RegisterPoliciesResponse names;
  ASSERT_TRUE(c->stub()->RegisterPolicies(&ctx, reg, &names).ok());
  ASSERT_EQ(names.names_size(), 1);
  req.mutable_header()->set_policy("all-int8");
  p = c->Plan(req);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->plan().ranges(0).format(), v1::FORMAT_INT8);
  grpc::ClientContext bad_ctx;
  c->Prepare(&bad_ctx);
  reg.set_text("policies:\n  - name: x\n    rules:\n      - formats: int9\n");
  const grpc::Status bad = c->stub()->RegisterPolicies(&bad_ctx, reg, &names);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.error_message().find("line 4"), std::string::npos) << bad.error_message();
  req.mutable_header()->set_policy("nope");
  EXPECT_EQ(c->Plan(req).status().code(), absl::StatusCode::kNotFound);
  req.mutable_header()->mutable_ranges(0)->set_role("video");
  EXPECT_EQ(c->Plan(req).status().code(), absl::StatusCode::kInvalidArgument);

  // A bad file stops the daemon at start.
  std::ofstream(path) << "policies:\n  - name: dit\n    rules:\n      - formats: [int4, fp3]\n";
  DaemonProcess refused({"--policy_file=" + path});
  EXPECT_FALSE(refused.ok());
}

TEST_F(DaemonTest, KeepKvProjectAttendAndRelease) {
  auto c = daemon_.Connect();
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(11));
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok()) << w.status();
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  h.set_keep_kv(true);
  std::vector<uint16_t> full;
  absl::StatusOr<v1::LayerResult> r = c->AttentionLayer(h, DataOf(L, &full));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_FALSE(r->kv_handle().empty());
  absl::StatusOr<v1::StatusResponse> s = c->Status();
  EXPECT_EQ(s->kv_kept_bytes(), r->plan().kv_bytes());
  EXPECT_EQ(s->kv_handles(), 1);
  EXPECT_GT(s->bf16_bytes(), 0u);
  EXPECT_GT(s->int8_bytes(), 0u);
  EXPECT_GT(s->int4_bytes(), 0u);

  // Attend over the kept entry gives the same output.
  v1::LayerHeader ah = L.header;
  ah.set_weights_handle(w->handle());
  ah.set_kv_handle(r->kv_handle());
  std::vector<uint16_t> attended;
  absl::StatusOr<v1::LayerResult> a = c->Attend(ah, DataOf(L, &attended));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(attended == full);
  EXPECT_EQ(a->plan().kv_bytes(), 0u);  // already held

  // Project makes another entry; Attend over it agrees too.
  v1::LayerHeader ph = L.header;
  ph.set_weights_handle(w->handle());
  ph.mutable_output()->set_mode(v1::OUTPUT_NONE);
  client::LayerData pd{L.x.data(), L.positions.data(), nullptr, 0};
  absl::StatusOr<v1::LayerResult> p = c->Project(ph, pd);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_FALSE(p->kv_handle().empty());
  ah.set_kv_handle(p->kv_handle());
  a = c->Attend(ah, DataOf(L, &attended));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(attended == full);

  ASSERT_TRUE(c->ReleaseKv(r->kv_handle()).ok());
  ASSERT_TRUE(c->ReleaseKv(p->kv_handle()).ok());
  ASSERT_TRUE(c->ReleaseWeights(w->handle()).ok());
  s = c->Status();
  EXPECT_EQ(s->pool_bytes(), 0u);
  EXPECT_EQ(s->int4_bytes() + s->int8_bytes() + s->bf16_bytes(), 0u);
  EXPECT_EQ(s->kv_handles(), 0);
}

TEST_F(DaemonTest, SharedMemoryRegionsForInputAndOutput) {
  auto c = daemon_.Connect();
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(5));
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok()) << w.status();
  const uint64_t x_bytes = L.x.size() * 2, pos_bytes = L.positions.size() * 4, out_bytes = L.out_bytes();
  const uint64_t x_off = 4096, pos_off = x_off + x_bytes, out_off = pos_off + pos_bytes;
  auto shm = client::SharedMemory::Create(out_off + out_bytes);
  ASSERT_TRUE(shm.ok()) << shm.status();
  std::memcpy((*shm)->data() + x_off, L.x.data(), x_bytes);
  std::memcpy((*shm)->data() + pos_off, L.positions.data(), pos_bytes);
  absl::StatusOr<std::string> region = c->RegisterShmRegion((*shm)->name(), (*shm)->size());
  ASSERT_TRUE(region.ok()) << region.status();

  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  auto slice = [&](v1::RegionSlice* s, uint64_t off, uint64_t n) {
    s->set_region_id(*region);
    s->set_offset(off);
    s->set_size_bytes(n);
  };
  slice(h.mutable_x()->mutable_region(), x_off, x_bytes);
  slice(h.mutable_positions()->mutable_region(), pos_off, pos_bytes);
  h.mutable_output()->set_mode(v1::OUTPUT_REGION);
  slice(h.mutable_output()->mutable_region(), out_off, out_bytes);
  absl::StatusOr<v1::LayerResult> r = c->AttentionLayer(h, client::LayerData{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->output_bytes(), 0u);
  absl::StatusOr<std::vector<uint16_t>> ref = client::ReferenceOutput(L, r->plan());
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ(std::memcmp((*shm)->data() + out_off, ref->data(), out_bytes), 0);

  absl::StatusOr<v1::RegionStatusResponse> rs = c->RegionStatus();
  ASSERT_TRUE(rs.ok());
  ASSERT_EQ(rs->regions_size(), 1);
  EXPECT_EQ(rs->regions(0).size_bytes(), (*shm)->size());
  EXPECT_EQ(rs->regions(0).users(), 0);
  EXPECT_EQ(c->Status()->shm_regions(), 1);
  absl::StatusOr<int> renewed = c->KeepAlive({*region, w->handle(), "w-nonexistent"});
  ASSERT_TRUE(renewed.ok());
  EXPECT_EQ(*renewed, 2);

  // Bounds are checked.
  slice(h.mutable_x()->mutable_region(), (*shm)->size() - 10, x_bytes);
  r = c->AttentionLayer(h, client::LayerData{});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("outside region"), std::string::npos) << r.status();

  ASSERT_TRUE(c->UnregisterRegion(*region).ok());
  EXPECT_EQ(c->UnregisterRegion(*region).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->Status()->shm_regions(), 0);

  // CUDA IPC needs the CUDA backend.
  grpc::ClientContext ctx;
  c->Prepare(&ctx);
  v1::RegisterRegionRequest ipc;
  ipc.set_kind(v1::REGION_CUDA_IPC);
  ipc.set_cuda_ipc_handle(std::string(64, '\1'));
  ipc.set_size_bytes(1 << 20);
  v1::RegisterRegionResponse ipc_response;
  EXPECT_EQ(c->stub()->RegisterRegion(&ctx, ipc, &ipc_response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(c->ReleaseWeights(w->handle()).ok());
}

TEST_F(DaemonTest, UnregisteringARegionInUseWaitsForItsRequests) {
  auto c = daemon_.Connect();
  client::SyntheticSpec spec = SmallSpec(6);
  spec.n_tokens = 1500;
  spec.ranges = {{1500, 0, {v1::FORMAT_INT4}}};
  const client::SyntheticLayer L = client::MakeSyntheticLayer(spec);
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok());
  auto shm = client::SharedMemory::Create(L.x.size() * 2);
  ASSERT_TRUE(shm.ok());
  std::memcpy((*shm)->data(), L.x.data(), L.x.size() * 2);
  absl::StatusOr<std::string> region = c->RegisterShmRegion((*shm)->name(), (*shm)->size());
  ASSERT_TRUE(region.ok());
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  h.mutable_x()->mutable_region()->set_region_id(*region);
  h.mutable_x()->mutable_region()->set_size_bytes(L.x.size() * 2);
  std::vector<uint16_t> out(L.out_bytes() / 2);
  absl::StatusOr<v1::LayerResult> r;
  std::thread call([&] { r = c->AttentionLayer(h, client::LayerData{nullptr, L.positions.data(), out.data(), L.out_bytes()}); });
  ASSERT_TRUE(WaitFor([&] {
    absl::StatusOr<v1::RegionStatusResponse> rs = c->RegionStatus(*region);
    return rs.ok() && rs->regions(0).users() == 1;
  }));
  const absl::Status unregistered = c->UnregisterRegion(*region);  // returns once the layer lets go
  EXPECT_TRUE(unregistered.ok()) << unregistered;
  EXPECT_EQ(c->Status()->running(), 0);  // the layer had finished computing
  EXPECT_EQ(c->RegionStatus(*region).status().code(), absl::StatusCode::kNotFound);
  call.join();
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(c->Status()->shm_regions(), 0);
}

TEST_F(DaemonTest, InPlaceOutputStreamsBack) {
  auto c = daemon_.Connect();
  client::SyntheticSpec spec = SmallSpec(3);
  spec.hidden = spec.n_heads * spec.head_dim;  // in place needs D == H·d
  const client::SyntheticLayer L = client::MakeSyntheticLayer(spec);
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok()) << w.status();
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  h.mutable_output()->set_mode(v1::OUTPUT_IN_PLACE);
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> r = c->AttentionLayer(h, DataOf(L, &out));
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<std::vector<uint16_t>> ref = client::ReferenceOutput(L, r->plan());
  ASSERT_TRUE(ref.ok());
  EXPECT_TRUE(out == *ref);
}

// Block-sparse attention on the CPU backend: with every page routed the output is the dense one;
// at top-k 20% the result reports its routed fraction (within the plan's bound), the plan its
// routing bytes, and the metrics one observation per sparse request.
TEST_F(DaemonTest, SparseAttentionReportsItsRoutedFraction) {
  auto c = daemon_.Connect();
  client::SyntheticSpec spec = SmallSpec(5);
  spec.n_tokens = 1000;
  spec.ranges = {{64, 0, {v1::FORMAT_BF16}}, {936, 0, {v1::FORMAT_INT4}}};
  const client::SyntheticLayer L = client::MakeSyntheticLayer(spec);
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok()) << w.status();
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  std::vector<uint16_t> dense, full, sparse;
  absl::StatusOr<v1::LayerResult> r = c->AttentionLayer(h, DataOf(L, &dense));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->routed_fraction(), 0.0);
  EXPECT_EQ(r->plan().routing_bytes(), 0u);
  const uint64_t dense_workspace = r->plan().workspace_bytes();

  h.mutable_options()->mutable_attention()->mutable_sparse()->set_topk_ratio(1.0f);
  r = c->AttentionLayer(h, DataOf(L, &full));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(full, dense);
  EXPECT_EQ(r->routed_fraction(), 1.0);

  h.mutable_options()->mutable_attention()->mutable_sparse()->set_topk_ratio(0.2f);
  h.mutable_ranges(0)->set_always_attend(true);
  h.set_keep_kv(true);
  r = c->AttentionLayer(h, DataOf(L, &sparse));
  ASSERT_TRUE(r.ok()) << r.status();
  // Attend over the kept entry routes the same pages (statistics come from the pages).
  v1::LayerHeader ah = h;
  ah.set_keep_kv(false);
  ah.set_kv_handle(r->kv_handle());
  std::vector<uint16_t> attended;
  absl::StatusOr<v1::LayerResult> a = c->Attend(ah, DataOf(L, &attended));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(attended, sparse);
  EXPECT_EQ(a->routed_fraction(), r->routed_fraction());
  ASSERT_TRUE(c->ReleaseKv(r->kv_handle()).ok());
  EXPECT_GT(r->routed_fraction(), 0.0);
  EXPECT_LT(r->routed_fraction(), 1.0);
  EXPECT_LE(r->routed_fraction(), r->plan().routed_fraction_bound());
  EXPECT_GT(r->plan().routing_bytes(), 0u);
  EXPECT_GE(r->plan().workspace_bytes(), dense_workspace);
  EXPECT_NE(sparse, dense);
  EXPECT_EQ(r->peak_bytes(), r->plan().predicted_peak_bytes());
  EXPECT_EQ(Sample(daemon_.Metrics(), "kvpack_sparse_routed_fraction_count"), 3.0);
}

TEST_F(DaemonTest, MetricsMatchStatus) {
  auto c = daemon_.Connect();
  const client::SyntheticLayer L = client::MakeSyntheticLayer(SmallSpec(9));
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok());
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  h.set_keep_kv(true);
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> r = c->AttentionLayer(h, DataOf(L, &out));
  ASSERT_TRUE(r.ok()) << r.status();

  const absl::StatusOr<v1::StatusResponse> s = c->Status();
  const std::string m = daemon_.Metrics();
  ASSERT_FALSE(m.empty());
  EXPECT_EQ(Sample(m, "kvpack_budget_bytes"), static_cast<double>(s->budget_bytes()));
  EXPECT_EQ(Sample(m, "kvpack_pool_bytes{state=\"weights\"}"), static_cast<double>(s->weights_bytes()));
  EXPECT_EQ(Sample(m, "kvpack_pool_bytes{state=\"kv_kept\"}"), static_cast<double>(s->kv_kept_bytes()));
  EXPECT_EQ(Sample(m, "kvpack_pool_bytes{state=\"kv_active\"}"), 0.0);
  EXPECT_EQ(Sample(m, "kvpack_pool_bytes{state=\"workspace\"}"), 0.0);
  EXPECT_EQ(Sample(m, "kvpack_pool_format_bytes{format=\"int4\"}"), static_cast<double>(s->int4_bytes()));
  EXPECT_EQ(Sample(m, "kvpack_pool_format_bytes{format=\"bf16\"}"), static_cast<double>(s->bf16_bytes()));
  EXPECT_EQ(Sample(m, "kvpack_pool_high_water_bytes"), static_cast<double>(s->high_water_bytes()));
  EXPECT_EQ(Sample(m, "kvpack_pool_mapped_bytes"), static_cast<double>(s->mapped_bytes()));
  EXPECT_EQ(Sample(m, "kvpack_queue_depth"), 0.0);
  EXPECT_EQ(Sample(m, "kvpack_handles{kind=\"weights\"}"), 1.0);
  EXPECT_EQ(Sample(m, "kvpack_handles{kind=\"kv\"}"), 1.0);
  EXPECT_EQ(Sample(m, "kvpack_regions{kind=\"shm\"}"), 0.0);
  EXPECT_EQ(Sample(m, "kvpack_requests_total{code=\"OK\",method=\"AttentionLayer\"}"), 1.0);
  EXPECT_EQ(Sample(m, "kvpack_requests_total{code=\"OK\",method=\"RegisterWeights\"}"), 1.0);
  EXPECT_EQ(Sample(m, "kvpack_tokens_total{format=\"bf16\"}"), 77.0);
  EXPECT_EQ(Sample(m, "kvpack_tokens_total{format=\"int8\"}"), 150.0);
  EXPECT_EQ(Sample(m, "kvpack_tokens_total{format=\"int4\"}"), 73.0);
  EXPECT_EQ(Sample(m, "kvpack_precision_downgrades_total"), 0.0);
  EXPECT_EQ(Sample(m, "kvpack_request_peak_bytes_count"), 1.0);
  EXPECT_EQ(Sample(m, "kvpack_request_peak_bytes_sum"), static_cast<double>(r->peak_bytes()));
  EXPECT_EQ(Sample(m, "kvpack_stage_duration_seconds_count{stage=\"attend\"}"), 1.0);
  EXPECT_NE(m.find("kvpack_build_info{backend=\"cpu\",version=\"0.1.0\"} 1"), std::string::npos);
  EXPECT_NE(m.find("kvpack_device_info{archs=\"\",attention_kernel=\"cpu\",compute_capability=\"\",sm_count=\"0\"} 1"),
            std::string::npos);
  EXPECT_EQ(m.find("kvpack_gpu_memory_bytes"), std::string::npos);  // absent on the CPU backend
}

// A forced GPU kernel never falls back to the CPU backend: the daemon stops at startup (exit 2), and
// so does a kernel name it does not know.
TEST(DaemonStartup, ForcedAttentionKernelNeedsTheCudaBackend) {
  for (const char* kernel : {"--attention_kernel=wgmma", "--attention_kernel=mma_sync", "--attention_kernel=tall"}) {
    DaemonProcess d({"--backend=cpu", kernel});
    EXPECT_FALSE(d.ok()) << kernel;
    EXPECT_EQ(d.Stop(), 2) << kernel;
  }
  DaemonProcess automatic({"--backend=cpu", "--attention_kernel=auto"});
  ASSERT_TRUE(automatic.ok());
  EXPECT_EQ(automatic.Connect()->Status()->attention_kernel(), "cpu");
}

TEST_F(DaemonTest, DrainsInFlightWorkOnSigterm) {
  auto c = daemon_.Connect();
  client::SyntheticSpec spec = SmallSpec(4);
  spec.n_tokens = 1500;
  spec.ranges = {{1500, 0, {v1::FORMAT_INT4}}};
  const client::SyntheticLayer L = client::MakeSyntheticLayer(spec);
  absl::StatusOr<v1::WeightsResponse> w = c->RegisterWeights(WeightsOf(L));
  ASSERT_TRUE(w.ok());
  v1::LayerHeader h = L.header;
  h.set_weights_handle(w->handle());
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> r;
  std::thread call([&] { r = c->AttentionLayer(h, DataOf(L, &out)); });
  ASSERT_TRUE(WaitFor([&] { return c->Status()->running() == 1; }));
  EXPECT_EQ(daemon_.Stop(), 0);
  call.join();
  EXPECT_TRUE(r.ok()) << r.status();
}

}  // namespace
}  // namespace kvpack::testing
