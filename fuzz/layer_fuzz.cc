// Fuzz target: one whole AttentionLayer call through the real service (gRPC reactor, conversion,
// limits, planner, scheduler, executor, CPU backend) over a Unix socket (LAYER_FUZZ_INPROC=1: gRPC's
// in-process channel).
//
// Input: one flags byte (Flags below; kUnary sends the header over AttentionLayerRegions, kLane
// through a lane (kvpack/v1/lane.h); without kChooseDefault an unset per-head transform choice is
// turned off), then a
// v1::LayerHeader (wire bytes, or 't' + text format: ParseInput).
// The harness registers weights that match the header's shape (flags: bias, QK-norm weights of d
// or H·d, whether the header names them), streams every inline tensor the header declares (seeded
// bf16/f32 data, never zeros), reads the result and the output, releases what the call kept, and
// checks:
//   * the call ends with a code a client can act on — never UNKNOWN, INTERNAL or a hang (the
//     deadline below is ~100x a call's worst time at these sizes);
//   * an OK call returns its whole output (N·H·d bf16 when inline) and peak == predicted peak;
//   * the pool returns to empty (no allocated, no reserved bytes) after every call.
// The service's limits keep shapes tiny (N ≤ 192, D ≤ 128, H ≤ 4), so one exec is milliseconds.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <sanitizer/allocator_interface.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include "client/client.h"
#include "client/lane.h"
#include "fuzz/fuzz_input.h"
#include "kvpack/v1/kvpack.grpc.pb.h"
#include "server/backends/cpu_backend.h"
#include "server/service/service.h"

namespace kvpack::server {
namespace {

constexpr uint64_t kBudgetBytes = 64ull << 20;
constexpr uint64_t kMaxInlineBytes = 1ull << 20;
constexpr uint64_t kChunkBytes = 64ull << 10;  // several chunks per tensor at the largest shapes
constexpr auto kCallDeadline = std::chrono::seconds(30);
constexpr auto kPoolSettle = std::chrono::seconds(5);  // reactors drop their references after Finish
// The reactor lets go within microseconds of Finish: a 1 ms poll cost most execs a whole millisecond.
constexpr auto kPoolPoll = std::chrono::microseconds(20);

enum Flags : uint8_t {
  kBias = 1,
  kNormShared = 2,     // q/k norm weights of d values
  kNormPerHead = 4,    // q/k norm weights of H·d values (wins over kNormShared)
  kUseWeights = 8,     // put the registered handle into header.weights_handle
  kUnary = 16,         // send the header over the unary AttentionLayerRegions instead of the stream
  kChooseDefault = 32, // leave an unset transforms.choose_per_head at the daemon's default (on)
  kLane = 64,          // send the header through a lane (over the socket only; wins over kUnary)
};
// Without kChooseDefault the harness turns an unset choose_per_head off. The choice's host evaluator
// (pure arithmetic, held bit for bit by transform_choice_test and cuda_head_choice_test) costs tens
// of milliseconds per head under ASan at the service's largest shapes, 100x the rest of a call; with
// it on by default the corpus drifted to those shapes and the target ran at ~150 execs/s per core
// (bench/RESULTS.md, session 9). The bit keeps the path one mutation away.

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "layer_fuzz: %s\n", what.c_str());
  std::abort();
}

// Seeded, never-zero bytes: bf16 values in [0.25, 1) with random signs (valid for every float
// tensor too when read as f32 pairs: exponents stay small).
std::string Filled(uint64_t bytes, uint64_t seed) {
  std::string out(bytes, '\0');
  uint64_t s = seed | 1;
  for (uint64_t i = 0; i + 1 < bytes; i += 2) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const uint16_t bf16 = static_cast<uint16_t>(0x3e80 + (s & 0x7f)) | static_cast<uint16_t>((s >> 8) & 0x8000);
    out[i] = static_cast<char>(bf16 & 0xff);
    out[i + 1] = static_cast<char>(bf16 >> 8);
  }
  return out;
}

