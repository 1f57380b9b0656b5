// The Engine without gRPC: a layer job planned, admitted and run on the executor; and the staging
// path of backends that cannot read host memory, exercised by the CPU backend dressed as a device.
#include "server/runtime/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/synthetic.h"
#include "server/backends/cpu_backend.h"
#include "tests/server/service/test_layers.h"

namespace kvpack::server {
namespace {

// The CPU backend, but it claims not to read host memory and to take GPU turns, so the engine stages
// x, positions and the output through the I/O block and gates every chunk with a turn as it does for
// the CUDA backend. It counts the chunks running at once.
class FakeDeviceBackend final : public Backend {
 public:
  FakeDeviceBackend() : cpu_(MakeCpuBackend(1)) {}
  std::string name() const override { return "fakedev"; }
  absl::Status Supported(const LayerConfig& c) const override { return cpu_->Supported(c); }
  uint64_t KvBytes(const LayerConfig& c) const override { return cpu_->KvBytes(c); }
  uint64_t WorkspaceBytes(const LayerConfig& c) const override { return cpu_->WorkspaceBytes(c); }
  uint64_t RoutingBytes(const LayerConfig& c) const override { return cpu_->RoutingBytes(c); }
  uint64_t IoBytes(const LayerConfig& c, const TensorResidency& r) const override { return HostStagingBytes(c, r); }
  absl::Status ProjectKv(const LayerConfig& c, const LayerTensors& t, uint8_t* kv, uint8_t* ws,
                         const ChunkGate& gate) override {
    ++project_calls;
    in_project = true;
    if (hold_projects) release_projects.wait();
    bool in_chunk = false;
    absl::Status s = cpu_->ProjectKv(c, t, kv, ws, Counted(gate, &in_chunk));
    EndChunk(&in_chunk);
    return s;
  }
  absl::Status AttendLayer(const LayerConfig& c, const LayerTensors& t, const uint8_t* kv, uint8_t* ws,
                           const ChunkGate& gate, SparseReport* sparse_report) override {
    last_out = t.out;
    bool in_chunk = false;
    absl::Status s = cpu_->AttendLayer(c, t, kv, ws, Counted(gate, &in_chunk), sparse_report);
    EndChunk(&in_chunk);
    return s;
  }
  bool TakesTurns() const override { return true; }
  std::unique_ptr<Arena> CreateArena() override { return MakeHostArena(); }
  absl::Status CopyToPool(void* d, const void* s, uint64_t n) override {
    copied_in += n;
    std::memcpy(d, s, n);
    return absl::OkStatus();
  }
  absl::Status CopyFromPool(void* d, const void* s, uint64_t n) override {
    copied_out += n;
    std::memcpy(d, s, n);
    return absl::OkStatus();
  }
  bool ReadsHostMemory() const override { return false; }
  bool TakesIpcEvents() const override { return true; }
  absl::Status WaitIpcEvent(const std::string& handle, absl::Time) override {
    waited_events.push_back(handle);
    waited_before_project = project_calls == 0;
    if (pool != nullptr) kv_bytes_at_wait = pool->Snapshot().by_state[static_cast<int>(PoolState::kKvActive)];
    in_wait = true;
    if (hold_waits) release_waits.wait();
    return event_status;
  }
  void SetRunsAlone(std::function<bool()> probe) override { runs_alone = std::move(probe); }

