// A client that goes away (cancels; to the daemon the same as a dead connection) at every stage of
// an AttentionLayer call: after the header, in the middle of the upload, after the upload, while
// the layer runs, after the result, in the middle of the streamed output. Each time the call ends
// (CANCELLED, or OK when the daemon had finished first), the metrics count it with that code (never
// INVALID_ARGUMENT: a stream cut mid-upload can look to the daemon like one its client ended early,
// and only OnDone tells them apart), the pool returns to empty, nothing stays queued or running,
// and the daemon serves the next call in full (docs/reliability.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/server/service/in_process_daemon.h"
#include "tests/server/service/metrics_text.h"
#include "tests/server/service/sanitizer_build.h"

namespace kvpack::testing {
namespace {

constexpr auto kSettle = std::chrono::milliseconds(10000 * kSanitizerSlowdown);  // a chunk ends first
constexpr uint64_t kUploadChunk = 256ull << 10;

// Pre-projected q, k, v of N = 64 tokens, 160 heads of 128: the output (2.5 MiB) streams back in
// two chunks, and the layer runs long enough (~0.1–1 s) to be caught running.
struct Layer {
  static constexpr int64_t kTokens = 64;
  static constexpr int kHeads = 160, kHeadDim = 128;
  v1::LayerHeader header;
  std::string qkv[3];
  uint64_t out_bytes = 2ull * kTokens * kHeads * kHeadDim;

