// A table of malformed requests, each with the code it must get; the daemon keeps serving.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <iterator>

#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

class MalformedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(daemon_.ok());
    c_ = daemon_.Connect();
    L_ = client::MakeSyntheticLayer(SmallSpec(13));
    absl::StatusOr<v1::WeightsResponse> w = c_->RegisterWeights(WeightsOf(L_));
    ASSERT_TRUE(w.ok()) << w.status();
    handle_ = w->handle();
  }

  // A well-formed AttentionLayer stream: header (x and positions inline) then the chunks.
  std::vector<v1::LayerRequest> GoodStream() const {
    std::vector<v1::LayerRequest> msgs(1);
    v1::LayerHeader* h = msgs[0].mutable_header();
    *h = L_.header;
    h->set_weights_handle(handle_);
    h->mutable_x()->set_inline_bytes(L_.x.size() * 2);
    h->mutable_positions()->set_inline_bytes(L_.positions.size() * 4);
    v1::LayerRequest x, pos;
    x.mutable_chunk()->set_tensor(v1::TENSOR_X);
    x.mutable_chunk()->set_data(L_.x.data(), L_.x.size() * 2);
    pos.mutable_chunk()->set_tensor(v1::TENSOR_POSITIONS);
    pos.mutable_chunk()->set_data(L_.positions.data(), L_.positions.size() * 4);
    msgs.push_back(x);
    msgs.push_back(pos);
    return msgs;
  }

  grpc::Status Send(const std::vector<v1::LayerRequest>& msgs, const char* method = "AttentionLayer",
                    const std::string& tenant = "") {
    grpc::ClientContext context;
    c_->Prepare(&context);
    if (!tenant.empty()) context.AddMetadata("x-kvpack-tenant", tenant);
    auto stream = std::string(method) == "Attend" ? c_->stub()->Attend(&context)
                  : std::string(method) == "Project" ? c_->stub()->Project(&context)
                                                     : c_->stub()->AttentionLayer(&context);
    for (const auto& m : msgs) {
      if (!stream->Write(m)) break;
    }
    stream->WritesDone();
    v1::LayerResponse r;
    while (stream->Read(&r)) {
    }
    return stream->Finish();
  }

  DaemonProcess daemon_{{"--vram_budget=64Mi"}};
  std::unique_ptr<client::Client> c_;
  client::SyntheticLayer L_;
  std::string handle_;
};

struct Case {
  const char* name;
  std::function<void(std::vector<v1::LayerRequest>*)> mutate;
  grpc::StatusCode code;
  const char* needle;  // must appear in the message
};