  std::vector<std::string> waited_events;  // handles, in the order waited for
  bool waited_before_project = false;
  absl::Status event_status;               // what WaitIpcEvent answers
  const Pool* pool = nullptr;              // the engine's, when a test sets it
  uint64_t kv_bytes_at_wait = 0;           // the pool's active K/V bytes when the wait began
  std::atomic<bool> hold_waits{false};     // WaitIpcEvent blocks until release_waits is ready
  std::shared_future<void> release_waits;
  std::atomic<bool> in_wait{false};
  std::atomic<bool> hold_projects{false};  // ProjectKv blocks until release_projects is ready
  std::shared_future<void> release_projects;
  std::atomic<bool> in_project{false};
  std::function<bool()> runs_alone;        // the engine's probe (SetRunsAlone)
  std::atomic<int> alone_gates{0}, shared_gates{0};  // chunk gates called alone / beside other calls
  std::atomic<int> project_calls{0};
  std::atomic<uint64_t> copied_in{0}, copied_out{0};
  const uint16_t* last_out = nullptr;
  int max_running_chunks = 0;  // most chunks of all calls running at once
  int chunks = 0;

 private:
  // The engine's gate; a chunk runs from its gate's OK to the next gate call or the call's end.
  ChunkGate Counted(const ChunkGate& gate, bool* in_chunk) {
    return [this, &gate, in_chunk]() -> Error {
      EndChunk(in_chunk);
      ++(runs_alone && runs_alone() ? alone_gates : shared_gates);
      Error e = gate();
      if (e.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        *in_chunk = true;
        ++chunks;
        max_running_chunks = std::max(max_running_chunks, ++running_chunks_);
      }
      return e;
    };
  }
  void EndChunk(bool* in_chunk) {
    std::lock_guard<std::mutex> lock(mu_);
    if (*in_chunk) --running_chunks_;
    *in_chunk = false;
  }