class Harness {
 public:
  Harness() {
    EngineOptions eo;
    eo.budget_bytes = kBudgetBytes;
    eo.max_chunk_tokens = 64;  // several chunks per call, so the chunk loop and its gate run
    engine_ = std::make_unique<Engine>(eo, MakeCpuBackend(1), &clock_);
    ServiceLimits limits;
    limits.max_inline_bytes = kMaxInlineBytes;
    limits.max_tokens = 192;
    limits.max_hidden = 128;
    limits.max_heads = 4;
    service_ = std::make_unique<KvpackService>(engine_.get(), Auth(), limits);
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    // Over a Unix socket, as a client on the host reaches kvpackd. The in-process channel
    // (LAYER_FUZZ_INPROC=1) leaks in libgrpc 1.51's in-process transport: 1.4–4.5 KB of live heap per
    // call refused while its header is read, none over the socket with the same inputs (session 10);
    // the fuzzer's RSS grew to its 4 GiB limit at 2.7 M executions.
    const bool inproc = std::getenv("LAYER_FUZZ_INPROC") != nullptr;
    if (!inproc) {
      socket_path_ = SocketPath();
      ::unlink(socket_path_.c_str());
      builder.AddListeningPort("unix:" + socket_path_, grpc::InsecureServerCredentials());
    }
    server_ = builder.BuildAndStart();
    if (!server_) Fail("the service did not start on " + socket_path_);
    stub_ = v1::Kvpack::NewStub(inproc ? server_->InProcessChannel(grpc::ChannelArguments())
                                       : grpc::CreateChannel("unix:" + socket_path_, grpc::InsecureChannelCredentials()));
    if (!inproc) {  // the lane's region is a shared-memory object the daemon maps by name
      client::ClientOptions o;
      o.address = "unix:" + socket_path_;
      absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Connect(o);
      if (!c.ok()) Fail("client: " + std::string(c.status().message()));
      client_ = *std::move(c);
      absl::StatusOr<std::unique_ptr<client::Lane>> lane = client::Lane::Open(client_.get());
      if (!lane.ok()) Fail("OpenLane: " + std::string(lane.status().message()));
      lane_ = *std::move(lane);
    }
  }

  void Run(uint8_t flags, v1::LayerHeader header, uint64_t seed) {
    std::string weights;
    if (!header.has_projected()) weights = RegisterWeights(header.shape(), flags, seed);
    if (flags & kUseWeights) header.set_weights_handle(weights);
    v1::TransformOptions* transforms = header.mutable_options()->mutable_transforms();
    if (!(flags & kChooseDefault) && !transforms->has_choose_per_head()) transforms->set_choose_per_head(false);
    const std::string kept = (flags & kLane) && lane_ ? CallLane(header)
                             : (flags & (kUnary | kLane)) ? CallUnary(header)
                                                          : Call(header, seed);
    if (!kept.empty()) Release(kept, /*weights=*/false);
    if (!weights.empty()) Release(weights, /*weights=*/true);
    CheckPoolEmpty();
  }