TEST_F(MalformedTest, LayerRequests) {
  using M = std::vector<v1::LayerRequest>;
  auto header = [](M* m) { return (*m)[0].mutable_header(); };
  const Case cases[] = {
      {"no header", [](M* m) { m->erase(m->begin()); }, grpc::StatusCode::INVALID_ARGUMENT, "header"},
      {"empty stream", [](M* m) { m->clear(); }, grpc::StatusCode::INVALID_ARGUMENT, "header"},
      {"two headers", [](M* m) { m->push_back((*m)[0]); }, grpc::StatusCode::INVALID_ARGUMENT, "sent twice"},
      {"no weights", [&](M* m) { header(m)->clear_weights_handle(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "weights_handle"},
      {"unknown weights", [&](M* m) { header(m)->set_weights_handle("w-0123"); }, grpc::StatusCode::NOT_FOUND,
       "weights_handle"},
      {"zero tokens", [&](M* m) { header(m)->mutable_shape()->set_n_tokens(0); }, grpc::StatusCode::INVALID_ARGUMENT,
       "n_tokens"},
      {"too many tokens", [&](M* m) { header(m)->mutable_shape()->set_n_tokens(1ll << 40); },
       grpc::StatusCode::INVALID_ARGUMENT, "n_tokens"},
      {"page tables too large",
       [&](M* m) {
         header(m)->mutable_shape()->set_n_tokens(4000000);
         header(m)->mutable_shape()->set_n_heads(1024);
         header(m)->mutable_ranges(2)->set_end(4000000);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "page tables"},
      {"sparse topk_ratio 0",
       [&](M* m) { header(m)->mutable_options()->mutable_attention()->mutable_sparse()->set_topk_ratio(0.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "header.options.attention.sparse.topk_ratio"},
      {"sparse rel_tau negative",
       [&](M* m) { header(m)->mutable_options()->mutable_attention()->mutable_sparse()->set_rel_tau(-1.0f); },
       grpc::StatusCode::INVALID_ARGUMENT, "header.options.attention.sparse.rel_tau"},
      {"sparse sink_pages too many",
       [&](M* m) { header(m)->mutable_options()->mutable_attention()->mutable_sparse()->set_sink_pages(1 << 20); },
       grpc::StatusCode::INVALID_ARGUMENT, "header.options.attention.sparse.sink_pages"},
      {"sparse min_exact_pages negative",
       [&](M* m) { header(m)->mutable_options()->mutable_attention()->mutable_sparse()->set_min_exact_pages(-2); },
       grpc::StatusCode::INVALID_ARGUMENT, "header.options.attention.sparse.min_exact_pages"},
      {"always_attend without sparse", [&](M* m) { header(m)->mutable_ranges(0)->set_always_attend(true); },
       grpc::StatusCode::INVALID_ARGUMENT, "header.ranges[0].always_attend"},
      {"range gap", [&](M* m) { header(m)->mutable_ranges(1)->set_begin(80); }, grpc::StatusCode::INVALID_ARGUMENT,
       "ranges[1].begin"},
      {"range overlap", [&](M* m) { header(m)->mutable_ranges(2)->set_begin(200); },
       grpc::StatusCode::INVALID_ARGUMENT, "ranges[2].begin"},
      {"unknown format", [&](M* m) { header(m)->mutable_ranges(0)->set_allowed_formats(0, static_cast<v1::Format>(9)); },
       grpc::StatusCode::INVALID_ARGUMENT, "ranges[0].allowed_formats[0]"},
      {"300 ranges",
       [&](M* m) {
         auto* h = header(m);
         h->clear_ranges();
         for (int i = 0; i < 300; ++i) {
           auto* r = h->add_ranges();
           r->set_begin(i);
           r->set_end(i + 1);
         }
       },
       grpc::StatusCode::INVALID_ARGUMENT, "at most 256"},
      {"shape vs weights", [&](M* m) { header(m)->mutable_shape()->set_hidden(256); },
       grpc::StatusCode::INVALID_ARGUMENT, "does not match the weights"},
      {"x size", [&](M* m) { header(m)->mutable_x()->set_inline_bytes(10); }, grpc::StatusCode::INVALID_ARGUMENT,
       "header.x.inline_bytes"},
      {"no x", [&](M* m) { header(m)->clear_x(); }, grpc::StatusCode::INVALID_ARGUMENT, "header.x: required"},
      {"rope without positions", [&](M* m) { header(m)->clear_positions(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "header.positions: required"},
      {"positions without rope", [&](M* m) { header(m)->mutable_options()->clear_rope(); },
       grpc::StatusCode::INVALID_ARGUMENT, "without RoPE"},
      {"rope axis", [&](M* m) { header(m)->mutable_options()->mutable_rope()->set_axis_dims(0, 7); },
       grpc::StatusCode::INVALID_ARGUMENT, "axis_dims"},
      {"rope axis sum overflows int32",  // 2^30 + 2^30 wrapped to a negative sum that passed "sum <= head_dim"
       [&](M* m) {
         v1::RopeOptions* rope = header(m)->mutable_options()->mutable_rope();
         rope->clear_axis_dims();
         rope->add_axis_dims(1 << 30);
         rope->add_axis_dims(1 << 30);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "axis_dims[0]"},
      {"projected row stride overflows int64",
       [&](M* m) {
         v1::LayerHeader* h = header(m);
         h->clear_weights_handle();
         h->clear_x();
         h->clear_positions();
         h->mutable_options()->clear_rope();
         h->mutable_options()->clear_qk_norm();
         h->mutable_shape()->set_hidden(0);
         v1::ProjectedQkv* p = h->mutable_projected();
         p->set_layout(v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR);
         p->set_row_stride(1ll << 62);
         for (v1::TensorRef* t : {p->mutable_q(), p->mutable_k(), p->mutable_v()}) t->set_inline_bytes(64);
         m->resize(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "strides span"},
      {"projected head-major batch stride overflows int64",
       [&](M* m) {
         v1::LayerHeader* h = header(m);
         h->clear_weights_handle();
         h->clear_x();
         h->clear_positions();
         h->mutable_options()->clear_rope();
         h->mutable_options()->clear_qk_norm();
         h->mutable_shape()->set_hidden(0);
         h->mutable_shape()->set_n_tokens(1 << 30);
         h->mutable_shape()->set_n_heads(1 << 30);
         h->mutable_projected()->set_layout(v1::ProjectedQkv::LAYOUT_HEAD_MAJOR);
         m->resize(1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "n_heads"},
      {"output none", [&](M* m) { header(m)->mutable_output()->set_mode(v1::OUTPUT_NONE); },
       grpc::StatusCode::INVALID_ARGUMENT, "writes an output"},
      {"unknown output mode", [&](M* m) { header(m)->mutable_output()->set_mode(static_cast<v1::OutputMode>(9)); },
       grpc::StatusCode::INVALID_ARGUMENT, "output.mode"},
      {"unknown region",
       [&](M* m) {
         header(m)->mutable_output()->set_mode(v1::OUTPUT_REGION);
         header(m)->mutable_output()->mutable_region()->set_region_id("r-77");
         header(m)->mutable_output()->mutable_region()->set_size_bytes(L_.out_bytes());
       },
       grpc::StatusCode::NOT_FOUND, "region"},
      {"kv handle on AttentionLayer", [&](M* m) { header(m)->set_kv_handle("kv-1"); },
       grpc::StatusCode::INVALID_ARGUMENT, "only Attend"},
      {"negative softmax scale",
       [&](M* m) { header(m)->mutable_options()->mutable_attention()->set_softmax_scale(-1); },
       grpc::StatusCode::INVALID_ARGUMENT, "softmax_scale"},
      {"unknown mma path",
       [&](M* m) {
         header(m)->mutable_options()->mutable_attention()->set_mma(static_cast<v1::AttentionOptions::Mma>(99));
       },
       grpc::StatusCode::INVALID_ARGUMENT, "attention.mma"},
      {"too big for the budget",
       [&](M* m) {
         header(m)->mutable_shape()->set_n_tokens(4000000);
         header(m)->mutable_ranges(2)->set_end(4000000);
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED, "bytes are available"},
      {"chunk of unknown tensor", [](M* m) { (*m)[1].mutable_chunk()->set_tensor(v1::TENSOR_OUTPUT); },
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.tensor"},
      {"chunk out of order", [](M* m) { (*m)[1].mutable_chunk()->set_offset(64); },
       grpc::StatusCode::INVALID_ARGUMENT, "in order"},
      {"chunk too long", [](M* m) { (*m)[1].mutable_chunk()->mutable_data()->append("xx"); },
       grpc::StatusCode::INVALID_ARGUMENT, "chunk.data"},
      {"stream ends early", [](M* m) { m->pop_back(); }, grpc::StatusCode::INVALID_ARGUMENT, "received 0 of"},
      {"empty message", [](M* m) { m->push_back(v1::LayerRequest()); }, grpc::StatusCode::INVALID_ARGUMENT,
       "neither header nor chunk"},
  };
  for (const Case& c : cases) {
    std::vector<v1::LayerRequest> msgs = GoodStream();
    c.mutate(&msgs);
    const grpc::Status s = Send(msgs);
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.needle), std::string::npos) << c.name << ": " << s.error_message();
  }
  // A stream its client ended early (half-close, no cancel) counts as INVALID_ARGUMENT, as it was
  // answered; the metric is taken in OnDone for these (disconnect_test: a cut one counts CANCELLED).
  const auto invalid = std::count_if(std::begin(cases), std::end(cases),
                                     [](const Case& c) { return c.code == grpc::StatusCode::INVALID_ARGUMENT; });
  EXPECT_TRUE(WaitFor([&] {
    return Sample(daemon_.Metrics(), "kvpack_requests_total{code=\"INVALID_ARGUMENT\",method=\"AttentionLayer\"}") ==
           static_cast<double>(invalid);
  })) << daemon_.Metrics();
  // Still serving, and nothing leaked.
  EXPECT_TRUE(Send(GoodStream()).ok());
  EXPECT_TRUE(*c_->Health());
  const absl::StatusOr<v1::StatusResponse> st = c_->Status();
  EXPECT_EQ(st->pool_bytes(), st->weights_bytes());
  EXPECT_EQ(st->reserved_bytes(), 0u);
}

TEST_F(MalformedTest, AttendAndProject) {
  std::vector<v1::LayerRequest> msgs = GoodStream();
  msgs[0].mutable_header()->set_kv_handle("kv-00");
  grpc::Status s = Send(msgs, "Attend");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  msgs[0].mutable_header()->clear_kv_handle();
  s = Send(msgs, "Attend");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  msgs = GoodStream();
  msgs[0].mutable_header()->mutable_output()->set_mode(v1::OUTPUT_IN_PLACE);
  s = Send(msgs, "Project");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
}

TEST_F(MalformedTest, TenantHeader) {
  const grpc::Status s = Send(GoodStream(), "AttentionLayer", "bad tenant!");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("x-kvpack-tenant"), std::string::npos);
}

TEST_F(MalformedTest, WeightsAndRegions) {
  client::WeightsData w = WeightsOf(L_);
  w.head_dim = 48;
  EXPECT_EQ(c_->RegisterWeights(w).status().code(), absl::StatusCode::kInvalidArgument);
  w = WeightsOf(L_);
  w.k_norm = nullptr;
  absl::StatusOr<v1::WeightsResponse> r = c_->RegisterWeights(w);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("both or neither"), std::string::npos) << r.status();
  w = WeightsOf(L_);
  w.norm_len = 5;
  EXPECT_EQ(c_->RegisterWeights(w).status().code(), absl::StatusCode::kInvalidArgument);
  // Weights larger than the 64 MiB budget: refused at the header, before any upload.
  grpc::ClientContext ctx;
  c_->Prepare(&ctx);
  v1::WeightsResponse resp;
  auto writer = c_->stub()->RegisterWeights(&ctx, &resp);
  v1::WeightsRequest hdr;
  hdr.mutable_header()->set_hidden(65536);
  hdr.mutable_header()->set_n_heads(64);
  hdr.mutable_header()->set_head_dim(128);
  hdr.mutable_header()->mutable_w_qkv()->set_inline_bytes(3ull * 64 * 128 * 65536 * 2);
  writer->Write(hdr);
  writer->WritesDone();
  grpc::Status ws = writer->Finish();
  EXPECT_EQ(ws.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << ws.error_message();

  EXPECT_EQ(c_->RegisterShmRegion("no-slash", 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->RegisterShmRegion("/kvpack-does-not-exist-42", 100).status().code(), absl::StatusCode::kNotFound);
  auto shm = client::SharedMemory::Create(4096);
  ASSERT_TRUE(shm.ok());
  EXPECT_EQ(c_->RegisterShmRegion((*shm)->name(), 8192).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c_->UnregisterRegion("r-1").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c_->RegionStatus("r-1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c_->ReleaseKv("kv-1").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c_->ReleaseWeights("").code(), absl::StatusCode::kInvalidArgument);
  grpc::ClientContext rctx;
  c_->Prepare(&rctx);
  v1::RegisterRegionRequest bad_kind;
  v1::RegisterRegionResponse bad_resp;
  EXPECT_EQ(c_->stub()->RegisterRegion(&rctx, bad_kind, &bad_resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(*c_->Health());
}

}  // namespace
}  // namespace kvpack::testing
