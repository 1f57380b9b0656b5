// AttentionLayer with pre-projected q, k, v (header.projected) against the real kvpackd (CPU
// backend): the same rows sent as x = [q | k | v] with an identity weight go through the projection
// unchanged (one product of 1.0 per output, exact in fp32 and bf16), so both paths must give
// bit-identical outputs. Also: the planner's peak is the pool's high-water mark with no GEMM
// workspace, layouts and strides, and malformed headers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/format.h"
#include "tests/server/service/daemon_process.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::testing {
namespace {

constexpr int kHeads = 2;
constexpr int kDim = 64;
constexpr int kHd = kHeads * kDim;
constexpr int64_t kTokens = 302;  // two sequences of 151 (odd sizes, partial pages)

// Seeded bf16 rows with per-channel offsets and a few outlier channels, never zeros.
std::vector<uint16_t> RandomRows(int64_t rows, int cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::student_t_distribution<float> tail(4.0f);
  std::vector<float> offset(cols);
  for (int c = 0; c < cols; ++c) offset[c] = 0.5f * tail(rng) + (c % 17 == 3 ? 8.0f : 0.0f);
  std::vector<uint16_t> out(static_cast<size_t>(rows) * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) out[r * cols + c] = FloatToBf16(offset[c] + tail(rng));
  }
  return out;
}

v1::LayerHeader BaseHeader() {
  v1::LayerHeader h;
  h.mutable_shape()->set_n_tokens(kTokens);
  h.mutable_shape()->set_n_heads(kHeads);
  h.mutable_shape()->set_head_dim(kDim);
  const int64_t half = kTokens / 2;
  v1::TokenRange* a = h.add_ranges();
  a->set_end(77);
  a->add_allowed_formats(v1::FORMAT_BF16);
  v1::TokenRange* b = h.add_ranges();
  b->set_begin(77);
  b->set_end(half);
  b->add_allowed_formats(v1::FORMAT_INT8);
  v1::TokenRange* c = h.add_ranges();
  c->set_begin(half);
  c->set_end(kTokens);
  c->set_seq_id(1);
  c->add_allowed_formats(v1::FORMAT_INT4);
  h.mutable_options()->mutable_attention()->set_causal(true);
  return h;
}

v1::LayerHeader ProjectedHeader(v1::ProjectedQkv::Layout layout, int64_t row_stride = 0, int batch = 0) {
  v1::LayerHeader h = BaseHeader();
  v1::ProjectedQkv* p = h.mutable_projected();
  p->set_layout(layout);
  p->set_row_stride(row_stride);
  p->set_batch(batch);
  return h;
}

// [N, H·d] token-major rows → [B, H, N/B, d] head-major.
std::vector<uint16_t> ToHeadMajor(const std::vector<uint16_t>& rows, int batch) {
  const int64_t m = kTokens / batch;
  std::vector<uint16_t> out(rows.size());
  for (int64_t t = 0; t < kTokens; ++t) {
    const int64_t b = t / m, i = t % m;
    for (int h = 0; h < kHeads; ++h) {
      std::memcpy(&out[((b * kHeads + h) * m + i) * kDim], &rows[t * kHd + h * kDim], kDim * 2);
    }
  }
  return out;
}

class ProjectedTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.ok()) << daemon_.why(); }

  // The reference: x = [q | k | v] per token with the identity weight, through the x + W path.
  std::vector<uint16_t> IdentityPath(client::Client& c) {
    std::vector<uint16_t> x(static_cast<size_t>(kTokens) * 3 * kHd);
    for (int64_t t = 0; t < kTokens; ++t) {
      std::memcpy(&x[t * 3 * kHd], &q_[t * kHd], kHd * 2);
      std::memcpy(&x[t * 3 * kHd + kHd], &k_[t * kHd], kHd * 2);
      std::memcpy(&x[t * 3 * kHd + 2 * kHd], &v_[t * kHd], kHd * 2);
    }
    std::vector<uint16_t> eye(static_cast<size_t>(3 * kHd) * 3 * kHd, 0);
    for (int i = 0; i < 3 * kHd; ++i) eye[static_cast<size_t>(i) * 3 * kHd + i] = 0x3F80;  // bf16 1.0
    client::WeightsData w;
    w.hidden = 3 * kHd;
    w.n_heads = kHeads;
    w.head_dim = kDim;
    w.w_qkv = eye.data();
    absl::StatusOr<v1::WeightsResponse> handle = c.RegisterWeights(w);
    EXPECT_TRUE(handle.ok()) << handle.status();
    v1::LayerHeader h = BaseHeader();
    h.mutable_shape()->set_hidden(3 * kHd);
    h.set_weights_handle(handle->handle());
    std::vector<uint16_t> out(static_cast<size_t>(kTokens) * kHd);
    client::LayerData data;
    data.x = x.data();
    data.out = out.data();
    data.out_capacity = out.size() * 2;
    absl::StatusOr<v1::LayerResult> r = c.AttentionLayer(h, data);
    EXPECT_TRUE(r.ok()) << r.status();
    return out;
  }

  absl::StatusOr<v1::LayerResult> Run(client::Client& c, const v1::LayerHeader& h, const void* q, const void* k,
                                      const void* v, std::vector<uint16_t>* out) {
    out->assign(static_cast<size_t>(kTokens) * kHd, 0);
    client::LayerData data;
    data.q = q, data.k = k, data.v = v;
    data.out = out->data();
    data.out_capacity = out->size() * 2;
    return c.AttentionLayer(h, data);
  }

  DaemonProcess daemon_{{"--vram_budget=256Mi"}};
  std::vector<uint16_t> q_ = RandomRows(kTokens, kHd, 11);
  std::vector<uint16_t> k_ = RandomRows(kTokens, kHd, 12);
  std::vector<uint16_t> v_ = RandomRows(kTokens, kHd, 13);
};