  std::mutex mu_;
  int running_chunks_ = 0;
  std::unique_ptr<Backend> cpu_;
};

struct Ran {
  absl::Status status;
  std::vector<uint16_t> out;
  uint64_t peak = 0;
  LayerPlan plan;
};

// Registers the weights in the engine's pool, plans, submits and waits.
Ran RunOnEngine(Engine& engine, const client::SyntheticLayer& L, const std::string& wait_event = "") {
  auto w = std::make_shared<WeightsEntry>();
  w->id = Registry::NewId("w-");
  w->tenant = "t";
  w->hidden = L.spec.hidden;
  w->n_heads = L.spec.n_heads;
  w->head_dim = L.spec.head_dim;
  w->has_bias = !L.bias.empty();
  w->norm_len = static_cast<int>(L.q_norm.size());
  absl::StatusOr<Pool::Lease> lease = engine.pool().Allocate({w->total_bytes(), PoolState::kWeights, "t", {}});
  EXPECT_TRUE(lease.ok());
  w->lease = std::move(*lease);
  std::memcpy(w->lease.data(), L.w_qkv.data(), w->w_bytes());
  std::memcpy(w->lease.data() + w->bias_offset(), L.bias.data(), w->bias_bytes());
  std::memcpy(w->lease.data() + w->q_norm_offset(), L.q_norm.data(), w->norm_bytes());
  std::memcpy(w->lease.data() + w->k_norm_offset(), L.k_norm.data(), w->norm_bytes());

  LayerRequest request;
  request.shape = {L.spec.n_tokens, L.spec.hidden, L.spec.n_heads, L.spec.head_dim};
  int64_t begin = 0;
  for (const auto& r : L.spec.ranges) {
    std::vector<PageFormat> allowed;
    for (v1::Format f : r.allowed) allowed.push_back(client::ToPage(f));
    request.ranges.push_back(MakeRange(begin, begin + r.tokens, r.seq_id, std::move(allowed)));
    begin += r.tokens;
  }
  request.rope.layout = RopeLayout::kSplitHalves;
  request.rope.n_axes = 1;
  request.rope.axis_dims[0] = L.spec.head_dim;
  request.qk_norm.enabled = true;
  request.qk_norm.weight_len = L.spec.head_dim;
  request.attention.causal = L.spec.causal;
  request.has_bias = true;

  Ran ran;
  ran.out.assign(L.out_bytes() / 2, 0);
  auto job = std::make_shared<LayerJob>();
  job->tenant = "t";
  job->weights = w;
  absl::StatusOr<LayerPlan> plan = engine.Plan("t", request);
  EXPECT_TRUE(plan.ok() && plan->fits);
  job->plan = *plan;
  ran.plan = *plan;
  job->tensors.x = L.x.data();
  job->tensors.positions = L.positions.data();
  job->tensors.out = ran.out.data();
  job->wait_event = wait_event;
  std::promise<absl::Status> done;
  job->done = [&done](absl::Status s) { done.set_value(std::move(s)); };
  engine.Submit(job);
  ran.status = done.get_future().get();
  ran.peak = job->peak_bytes;
  return ran;
}

EngineOptions Options() {
  EngineOptions o;
  o.budget_bytes = 64 << 20;
  return o;
}

TEST(Engine, RunsAJobAndFreesItsMemory) {
  SystemClock clock;
  Engine engine(Options(), MakeCpuBackend(1), &clock);
  const client::SyntheticLayer L = client::MakeSyntheticLayer(testing::SmallSpec(41));
  Ran ran = RunOnEngine(engine, L);
  ASSERT_TRUE(ran.status.ok()) << ran.status;
  EXPECT_EQ(ran.plan.io_bytes, 0u);
  EXPECT_EQ(ran.peak, ran.plan.peak_bytes);
  v1::PlanResult proto_plan;
  for (const RangePlan& r : ran.plan.ranges) {
    proto_plan.add_ranges()->set_format(r.format == PageFormat::kBf16 ? v1::FORMAT_BF16
                                        : r.format == PageFormat::kInt8 ? v1::FORMAT_INT8 : v1::FORMAT_INT4);
  }
  proto_plan.set_projection_chunk(ran.plan.projection_chunk);
  proto_plan.set_query_chunk(ran.plan.query_chunk);
  absl::StatusOr<std::vector<uint16_t>> ref = client::ReferenceOutput(L, proto_plan);
  ASSERT_TRUE(ref.ok());
  EXPECT_TRUE(ran.out == *ref);
  EXPECT_EQ(engine.pool().Snapshot().by_state[static_cast<int>(PoolState::kWorkspace)], 0u);
  EXPECT_EQ(engine.pool().Snapshot().reserved, 0u);
}

TEST(Engine, StagesHostTensorsForDeviceBackends) {
  SystemClock clock;
  auto device = std::make_unique<FakeDeviceBackend>();
  FakeDeviceBackend* fake = device.get();
  Engine engine(Options(), std::move(device), &clock);
  Engine reference(Options(), MakeCpuBackend(1), &clock);
  const client::SyntheticLayer L = client::MakeSyntheticLayer(testing::SmallSpec(43));
  Ran staged = RunOnEngine(engine, L);
  Ran direct = RunOnEngine(reference, L);
  ASSERT_TRUE(staged.status.ok()) << staged.status;
  ASSERT_TRUE(direct.status.ok()) << direct.status;
  EXPECT_TRUE(staged.out == direct.out);
  const LayerShape& shape = staged.plan.config.shape;
  const uint64_t x_bytes = 2ull * shape.n_tokens * shape.hidden, positions_bytes = 4ull * L.positions.size(),
                 out_bytes = 2ull * shape.n_tokens * shape.HeadCols();
  EXPECT_EQ(staged.plan.io_bytes, PoolBytes(x_bytes) + PoolBytes(positions_bytes) + PoolBytes(out_bytes));
  EXPECT_EQ(staged.peak, staged.plan.peak_bytes);
  EXPECT_EQ(staged.peak, direct.peak + staged.plan.io_bytes);
  EXPECT_EQ(fake->copied_in, x_bytes + positions_bytes);
  // The output, and the entry's per-head error estimates (16 bytes a head) after the projection.
  EXPECT_EQ(fake->copied_out, out_bytes + uint64_t{kHeadEstimateFields} * sizeof(float) * shape.n_heads);
  EXPECT_NE(fake->last_out, nullptr);
  EXPECT_EQ(engine.pool().Snapshot().high_water, testing::WeightsPoolBytes(L) + staged.peak);
  EXPECT_EQ(engine.pool().Snapshot().allocated, 0u);
}

TEST(Engine, ConcurrentLayersOnADeviceTakeTurnsChunkByChunk) {
  SystemClock clock;
  EngineOptions options = Options();
  options.executor_threads = 3;
  options.max_chunk_tokens = 64;  // several chunks per layer, so the calls have turns to interleave
  auto device = std::make_unique<FakeDeviceBackend>();
  FakeDeviceBackend* fake = device.get();
  Engine engine(options, std::move(device), &clock);
  Engine reference(Options(), MakeCpuBackend(1), &clock);
  const client::SyntheticLayer a = client::MakeSyntheticLayer(testing::SmallSpec(45));
  const client::SyntheticLayer b = client::MakeSyntheticLayer(testing::SmallSpec(46));
  std::vector<std::future<Ran>> runs;
  for (int i = 0; i < 3; ++i) {
    runs.push_back(std::async(std::launch::async, [&, i] { return RunOnEngine(engine, i == 1 ? b : a); }));
  }
  const Ran want_a = RunOnEngine(reference, a), want_b = RunOnEngine(reference, b);
  for (int i = 0; i < 3; ++i) {
    Ran got = runs[i].get();
    ASSERT_TRUE(got.status.ok()) << got.status;
    EXPECT_TRUE(got.out == (i == 1 ? want_b : want_a).out) << "run " << i;
  }
  EXPECT_GT(fake->chunks, 3 * 2);
  EXPECT_EQ(fake->max_running_chunks, 1) << "two calls' chunks ran at once: the turn did not serialise them";
  // A job (and the weights lease it holds) is dropped by the executor thread just after its `done`
  // has fired, so the last release may trail the future by a moment.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (engine.pool().Snapshot().allocated != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(engine.pool().Snapshot().allocated, 0u);
}

// Pre-projected q, k, v (strided: column slices of one fused [N, 3·H·d] buffer) staged through the
// pool as whole spans, strides kept; no weights, and the peak is the plan's.
Ran RunProjected(Engine& engine, const std::vector<uint16_t>& fused, int64_t n, int heads, int head_dim) {
  const int64_t hd = static_cast<int64_t>(heads) * head_dim;
  LayerRequest request;
  request.shape = {n, static_cast<int>(hd), heads, head_dim};
  request.ranges = {MakeRange(0, n / 3, 0, {PageFormat::kBf16}), MakeRange(n / 3, n, 1, {PageFormat::kInt8, PageFormat::kInt4})};
  request.attention.causal = true;
  request.projected = {true, 3 * hd, head_dim, n, 0};
  Ran ran;
  ran.out.assign(static_cast<size_t>(n * hd), 0);
  auto job = std::make_shared<LayerJob>();
  job->tenant = "t";
  absl::StatusOr<LayerPlan> plan = engine.Plan("t", request);
  EXPECT_TRUE(plan.ok() && plan->fits);
  job->plan = *plan;
  ran.plan = *plan;
  job->tensors.q = fused.data();
  job->tensors.k = fused.data() + hd;
  job->tensors.v = fused.data() + 2 * hd;
  job->tensors.out = ran.out.data();
  std::promise<absl::Status> done;
  job->done = [&done](absl::Status s) { done.set_value(std::move(s)); };
  engine.Submit(job);
  ran.status = done.get_future().get();
  ran.peak = job->peak_bytes;
  return ran;
}

TEST(Engine, StagesProjectedInputsAsWholeSpans) {
  SystemClock clock;
  auto device = std::make_unique<FakeDeviceBackend>();
  FakeDeviceBackend* fake = device.get();
  Engine engine(Options(), std::move(device), &clock);
  Engine reference(Options(), MakeCpuBackend(1), &clock);
  const int64_t n = 203;
  const int heads = 2, head_dim = 32, hd = heads * head_dim;
  const client::SyntheticLayer L = client::MakeSyntheticLayer(testing::SmallSpec(47));
  std::vector<uint16_t> fused(static_cast<size_t>(n * 3 * hd));
  for (size_t i = 0; i < fused.size(); ++i) fused[i] = L.x[i % L.x.size()];  // seeded, structured, not zeros
  Ran staged = RunProjected(engine, fused, n, heads, head_dim);
  Ran direct = RunProjected(reference, fused, n, heads, head_dim);
  ASSERT_TRUE(staged.status.ok()) << staged.status;
  ASSERT_TRUE(direct.status.ok()) << direct.status;
  EXPECT_TRUE(staged.out == direct.out);
  const uint64_t span = 2ull * ((n - 1) * 3 * hd + hd), out_bytes = 2ull * n * hd;
  EXPECT_EQ(staged.plan.io_bytes, 3 * PoolBytes(span) + PoolBytes(out_bytes));
  EXPECT_EQ(direct.plan.workspace_bytes, PoolBytes(2ull * direct.plan.query_chunk * hd));  // no GEMM rows
  EXPECT_EQ(staged.peak, staged.plan.peak_bytes);
  EXPECT_EQ(fake->copied_in, 3 * span);
  EXPECT_EQ(fake->copied_out, out_bytes + uint64_t{kHeadEstimateFields} * sizeof(float) * heads);
  EXPECT_EQ(fake->project_calls, 1);
  EXPECT_EQ(engine.pool().Snapshot().high_water, staged.peak);
  EXPECT_EQ(reference.pool().Snapshot().high_water, direct.peak);
}


TEST(Engine, WaitsForTheCallersEventBeforeTheLayerRuns) {
  SystemClock clock;
  auto device = std::make_unique<FakeDeviceBackend>();
  FakeDeviceBackend* fake = device.get();
  Engine engine(Options(), std::move(device), &clock);
  const client::SyntheticLayer L = client::MakeSyntheticLayer(testing::SmallSpec(47));
  const std::string handle(64, '\x5a');
  Ran ran = RunOnEngine(engine, L, handle);
  ASSERT_TRUE(ran.status.ok()) << ran.status;
  EXPECT_EQ(fake->waited_events, std::vector<std::string>{handle});
  EXPECT_TRUE(fake->waited_before_project);
  // Without an event nothing is waited for.
  ASSERT_TRUE(RunOnEngine(engine, L).status.ok());
  EXPECT_EQ(fake->waited_events.size(), 1u);
}

TEST(Engine, AFailedWaitEndsTheJobBeforeItRunsAndFreesItsMemory) {
  SystemClock clock;
  auto device = std::make_unique<FakeDeviceBackend>();
  FakeDeviceBackend* fake = device.get();
  fake->event_status = absl::DeadlineExceededError("the deadline passed while waiting for header.cuda_wait_event");
  Engine engine(Options(), std::move(device), &clock);
  const client::SyntheticLayer L = client::MakeSyntheticLayer(testing::SmallSpec(53));
  Ran ran = RunOnEngine(engine, L, std::string(64, '\x33'));
  EXPECT_EQ(ran.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(fake->project_calls, 0);
  EXPECT_EQ(engine.pool().Snapshot().reserved, 0u);
  // The executor drops the job (and the weights lease it holds) just after `done` fired.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (engine.pool().Snapshot().allocated != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(engine.pool().Snapshot().allocated, 0u);
}

// Host-side preparation (staging, taking the memory) comes before the wait for the caller's event,
// so that it overlaps the caller's GPU work instead of following it.
TEST(Engine, TakesItsMemoryBeforeWaitingForTheCallersEvent) {
  SystemClock clock;
  auto device = std::make_unique<FakeDeviceBackend>();
  FakeDeviceBackend* fake = device.get();
  Engine engine(Options(), std::move(device), &clock);
  fake->pool = &engine.pool();
  const client::SyntheticLayer L = client::MakeSyntheticLayer(testing::SmallSpec(59));
  Ran ran = RunOnEngine(engine, L, std::string(64, '\x21'));
  ASSERT_TRUE(ran.status.ok()) << ran.status;
  EXPECT_TRUE(fake->waited_before_project);
  EXPECT_EQ(fake->kv_bytes_at_wait, PoolBytes(ran.plan.kv_bytes)) << "the K/V block was not taken before the wait";
  EXPECT_GT(fake->copied_in.load(), 0u) << "x was not staged";
}

// The backend's probe (SetRunsAlone) is true while one call runs and false while another runs
// beside it; a call still waiting for its caller's event has not joined (it cannot use the GPU
// before that work ends), so it does not keep the running one from running ahead.
TEST(Engine, ChunkGatesKnowWhetherTheirCallRunsAlone) {
  SystemClock clock;
  EngineOptions options = Options();
  options.executor_threads = 2;
  options.max_chunk_tokens = 64;  // several chunks per call
  auto device = std::make_unique<FakeDeviceBackend>();
  FakeDeviceBackend* fake = device.get();
  Engine engine(options, std::move(device), &clock);
  ASSERT_TRUE(fake->runs_alone != nullptr) << "the engine set no probe on a backend that takes turns";
  const client::SyntheticLayer a = client::MakeSyntheticLayer(testing::SmallSpec(61));
  const client::SyntheticLayer b = client::MakeSyntheticLayer(testing::SmallSpec(62));

  ASSERT_TRUE(RunOnEngine(engine, a).status.ok());
  EXPECT_GT(fake->alone_gates.load(), 2);
  EXPECT_EQ(fake->shared_gates.load(), 0);

  // The first call waits for its caller's event while the second runs: the second runs alone.
  std::promise<void> release_wait;
  fake->release_waits = release_wait.get_future().share();
  fake->hold_waits = true;
  fake->alone_gates = 0;
  std::future<Ran> waiting = std::async(std::launch::async, [&] { return RunOnEngine(engine, a, std::string(64, 'w')); });
  while (!fake->in_wait) std::this_thread::yield();
  ASSERT_TRUE(RunOnEngine(engine, b).status.ok());
  EXPECT_GT(fake->alone_gates.load(), 2);
  EXPECT_EQ(fake->shared_gates.load(), 0) << "a call waiting for its caller's event kept another from running ahead";
  release_wait.set_value();
  ASSERT_TRUE(waiting.get().status.ok());
  fake->hold_waits = false;

  // The first call has joined (it waits inside ProjectKv) while the second runs: not alone.
  std::promise<void> release_project;
  fake->release_projects = release_project.get_future().share();
  fake->in_project = false;
  fake->hold_projects = true;
  fake->alone_gates = 0;
  std::future<Ran> running = std::async(std::launch::async, [&] { return RunOnEngine(engine, a); });
  while (!fake->in_project) std::this_thread::yield();
  fake->hold_projects = false;  // the second call's ProjectKv goes straight through
  const Ran beside = RunOnEngine(engine, b);
  ASSERT_TRUE(beside.status.ok()) << beside.status;
  EXPECT_GT(fake->shared_gates.load(), 2);
  EXPECT_EQ(fake->alone_gates.load(), 0) << "a gate ran ahead while another call was running";
  const int shared = fake->shared_gates;
  release_project.set_value();
  ASSERT_TRUE(running.get().status.ok());
  EXPECT_GT(fake->alone_gates.load(), 2) << "the second call had left: the first runs alone";
  EXPECT_EQ(fake->shared_gates.load(), shared);
}

}  // namespace
}  // namespace kvpack::server