  Layer() {
    header.mutable_shape()->set_n_tokens(kTokens);
    header.mutable_shape()->set_n_heads(kHeads);
    header.mutable_shape()->set_head_dim(kHeadDim);
    v1::TokenRange* r = header.add_ranges();
    r->set_end(kTokens);
    r->add_allowed_formats(v1::FORMAT_INT4);
    v1::ProjectedQkv* p = header.mutable_projected();
    p->set_layout(v1::ProjectedQkv::LAYOUT_TOKEN_MAJOR);
    uint64_t s = 0x5eed;
    for (int i = 0; i < 3; ++i) {
      qkv[i].resize(out_bytes);
      for (size_t j = 0; j + 1 < qkv[i].size(); j += 2) {  // bf16 in ±[0.25, 1), never zero
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        qkv[i][j] = static_cast<char>(0x80 + (s & 0x7f));
        qkv[i][j + 1] = static_cast<char>(0x3e | ((s >> 8) & 0x80));
      }
    }
    p->mutable_q()->set_inline_bytes(out_bytes);
    p->mutable_k()->set_inline_bytes(out_bytes);
    p->mutable_v()->set_inline_bytes(out_bytes);
  }
};

enum class Stage { kAfterHeader, kMidUpload, kAfterUpload, kWhileRunning, kAfterResult, kMidOutput, kNever };

const char* StageName(Stage s) {
  switch (s) {
    case Stage::kAfterHeader: return "AfterHeader";
    case Stage::kMidUpload: return "MidUpload";
    case Stage::kAfterUpload: return "AfterUpload";
    case Stage::kWhileRunning: return "WhileRunning";
    case Stage::kAfterResult: return "AfterResult";
    case Stage::kMidOutput: return "MidOutput";
    case Stage::kNever: return "Never";
  }
  return "?";
}

// Runs the call, going away at `stage`; returns the call's status and the output bytes received.
grpc::Status Call(v1::Kvpack::Stub& stub, server::Engine& engine, const Layer& L, Stage stage, uint64_t* received) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub.AttentionLayer(&context);
  auto leave_at = [&](Stage s) {
    if (s == stage) context.TryCancel();
    return s == stage;
  };
  *received = 0;
  do {
    v1::LayerRequest first;
    *first.mutable_header() = L.header;
    stream->Write(first);
    if (leave_at(Stage::kAfterHeader)) break;
    const v1::TensorId ids[3] = {v1::TENSOR_Q, v1::TENSOR_K, v1::TENSOR_V};
    bool left = false;
    for (int i = 0; i < 3 && !left; ++i) {
      for (uint64_t off = 0; off < L.out_bytes && !left; off += kUploadChunk) {
        v1::LayerRequest chunk;
        chunk.mutable_chunk()->set_tensor(ids[i]);
        chunk.mutable_chunk()->set_offset(off);
        chunk.mutable_chunk()->set_data(L.qkv[i].substr(off, kUploadChunk));
        stream->Write(chunk);
        left = i == 1 && off == 0 && leave_at(Stage::kMidUpload);
      }
    }
    if (left) break;
    stream->WritesDone();
    if (leave_at(Stage::kAfterUpload)) break;
    if (stage == Stage::kWhileRunning) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (engine.Running() == 0 && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      EXPECT_GT(engine.Running(), 0) << "the layer was never seen running";
      context.TryCancel();
      break;
    }
    v1::LayerResponse response;
    if (!stream->Read(&response)) break;  // the result
    if (leave_at(Stage::kAfterResult)) break;
    while (stream->Read(&response)) {
      *received += response.chunk().data().size();
      if (leave_at(Stage::kMidOutput)) break;
    }
  } while (false);
  return stream->Finish();
}

class DisconnectTest : public ::testing::TestWithParam<Stage> {};

TEST_P(DisconnectTest, TheDaemonCleansUpAndServesTheNextCall) {
  const Stage stage = GetParam();
  InProcessDaemon daemon(nullptr);
  ASSERT_TRUE(daemon.ok());
  auto c = daemon.Connect();
  const Layer L;
  uint64_t received = 0;
  const grpc::Status status = Call(*c->stub(), daemon.engine(), L, stage, &received);
  if (stage <= Stage::kWhileRunning) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  } else {  // the daemon may have sent everything before the cancel arrived
    EXPECT_TRUE(status.error_code() == grpc::StatusCode::CANCELLED || status.ok()) << status.error_message();
  }
  EXPECT_TRUE(daemon.PoolEmptyWithin(kSettle)) << StageName(stage) << ": "
                                               << daemon.engine().pool().Snapshot().allocated << " bytes held";
  // Counted (from the reactor's OnDone, a moment after the client's status) with the code the call
  // ended with.
  auto count = [&](const char* code) {
    return Sample(daemon.engine().metrics().Render(),
                  std::string("kvpack_requests_total{code=\"") + code + "\",method=\"AttentionLayer\"}");
  };
  // After the result the daemon may have finished OK before the client's cancel reached it.
  auto counted = [&] {
    const double cancelled = std::max(0.0, count("CANCELLED")), ok = std::max(0.0, count("OK"));
    return stage <= Stage::kWhileRunning ? cancelled == 1.0 && ok == 0.0 : cancelled + ok == 1.0;
  };
  EXPECT_TRUE(WaitFor(counted, kSettle)) << StageName(stage) << ": " << daemon.engine().metrics().Render();
  EXPECT_LT(count("INVALID_ARGUMENT"), 1.0) << StageName(stage) << ": a cut stream counted as a malformed one";
  // The job lets go of its pool memory a moment before it stops counting as running.
  const auto until = std::chrono::steady_clock::now() + kSettle;
  absl::StatusOr<v1::StatusResponse> s = c->Status();
  while (s.ok() && (s->queue_depth() != 0 || s->running() != 0) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    s = c->Status();
  }
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->queue_depth(), 0);
  EXPECT_EQ(s->running(), 0) << StageName(stage) << ": a job still runs " << kSettle.count() << " ms after";

  // The next call runs in full.
  const grpc::Status next = Call(*c->stub(), daemon.engine(), L, Stage::kNever, &received);
  EXPECT_TRUE(next.ok()) << next.error_message();
  EXPECT_EQ(received, L.out_bytes);
  EXPECT_TRUE(daemon.PoolEmptyWithin(kSettle));
}

INSTANTIATE_TEST_SUITE_P(Stages, DisconnectTest,
                         ::testing::Values(Stage::kAfterHeader, Stage::kMidUpload, Stage::kAfterUpload,
                                           Stage::kWhileRunning, Stage::kAfterResult, Stage::kMidOutput),
                         [](const ::testing::TestParamInfo<Stage>& info) { return std::string(StageName(info.param)); });

}  // namespace
}  // namespace kvpack::testing