 private:
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    return context;
  }

  static void CheckCode(const grpc::Status& status, const char* method) {
    switch (status.error_code()) {
      case grpc::StatusCode::UNKNOWN:
      case grpc::StatusCode::INTERNAL:
      case grpc::StatusCode::DEADLINE_EXCEEDED:
      case grpc::StatusCode::UNAVAILABLE:
        Fail(std::string(method) + " ended with code " + std::to_string(status.error_code()) + ": " +
             status.error_message());
      default:
        break;
    }
  }

  // Weights for the header's shape when it is within the service's limits; "" otherwise.
  std::string RegisterWeights(const v1::LayerShape& shape, uint8_t flags, uint64_t seed) {
    const int64_t d = shape.head_dim(), h = shape.n_heads(), hidden = shape.hidden();
    if (d < 1 || d > 256 || h < 1 || h > 4 || hidden < 1 || hidden > 128) return "";
    const uint64_t rows = 3ull * h * d;
    const uint64_t norm_len = (flags & kNormPerHead) ? h * d : (flags & kNormShared) ? d : 0;
    struct Tensor {
      v1::TensorId id;
      uint64_t bytes;
    };
    std::vector<Tensor> tensors = {{v1::TENSOR_W_QKV, rows * hidden * 2}};
    if (flags & kBias) tensors.push_back({v1::TENSOR_BIAS, rows * 4});
    if (norm_len) tensors.push_back({v1::TENSOR_Q_NORM_WEIGHT, norm_len * 4});
    if (norm_len) tensors.push_back({v1::TENSOR_K_NORM_WEIGHT, norm_len * 4});

    v1::WeightsRequest request;
    v1::WeightsHeader* wh = request.mutable_header();
    wh->set_hidden(static_cast<int32_t>(hidden));
    wh->set_n_heads(static_cast<int32_t>(h));
    wh->set_head_dim(static_cast<int32_t>(d));
    for (const Tensor& t : tensors) {
      v1::TensorRef* ref = t.id == v1::TENSOR_W_QKV ? wh->mutable_w_qkv()
                           : t.id == v1::TENSOR_BIAS ? wh->mutable_bias()
                           : t.id == v1::TENSOR_Q_NORM_WEIGHT ? wh->mutable_q_norm_weight()
                                                              : wh->mutable_k_norm_weight();
      ref->set_inline_bytes(t.bytes);
    }
    std::unique_ptr<grpc::ClientContext> context = Context();
    v1::WeightsResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::WeightsRequest>> writer = stub_->RegisterWeights(context.get(), &response);
    bool ok = writer->Write(request);
    for (const Tensor& t : tensors) {
      if (!ok) break;
      const std::string data = Filled(t.bytes, seed + t.id);
      for (uint64_t off = 0; ok && off < t.bytes; off += kChunkBytes) {
        v1::WeightsRequest chunk;
        chunk.mutable_chunk()->set_tensor(t.id);
        chunk.mutable_chunk()->set_offset(off);
        chunk.mutable_chunk()->set_data(data.substr(off, kChunkBytes));
        ok = writer->Write(chunk);
      }
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    CheckCode(status, "RegisterWeights");
    return status.ok() ? response.handle() : "";
  }

  // The AttentionLayer call; returns the kept K/V handle, if any.
  std::string Call(const v1::LayerHeader& header, uint64_t seed) {
    struct Inline {
      v1::TensorId id;
      uint64_t bytes;
    };
    std::vector<Inline> inputs;
    auto add = [&inputs](v1::TensorId id, const v1::TensorRef& ref) {
      if (ref.location_case() == v1::TensorRef::kInlineBytes && ref.inline_bytes() <= kMaxInlineBytes) {
        inputs.push_back({id, ref.inline_bytes()});
      }
    };
    if (header.has_projected()) {
      add(v1::TENSOR_Q, header.projected().q());
      add(v1::TENSOR_K, header.projected().k());
      add(v1::TENSOR_V, header.projected().v());
    } else {
      add(v1::TENSOR_X, header.x());
    }
    add(v1::TENSOR_POSITIONS, header.positions());

    std::unique_ptr<grpc::ClientContext> context = Context();
    auto stream = stub_->AttentionLayer(context.get());
    v1::LayerRequest first;
    *first.mutable_header() = header;
    bool ok = stream->Write(first);
    for (const Inline& in : inputs) {
      const std::string data = Filled(in.bytes, seed + in.id);
      for (uint64_t off = 0; ok && off < in.bytes; off += kChunkBytes) {
        v1::LayerRequest chunk;
        chunk.mutable_chunk()->set_tensor(in.id);
        chunk.mutable_chunk()->set_offset(off);
        chunk.mutable_chunk()->set_data(data.substr(off, kChunkBytes));
        ok = stream->Write(chunk);
      }
    }
    stream->WritesDone();
    v1::LayerResponse response;
    v1::LayerResult result;
    bool have_result = false;
    uint64_t output_bytes = 0;
    while (stream->Read(&response)) {
      if (response.has_result()) {
        result = response.result();
        have_result = true;
      } else {
        output_bytes += response.chunk().data().size();
      }
    }
    const grpc::Status status = stream->Finish();
    if (verbose_) {
      std::fprintf(stderr, "layer_fuzz: AttentionLayer %d %s (%llu output bytes)\n", status.error_code(),
                   status.error_message().c_str(), static_cast<unsigned long long>(output_bytes));
    }
    CheckCode(status, "AttentionLayer");
    if (status.ok()) {
      if (!have_result) Fail("AttentionLayer: OK without a result");
      if (output_bytes != result.output_bytes()) {
        Fail("AttentionLayer: " + std::to_string(output_bytes) + " output bytes, the result says " +
             std::to_string(result.output_bytes()));
      }
      if (result.peak_bytes() != result.plan().predicted_peak_bytes()) {
        Fail("AttentionLayer: peak " + std::to_string(result.peak_bytes()) + " != predicted " +
             std::to_string(result.plan().predicted_peak_bytes()));
      }
    }
    return status.ok() ? result.kv_handle() : "";
  }

  // The same header over AttentionLayerRegions (inline tensors and outputs are refused there; the
  // harness registers no regions, so an OK call has neither); returns the kept K/V handle, if any.
  std::string CallUnary(const v1::LayerHeader& header) {
    std::unique_ptr<grpc::ClientContext> context = Context();
    v1::LayerResult result;
    const grpc::Status status = stub_->AttentionLayerRegions(context.get(), header, &result);
    if (verbose_) {
      std::fprintf(stderr, "layer_fuzz: AttentionLayerRegions %d %s\n", status.error_code(),
                   status.error_message().c_str());
    }
    CheckCode(status, "AttentionLayerRegions");
    if (status.ok()) {
      if (result.output_bytes() != 0) Fail("AttentionLayerRegions: an inline output");
      if (result.peak_bytes() != result.plan().predicted_peak_bytes()) {
        Fail("AttentionLayerRegions: peak " + std::to_string(result.peak_bytes()) + " != predicted " +
             std::to_string(result.plan().predicted_peak_bytes()));
      }
    }
    return status.ok() ? result.kv_handle() : "";
  }

  // The same header through the lane: the daemon reads the request bytes out of shared memory.
  std::string CallLane(const v1::LayerHeader& header) {
    const std::string bytes = header.SerializeAsString();
    absl::StatusOr<client::Lane::Answer> a =
        lane_->CallRaw(v1::lane::kAttentionLayerRegions, bytes, static_cast<uint32_t>(bytes.size()),
                       absl::FromChrono(kCallDeadline));
    if (!a.ok()) Fail("lane: " + std::string(a.status().message()));
    const grpc::Status status(static_cast<grpc::StatusCode>(a->code), a->code == 0 ? "" : a->bytes);
    if (verbose_) std::fprintf(stderr, "layer_fuzz: AttentionLayerLane %d %s\n", a->code, status.error_message().c_str());
    CheckCode(status, "AttentionLayerLane");
    if (!status.ok()) return "";
    v1::LayerResult result;
    if (!result.ParseFromString(a->bytes)) Fail("AttentionLayerLane: OK without a LayerResult");
    if (result.peak_bytes() != result.plan().predicted_peak_bytes()) {
      Fail("AttentionLayerLane: peak " + std::to_string(result.peak_bytes()) + " != predicted " +
           std::to_string(result.plan().predicted_peak_bytes()));
    }
    return result.kv_handle();
  }

  void Release(const std::string& handle, bool weights) {
    std::unique_ptr<grpc::ClientContext> context = Context();
    v1::ReleaseRequest request;
    request.set_handle(handle);
    v1::ReleaseResponse response;
    const grpc::Status status = weights ? stub_->ReleaseWeights(context.get(), request, &response)
                                        : stub_->ReleaseKv(context.get(), request, &response);
    if (!status.ok()) Fail("release of " + handle + ": " + status.error_message());
  }

  void CheckPoolEmpty() {
    const auto until = std::chrono::steady_clock::now() + kPoolSettle;
    for (;;) {
      const PoolSnapshot s = engine_->pool().Snapshot();
      if (s.allocated == 0 && s.reserved == 0) return;
      if (std::chrono::steady_clock::now() > until) {
        Fail("pool not empty after the call: " + std::to_string(s.allocated) + " allocated, " +
             std::to_string(s.reserved) + " reserved bytes");
      }
      std::this_thread::sleep_for(kPoolPoll);
    }
  }

  // LAYER_FUZZ_UDS names the socket; by default one per process (libFuzzer's -fork children too), in
  // $TMPDIR, removed at exit.
  static std::string SocketPath() {
    if (const char* path = std::getenv("LAYER_FUZZ_UDS")) return path;
    const char* tmp = std::getenv("TMPDIR");
    static const std::string path =
        std::string(tmp && *tmp ? tmp : "/tmp") + "/kvpack_layer_fuzz_" + std::to_string(::getpid()) + ".sock";
    // Registered once, after `path` exists, so the handler runs before its destructor.
    static const bool unlink_at_exit = std::atexit([] { ::unlink(path.c_str()); }) == 0;
    (void)unlink_at_exit;
    return path;
  }

  const bool verbose_ = std::getenv("LAYER_FUZZ_VERBOSE") != nullptr;  // each call's code on stderr
  std::string socket_path_;
  SystemClock clock_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KvpackService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Kvpack::Stub> stub_;
  std::unique_ptr<client::Client> client_;  // owns the lane's registration
  std::unique_ptr<client::Lane> lane_;
};

}  // namespace


}  // namespace kvpack::server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One daemon for the whole run, as a real one serves call after call (it is never destroyed:
  // libFuzzer exits without running static destructors of a live server anyway).
  static auto* harness = new kvpack::server::Harness();
  if (size < 1) return 0;
  kvpack::v1::LayerHeader header;
  if (!kvpack::server::ParseInput(data + 1, size - 1, &header)) return 0;
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < size; ++i) seed = (seed ^ data[i]) * 0x100000001b3ull;
  harness->Run(data[0], std::move(header), seed);
  // LAYER_FUZZ_HEAP=N: the sanitizer allocator's live bytes every N calls (memory a call leaves behind).
  static const long heap_every = std::getenv("LAYER_FUZZ_HEAP") ? std::atol(std::getenv("LAYER_FUZZ_HEAP")) : 0;
  static long calls = 0;
  if (heap_every > 0 && ++calls % heap_every == 0) {
    std::fprintf(stderr, "layer_fuzz: %ld calls, %zu live heap bytes\n", calls, __sanitizer_get_current_allocated_bytes());
  }
  return 0;
}