TEST_F(ProjectedTest, TokenMajorMatchesTheIdentityWeightPathBitForBit) {
  auto c = daemon_.Connect();
  std::vector<uint16_t> out;
  absl::StatusOr<v1::LayerResult> r =
      Run(*c, ProjectedHeader(v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR), q_.data(), k_.data(), v_.data(), &out);
  ASSERT_TRUE(r.ok()) << r.status();

  // No weights, no GEMM workspace: the workspace is the stored-form Q of one chunk, and the
  // pool's high-water mark is exactly the plan's predicted peak.
  const uint64_t q_chunk = static_cast<uint64_t>(r->plan().query_chunk()) * kHd * 2;
  EXPECT_EQ(r->plan().workspace_bytes(), server::PoolBytes(q_chunk));
  EXPECT_EQ(r->peak_bytes(), r->plan().predicted_peak_bytes());
  absl::StatusOr<v1::StatusResponse> s = c->Status();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->high_water_bytes(), r->plan().predicted_peak_bytes());
  EXPECT_EQ(s->pool_bytes(), 0u);
  EXPECT_EQ(s->inline_bytes_received(), 3ull * kTokens * kHd * 2);
  EXPECT_EQ(s->inline_bytes_sent(), static_cast<uint64_t>(kTokens) * kHd * 2);
  EXPECT_EQ(s->device_ordinal(), -1);
  EXPECT_EQ(s->device_uuid(), "");

  const std::vector<uint16_t> want = IdentityPath(*c);
  EXPECT_TRUE(out == want) << "max |err| " << client::Compare(out, want).max_abs;
}

TEST_F(ProjectedTest, HeadMajorBatchAndStridedRegionsGiveTheSameOutput) {
  auto c = daemon_.Connect();
  std::vector<uint16_t> token_major;
  ASSERT_TRUE(
      Run(*c, ProjectedHeader(v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR), q_.data(), k_.data(), v_.data(), &token_major)
          .ok());

  // [B = 2, H, 151, d] (what ComfyUI's skip_reshape layout holds), inline.
  const std::vector<uint16_t> qh = ToHeadMajor(q_, 2), kh = ToHeadMajor(k_, 2), vh = ToHeadMajor(v_, 2);
  std::vector<uint16_t> head_major;
  absl::StatusOr<v1::LayerResult> r = Run(*c, ProjectedHeader(v1::ProjectedQkv::LAYOUT_HEAD_MAJOR, 0, 2), qh.data(),
                                          kh.data(), vh.data(), &head_major);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(head_major == token_major);

  // q, k, v as column slices of one fused [N, 3·H·d] tensor in a shared-memory region
  // (row_stride = 3·H·d, no copy on the client), output into the same region.
  const uint64_t fused_bytes = static_cast<uint64_t>(kTokens) * 3 * kHd * 2;
  const uint64_t out_bytes = static_cast<uint64_t>(kTokens) * kHd * 2;
  absl::StatusOr<std::unique_ptr<client::SharedMemory>> shm = client::SharedMemory::Create(fused_bytes + out_bytes);
  ASSERT_TRUE(shm.ok()) << shm.status();
  auto* fused = reinterpret_cast<uint16_t*>((*shm)->data());
  for (int64_t t = 0; t < kTokens; ++t) {
    std::memcpy(fused + t * 3 * kHd, &q_[t * kHd], kHd * 2);
    std::memcpy(fused + t * 3 * kHd + kHd, &k_[t * kHd], kHd * 2);
    std::memcpy(fused + t * 3 * kHd + 2 * kHd, &v_[t * kHd], kHd * 2);
  }
  absl::StatusOr<std::string> region = c->RegisterShmRegion((*shm)->name(), (*shm)->size());
  ASSERT_TRUE(region.ok()) << region.status();
  v1::LayerHeader h = ProjectedHeader(v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR, 3 * kHd);
  const uint64_t span = client::ProjectedBytes(h);
  EXPECT_EQ(span, 2ull * ((kTokens - 1) * 3 * kHd + kHd));
  v1::TensorRef* refs[3] = {h.mutable_projected()->mutable_q(), h.mutable_projected()->mutable_k(),
                            h.mutable_projected()->mutable_v()};
  for (int i = 0; i < 3; ++i) {
    v1::RegionSlice* slice = refs[i]->mutable_region();
    slice->set_region_id(*region);
    slice->set_offset(static_cast<uint64_t>(i) * kHd * 2);
    slice->set_size_bytes(span);
  }
  h.mutable_output()->set_mode(v1::OUTPUT_REGION);
  h.mutable_output()->mutable_region()->set_region_id(*region);
  h.mutable_output()->mutable_region()->set_offset(fused_bytes);
  h.mutable_output()->mutable_region()->set_size_bytes(out_bytes);
  absl::StatusOr<v1::StatusResponse> before = c->Status();
  r = c->AttentionLayer(h, client::LayerData{});
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<v1::StatusResponse> after = c->Status();
  EXPECT_EQ(after->inline_bytes_received(), before->inline_bytes_received());  // nothing travelled inline
  EXPECT_EQ(after->inline_bytes_sent(), before->inline_bytes_sent());
  std::vector<uint16_t> from_region(kTokens * kHd);
  std::memcpy(from_region.data(), (*shm)->data() + fused_bytes, out_bytes);
  EXPECT_TRUE(from_region == token_major);
  ASSERT_TRUE(c->UnregisterRegion(*region).ok());
}

TEST_F(ProjectedTest, MalformedHeadersNameTheField) {
  auto c = daemon_.Connect();
  std::vector<uint16_t> out;
  const auto expect = [&](const v1::LayerHeader& h, const void* v, absl::StatusCode code, const std::string& field) {
    absl::StatusOr<v1::LayerResult> r = Run(*c, h, q_.data(), k_.data(), v, &out);
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
  };
  const auto token_major = [] { return ProjectedHeader(v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR); };

  // A missing tensor.
  expect(token_major(), nullptr, absl::StatusCode::kInvalidArgument, "header.projected.v: required");
  // A size that does not match the shape.
  v1::LayerHeader h = token_major();
  h.mutable_projected()->mutable_k()->set_inline_bytes(kTokens * kHd * 2 - 2);
  expect(h, v_.data(), absl::StatusCode::kInvalidArgument, "header.projected.k.inline_bytes");
  // Options that need x and weights.
  h = token_major();
  h.mutable_options()->mutable_rope()->set_layout(v1::RopeOptions::LAYOUT_SPLIT_HALVES);
  h.mutable_options()->mutable_rope()->add_axis_dims(kDim);
  expect(h, v_.data(), absl::StatusCode::kInvalidArgument, "header.options.rope");
  h = token_major();
  h.mutable_options()->mutable_qk_norm()->set_enabled(true);
  expect(h, v_.data(), absl::StatusCode::kInvalidArgument, "header.options.qk_norm.enabled");
  h = token_major();
  h.set_weights_handle("w-0123");
  expect(h, v_.data(), absl::StatusCode::kInvalidArgument, "header.weights_handle");
  h = token_major();
  h.mutable_shape()->set_hidden(kHd + 8);
  expect(h, v_.data(), absl::StatusCode::kInvalidArgument, "header.shape.hidden");
  h = token_major();
  h.mutable_output()->set_mode(v1::OUTPUT_IN_PLACE);
  expect(h, v_.data(), absl::StatusCode::kInvalidArgument, "header.output.mode");
  // Layouts.
  expect(ProjectedHeader(v1::ProjectedQkv::LAYOUT_UNSPECIFIED), v_.data(), absl::StatusCode::kInvalidArgument,
         "header.projected.layout");
  expect(ProjectedHeader(v1::ProjectedQkv::LAYOUT_HEAD_MAJOR, 0, 4), v_.data(), absl::StatusCode::kInvalidArgument,
         "header.projected.batch");
  expect(ProjectedHeader(v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR, kHd - 1), v_.data(), absl::StatusCode::kInvalidArgument,
         "header.projected.row_stride");
  // Project and Attend need x and weights.
  client::LayerData data;
  data.q = q_.data(), data.k = k_.data(), data.v = v_.data();
  h = token_major();
  h.mutable_output()->set_mode(v1::OUTPUT_NONE);
  absl::StatusOr<v1::LayerResult> r = c->Project(h, data);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("header.projected"), std::string::npos) << r.status();

  // The daemon still serves after all of it.
  EXPECT_TRUE(Run(*c, token_major(), q_.data(), k_.data(), v_.data(), &out).ok());
}

}  // namespace
}  // namespace kvpack::testing
